"""Constrained decoding: grammars from JSON schemas and tool definitions, token masks from llguidance.

llguidance was chosen by measurement (bench/archive.md): on the Qwen2.5 vocabulary it compiles a
nested schema in about a millisecond (lazily, as tokens arrive) and fills eight rows' masks in well
under a millisecond, on CPU, with no dependencies. A grammar is checked without the vocabulary (in
the request thread, so a bad schema is a 400); matchers need the worker's view of the vocabulary,
built by the first request that needs one.
"""

import json
import threading
from collections import OrderedDict
from functools import lru_cache

import numpy
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance._tokenizer import TokenizerWrapper
from llguidance.gbnf_to_lark import gbnf_to_lark

from .text import byte_level_alphabet

# The spacing Qwen2.5 and json.dumps write. No free whitespace: a model (a random one above all)
# could otherwise fill its whole budget with blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
COMPILED_GRAMMARS = 64


class GrammarRefused(ValueError):
    """A schema or tool definition the grammar engine cannot enforce."""


@lru_cache(maxsize=256)
def check_grammar(grammar: str) -> str:
    """Return the grammar if llguidance can enforce it exactly, else raise GrammarRefused with its reason."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        # A warning is a keyword (an unknown `format`, say) that would go unenforced.
        raise GrammarRefused("; ".join(messages))
    return grammar


def json_schema_grammar(schema: dict) -> str:
    """Return the grammar of a JSON document following `schema`."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarRefused(str(exc)) from None
    return check_grammar(grammar)


def regex_grammar(regex: str) -> str:
    """Return the grammar of a text the whole of which `regex` (Rust's regex syntax) matches."""
    return check_grammar(LLMatcher.grammar_from_regex(regex))


def lark_grammar(lark: str) -> str:
    """Return the grammar of a Lark grammar as llguidance writes them (its `start` rule)."""
    return check_grammar(LLMatcher.grammar_from_lark(lark))


def gbnf_grammar(gbnf: str) -> str:
    """Return the grammar of a GBNF grammar, llama.cpp's (its `root` rule), by llguidance's own converter."""
    try:
        lark = gbnf_to_lark(gbnf)
    except Exception as exc:  # the converter raises bare Exception for a missing rule, GbnfToLarkError for syntax
        raise GrammarRefused(f"not a GBNF grammar: {exc}") from None
    return lark_grammar(lark)


def choice_grammar(choices: list[str]) -> str:
    """Return the grammar of a text that is exactly one of `choices`."""
    # A JSON string is a Lark string literal to llguidance, escapes included.
    return lark_grammar("start: " + " | ".join(json.dumps(choice) for choice in choices))


