"""Time the paged attention kernel alone: decode steps and prompt chunks at growing context.

`python bench/probes/attention_probe.py [--threads 2] [--contexts 1000 5000 20000]` runs
torch.ops.corechat.paged_attention with the 0.5B model's heads (14 query heads over 2 key/value
heads of 64) on every kernel path this CPU runs: a decode step of 1 and 8 rows at each context, and
a PREFILL_CHUNK_TOKENS-token prompt chunk ending at it, per layer; and the multiply-adds per
second (each query head times each key, twice: scores and values). It prints a table and writes
bench/results/<machine>/attention.json and .md.

`--against REV [--rounds 10] [--chunks] [--path P]` instead times one decode row (and with --chunks a prompt
chunk) at each context with the working tree's kernels and git revision REV's (built renamed beside
them, as bench/probes/kernel_ab.py does), in turns, for heads of three models' shapes: the 0.5B's 14
over 2 key/value heads, SmolLM2's 9 over 3, and 8 over 1; it checks both give the same bits
(`--other-arithmetic`: not, for a revision whose scores or page layout differ) and writes
<name>.json and .md (--name, default attention-ab).
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


def decode_ab(operators: dict, heads: int, kv_heads: int, context: int, rounds: int, rows: int = 1,
              check_bits: bool = True, path: str = "best") -> dict:
    """Time one decode row at `context` keys (or, with `rows`, a prompt chunk of that many rows ending
    there) with each library in turns (the order alternating); return each one's per-round best and
    the ratios, after checking they give the same bits (unless not `check_bits`)."""
    pages = -(-(context + 1) // PAGE_TOKENS)
    pool = torch.randn(pages, 1, 2, kv_heads, PAGE_TOKENS * DIM).bfloat16()
    tables = torch.arange(pages).view(1, pages)
    inputs = (torch.randn(rows, heads, DIM).bfloat16(), torch.randn(rows, kv_heads, DIM).bfloat16(),
              torch.randn(rows, kv_heads, DIM).bfloat16())
    sequences, positions = torch.zeros(rows, dtype=torch.long), torch.arange(context - rows + 1, context + 1)

    def run(name: str) -> torch.Tensor:
        return operators[name].paged_attention(*inputs, pool, 0, tables, sequences, positions, DIM ** -0.5,
                                               kernels.PATHS[path] if name == "tree" else against_path)

    # The other revision may not know the tree's attention-only path: it runs its AVX-512 one there.
    against_path = kernels.PATHS["avx512_vnni" if path == "avx512_bf16" else path]

    if check_bits and not torch.equal(run("tree"), run("against")):
        raise SystemExit(f"the two libraries differ at {heads}/{kv_heads} heads, {context} keys")
    seconds = {"tree": [], "against": []}
    for number in range(rounds):
        for name in ("tree", "against") if number % 2 == 0 else ("against", "tree"):
            seconds[name].append(best_seconds(lambda name=name: run(name), rounds=3))
    ratios = [tree / against for tree, against in zip(seconds["tree"], seconds["against"], strict=True)]
    return {"heads": heads, "kv_heads": kv_heads, "context": context, "rows": rows, "seconds": seconds,
            "ratios": ratios}


def compare(args) -> None:
    """Time decode rows against another revision's kernels; print and save the table."""
    commit, library = build_revision(args.against)
    torch.ops.load_library(str(library))
    operators = {"tree": torch.ops.corechat, "against": torch.ops.corechat_b}
    runs = [decode_ab(operators, heads, kv_heads, context, args.rounds, rows, not args.other_arithmetic, args.path)
            for rows in (1, CHUNK) if rows == 1 or args.chunks
            for heads, kv_heads in AB_SHAPES for context in args.contexts]
    lines = [f"One layer's attention (dim {DIM}, path {args.path}) for a decode row, and with --chunks a {CHUNK}-row "
             f"prompt chunk ending at the context, working tree against {commit}, {args.threads} thread(s), "
             f"{args.rounds} alternating rounds (each the best of 3): medians, and the ratio of the tree's time to "
             "the other's per round.", "",
             "| rows | heads / kv heads | context | tree | against | ratio, median (range) |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        lines.append(f"| {run['rows']} | {run['heads']} / {run['kv_heads']} | {run['context']} | "
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
    parser.add_argument("--chunks", action="store_true", help="with --against, time prompt chunks too")
    parser.add_argument("--path", default="best", help="with --against, the tree's kernel path (default best)")
    parser.add_argument("--other-arithmetic", action="store_true",
                        help="with --against, a revision whose scores or page layout differ: no bits check")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load()
    if args.against:
        return compare(args)
    paths = [path for path in kernels.attention_paths() if path != "reference"]
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
