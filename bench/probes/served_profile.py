"""Where a served stream's CPU time goes: Linux perf samples every CPU while one stream decodes.

`python bench/probes/served_profile.py [--dtypes int8 int4] [--tokens 400] [--rounds 2]`

Starts Gunicorn as `make serve` does (one worker per physical core, idle cores lent) on the dev
model, then per dtype and round streams one greedy reply (end-of-turn tokens forbidden, so it runs
`--tokens` long) while `perf record -a -e cpu-clock` samples every CPU, and sorts the samples by
where they ran: the weight products, attention, corechat's other operators, OpenMP (the pool's
threads waiting for work or for each other: the step's thread hand-offs), the Python interpreter,
torch's dispatch, libc, the Linux kernel, idle. Needs `perf` (linux-perf) and the right to sample
every CPU (root, or kernel.perf_event_paranoid <= 0). Prints a table and writes
bench/results/<machine>/served-profile.json and .md.
"""

import argparse
import collections
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import save_results, start_corechat  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from bench.versus import short  # noqa: E402
from harness import NO_END_OF_TURN, stream_chat  # noqa: E402

SAMPLES_PER_SECOND = 2000
NO_END = {"logit_bias": NO_END_OF_TURN}
PLACES = ["products", "attention", "corechat's other operators", "OpenMP (waits, hand-offs)", "Python interpreter",
          "torch (dispatch, other operators)", "libc (malloc, copies)", "Linux kernel", "idle", "other"]


def place(dso: str, symbol: str) -> str:
    """Name where a sample ran from its shared object and symbol."""
    if "corechat" in dso:
        if re.search(r"tiles|int4_row|matmul", symbol):
            return "products"
        if re.search(r"attend|score_keys|weigh_values|write_rows", symbol):
            return "attention"
        return "corechat's other operators"
    if "gomp" in dso:
        return "OpenMP (waits, hand-offs)"
    if "python" in dso:
        return "Python interpreter"
    if "torch" in dso or "c10" in dso:
        return "torch (dispatch, other operators)"
    if dso.startswith("libc.so") or dso.startswith("libm.so"):
        return "libc (malloc, copies)"
    if "kernel" in dso:
        return "idle" if "halt" in symbol or "idle" in symbol else "Linux kernel"
    return "other"


def split(report: str) -> dict[str, float]:
    """Sum `perf report --sort dso,sym` percentages by place."""
    shares: collections.Counter = collections.Counter()
    for line in report.splitlines():
        found = re.match(r"\s+([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*)", line)
        if found:
            shares[place(found[2], found[3])] += float(found[1])
    return {name: shares.get(name, 0.0) for name in PLACES}


def profile_stream(url: str, tokens: int, data: Path, label: str) -> tuple[float, dict[str, float]]:
    """Stream one reply under perf; return its decode tokens/s and the samples' split."""
    recorder = subprocess.Popen(["perf", "record", "-a", "-q", "-F", str(SAMPLES_PER_SECOND), "-e", "cpu-clock",
                                 "-o", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        reply = stream_chat(url, short(label), tokens, extra=NO_END)
    finally:
        recorder.send_signal(signal.SIGINT)
        _, errors = recorder.communicate(timeout=60)
    # perf record writes its data when SIGINT stops it, and then reports the signal as its end.
    if recorder.returncode not in (0, -signal.SIGINT, 128 + signal.SIGINT) or reply.error:
        raise SystemExit(f"perf record exited {recorder.returncode} ({errors.decode(errors='replace').strip()}); "
                         f"the stream: {reply.status} {reply.error}")
    report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "-g", "none", "--sort", "dso,sym",
                             "--stdio"], check=True, capture_output=True, text=True).stdout
    return reply.decode_tokens_per_second, split(report)


def main() -> None:
    """Profile a lone stream per dtype and round, and report the medians."""
    parser = argparse.ArgumentParser(prog="python bench/probes/served_profile.py", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["int8", "int4"])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("this probe needs Linux perf (Debian: apt-get install linux-perf)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="corechat-profile-") as scratch:
        for dtype in args.dtypes:
            server, _ = start_corechat(Path(scratch), DEV_MODEL_DIR, "", dtype=dtype)
            try:
                stream_chat(server.url, short("warm"), 16, extra=NO_END)
                for number in range(args.rounds):
                    rate, shares = profile_stream(server.url, args.tokens, Path(scratch) / "perf.data",
                                                  f"profile {dtype} {number}")
                    runs.append({"dtype": dtype, "round": number, "tokens_per_second": rate, "shares": shares})
            finally:
                server.stop()
    lines = ["| DTYPE | decode | " + " | ".join(PLACES) + " |", "|---|---|" + "---|" * len(PLACES)]
    for dtype in args.dtypes:
        mine = [run for run in runs if run["dtype"] == dtype]
        cells = [f"{statistics.median(run['shares'][name] for run in mine):.1f}%" for name in PLACES]
        rate = statistics.median(run["tokens_per_second"] for run in mine)
        lines.append(f"| {dtype} | {rate:.1f} tok/s | " + " | ".join(cells) + " |")
    table = (f"### Where a served stream's CPU time goes\n\nThe default shape on the dev model, one greedy stream of "
             f"{args.tokens} tokens, every CPU sampled by perf at {SAMPLES_PER_SECOND} Hz while it decodes "
             f"(medians of {args.rounds} rounds; shares of all samples on all CPUs).\n\n" + "\n".join(lines) + "\n")
    save_results("served-profile", {"tokens": args.tokens, "rounds": args.rounds, "runs": runs}, table)


if __name__ == "__main__":
    main()
