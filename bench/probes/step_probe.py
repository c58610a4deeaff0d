"""Where a decode step's and a prompt pass's time goes: products, attention, the rest, Python, sampling.

`python bench/probes/step_probe.py [--dtypes int8 int4] [--rows 1 8] [--prompts 850 5000] [--threads 2]`
loads the 0.5B dev model as a worker does and drives the runner its engine drives
(service/engine/runners.py: the lean forward over the page pool):
- decode: `rows` sequences of a ~40-token chat prompt each decode as one batch; the median wall
  time of a step, then one profiled run that splits its time into the decoder layers (one
  corechat::run_layers call for a quantized model: norms, products, rotary, attention,
  activations), the output layer's product (corechat::quantized_linear at top level), the other
  torch operators (embedding, rotary tables), and what is left: Python between the operators.
  Sampling is timed apart (greedy and top-p over the step's logits, all rows in the engine's one
  call, the median of several).
- prompt: a prompt of each length passes in PREFILL_CHUNK_TOKENS chunks, profiled the same way;
  its attention is then replayed alone (torch.ops.corechat.paged_attention, every layer's call of
  every chunk, on random keys at the same positions) to split the layers' time into attention and
  the rest (products, norms, rotary), whose multiply-adds per second the table gives.
Wall time: the operators run on `--threads` threads (a default worker on an idle machine borrows
its neighbours' cores). It prints a table and writes bench/results/<machine>/step.json and .md with the CPU,
date and commit.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes.dev_model import load_dev_runner  # noqa: E402
from service.engine.sampling import Sampler, SamplingParams, sample_tokens  # noqa: E402
from service.settings import Settings  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me about the history of bread, briefly."}]
CHUNK = Settings.model_fields["prefill_chunk_tokens"].default
# The profiler's names of each part; every one is a top-level operator (its total includes its children).
PARTS = {
    "decoder layers": ("corechat::run_layers", "corechat::attention_inputs", "corechat::mlp", "corechat::rms_norm",
                       "corechat::paged_attention"),
    "output product": ("corechat::quantized_linear", "aten::linear"),
}
SAMPLING_REPEATS = 9


def split(events, wall_seconds: float, repeats: int) -> dict[str, float]:
    """Return each part's seconds per repeat, the other operators' and Python's (the rest of the wall time)."""
    every = sum(event.self_cpu_time_total for event in events) / 1e6 / repeats
    parts = {name: sum(event.cpu_time_total for event in events if event.key in names) / 1e6 / repeats
             for name, names in PARTS.items()}
    parts["other operators"] = every - sum(parts.values())
    parts["python"] = wall_seconds / repeats - every
    return parts


def measure_decode(runner, prompt_ids: list[int], rows: int, steps: int) -> dict:
    """Time a batch's decode steps and split a profiled run of them."""
    with torch.inference_mode():
        kvs = [runner.reserve(len(prompt_ids) + 4 * steps + 8) for _ in range(rows)]
        for kv in kvs:
            runner.prefill(kv, prompt_ids, 1)
        tokens = [100 + row for row in range(rows)]
        for _ in range(3):
            logits = runner.decode(kvs, tokens)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            logits = runner.decode(kvs, tokens)
            times.append(time.perf_counter() - began)
        began = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(steps):
                runner.decode(kvs, tokens)
        wall = time.perf_counter() - began
        for kv in kvs:
            runner.release(kv)
    sampling = {}
    for name, params in {"greedy": SamplingParams(max_tokens=1, temperature=0.0),
                         "top-p 0.9": SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=1)}.items():
        samples = []
        for _ in range(SAMPLING_REPEATS):
            samplers = [Sampler(params, logits.shape[-1]) for _ in range(rows)]
            began = time.perf_counter()
            sample_tokens(samplers, logits)
            samples.append(time.perf_counter() - began)
        sampling[name] = statistics.median(samples)
    return {"rows": rows, "step_seconds": statistics.median(times), "parts": split(profiled.key_averages(), wall, steps),
            "sampling_seconds": sampling}


def measure_prompt(runner, tokens: int, multiply_adds_per_token: int) -> dict:
    """Pass a prompt of `tokens` tokens in the engine's chunks, profiled; split its time."""
    prompt_ids = [1000 + (index * 7919) % 50_000 for index in range(tokens)]
    with torch.inference_mode():
        kv = runner.reserve(tokens)
        runner.prefill(kv, prompt_ids[:CHUNK], 1)  # warm, then the measured pass from scratch
        runner.release(kv)
        kv = runner.reserve(tokens)
        began = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for start in range(0, tokens, CHUNK):
                runner.prefill(kv, prompt_ids[start:start + CHUNK], 1)
        wall = time.perf_counter() - began
        runner.release(kv)
    parts = split(profiled.key_averages(), wall, 1)
    parts["attention (replayed)"] = replay_attention(runner, tokens)
    products = parts["decoder layers"] - parts["attention (replayed)"]
    return {"tokens": tokens, "seconds": wall, "parts": parts,
            "product_multiply_adds_per_second": multiply_adds_per_token * tokens / products}


