"""Where a decode step's and a prompt pass's time goes: products, attention, the rest, sampling.

`python bench/probes/step_probe.py [--dtypes int8 int4] [--rows 1 8] [--prompts 850 5000] [--threads 2] [--server] [--name step]`
loads the 0.5B dev model as a worker does and drives the runner its engine drives
(service/engine/runners.py: the lean forward over the page pool):
- decode: `rows` sequences of a ~40-token chat prompt each decode as one batch. Whole steps take
  turns with each part of a step timed alone, unprofiled (medians): the decoder layers (one
  corechat::run_layers call), every layer's products (one corechat::run_products call), every
  layer's attention, the output product; the layers' time around their products and attention and
  the step's time outside the layers are the differences. Products are given in weights read per
  second against the read bandwidth (bench.probes bandwidth, in the same command). Sampling is
  timed apart (greedy, and the dev model's generation_config, Qwen2.5's: temperature 0.7, top_p 0.8,
  top_k 20, repetition penalty 1.05 over the prompt; all rows in the engine's one call), repeated on
  warm caches and, as the engine draws, right after every layer's products swept the caches.
- prompt: a prompt of each length passes in PREFILL_CHUNK_TOKENS chunks, profiled;
  its attention is then replayed alone (torch.ops.corechat.paged_attention, every layer's call of
  every chunk, on random keys at the same positions) to split the layers' time into attention and
  the rest (products, norms, rotary), whose multiply-adds per second the table gives.
- with --server: Gunicorn with one worker on the same threads (SPECULATIVE_TOKENS=0) serves lone
  streams in turns with runs of the same steps in this process: what serving adds per token, and
  how much of it the engine spends inside its steps outside the forward (its decode_overhead_fraction).
Wall time: the operators run on `--threads` threads (a default worker on an idle machine borrows
its neighbours' cores). It prints a table and writes bench/results/<machine>/<name>.json and .md (--name,
default step) with the CPU, date and commit.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes import run_probe  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR, load_dev_runner  # noqa: E402
from service.engine.loading import load_generation_defaults  # noqa: E402
from service.engine.qwen2 import Rows, product  # noqa: E402
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


def tensor_bytes(tensors) -> int:
    """Return the bytes tensors hold."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def layer_weight_bytes(lean) -> int:
    """Return the bytes of every decoder layer's product weights and scales, as run_layers reads them."""
    # A fused block's arguments: norm weight, epsilon, weights, scales, biases, outputs, format.
    return tensor_bytes(tensor for layer in lean.fused for block in (layer.attention, layer.mlp)
                        for tensor in (*block[2], *block[3]))


