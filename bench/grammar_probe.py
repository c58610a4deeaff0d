"""Measure the JSON-schema grammar engines on the real Qwen2.5 vocabulary: compile time and per-step mask time.

`python bench/grammar_probe.py [--rounds 3] [--steps 120]` builds the 0.5B dev model's tokenizer
(151,936 vocabulary entries), then for each engine that imports here (xgrammar, llguidance,
outlines-core) compiles a typical nested schema (objects, arrays, enums, numbers, strings) from
nothing, best of `rounds`, and replays eight different valid documents token by token as eight
rows of one batch, timing each step's bitmask fill for all eight rows and its application to a
(8, 151936) float32 logits tensor; then the service's own `mask_logits` the same way. Times are
wall times (parallel fills use two threads), medians over the steps, so a busy machine inflates
them. Engines that do not import are listed as such: measure all three with
`pip install --target /tmp/grammar-engines --no-deps xgrammar==0.2.9 apache-tvm-ffi outlines-core==0.2.14`
and `PYTHONPATH=/tmp/grammar-engines`. It prints a table and writes bench/results/grammar.json and .md.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy  # noqa: E402
import torch  # noqa: E402

from bench import save_results  # noqa: E402
from service.engine.grammar import JSON_OPTIONS, Vocabulary, mask_logits  # noqa: E402
from service.engine.text import byte_level_alphabet  # noqa: E402

BATCH = 8
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


def documents() -> list[str]:
    """Return BATCH different documents valid under SCHEMA, spaced as json.dumps and the engines write them."""
    roles = ["admin", "editor", "viewer"]
    return [
        json.dumps(
            {
                "name": f"Person \"{row}\" of the line\\{row}",
                "age": 20 + row,
                "score": -1.5 + row * 0.37,
                "role": roles[row % 3],
                "tags": [f"tag{t}" for t in range(row % 4)],
                "address": {"street": f"{row} Main Street", "city": "Zürich"},
                "history": [{"year": 1990 + y, "event": f"event number {y}\n", "ok": y % 2 == 0} for y in range(row % 3 + 1)],
            },
            ensure_ascii=False,
        )
        for row in range(BATCH)
    ]


def wall_seconds(run) -> float:
    """Return the wall seconds of run() (masks of a batch may fill on several threads)."""
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every logit whose bit is 0 to -inf (the same packed layout all three engines fill)."""
    bits = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=1, count=logits.shape[1], bitorder="little")
    logits.masked_fill_(torch.from_numpy(bits.view(numpy.bool_)).logical_not_(), float("-inf"))


