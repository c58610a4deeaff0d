"""Where the time to the first token goes, on a short prompt, with the defaults.

    python bench/probes/first_token.py [--repetitions 15]

Two views of the same path. Served: real Gunicorn with the default workers and threads and
LOG_LEVEL=debug, the benchmark's streaming client, and each request's `first token timings` line
(service/observability/observed.py) split into: before the engine's queue (parsing, chat template, tokenizer,
response cache lookup), the queue, the prompt pass, the rest up to the first text (sampling, text,
the cache's relay), and the first write. In-process: the same engine on one thread (a default
worker's share of this machine), timing the chat template, the tokenizer, the queue handoff, the
output layer inside the prompt pass (a forward hook on lm_head) and sampling the first token.
Results go to bench/results/<machine>/first-token.json and .md.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import save_results, start_corechat  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from harness import RedisServer, parse_first_token_timings, short_chat, stream_chat  # noqa: E402

SERVED_PARTS = ("first_token", "before_queue", "queue", "prompt_pass", "after_prompt_pass", "first_write")


def measure_served(model_dir: Path, repetitions: int, max_tokens: int) -> dict:
    """Send short chats one at a time to Gunicorn with the defaults; return client and server medians."""
    with tempfile.TemporaryDirectory(prefix="corechat-first-token-") as scratch:
        scratch = Path(scratch)
        redis = RedisServer(scratch).start() if shutil.which("redis-server") else None
        try:
            server, _ = start_corechat(scratch, model_dir, redis.url if redis else "", log_level="debug")
            try:
                client = [stream_chat(server.url, short_chat(f"ft-{uuid.uuid4().hex[:8]}"), max_tokens)
                          for _ in range(repetitions)]
                time.sleep(0.5)  # the last request's line is logged as its stream ends
                rows = parse_first_token_timings(server.log())[-repetitions:]
            finally:
                server.stop()
        finally:
            if redis:
                redis.stop()
    served = {key: statistics.median(row[key] for row in rows if key in row) for key in SERVED_PARTS}
    return {
        "client_first_token_ms": statistics.median(run.first_token_seconds * 1000 for run in client),
        "server_ms": served,
        "prompt_tokens": rows[-1]["prompt_tokens"],
        "cached_prompt_tokens": statistics.median(row["cached_prompt_tokens"] for row in rows),
    }


def measure_in_process(model_dir: Path, repetitions: int, threads: int) -> dict:
    """Run the engine in this process and time each step of the first token."""
    import torch

    from service.engine import Engine, Finished, SamplingParams, Started, TextDelta, qwen2, scheduler
    from service.settings import Settings

    torch.set_num_threads(threads)
    engine = Engine(Settings(model=str(model_dir)))
    engine.start()
    engine.wait_ready()
    times: dict[str, list[float]] = {name: [] for name in
                                     ("template", "tokenizer", "queue_handoff", "prompt_pass", "output_layer",
                                      "sampling", "submit_to_first_text")}
    output_layer: list[float] = []
    began_at: list[float] = []
    # transformers' forward calls the module (hooks); the lean forward calls qwen2.product on it.
    engine.model.lm_head.register_forward_pre_hook(lambda module, args: began_at.append(time.perf_counter()))
    engine.model.lm_head.register_forward_hook(
        lambda module, args, output: output_layer.append(time.perf_counter() - began_at[-1]))
    product = qwen2.product

    def timed_product(linear, inputs):
        """Apply a product as the lean forward does, timing the output layer's."""
        began = time.perf_counter()
        output = product(linear, inputs)
        if linear is engine.model.lm_head:
            output_layer.append(time.perf_counter() - began)
        return output

    qwen2.product = timed_product
    sampling: list[float] = []
    sample_tokens = scheduler.sample_tokens

    def timed_sample_tokens(samplers, logits):
        """Sample as the engine does, timing it (the probe's only change to the engine)."""
        began = time.perf_counter()
        tokens = sample_tokens(samplers, logits)
        sampling.append(time.perf_counter() - began)
        return tokens

    scheduler.sample_tokens = timed_sample_tokens
    for _ in range(repetitions):
        messages = short_chat(f"ft-{uuid.uuid4().hex[:8]}")
        began = time.perf_counter()
        prompt = engine.template.render(messages)
        rendered = time.perf_counter()
        prompt_ids = engine.template.encode(prompt)
        encoded = time.perf_counter()
        output_layer.clear()
        sampling.clear()
        generation = engine.submit(prompt_ids, SamplingParams(max_tokens=2, temperature=0.0))
        submitted = time.perf_counter()
        first_text_at = None
        for event in generation.events():
            if isinstance(event, Started):
                times["queue_handoff"].append(event.queue_seconds)
            elif isinstance(event, TextDelta) and first_text_at is None:
                first_text_at = time.perf_counter()
                times["submit_to_first_text"].append(first_text_at - submitted)
            elif isinstance(event, Finished):
                times["prompt_pass"].append(event.prompt_seconds)
        times["template"].append(rendered - began)
        times["tokenizer"].append(encoded - rendered)
        times["output_layer"].append(output_layer[0])
        times["sampling"].append(sampling[0])
    engine.stop()
    return {"threads": threads, "prompt_tokens": len(prompt_ids),
            **{f"{name}_ms": statistics.median(values) * 1000 for name, values in times.items() if values}}