def _call_schema(functions: list[tuple[str, dict]]) -> dict:
    """Return the schema of one call's JSON body: the name of one of `functions` and its arguments."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in functions
        ],
        "x-guidance": JSON_OPTIONS,
    }


def tool_call_grammar(functions: list[tuple[str, dict]], parallel: bool) -> str:
    """Return the grammar of a reply made of Qwen2.5 tool-call blocks calling one of `functions` (name, arguments schema)."""
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = (
        f"start: call{repeat}\n"
        f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} body {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n"
        f"body: %json {json.dumps(_call_schema(functions))}\n"
    )
    try:
        return check_grammar(LLMatcher.grammar_from_lark(lark))
    except ValueError as exc:
        raise GrammarRefused(str(exc)) from None


def text_or_tool_call_grammar(functions: list[tuple[str, dict]], parallel: bool, markers: tuple[int, int]) -> str:
    """Return the grammar of a reply under tool_choice `auto` with strict tools: text, or text and then
    tool-call blocks whose bodies follow `functions` (name, arguments schema).

    A call opens and closes with the marker tokens themselves (`markers`: their ids), so the text
    before it ends where the model takes the opening token; the text may not spell the marker out
    of smaller tokens either, so a call is never free text that the tool-call parser would read.
    """
    repeat = ' ("\\n" call)*' if parallel else ""
    open_id, close_id = markers
    lark = (
        "start: TEXT | TEXT? calls\n"
        f"calls: call{repeat}\n"
        f'call: <[{open_id}]> "\\n" body "\\n" <[{close_id}]>\n'
        f"body: %json {json.dumps(_call_schema(functions))}\n"
        f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{TOOL_CALL_OPEN}(.|\\n)*/\n"
    )
    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except ValueError as exc:
        raise GrammarRefused(str(exc)) from None
    # Token ids are checked against the vocabulary when a worker compiles the grammar, not here.
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    messages = [message for message in messages if not message.startswith("no tokenizer - can't validate <[")]
    if is_error or messages:
        raise GrammarRefused("; ".join(messages))
    return grammar


class Vocabulary:
    """The tokenizer as llguidance reads it: each id's bytes, the special ids and an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        backend = tokenizer.backend_tokenizer
        alphabet = byte_level_alphabet()
        added = tokenizer.added_tokens_decoder
        self.tokens = [b""] * vocab_size
        for text, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id >= vocab_size:
                continue
            if token_id in added:
                self.tokens[token_id] = added[token_id].content.encode()
            else:
                self.tokens[token_id] = bytes(alphabet[char] for char in text)
        # Non-special added tokens (<tool_call>) are text to the grammar, as they are to the reply.
        self.special_token_ids = [token_id for token_id, token in added.items() if token.special]
        self.eos_token_id, self.bos_token_id = eos_id, None
        self._backend = backend

    def __call__(self, data: bytes) -> list[int]:
        """Encode text as the model's tokenizer does."""
        return self._backend.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids


class Grammars:
    """A worker's grammar engine: its view of the vocabulary (built on first use) and compiled grammars by text."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self._tokenizer, self._eos_ids = tokenizer, eos_ids
        self._lltokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _vocabulary(self) -> LLTokenizer:
        """Return llguidance's view of the vocabulary, built on first use.

        It takes about 1.5 s of CPU and 70 MB, which a worker never asked for a grammar (and every
        engine a test starts) does not pay; the first constrained request of a worker waits for it.
        """
        if self._lltokenizer is None:
            vocabulary = Vocabulary(self._tokenizer, self.vocab_size, self._eos_ids[0])
            self._lltokenizer = LLTokenizer(TokenizerWrapper(vocabulary), n_vocab=self.vocab_size, eos_token=self._eos_ids)
        return self._lltokenizer

    def matcher(self, grammar: str) -> LLMatcher:
        """Return a fresh matcher of a grammar, copied from its compiled form (compiled on first use)."""
        with self._lock:
            compiled = self._compiled.pop(grammar, None)
            if compiled is None:
                compiled = LLMatcher(self._vocabulary(), grammar)
                if compiled.is_error():
                    raise GrammarRefused(compiled.get_error())
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled.deep_copy()


def mask_logits(logits: torch.Tensor, matchers: list[LLMatcher | None]) -> None:
    """Set to -inf, row by row, every logit its matcher's grammar forbids next (rows without one stay)."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    vocab_size = logits.shape[-1]
    bitmask = numpy.empty((len(rows), (vocab_size + 31) // 32), dtype=numpy.int32)
    for slot, row in enumerate(rows):
        view = bitmask[slot]
        matchers[row].unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
    allowed = numpy.unpackbits(bitmask.view(numpy.uint8), axis=1, count=vocab_size, bitorder="little").view(numpy.bool_)
    # A mask is nearly all one way (a few structural tokens, or all but a few inside a string), so
    # writing the few by index costs far less than a masked write over the whole vocabulary.
    for slot, row in enumerate(rows):
        allowed_ids = numpy.flatnonzero(allowed[slot])
        if len(allowed_ids) * 2 < vocab_size:
            allowed_ids = torch.from_numpy(allowed_ids)
            kept = logits[row, allowed_ids]
            logits[row].fill_(float("-inf"))
            logits[row, allowed_ids] = kept
        else:
            logits[row, torch.from_numpy(numpy.flatnonzero(~allowed[slot]))] = float("-inf")