def replay_attention(runner, tokens: int) -> float:
    """Time the paged attention calls of a prompt pass alone: every chunk's, every layer's."""
    layers, kv_heads, head_dim = runner.lean.shape
    heads = runner.lean.model.config.num_attention_heads
    scaling = runner.lean.model.model.layers[0].self_attn.scaling
    seconds = 0.0
    with torch.inference_mode():
        kv = runner.reserve(tokens)
        table = kv.table.unsqueeze(0)
        for start in range(0, tokens, CHUNK):
            count = min(CHUNK, tokens - start)
            query = torch.randn(count, heads, head_dim).bfloat16()
            keys, values = torch.randn(count, kv_heads, head_dim).bfloat16(), torch.randn(count, kv_heads, head_dim).bfloat16()
            rows, positions = torch.zeros(count, dtype=torch.long), torch.arange(start, start + count)
            began = time.perf_counter()
            for layer in range(layers):
                torch.ops.corechat.paged_attention(query, keys, values, runner.pool.storage, layer, table, rows, positions,
                                                   scaling)
            seconds += time.perf_counter() - began
        runner.release(kv)
    return seconds


def layer_multiply_adds(runner) -> int:
    """Return the decoder layers' product multiply-adds per token (the output layer runs once per prompt)."""
    config = runner.lean.model.config
    layers, kv_heads, head_dim = runner.lean.shape
    hidden, inner = config.hidden_size, config.intermediate_size
    per_layer = hidden * (config.num_attention_heads * head_dim + 2 * kv_heads * head_dim)
    per_layer += config.num_attention_heads * head_dim * hidden + 3 * hidden * inner
    return layers * per_layer


def main() -> None:
    """Measure every dtype asked for and report the splits."""
    parser = argparse.ArgumentParser(prog="python bench/probes/step_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["int8", "int4"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompts", nargs="+", type=int, default=[850, 5000])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "decode": [], "prompt": []}
    part_names = list(PARTS) + ["other operators", "python"]
    prompt_names = ["decoder layers", "attention (replayed)", *part_names[1:]]
    decode_lines = ["| DTYPE | rows | step | " + " | ".join(part_names) + " | sampling (greedy / top-p), all rows |",
                    "|---|---|---|" + "---|" * len(part_names) + "---|"]
    prompt_lines = ["| DTYPE | prompt tokens | pass | " + " | ".join(prompt_names) + " | products, G multiply-adds/s |",
                    "|---|---|---|" + "---|" * len(prompt_names) + "---|"]
    for dtype in args.dtypes:
        runner, tokenizer = load_dev_runner(dtype)
        prompt_ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt_ids, list):
            prompt_ids = prompt_ids["input_ids"]
        for rows in args.rows:
            run = {"dtype": dtype, **measure_decode(runner, prompt_ids, rows, args.steps)}
            results["decode"].append(run)
            step = run["step_seconds"]
            parts = " | ".join(f"{run['parts'][name] * 1e3:.1f} ms ({run['parts'][name] / step:.0%})" for name in part_names)
            sampling = run["sampling_seconds"]
            decode_lines.append(f"| {dtype} | {rows} | {step * 1e3:.1f} ms | {parts} | "
                                f"{sampling['greedy'] * 1e3:.2f} / {sampling['top-p 0.9'] * 1e3:.2f} ms |")
        for tokens in args.prompts:
            run = {"dtype": dtype, **measure_prompt(runner, tokens, layer_multiply_adds(runner))}
            results["prompt"].append(run)
            seconds = run["seconds"]
            parts = " | ".join(f"{run['parts'][name]:.2f} s ({run['parts'][name] / seconds:.0%})" for name in prompt_names)
            prompt_lines.append(f"| {dtype} | {tokens} | {seconds:.2f} s | {parts} | "
                                f"{run['product_multiply_adds_per_second'] / 1e9:.0f} |")
        del runner
    table = "\n".join([
        f"Qwen2.5-0.5B-shaped dev model, {args.threads} thread(s).", "", "### Decode step (~40-token context)", "",
        *decode_lines, "", f"### Prompt pass ({CHUNK}-token chunks; the decoder layers include the attention; products "
        "= the layers less the attention, norms and rotary included)", "", *prompt_lines, ""])
    save_results("step", results, table)


if __name__ == "__main__":
    main()
