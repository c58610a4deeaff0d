"""Measure what constrained decoding costs a real decode loop: tok/s with and without a schema, 1 and 8 streams.

`python bench/probes/grammar_decode.py [--dtype int8] [--tokens 48] [--rounds 2]` runs the engine
in-process on the 0.5B dev model (random weights, Qwen2.5's shapes and 151,936-token vocabulary)
with the settings' defaults, one thread, and submits 1 or 8 greedy generations at once, each
`tokens` long, free or under a typical nested schema (SCHEMA: objects, arrays, enums, numbers,
strings; its strings are unbounded, so replies run their full length, mostly inside strings). Decode
tok/s is the tokens generated after each stream's first, over the time from the first stream's first
token to the last stream's end; the best of `rounds`. Since tok/s on a shared machine moves by
several percent between runs, the probe also times the engine's masking itself
(service.engine.scheduler.mask_logits, wrapped) and reports its median per decode step and its share
of the schema run's step time. It prints a table and writes
bench/results/<machine>/grammar-decode.json and .md.
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
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from service.engine import (  # noqa: E402
    Engine,
    Finished,
    SamplingParams,
    Started,
    TextDelta,
    json_schema_grammar,
    scheduler,
)

STREAMS = (1, 8)
MASK_SECONDS: list[float] = []
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"year": {"type": "integer"}, "event": {"type": "string"}, "ok": {"type": "boolean"}},
                "required": ["year", "event", "ok"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "score", "role", "tags", "address", "history"],
    "additionalProperties": False,
}


def timed_mask_logits(logits, matchers, mask_logits=scheduler.mask_logits) -> None:
    """Mask as the engine does, recording how long it took when any row has a grammar (the prompt
    passes' few calls among them; the median is the decode steps')."""
    began = time.perf_counter()
    mask_logits(logits, matchers)
    if any(matcher is not None for matcher in matchers):
        MASK_SECONDS.append(time.perf_counter() - began)


def run_round(engine: Engine, streams: int, tokens: int, grammar: str | None) -> float:
    """Run `streams` generations at once and return their decode tokens per second."""
    prompt = engine.template.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    params = SamplingParams(max_tokens=tokens, temperature=0.0, grammar=grammar)
    generations = [engine.submit(prompt, params) for _ in range(streams)]
    first_token_at, decoded = None, 0
    for generation in generations:
        for event in generation.events():
            if isinstance(event, TextDelta) and first_token_at is None:
                first_token_at = time.perf_counter()
            elif isinstance(event, Finished):
                decoded += event.completion_tokens - 1
            elif not isinstance(event, (Started, TextDelta)):
                raise RuntimeError(f"generation failed: {event}")
    return decoded / (time.perf_counter() - first_token_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from devtools.devmodel import build_dev_model
    from service.settings import Settings

    torch.set_num_threads(1)
    scheduler.mask_logits = timed_mask_logits
    model_dir = build_dev_model(DEV_MODEL_DIR, "qwen2.5-0.5b")
    engine = Engine(Settings(model=str(model_dir), dtype=args.dtype, prefix_cache_mb=0))
    engine.start()
    if not engine.wait_ready(600):
        raise SystemExit(f"the engine did not start: {engine.facts}")
    grammar = json_schema_grammar(SCHEMA)
    results = {"dtype": args.dtype, "tokens": args.tokens, "rounds": args.rounds, "runs": []}
    try:
        for streams in STREAMS:
            row = {"streams": streams}
            for name, used in (("free", None), ("schema", grammar)):
                MASK_SECONDS.clear()
                row[f"{name}_tokens_per_second"] = round(
                    max(run_round(engine, streams, args.tokens, used) for _ in range(args.rounds)), 2)
            row["schema_cost_percent"] = round(100 * (1 - row["schema_tokens_per_second"] / row["free_tokens_per_second"]), 1)
            row["mask_ms_per_step"] = round(statistics.median(MASK_SECONDS) * 1000, 2)
            step_ms = 1000 * streams / row["schema_tokens_per_second"]
            row["mask_share_percent"] = round(100 * row["mask_ms_per_step"] / step_ms, 1)
            results["runs"].append(row)
            print(row, flush=True)
    finally:
        engine.stop()
    table = (f"## Decode with and without a JSON schema, 0.5B dev model, {args.dtype}, 1 thread, greedy, "
             f"{args.tokens} tokens per stream\n\n| streams | free tok/s | schema tok/s | tok/s lost to the schema (noise: ±8%) | masking per step "
             "(median) | masking's share of a step |\n|---|---|---|---|---|---|\n")
    table += "".join(f"| {row['streams']} | {row['free_tokens_per_second']} | {row['schema_tokens_per_second']} | "
                     f"{row['schema_cost_percent']}% | {row['mask_ms_per_step']} ms | {row['mask_share_percent']}% |\n"
                     for row in results["runs"])
    table += (f"\nBest of {args.rounds} rounds; the machine is shared, so compare the columns, not other runs. "
              f"`python bench/probes/grammar_decode.py --dtype {args.dtype} --tokens {args.tokens} --rounds {args.rounds}`\n")
    save_results("grammar-decode", results, table)


if __name__ == "__main__":
    main()
