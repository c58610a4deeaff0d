"""Speculative decoding (SPECULATIVE_TOKENS) on against off: one stream's tokens/s on the real SmolLM2, alternating.

    python bench/speculation.py [--rounds 3] [--tokens 8] [--dtype int8] [--replies 3]

Each round starts corechat in its default shape (`make serve MODEL=smollm2`: a worker per core, idle
cores lent) with SPECULATIVE_TOKENS at --tokens, then at 0 (the order reversed every other round),
and streams one reply at a time to each workload: a JSON record (as text, and as a structured
output under its JSON schema) and a code block to repeat with one change (text the prompt holds),
greedy, and a story (text it does not), greedy and sampled; then 4 sampled stories at once (their
aggregate tokens/s over the wall time). A reply's speed is its tokens after the first over the time
after the first, as the client sees them; a round's figure is the median of --replies replies to
the same prompt, each with a cache_salt of its own so no cache answers it; the table also tells
whether the replies were the same text on and off. Results go to
bench/results/<machine>/speculation.json and .md with the CPU, the date and the commit.
"""

import argparse
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import progress, save_results  # noqa: E402
from bench.versus import PEER_QUANTIZATION, spread, with_corechat  # noqa: E402
from harness.client import stream_chat  # noqa: E402
from service.settings import Settings  # noqa: E402

