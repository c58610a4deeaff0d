"""Measure a decode step at growing context with SDPA and with the engine's attention (by rows in bf16).

`python bench/attention_probe.py [--dtype int8] [--threads 1]` loads the 0.5B dev model as a worker
does, fills a KV cache with a prompt of each context length (in the engine's prompt chunks),
then times single-token steps, once per attention implementation, in one process. It prints a
table and writes bench/results/attention-<dtype>.json and .md.
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
from service.engine.attention import ATTENTION  # noqa: E402
from service.settings import Settings  # noqa: E402

CONTEXTS = (40, 1000, 3000)
CHUNK = Settings.model_fields["prefill_chunk_tokens"].default


def step_seconds(model, context: int, steps: int) -> tuple[float, float]:
    """Fill a cache with `context` tokens, then return the prompt seconds and the median step seconds."""
    cache = DynamicCache(config=model.config)
    prompt = torch.randint(0, 1000, (1, context), generator=torch.Generator().manual_seed(context))
    with torch.inference_mode():
        began = time.perf_counter()
        for start in range(0, context, CHUNK):
            model(input_ids=prompt[:, start : start + CHUNK], cache=cache, use_cache=True, logits_to_keep=1)
        prompt_seconds = time.perf_counter() - began
        times = []
        for token in range(steps):
            began = time.perf_counter()
            model(input_ids=torch.tensor([[token + 100]]), cache=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - began)
    return prompt_seconds, statistics.median(times)


def main() -> None:
    """Time both implementations at every context length and report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=Settings.model_fields["dtype"].default)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default worker has 1 here)")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load(args.dtype)
    results = {"dtype": args.dtype, "threads": args.threads, "contexts": {}}
    for implementation in ("sdpa", ATTENTION):
        model.set_attn_implementation(implementation)
        step_seconds(model, 40, 4)  # warm up
        for context in CONTEXTS:
            prompt, step = step_seconds(model, context, args.steps)
            results["contexts"].setdefault(str(context), {})[implementation] = {"prompt_seconds": prompt, "step_seconds": step}
    rows = ["| context tokens | decode step, SDPA | decode step, engine's attention | prompt pass, SDPA / engine's |",
            "|---|---|---|---|"]
    for context, figures in results["contexts"].items():
        sdpa, grouped = figures["sdpa"], figures[ATTENTION]
        rows.append(f"| {context} | {sdpa['step_seconds'] * 1000:.1f} ms | {grouped['step_seconds'] * 1000:.1f} ms | "
                    f"{sdpa['prompt_seconds']:.2f} / {grouped['prompt_seconds']:.2f} s |")
    table = f"## Attention probe: {args.dtype}, {args.threads} thread(s)\n\n" + "\n".join(rows) + "\n"
    save_results(f"attention-{args.dtype}", results, table)


if __name__ == "__main__":
    main()