def measure_decode(runner, prompt_ids: list[int], rows: int, steps: int) -> dict:
    """Time a batch's decode steps, and each part of a step alone, unprofiled, in turns.

    Each turn times a whole step (runner.decode), the decoder layers alone (one run_layers call on the
    step's inputs), every layer's products alone (one run_products call: grouped as the layers group
    them, on inputs rounded beforehand), every layer's
    attention alone (paged_attention on the step's positions) and the output product alone. What the
    layers spend around their products and attention (norms, rotary, rounding the inputs, SiLU,
    residuals, the threads' fork and join per product) and what the step spends outside the layers
    (embedding, rotary tables, final norm, the interpreter) are the differences.
    """
    lean = runner.lean
    model, inner = lean.model, lean.model.model
    layers, kv_heads, head_dim = lean.shape
    heads, scaling = model.config.num_attention_heads, inner.layers[0].self_attn.scaling
    times = {part: [] for part in ("step", "decoder layers", "products", "attention", "output product")}
    with torch.inference_mode():
        kvs = [runner.reserve(len(prompt_ids) + 2 * steps + 8) for _ in range(rows)]
        for kv in kvs:
            runner.prefill(kv, prompt_ids, 1)
        tokens = [100 + row for row in range(rows)]
        for _ in range(3):
            logits = runner.decode(kvs, tokens)
        query = torch.randn(rows, heads, head_dim).bfloat16()
        keys, values = torch.randn(rows, kv_heads, head_dim).bfloat16(), torch.randn(rows, kv_heads, head_dim).bfloat16()
        for _ in range(steps):
            # The parts write keys and values at the next step's positions, which that step then overwrites.
            positions = torch.tensor([kv.length for kv in kvs])
            table_rows = Rows(runner._tables, torch.arange(rows), positions)
            hidden = F.embedding(torch.tensor(tokens), inner.embed_tokens.weight)
            cos, sin = inner.rotary_emb(hidden, positions.unsqueeze(0))
            cos, sin = cos[0].contiguous(), sin[0].contiguous()
            began = time.perf_counter()
            last = torch.ops.corechat.run_layers(lean.registered, hidden, cos, sin, runner.pool.storage, table_rows.tables,
                                                 table_rows.sequences, positions)
            times["decoder layers"].append(time.perf_counter() - began)
            began = time.perf_counter()
            torch.ops.corechat.run_products(lean.registered, rows)
            times["products"].append(time.perf_counter() - began)
            began = time.perf_counter()
            for layer in range(layers):
                torch.ops.corechat.paged_attention(query, keys, values, runner.pool.storage, layer, table_rows.tables,
                                                   table_rows.sequences, positions, scaling)
            times["attention"].append(time.perf_counter() - began)
            began = time.perf_counter()
            product(model.lm_head, last)
            times["output product"].append(time.perf_counter() - began)
            began = time.perf_counter()
            logits = runner.decode(kvs, tokens)
            times["step"].append(time.perf_counter() - began)
        for kv in kvs:
            runner.release(kv)
    sampling = {}
    # What a request that names no sampling gets: the dev model's generation_config (Qwen2.5's), over this prompt.
    defaults = load_generation_defaults(DEV_MODEL_DIR)
    for name, params in {"greedy": SamplingParams(max_tokens=1, temperature=0.0),
                         "defaults": SamplingParams(max_tokens=1, temperature=defaults.temperature, top_p=defaults.top_p,
                                                    top_k=defaults.top_k, repetition_penalty=defaults.repetition_penalty,
                                                    seed=1)}.items():
        samples, swept = [], []
        for _ in range(SAMPLING_REPEATS):
            samplers = [Sampler(params, logits.shape[-1], prompt_ids) for _ in range(rows)]
            began = time.perf_counter()
            sample_tokens(samplers, logits)
            samples.append(time.perf_counter() - began)
            # As the engine draws: right after a step's weights went through every cache.
            samplers = [Sampler(params, logits.shape[-1], prompt_ids) for _ in range(rows)]
            torch.ops.corechat.run_products(lean.registered, rows)
            began = time.perf_counter()
            sample_tokens(samplers, logits)
            swept.append(time.perf_counter() - began)
        sampling[name] = statistics.median(samples)
        sampling[f"{name} after a step"] = statistics.median(swept)
    seconds = {part: statistics.median(values) for part, values in times.items()}
    parts = {"products": seconds["products"], "attention": seconds["attention"],
             "around them": seconds["decoder layers"] - seconds["products"] - seconds["attention"],
             "output product": seconds["output product"],
             "outside the layers": seconds["step"] - seconds["decoder layers"] - seconds["output product"]}
    return {"rows": rows, "step_seconds": seconds["step"], "seconds": seconds, "parts": parts,
            "sampling_seconds": sampling, "layer_weight_bytes": layer_weight_bytes(lean),
            "output_weight_bytes": tensor_bytes((model.lm_head.qweight, model.lm_head.qscale))}


def chat_prompt_ids(tokenizer) -> list[int]:
    """Return PROMPT's tokens as the chat template renders it for a reply."""
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    return ids if isinstance(ids, list) else ids["input_ids"]


