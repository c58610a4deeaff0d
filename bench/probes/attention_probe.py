"""Time the paged attention kernel alone: decode steps and prompt chunks at growing context.

`python bench/probes/attention_probe.py [--threads 2] [--contexts 1000 5000 20000]` runs
torch.ops.corechat.paged_attention with the 0.5B model's heads (14 query heads over 2 key/value
heads of 64) on every kernel path this CPU runs: a decode step of 1 and 8 rows at each context, and
a PREFILL_CHUNK_TOKENS-token prompt chunk ending at it, per layer; and the multiply-adds per
second (each query head times each key, twice: scores and values). It prints a table and writes
bench/results/<machine>/attention.json and .md.

`--against REV [--rounds 10]` instead times one decode row at each context with the working tree's
kernels and git revision REV's (built renamed beside them, as bench/probes/kernel_ab.py does), in
turns, for heads of three models' shapes: the 0.5B's 14 over 2 key/value heads, SmolLM2's 9 over 3,
and 8 over 1; it checks both give the same bits and writes <name>.json and .md (--name, default
attention-ab).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes.kernel_ab import build_revision  # noqa: E402
from service.engine import kernels  # noqa: E402
from service.engine.memory import PAGE_TOKENS  # noqa: E402
from service.settings import Settings  # noqa: E402

HEADS, KV_HEADS, DIM = 14, 2, 64
CHUNK = Settings.model_fields["prefill_chunk_tokens"].default
ROUNDS = 5
# (query heads, key/value heads) of the decode comparison: the 0.5B's, SmolLM2's, one key/value head.
AB_SHAPES = [(14, 2), (9, 3), (8, 1)]


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


def decode_ab(operators: dict, heads: int, kv_heads: int, context: int, rounds: int) -> dict:
    """Time one decode row at `context` keys with each library in turns (the order alternating); return
    each one's per-round best and the ratios, after checking they give the same bits."""
    pages = -(-(context + 1) // PAGE_TOKENS)
    pool = torch.randn(pages, 1, 2, kv_heads, PAGE_TOKENS * DIM).bfloat16()
    tables = torch.arange(pages).view(1, pages)
    inputs = (torch.randn(1, heads, DIM).bfloat16(), torch.randn(1, kv_heads, DIM).bfloat16(),
              torch.randn(1, kv_heads, DIM).bfloat16())

    def run(name: str) -> torch.Tensor:
        return operators[name].paged_attention(*inputs, pool, 0, tables, torch.tensor([0]), torch.tensor([context]),
                                               DIM ** -0.5, kernels.PATHS["best"])

    if not torch.equal(run("tree"), run("against")):
        raise SystemExit(f"the two libraries differ at {heads}/{kv_heads} heads, {context} keys")
    seconds = {"tree": [], "against": []}
    for number in range(rounds):
        for name in ("tree", "against") if number % 2 == 0 else ("against", "tree"):
            seconds[name].append(best_seconds(lambda name=name: run(name), rounds=3))
    ratios = [tree / against for tree, against in zip(seconds["tree"], seconds["against"], strict=True)]
    return {"heads": heads, "kv_heads": kv_heads, "context": context, "seconds": seconds, "ratios": ratios}


def compare(args) -> None:
    """Time decode rows against another revision's kernels; print and save the table."""
    commit, library = build_revision(args.against)
    torch.ops.load_library(str(library))
    operators = {"tree": torch.ops.corechat, "against": torch.ops.corechat_b}
    runs = [decode_ab(operators, heads, kv_heads, context, args.rounds)
            for heads, kv_heads in AB_SHAPES for context in args.contexts]
    lines = [f"One decode row's attention (one layer, dim {DIM}, path best), working tree against {commit}, "
             f"{args.threads} thread(s), {args.rounds} alternating rounds (each the best of 3): medians, and the "
             "ratio of the tree's time to the other's per round.", "",
             "| heads / kv heads | context | tree | against | ratio, median (range) |", "|---|---|---|---|---|"]
    for run in runs:
        lines.append(f"| {run['heads']} / {run['kv_heads']} | {run['context']} | "
                     f"{statistics.median(run['seconds']['tree']) * 1e3:.3f} ms | "
                     f"{statistics.median(run['seconds']['against']) * 1e3:.3f} ms | "
                     f"{statistics.median(run['ratios']):.2f}x ({min(run['ratios']):.2f}-{max(run['ratios']):.2f}) |")
    save_results(args.name or "attention-ab", {"against": commit, "threads": args.threads, "rounds": args.rounds,
                                               "runs": runs}, "\n".join([*lines, ""]))


def main() -> None:
    """Measure every path and context asked for; print and save the table."""
    parser = argparse.ArgumentParser(prog="python bench/probes/attention_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", nargs="+", type=int, default=[1000, 5000, 20000])
    parser.add_argument("--against", help="time decode rows against this git revision's kernels")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds of --against")
    parser.add_argument("--name", help="results file name of --against (default attention-ab)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load()
    if args.against:
        return compare(args)
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