def render(results: dict) -> str:
    """Render both views as the table docs/performance.md quotes."""
    served, local = results["served"], results["in_process"]
    server = served["server_ms"]
    rows = [
        ("client: first token (streamed, p50)", served["client_first_token_ms"], ""),
        ("server: arrival to first text", server["first_token"], "the line's first_token"),
        ("  before the engine's queue", server["before_queue"],
         f"template {local['template_ms']:.1f} ms + tokenizer {local['tokenizer_ms']:.1f} ms in-process; "
         "the rest is parsing and the cache lookup"),
        ("  queue", server["queue"], f"in-process handoff to an idle engine: {local['queue_handoff_ms']:.2f} ms"),
        ("  prompt pass", server["prompt_pass"],
         f"{served['prompt_tokens']:.0f} tokens, {served['cached_prompt_tokens']:.0f} from stored prefixes; "
         f"in-process {local['prompt_pass_ms']:.1f} ms, of which the output layer {local['output_layer_ms']:.1f} ms"),
        ("  after the prompt pass, to the first text", server["after_prompt_pass"],
         f"sampling {local['sampling_ms']:.2f} ms in-process; text, events and the cache's relay"),
        ("server: first write (render + socket)", server.get("first_write", 0.0), ""),
        ("client minus server (HTTP, request parsing in Gunicorn, client)",
         served["client_first_token_ms"] - server["first_token"], ""),
    ]
    lines = [
        f"## First token on a short prompt ({results['repetitions']} requests one at a time; medians)",
        "",
        "| part | ms | notes |",
        "|---|---|---|",
        *[f"| {name} | {value:.1f} | {note} |" for name, value, note in rows],
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure both views and write the results."""
    parser = argparse.ArgumentParser(prog="python bench/probes/first_token.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--model-dir", type=Path, default=DEV_MODEL_DIR)
    parser.add_argument("--name", default="first-token")
    parser.add_argument("--results-dir", type=Path, help="default: bench/results/<this machine>/")
    args = parser.parse_args()
    from devtools.devmodel import build_dev_model
    from service.settings import Settings

    preset = "tiny" if args.model_dir.name == "test-tiny" else "qwen2.5-0.5b"
    build_dev_model(args.model_dir, preset)
    results = {"repetitions": args.repetitions,
               "served": measure_served(args.model_dir, args.repetitions, max_tokens=4),
               "in_process": measure_in_process(args.model_dir, args.repetitions, Settings().threads_per_worker)}
    save_results(args.name, results, render(results), args.results_dir)


if __name__ == "__main__":
    main()