def lone_steps(runner, prompt_ids: list[int], steps: int) -> float:
    """Return the median seconds of one sequence's decode steps, as the step table times them."""
    with torch.inference_mode():
        kv = runner.reserve(len(prompt_ids) + steps + 8)
        runner.prefill(kv, prompt_ids, 1)
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            runner.decode([kv], [100])
            times.append(time.perf_counter() - began)
        runner.release(kv)
    return statistics.median(times)


def measure_server(runner, prompt_ids: list[int], dtype: str, threads: int, rounds: int) -> dict:
    """Time a lone stream's decode through Gunicorn (one worker on `threads` threads, no speculation) in
    turns with the same steps in this process: what serving adds to a step (sampling, text, delivery, HTTP, the
    client), and the part of it the engine counts inside its steps (decode_overhead_fraction)."""
    from bench import start_corechat
    from bench.versus import REPLY_TOKENS, short
    from harness import stream_chat

    steps, tokens = [], []
    with tempfile.TemporaryDirectory(prefix="corechat-step-") as scratch:
        # Without speculation, whose drafts would make the served steps other steps than these.
        server, _ = start_corechat(Path(scratch), DEV_MODEL_DIR, "", dtype=dtype, workers=1, torch_threads=threads,
                                   speculative_tokens=0)
        try:
            stream_chat(server.url, short("warm"), 8)
            for number in range(rounds):
                steps.append(lone_steps(runner, prompt_ids, 48))
                tokens += [1 / stream_chat(server.url, short(f"step probe {number} {index}"),
                                           REPLY_TOKENS).decode_tokens_per_second for index in range(2)]
            with urllib.request.urlopen(f"{server.url}/readyz", timeout=10) as response:
                overhead = json.load(response)["decode_overhead_fraction"]
        finally:
            server.stop()
    return {"dtype": dtype, "rounds": rounds, "reply_tokens": REPLY_TOKENS, "step_seconds": statistics.median(steps),
            "server_token_seconds": statistics.median(tokens), "engine_overhead_fraction": overhead}


def server_line(run: dict) -> str:
    """Return a server run's table row."""
    step, token = run["step_seconds"], run["server_token_seconds"]
    engine = run["engine_overhead_fraction"] * token
    return (f"| {run['dtype']} | {step * 1e3:.2f} ms | {token * 1e3:.2f} ms | {(token - step) * 1e3:.2f} ms "
            f"({token / step - 1:.0%}) | {engine * 1e3:.2f} ms |")


