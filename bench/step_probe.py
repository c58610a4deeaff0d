"""Where a decode step's time goes: products, attention, the rest of the forward, sampling.

`python bench/step_probe.py [--dtypes int8 int4] [--rows 1 8] [--threads 1]` loads the 0.5B dev
model as a worker does, fills a batch of `rows` sequences (a ~40-token chat prompt each, the
engine's DecodeBatch, so left padding and row_starts as served) and times decode steps: the
median wall time of a step, then one profiled run that splits its operators' time into the
top-level quantized products (corechat::quantized_linear: a quantized model's output layer, every
product of a bf16 one as aten::linear), the fused layer operators a quantized model's decoder
layers run as (corechat::attention_inputs, ::mlp, ::rms_norm, their products inside), attention
(corechat::attention or SDPA) and the other torch operators (cache appends, embedding, rotary
tables; in bf16 also norms, rotary, activations); what the step takes beyond its operators is
Python (the forward's own code, transformers' cache). Sampling is
timed apart: greedy and top-p over the step's logits, all rows in the engine's one call (the
median of several). Times are the thread's CPU time
(the profiler's shares are of wall time), so other processes on the machine move them less. It
prints a table and writes bench/results/step.json and .md.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench import save_results  # noqa: E402
from bench.compile_probe import load  # noqa: E402
from service.engine.batching import DecodeBatch  # noqa: E402
from service.engine.kvcache import new_cache  # noqa: E402
from service.engine.sampling import Sampler, SamplingParams, sample_tokens  # noqa: E402

# Top-level operators only: their totals include what they call.
PRODUCTS = ("corechat::quantized_linear", "aten::linear")
ATTENTION = ("corechat::attention", "aten::scaled_dot_product_attention")
# A quantized model's decoder layers run as these (their products inside, unseen by the profiler).
FUSED = ("corechat::attention_inputs", "corechat::mlp", "corechat::rms_norm")
SAMPLING_REPEATS = 9


def filled_batch(model, prompt_ids: list[int], rows: int) -> DecodeBatch:
    """Process the prompt (minus 0..rows-1 tokens, so rows are padded) per row and join them."""
    caches = []
    with torch.inference_mode():
        for row in range(rows):
            cache = new_cache(model.config)
            model(input_ids=torch.tensor([prompt_ids[: len(prompt_ids) - row]]), cache=cache, use_cache=True,
                  logits_to_keep=1)
            caches.append(cache)
    batch = DecodeBatch(model.config)
    batch.join(caches)
    return batch


def operator_seconds(events, names: tuple[str, ...]) -> float:
    """Sum the total (self plus children) CPU time of the named top-level operators, in seconds."""
    return sum(event.cpu_time_total for event in events if event.key in names) / 1e6


def measure(model, prompt_ids: list[int], rows: int, steps: int) -> dict:
    """Time a batch's decode steps and split one profiled step's time."""
    batch = filled_batch(model, prompt_ids, rows)
    tokens = [100 + row for row in range(rows)]
    with torch.inference_mode():
        for _ in range(3):
            logits = batch.step(model, tokens)
        step_times = []
        for _ in range(steps):
            began = time.thread_time()
            logits = batch.step(model, tokens)
            step_times.append(time.thread_time() - began)
        wall_began, cpu_began = time.perf_counter(), time.thread_time()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(steps):
                batch.step(model, tokens)
        # The profiler clocks wall time: its operator times, scaled to CPU time.
        scale = (time.thread_time() - cpu_began) / (time.perf_counter() - wall_began)
    events = profiled.key_averages()
    every_operator = sum(event.self_cpu_time_total for event in events) / 1e6 / steps
    step = statistics.median(step_times)
    products = operator_seconds(events, PRODUCTS) / steps * scale
    attention = operator_seconds(events, ATTENTION) / steps * scale
    fused = operator_seconds(events, FUSED) / steps * scale
    every_operator *= scale
    samplers = {"greedy": SamplingParams(max_tokens=1, temperature=0.0),
                "top-p 0.9": SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=1)}
    sampling = {}
    for name, params in samplers.items():
        times = []
        for _ in range(SAMPLING_REPEATS):
            step_samplers = [Sampler(params, model.config.vocab_size) for _ in range(rows)]
            began = time.thread_time()
            sample_tokens(step_samplers, logits)
            times.append(time.thread_time() - began)
        sampling[name] = statistics.median(times)
    return {"rows": rows, "step_seconds": step, "products_seconds": products, "attention_seconds": attention,
            "fused_layer_seconds": fused, "other_operators_seconds": every_operator - products - attention - fused,
            "python_seconds": step - every_operator, "sampling_seconds": sampling}


def main() -> None:
    """Measure every dtype and batch size asked for and report the split."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["int8", "int4"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default worker has 1 here)")
    parser.add_argument("--forwards", nargs="+", default=["lean", "transformers"],
                        help="the engine's lean Qwen2 forward and/or transformers' own")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "runs": []}
    lines = ["| DTYPE | forward | rows | step | products | fused layer operators (products inside) | attention | "
             "other operators | Python | sampling (greedy / top-p), all rows |", "|---|---|---|---|---|---|---|---|---|---|"]
    for dtype in args.dtypes:
        model, prompt_ids = load(dtype)
        lean = model.__dict__.get("forward")
        for forward in args.forwards:
            # The lean forward is an attribute of the model; without it, transformers' class forward runs.
            if forward == "lean" and lean is not None:
                model.forward = lean
            elif forward == "transformers":
                model.__dict__.pop("forward", None)
            else:
                continue
            for rows in args.rows:
                run = {"dtype": dtype, "forward": forward, **measure(model, prompt_ids, rows, args.steps)}
                results["runs"].append(run)
                step = run["step_seconds"]
                parts = [f"{run[key] * 1e3:.1f} ms ({run[key] / step:.0%})"
                         for key in ("products_seconds", "fused_layer_seconds", "attention_seconds", "other_operators_seconds",
                                     "python_seconds")]
                sampling = run["sampling_seconds"]
                lines.append(f"| {dtype} | {forward} | {rows} | {step * 1e3:.1f} ms | " + " | ".join(parts)
                             + f" | {sampling['greedy'] * 1e3:.2f} / {sampling['top-p 0.9'] * 1e3:.2f} ms |")
        del model
    table = (f"## Decode step split, qwen2.5-0.5b dev model, {args.threads} thread(s), ~40-token context\n\n"
             + "\n".join(lines) + "\n")
    save_results("step", results, table)


if __name__ == "__main__":
    main()
