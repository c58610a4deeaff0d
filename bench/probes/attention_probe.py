"""Time the paged attention kernel alone: decode steps and prompt chunks at growing context.

`python bench/probes/attention_probe.py [--threads 2] [--contexts 1000 5000 20000]` runs
torch.ops.corechat.paged_attention with the 0.5B model's heads (14 query heads over 2 key/value
heads of 64) on every kernel path this CPU runs: a decode step of 1 and 8 rows at each context, and
a PREFILL_CHUNK_TOKENS-token prompt chunk ending at it, per layer; and the multiply-adds per
second (each query head times each key, twice: scores and values). It prints a table and writes
bench/results/<machine>/attention.json and .md.
"""

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from service.engine import kernels  # noqa: E402
from service.engine.memory import PAGE_TOKENS  # noqa: E402
from service.settings import Settings  # noqa: E402

HEADS, KV_HEADS, DIM = 14, 2, 64
CHUNK = Settings.model_fields["prefill_chunk_tokens"].default
ROUNDS = 5


def best_seconds(call, rounds: int = ROUNDS) -> float:
    """Return the best of several runs of a call."""
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - began)
    return best


def measure(path: str, context: int) -> dict:
    """Time decode steps of 1 and 8 rows at `context` keys, and a prompt chunk ending there, on one path."""
    rows = 8
    pages = -(-(context + CHUNK) // PAGE_TOKENS)
    pool = torch.randn(rows * pages, 1, 2, KV_HEADS, PAGE_TOKENS * DIM).bfloat16()
    tables = torch.arange(rows * pages).view(rows, pages)
    code = kernels.PATHS[path]

    def run(count: int, sequences: list[int], positions: list[int]) -> None:
        torch.ops.corechat.paged_attention(
            torch.randn(count, HEADS, DIM).bfloat16(), torch.randn(count, KV_HEADS, DIM).bfloat16(),
            torch.randn(count, KV_HEADS, DIM).bfloat16(), pool, 0, tables, torch.tensor(sequences),
            torch.tensor(positions), DIM ** -0.5, code)

    one = best_seconds(lambda: run(1, [0], [context]))
    eight = best_seconds(lambda: run(rows, list(range(rows)), [context] * rows))
    chunk = best_seconds(lambda: run(CHUNK, [0] * CHUNK, list(range(context - CHUNK, context))), rounds=3)
    chunk_multiply_adds = sum(HEADS * DIM * 2 * (position + 1) for position in range(context - CHUNK, context))
    return {"context": context, "decode_1_seconds": one, "decode_8_seconds": eight, "chunk_seconds": chunk,
            "chunk_multiply_adds_per_second": chunk_multiply_adds / chunk,
            "decode_8_multiply_adds_per_second": rows * HEADS * DIM * 2 * (context + 1) / eight}


def main() -> None:
    """Measure every path and context asked for; print and save the table."""
    parser = argparse.ArgumentParser(prog="python bench/probes/attention_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", nargs="+", type=int, default=[1000, 5000, 20000])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load()
    paths = [path for path in kernels.available_paths() if path != "reference"]
    runs = [{"path": path, **measure(path, context)} for path in paths for context in args.contexts]
    lines = ["| path | context | decode, 1 row | decode, 8 rows | 8 rows, G multiply-adds/s | "
             f"{CHUNK}-token chunk | chunk, G multiply-adds/s |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        lines.append(f"| {run['path']} | {run['context']} | {run['decode_1_seconds'] * 1e3:.2f} ms | "
                     f"{run['decode_8_seconds'] * 1e3:.2f} ms | {run['decode_8_multiply_adds_per_second'] / 1e9:.1f} | "
                     f"{run['chunk_seconds'] * 1e3:.1f} ms | {run['chunk_multiply_adds_per_second'] / 1e9:.1f} |")
    table = "\n".join([f"One layer of the 0.5B model's attention ({HEADS} heads over {KV_HEADS}, dim {DIM}), "
                       f"{args.threads} thread(s), best of {ROUNDS} (chunks: 3).", "", *lines, ""])
    save_results("attention", {"threads": args.threads, "runs": runs}, table)


if __name__ == "__main__":
    main()