def decode_line(run: dict, bandwidth: float) -> str:
    """Return a decode run's table row."""
    step, parts, sampling = run["step_seconds"], run["parts"], run["sampling_seconds"]

    def share(seconds: float) -> str:
        return f"{seconds * 1e3:.2f} ms ({seconds / step:.0%})"

    def streamed(seconds: float, weight_bytes: int) -> str:
        return f"{share(seconds)}, {weight_bytes / seconds / 1e9:.1f} GB/s ({weight_bytes / seconds / bandwidth:.2f})"

    step_bytes = run["layer_weight_bytes"] + run["output_weight_bytes"]
    return (f"| {run['dtype']} | {run['rows']} | {step * 1e3:.2f} ms, {step_bytes / step / 1e9:.1f} GB/s "
            f"({step_bytes / step / bandwidth:.2f}) | {streamed(parts['products'], run['layer_weight_bytes'])} | "
            f"{share(parts['attention'])} | {share(parts['around them'])} | "
            f"{streamed(parts['output product'], run['output_weight_bytes'])} | {share(parts['outside the layers'])} | "
            f"{sampling['greedy'] * 1e3:.2f} / {sampling['defaults'] * 1e3:.2f} ms; "
            f"{sampling['greedy after a step'] * 1e3:.2f} / {sampling['defaults after a step'] * 1e3:.2f} ms |")


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
    parser.add_argument("--server", action="store_true",
                        help="also time a lone stream through Gunicorn in turns with the in-process steps")
    parser.add_argument("--name", default="step", help="the results files' name")
    args = parser.parse_args()
    bandwidth = run_probe("bandwidth", "--threads", str(args.threads), "--megabytes", "1024")["bytes_per_second"]
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "read_bytes_per_second": bandwidth, "decode": [], "prompt": [], "server": []}
    server_lines = ["| DTYPE | step in this process | server, per token | what serving adds | of it, in the engine's "
                    "steps outside the forward |", "|---|---|---|---|---|"]
    part_names = list(PARTS) + ["other operators", "python"]
    prompt_names = ["decoder layers", "attention (replayed)", *part_names[1:]]
    decode_lines = ["| DTYPE | rows | step | products | attention | around them | output product | outside the layers "
                    "| sampling (greedy / the defaults), all rows: repeated; after a step |",
                    "|---|---|---|---|---|---|---|---|---|"]
    prompt_lines = ["| DTYPE | prompt tokens | pass | " + " | ".join(prompt_names) + " | products, G multiply-adds/s |",
                    "|---|---|---|" + "---|" * len(prompt_names) + "---|"]
    for dtype in args.dtypes:
        runner, tokenizer = load_dev_runner(dtype)
        if runner.lean.registered is None:
            raise SystemExit(f"DTYPE={dtype} does not run the fused layers; the step probe splits int8 and int4 steps")
        prompt_ids = chat_prompt_ids(tokenizer)
        for rows in args.rows:
            run = {"dtype": dtype, **measure_decode(runner, prompt_ids, rows, args.steps)}
            results["decode"].append(run)
            decode_lines.append(decode_line(run, bandwidth))
        for tokens in args.prompts:
            run = {"dtype": dtype, **measure_prompt(runner, tokens, layer_multiply_adds(runner))}
            results["prompt"].append(run)
            seconds = run["seconds"]
            parts = " | ".join(f"{run['parts'][name]:.2f} s ({run['parts'][name] / seconds:.0%})" for name in prompt_names)
            prompt_lines.append(f"| {dtype} | {tokens} | {seconds:.2f} s | {parts} | "
                                f"{run['product_multiply_adds_per_second'] / 1e9:.0f} |")
        if args.server:
            run = measure_server(runner, prompt_ids, dtype, args.threads, rounds=3)
            results["server"].append(run)
            server_lines.append(server_line(run))
        del runner
    table = "\n".join([
        f"Qwen2.5-0.5B-shaped dev model, {args.threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(summing 1 GB on as many threads).", "", "### Decode step (~40-token context)", "",
        "Each part timed alone, unprofiled, in turns with whole steps (medians); products and the output product "
        "with the weights they read per second as a fraction of the read bandwidth, the step with every weight's "
        "bytes. Around them: what the decoder layers spend besides their products and attention (norms, rotary, "
        "rounding inputs, SiLU, residuals, each product's fork and join). Outside the layers: embedding, rotary "
        "tables, final norm, the interpreter. Sampling: repeated on warm caches; then each draw right after every "
        "layer's products (one run_products call) swept the caches, as the engine draws.", "", *decode_lines, "", f"### Prompt pass ({CHUNK}-token chunks; the decoder layers include the attention; products "
        "= the layers less the attention, norms and rotary included)", "", *prompt_lines, "",
        *(["### A lone stream through Gunicorn beside the same steps", "",
           f"One worker on {args.threads} thread(s), {results['server'][0]['reply_tokens'] if args.server else 0} greedy tokens a stream, two streams a round "
           "in turns with a run of in-process steps, three rounds (medians). The engine's share outside the forward "
           "(sampling, text, delivery) is its decode_overhead_fraction; the rest of what serving adds is between "
           "steps: the HTTP thread, the client and the engine's loop.", "", *server_lines, ""] if args.server else [])])
    save_results(args.name, results, table)


if __name__ == "__main__":
    main()
