"""Does fetching a conversation's KV state from Redis beat computing its prompt again?

`python bench/probes/kv_fetch_probe.py [--tokens 500 2000 8000] [--threads 2]` loads the 0.5B dev model as a
worker does and, for conversations of each length: passes the prompt (the engine's chunks) and
times it; stores its KV state as the prefix store does and sends it to a throwaway redis-server on
loopback (service/cache/kvshare.py); then, as another host would, looks the next turn up in a
fresh prefix store folder (the round trip that finds it, the read, the file written into the
folder) and copies it into the worker's pages, timed. Loopback is faster than a network: the
table adds what the bytes alone would take over 1 and 10 Gbit/s, computed from their size. It
prints a table and writes bench/results/<machine>/kv-fetch.json and .md.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes.dev_model import load_dev_runner  # noqa: E402
from harness import RedisServer  # noqa: E402
from service.cache.kvshare import RedisPrefixes  # noqa: E402
from service.engine import KvScope  # noqa: E402
from service.engine.prefixes import PrefixStore  # noqa: E402
from service.engine.sequence_files import SequenceFormat  # noqa: E402
from service.settings import Settings  # noqa: E402

CHUNK = Settings.model_fields["prefill_chunk_tokens"].default
END_OF_TURN = 151645


def main() -> None:
    """Measure each length; print and save the table."""
    parser = argparse.ArgumentParser(prog="python bench/probes/kv_fetch_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[500, 2000, 8000])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner, _ = load_dev_runner("int8")
    sequence_format = SequenceFormat(runner.lean.model.config.num_hidden_layers, torch.bfloat16, runner.stored_shape)
    runs = []
    with tempfile.TemporaryDirectory(prefix="corechat-kv-fetch-") as scratch:
        scratch = Path(scratch)
        redis_server = RedisServer(scratch).start()
        try:
            shared = RedisPrefixes(redis_server.url, ttl_seconds=600, max_bytes=1 << 30, connect_timeout=1.0,
                                   socket_timeout=30.0)
            for tokens in args.tokens:
                ids = [1000 + (index * 7919) % 50_000 for index in range(tokens)]
                with torch.inference_mode():
                    kv = runner.reserve(tokens + 1)
                    began = time.perf_counter()
                    for start in range(0, tokens, CHUNK):
                        runner.prefill(kv, ids[start:start + CHUNK], 1)
                    compute = time.perf_counter() - began
                    home = PrefixStore(sequence_format, 1 << 32, scratch / f"home-{tokens}", "model", shared=shared,
                                       turn_end_ids=[END_OF_TURN])
                    home.store(ids, runner.stored_shape(tokens), runner.read(kv, tokens))
                    began = time.perf_counter()
                    stored = next((home.root.path / home.folder_name(KvScope())).iterdir())
                    with stored.open("rb") as file:
                        shared.publish(f"{home.folder_name(KvScope())}/{stored.name}", memoryview(file.read()))
                    publish = time.perf_counter() - began
                    runner.release(kv)
                    away = PrefixStore(sequence_format, 1 << 32, scratch / f"away-{tokens}", "model", shared=shared,
                                       turn_end_ids=[END_OF_TURN])
                    kv = runner.reserve(tokens + 2)
                    began = time.perf_counter()
                    away.prefetch([*ids, END_OF_TURN, 1])
                    layers, found = away.lookup([*ids, END_OF_TURN, 1])
                    fetched = time.perf_counter() - began
                    runner.load(kv, layers, found)
                    loaded = time.perf_counter() - began
                    runner.release(kv)
                assert found == tokens, (found, tokens)
                size = stored.stat().st_size
                runs.append({"tokens": tokens, "bytes": size, "compute_seconds": compute, "publish_seconds": publish,
                             "fetch_seconds": fetched, "fetch_and_load_seconds": loaded,
                             "wire_1gbit_seconds": size * 8 / 1e9, "wire_10gbit_seconds": size * 8 / 1e10})
        finally:
            redis_server.stop()
    lines = ["| tokens | KV state | prompt computed | fetched from Redis and copied into pages (loopback) | "
             "computed / fetched | bytes alone over 1 Gbit/s | over 10 Gbit/s |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        lines.append(f"| {run['tokens']} | {run['bytes'] / 2**20:.1f} MiB | {run['compute_seconds']:.2f} s | "
                     f"{run['fetch_and_load_seconds'] * 1e3:.0f} ms | "
                     f"{run['compute_seconds'] / run['fetch_and_load_seconds']:.0f}x | "
                     f"{run['wire_1gbit_seconds'] * 1e3:.0f} ms | {run['wire_10gbit_seconds'] * 1e3:.0f} ms |")
    table = "\n".join([f"int8 0.5B dev model, {args.threads} thread(s); Redis on loopback.", "", *lines, ""])
    save_results("kv-fetch", {"threads": args.threads, "runs": runs}, table)


if __name__ == "__main__":
    main()