REPLY_TOKENS = 200
RECORD = json.dumps({"name": "Alice Smith", "email": "alice@example.com", "age": 34, "city": "Lisbon",
                     "orders": [{"id": 1017, "item": "keyboard", "price": 49.5},
                                {"id": 1022, "item": "monitor", "price": 189.0}], "active": True}, indent=2)
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"},
                   "orders": {"type": "array", "items": {
                       "type": "object", "additionalProperties": False, "required": ["id", "item", "price"],
                       "properties": {"id": {"type": "integer"}, "item": {"type": "string"}, "price": {"type": "number"}}}},
                   "active": {"type": "boolean"}},
    "required": ["name", "email", "age", "city", "orders", "active"],
    "additionalProperties": False,
}
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item['price'] * item['quantity']\n    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n")
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."
# Each workload's prompt and sampling: greedy, and a seeded draw at a usual temperature, where a small
# model's story seldom repeats itself (most drafts rejected: what speculation costs).
WORKLOADS = {
    "edit JSON": (f"Repeat this JSON record exactly, with the city changed to Porto:\n```json\n{RECORD}\n```",
                  {"temperature": 0}),
    # The same edit as a structured output: the record written on one line, as the schema's grammar spaces it.
    "edit JSON, schema": (f"Repeat this JSON record exactly, with the city changed to Porto:\n{json.dumps(json.loads(RECORD))}",
                          {"temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                              "name": "record", "schema": RECORD_SCHEMA, "strict": True}}}),
    "edit code": (f"Rename the function total_price to order_total and repeat the whole code:\n```python\n{CODE}```",
                  {"temperature": 0}),
    "prose": (STORY, {"temperature": 0}),
    "prose, sampled": (STORY, {"temperature": 0.8, "top_p": 0.95, "seed": 1}),
}
STREAMS = 4
STREAMS_WORKLOAD = f"prose, sampled, {STREAMS} streams (aggregate)"


def measure(url: str, _pids, replies: int) -> dict:
    """Return each workload's median one-stream decode tokens/s and its replies' lengths."""
    tag = uuid.uuid4().hex[:8]
    stream_chat(url, [{"role": "user", "content": f"({tag}) warm up"}], 16)
    figures = {}
    for name, (prompt, sampling) in WORKLOADS.items():
        speeds, lengths, texts = [], [], set()
        for index in range(replies):
            result = stream_chat(url, [{"role": "user", "content": prompt}], REPLY_TOKENS, greedy=False,
                                 extra={"cache_salt": f"{tag}-{index}", **sampling})
            if result.error:
                raise RuntimeError(f"{name}: {result.error}")
            speeds.append(result.decode_tokens_per_second)
            lengths.append(result.completion_tokens)
            texts.add(result.text)
        figures[name] = {"tokens_per_second": statistics.median(speeds), "replies": speeds, "tokens": lengths,
                         "texts": sorted(texts)}
    figures[STREAMS_WORKLOAD] = together(url, tag, replies)
    return figures


def together(url: str, tag: str, replies: int) -> dict:
    """Return the median aggregate tokens/s (first tokens and all, over the wall time) of STREAMS sampled stories
    at once, each seeded differently: whether drafts cost a batch that has room for them."""
    prompt, sampling = WORKLOADS["prose, sampled"]
    speeds, lengths, texts = [], [], set()
    for index in range(replies):
        results = [None] * STREAMS

        def run(stream: int, index: int = index) -> None:
            results[stream] = stream_chat(url, [{"role": "user", "content": prompt}], REPLY_TOKENS, greedy=False,
                                          extra={"cache_salt": f"{tag}-{index}-{stream}", **sampling, "seed": stream})

        threads = [threading.Thread(target=run, args=(stream,)) for stream in range(STREAMS)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        errors = [result.error for result in results if result.error]
        if errors:
            raise RuntimeError(f"{STREAMS_WORKLOAD}: {errors[:2]}")
        speeds.append(sum(result.completion_tokens for result in results) / wall)
        lengths += [result.completion_tokens for result in results]
        texts.add("\n\n".join(f"[seed {stream}] {result.text}" for stream, result in enumerate(results)))
    return {"tokens_per_second": statistics.median(speeds), "replies": speeds, "tokens": lengths,
            "texts": sorted(texts)}


def render(results: dict) -> str:
    """Return the markdown table of a run."""
    rounds = results["rounds"]
    on, off = f"SPECULATIVE_TOKENS={results['tokens']}", "SPECULATIVE_TOKENS=0"
    lines = ["# speculation", "",
             f"SmolLM2-135M-Instruct at {results['dtype']}, corechat's default shape, replies of up to {REPLY_TOKENS} "
             "tokens (greedy; the sampled story at temperature 0.8, top_p 0.95, seed 1), one stream at a time: decode "
             "tokens/s after the first token, as the client sees them; 4 sampled stories at once (seeds 0-3): all "
             f"their tokens over the wall time. {len(rounds)} alternating rounds, median of each round's medians "
             "(range), and each round's ratio of on to off.", "",
             f"| workload | {on} | {off} | ratio, per round | reply tokens | same text on and off |",
             "|---|---|---|---|---|---|"]
    for name in [*WORKLOADS, STREAMS_WORKLOAD]:
        with_drafts = [one[on][name]["tokens_per_second"] for one in rounds]
        without = [one[off][name]["tokens_per_second"] for one in rounds]
        ratios = ", ".join(f"{a / b:.2f}x" for a, b in zip(with_drafts, without, strict=True))
        tokens = sorted({count for one in rounds for shape in (on, off) for count in one[shape][name]["tokens"]})
        texts = {text for one in rounds for shape in (on, off) for text in one[shape][name]["texts"]}
        lines.append(f"| {name} | {spread(with_drafts, 1)} | {spread(without, 1)} | {ratios} | "
                     f"{', '.join(map(str, tokens))} | {'yes' if len(texts) == 1 else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the rounds, print the table and write the results files."""
    parser = argparse.ArgumentParser(prog="python bench/speculation.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=Settings.model_fields["speculative_tokens"].default,
                        help="SPECULATIVE_TOKENS of the rounds with speculation (its default unless told)")
    parser.add_argument("--dtype", default="int8", choices=sorted(PEER_QUANTIZATION))
    parser.add_argument("--replies", type=int, default=3, help="replies per workload and round")
    parser.add_argument("--name", default="speculation")
    args = parser.parse_args()
    from devtools.smollm2 import gguf_path

    model = gguf_path()
    shapes = {f"SPECULATIVE_TOKENS={args.tokens}": args.tokens, "SPECULATIVE_TOKENS=0": 0}
    results = {"dtype": args.dtype, "tokens": args.tokens, "reply_tokens": REPLY_TOKENS, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="corechat-speculation-") as scratch:
        for number in range(args.rounds):
            figures = {}
            order = list(shapes.items())
            for shape, tokens in order if number % 2 == 0 else reversed(order):
                progress(f"round {number + 1} of {args.rounds}: {shape}")
                figures[shape] = with_corechat(Path(scratch), model, functools.partial(measure, replies=args.replies),
                                               dtype=args.dtype,
                                               speculative_tokens=tokens, model_name="smollm2")
            results["rounds"].append(figures)
    save_results(args.name, results, render(results))


if __name__ == "__main__":
    main()
