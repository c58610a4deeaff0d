"""What corechat's processes cost together: PSS and RSS of master + workers after a few requests.

`python bench/probes/memory_probe.py [--set NAME=VALUE ...] [--requests 13]` starts Gunicorn with the
defaults (and any settings given) on the 0.5B dev model, sends short chats one at a time, waits a
second (idle workers hand freed memory back) and sums PSS and RSS over the master and its workers
from /proc/PID/smaps_rollup. Compare builds or settings by running it once for each, one after
the other. It prints one line and writes bench/results/<machine>/memory.json and .md.
"""

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import save_results, start_corechat  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from devtools.devmodel import build_dev_model  # noqa: E402
from harness import memory_of, processes_of, short_chat, stream_chat  # noqa: E402


def main() -> None:
    """Measure once and report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a setting, as the environment gives it")
    parser.add_argument("--requests", type=int, default=13)
    args = parser.parse_args()
    settings = dict(item.split("=", 1) for item in args.set)
    build_dev_model(DEV_MODEL_DIR, "qwen2.5-0.5b")
    with tempfile.TemporaryDirectory(prefix="corechat-memory-") as scratch:
        server, _ = start_corechat(Path(scratch), DEV_MODEL_DIR, "", **{key.lower(): value for key, value in settings.items()})
        try:
            for _ in range(args.requests):
                stream_chat(server.url, short_chat(f"m-{uuid.uuid4().hex[:8]}"), 16)
            time.sleep(1)
            memory = memory_of(processes_of(server))
        finally:
            server.stop()
    results = {"settings": settings, "requests": args.requests, **memory}
    table = (f"PSS of master + {memory['processes'] - 1} workers after {args.requests} requests "
             f"({', '.join(args.set) or 'defaults'}): {memory['pss'] / 1e9:.3f} GB; RSS {memory['rss'] / 1e9:.3f} GB\n")
    save_results("memory", results, table)


if __name__ == "__main__":
    main()