def measure_service_masking(tokenizer, vocab_size: int, schema: str, token_rows: list[list[int]], steps: int) -> dict:
    """Time the service's own per-row masking (service/engine/grammar.py) along the documents, 8 rows."""
    from service.engine.grammar import Grammars, json_schema_grammar

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    grammars = Grammars(tokenizer, vocab_size, [eos])
    grammar = json_schema_grammar(json.loads(schema))
    matchers = [grammars.matcher(grammar) for _ in range(BATCH)]
    logits = torch.randn(BATCH, vocab_size)
    times = []
    for step in range(min(steps, min(len(row) for row in token_rows))):
        masked = logits.clone()
        times.append(wall_seconds(lambda: mask_logits(masked, matchers)))
        for row, matcher in enumerate(matchers):
            if not matcher.consume_token(token_rows[row][step]):
                raise AssertionError(f"the service's grammar refused token {step} of row {row}")
    return {"mask_logits_ms": round(statistics.median(times) * 1000, 3),
            "mask_logits_p90_ms": round(sorted(times)[int(len(times) * 0.9)] * 1000, 3), "steps": len(times)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(schema, any_whitespace=False)

    def matchers(self, compiled, count: int):
        self.batch = self.xgr.BatchGrammarMatcher(max_threads=2)
        return [self.xgr.GrammarMatcher(compiled) for _ in range(count)]

    def allocate(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def fill_parallel(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.torch
        from llguidance._tokenizer import TokenizerWrapper

        self.llg = llguidance
        # As the service builds it (service/engine/grammar.py): faster than llguidance.hf.from_tokenizer.
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.tokenizer = llguidance.LLTokenizer(TokenizerWrapper(Vocabulary(tokenizer, vocab_size, eos)), n_vocab=vocab_size,
                                                eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matchers(self, compiled, count: int):
        return [self.llg.LLMatcher(self.tokenizer, compiled) for _ in range(count)]

    def allocate(self, rows: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for row, matcher in enumerate(matchers):
            self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_parallel(self, matchers, bitmask) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, row) for row, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core

        self.oc = outlines_core
        to_byte = byte_level_alphabet()
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        tokens: dict[bytes, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id == eos or token in tokenizer.all_special_tokens or token.startswith("<|"):
                continue
            tokens.setdefault(bytes(to_byte[c] for c in token), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        regex = self.oc.json_schema.build_regex_from_schema(schema, whitespace_pattern="[ ]?")
        return self.oc.Index(regex, self.vocabulary)

    def matchers(self, compiled, count: int):
        return [self.oc.Guide(compiled) for _ in range(count)]

    def allocate(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matchers, bitmask) -> None:
        for row, guide in enumerate(matchers):
            guide.write_mask_into(bitmask[row].data_ptr(), bitmask[row].numel(), bitmask.element_size())

    fill_parallel = None

    def accept(self, guide, token_id: int) -> bool:
        guide.advance(token_id)
        return True


ENGINES = [XGrammar, LLGuidance, OutlinesCore]


def measure(engine, schema: str, token_rows: list[list[int]], rounds: int, steps: int) -> dict:
    """Time compiling the schema, then filling and applying a batch's masks along the documents' tokens."""
    compile_seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        compiled = engine.compile(schema)
        compile_seconds.append(time.perf_counter() - began)
    result = {"compile_ms": round(min(compile_seconds) * 1000, 1)}
    bitmask = engine.allocate(BATCH)
    logits = torch.randn(BATCH, engine.vocab_size)
    for mode in ("sequential", "parallel"):
        fill = engine.fill if mode == "sequential" else engine.fill_parallel
        if fill is None:
            continue
        matchers = engine.matchers(compiled, BATCH)
        fill_times, apply_times = [], []
        for step in range(min(steps, min(len(row) for row in token_rows))):
            fill_times.append(wall_seconds(lambda: fill(matchers, bitmask)))
            for row, matcher in enumerate(matchers):
                allowed = bool((bitmask[row, token_rows[row][step] // 32] >> (token_rows[row][step] % 32)) & 1)
                if not allowed or not engine.accept(matcher, token_rows[row][step]):
                    raise AssertionError(f"{engine.name} refused token {step} of row {row}")
            masked = logits.clone()
            apply_times.append(wall_seconds(lambda: apply_bitmask(masked, bitmask)))
        result[f"fill_{mode}_ms"] = round(statistics.median(fill_times) * 1000, 3)
        result[f"fill_{mode}_p90_ms"] = round(sorted(fill_times)[int(len(fill_times) * 0.9)] * 1000, 3)
        result["apply_ms"] = round(statistics.median(apply_times) * 1000, 3)
        result["steps"] = len(fill_times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from devtools.devmodel import build_dev_model

    torch.set_num_threads(1)
    model_dir = build_dev_model(Path.home() / ".cache" / "corechat" / "bench-qwen2.5-0.5b", "qwen2.5-0.5b")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    schema = json.dumps(SCHEMA)
    token_rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in documents()]
    results = {"vocab_size": vocab_size, "batch": BATCH, "schema": SCHEMA, "engines": {}}
    for engine_class in ENGINES:
        try:
            began = time.perf_counter()
            engine = engine_class(tokenizer, vocab_size)
            setup = time.perf_counter() - began
        except ImportError as exc:
            results["engines"][engine_class.name] = {"error": f"not installed: {exc}"}
            continue
        figures = {"tokenizer_setup_ms": round(setup * 1000, 1), **measure(engine, schema, token_rows, args.rounds, args.steps)}
        results["engines"][engine_class.name] = figures
        print(engine_class.name, figures, flush=True)
    results["service"] = measure_service_masking(tokenizer, vocab_size, schema, token_rows, args.steps)
    print("service", results["service"], flush=True)
    header = (f"## JSON-schema grammar engines, Qwen2.5 vocabulary ({vocab_size}), batch {BATCH}, nested schema\n\n"
              "| engine | vocabulary setup | compile | fill 8 masks, one thread | fill 8 masks, 2 threads | apply 8 masks |\n"
              "|---|---|---|---|---|---|\n")
    rows = []
    for name, figures in results["engines"].items():
        if "error" in figures:
            rows.append(f"| {name} | {figures['error']} | | | | |")
            continue
        parallel = f"{figures['fill_parallel_ms']} ms" if "fill_parallel_ms" in figures else "n/a"
        rows.append(f"| {name} | {figures['tokenizer_setup_ms']} ms | {figures['compile_ms']} ms | "
                    f"{figures['fill_sequential_ms']} ms (p90 {figures['fill_sequential_p90_ms']}) | {parallel} | "
                    f"{figures['apply_ms']} ms |")
    service = results["service"]
    note = (f"\nThe service's mask_logits (llguidance fill + apply, {BATCH} rows): median {service['mask_logits_ms']} ms, "
            f"p90 {service['mask_logits_p90_ms']} ms per decode step.\n"
            "\nMedian over the documents' steps; compile is the best of the rounds from an empty cache. "
            f"`python bench/grammar_probe.py --rounds {args.rounds} --steps {args.steps}`\n")
    save_results("grammar", results, header + "\n".join(rows) + "\n" + note)


if __name__ == "__main__":
    main()
