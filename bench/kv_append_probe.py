"""What appending to the KV cache costs a decode step at long contexts: concatenating against room.

`python bench/kv_append_probe.py [--contexts 256 1024 4096 8192] [--rows 1 4] [--threads 1]` loads
the 0.5B dev model as a worker does (`--dtype`, int8 by default) and times decode steps over caches
of `rows` rows already holding `context` tokens (random keys and values): once with transformers'
DynamicLayer, whose every append concatenates (copying the layer's whole cache), and once with the
engine's cache (service/engine/kvcache.py), which appends into room it allocated ahead. The two run
alternately, several rounds each; a step's figure is the median wall time. It prints a table and
writes bench/results/kv-append.json and .md.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench import save_results  # noqa: E402
from bench.compile_probe import load  # noqa: E402
from service.engine.batching import DecodeBatch  # noqa: E402
from service.engine.kvcache import build_cache  # noqa: E402

ROUNDS = 3


def random_layers(config, rows: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return every layer's keys and values for `rows` rows of `context` tokens (random, bf16)."""
    kv_heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(rows, kv_heads, context, dim, generator=generator).bfloat16() for _ in range(2))
            for _ in range(config.num_hidden_layers)]


def concatenating_cache(config, layers) -> DynamicCache:
    """Return transformers' own DynamicCache holding the layers (its update concatenates)."""
    cache = DynamicCache(config=config)
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def room_cache(config, layers) -> DynamicCache:
    """Return the engine's cache holding the layers in room, as a batch join leaves it."""
    batch = DecodeBatch(config)
    batch.join([build_cache(config, layers)])
    return batch.cache


def step_seconds(model, cache, rows: int, context: int, steps: int) -> list[float]:
    """Time `steps` decode steps of `rows` rows over the cache."""
    tokens = torch.tensor([[100 + row] for row in range(rows)])
    times = []
    with torch.inference_mode():
        for step in range(steps):
            positions = torch.full((rows, 1), context + step)
            began = time.perf_counter()
            model(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1,
                  row_starts=torch.zeros(rows, dtype=torch.long))
            times.append(time.perf_counter() - began)
    return times


def main() -> None:
    """Measure each context and row count with both caches and report them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 4096, 8192])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default worker has 1 here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load(args.dtype)
    results = {"dtype": args.dtype, "threads": args.threads, "steps": args.steps, "rounds": ROUNDS, "rows": []}
    for context in args.contexts:
        for rows in args.rows:
            layers = random_layers(model.config, rows, context)
            timed = {"concatenating": [], "room": []}
            for _ in range(ROUNDS):
                timed["concatenating"] += step_seconds(model, concatenating_cache(model.config, layers), rows, context,
                                                       args.steps)
                timed["room"] += step_seconds(model, room_cache(model.config, layers), rows, context,
                                              args.steps)
            row = {"context": context, "rows": rows,
                   **{f"{name}_step_seconds": statistics.median(times) for name, times in timed.items()}}
            results["rows"].append(row)
            print(f"context {context}, {rows} row(s): {row['concatenating_step_seconds'] * 1000:.1f} ms -> "
                  f"{row['room_step_seconds'] * 1000:.1f} ms", file=sys.stderr)
    lines = [f"## A decode step over a long cache: concatenating appends against room ({args.dtype}, "
             f"{args.threads} thread(s), median of {ROUNDS} x {args.steps} steps)", "",
             "| context tokens | rows | step, transformers' DynamicLayer (concatenates) | step, corechat's cache (room) | ratio |",
             "|---|---|---|---|---|"]
    for row in results["rows"]:
        old, new = row["concatenating_step_seconds"], row["room_step_seconds"]
        lines.append(f"| {row['context']} | {row['rows']} | {old * 1000:.1f} ms | {new * 1000:.1f} ms | {new / old:.2f}x |")
    save_results("kv-append", results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
