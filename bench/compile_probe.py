"""Measure torch.compile against eager for the engine's decode step, on the 0.5B dev model.

The field reports recommend torch.compile; this probe measures what it costs (compile time, paid
at every worker start) and what it buys (time per decoded token), in one process, side by side:
`python bench/compile_probe.py [--dtype int8] [--tokens 32]`. It prints a table and writes
bench/results/compile-<dtype>.json and .md.
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
from bench.probes import load_dev_model  # noqa: E402
from service.settings import Settings  # noqa: E402

PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


def load(dtype: str):
    """Load the dev model as a worker does, in the given weight format; return it and the prompt's ids."""
    model, tokenizer = load_dev_model(dtype)
    prompt = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return model, tokenizer(prompt, add_special_tokens=False)["input_ids"]


def decode_seconds(forward, model, prompt_ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """Run a prompt pass and greedy decode steps; return the first call's seconds and each step's."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        began = time.perf_counter()
        logits = forward(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True, logits_to_keep=1).logits
        first_call = time.perf_counter() - began
        steps = []
        for _ in range(tokens):
            token = int(torch.argmax(logits[0, -1]))
            began = time.perf_counter()
            logits = forward(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1).logits
            steps.append(time.perf_counter() - began)
    return first_call, steps


def main() -> None:
    """Measure eager, then compiled, and report both."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=Settings.model_fields["dtype"].default)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default worker has 1 here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, prompt_ids = load(args.dtype)
    decode_seconds(model, model, prompt_ids, 4)  # warm up the eager kernels
    eager_first, eager_steps = decode_seconds(model, model, prompt_ids, args.tokens)
    compiled = torch.compile(model, dynamic=True)
    began = time.perf_counter()
    compile_first, _ = decode_seconds(compiled, model, prompt_ids, 2)
    compile_seconds = time.perf_counter() - began
    compiled_first, compiled_steps = decode_seconds(compiled, model, prompt_ids, args.tokens)
    results = {
        "dtype": args.dtype,
        "threads": args.threads,
        "tokens": args.tokens,
        "eager_step_median_ms": statistics.median(eager_steps) * 1000,
        "compiled_step_median_ms": statistics.median(compiled_steps) * 1000,
        "eager_prompt_pass_ms": eager_first * 1000,
        "compiled_prompt_pass_ms": compiled_first * 1000,
        "compile_seconds": compile_seconds,
    }
    rows = [
        "| measurement | eager | torch.compile(dynamic=True) |",
        "|---|---|---|",
        f"| decode step, median of {args.tokens} | {results['eager_step_median_ms']:.1f} ms | "
        f"{results['compiled_step_median_ms']:.1f} ms |",
        f"| prompt pass ({len(prompt_ids)} tokens) | {results['eager_prompt_pass_ms']:.1f} ms | "
        f"{results['compiled_prompt_pass_ms']:.1f} ms |",
        f"| compile time (first calls) | | {compile_seconds:.1f} s |",
    ]
    table = f"## torch.compile probe: {args.dtype}, {args.threads} thread(s)\n\n" + "\n".join(rows) + "\n"
    save_results(f"compile-{args.dtype}", results, table)


if __name__ == "__main__":
    main()
