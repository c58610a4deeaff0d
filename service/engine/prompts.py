"""Prompt passes: each step's prompt budget shared by the waiting prompts, and a chunk's pass.

A short question behind a long pasted document gets its first token after its own few tokens, not
after the document: the budget goes to the prompts with the fewest tokens left, while the oldest
still takes a least share of every step, so a stream of short prompts cannot stop it. Where a
prompt is cut never changes its logits (each row is computed alone:
tests/app/test_batch_invariance.py).
"""

import logging
import time

import torch

from .events import Failed, PromptLogprobs
from .facts import EngineFacts
from .grammar import mask_logits
from .logprobs import prompt_token_logprobs, token_logprobs
from .prefixes import PrefixStore
from .runners import SequenceModel
from .sampling import biased, sample_tokens
from .sequences import Delivery, Sequence
from .text import TokenSpeller

log = logging.getLogger(__name__)

# The fewest prompt tokens a chunk holds (settings' least PREFILL_CHUNK_TOKENS), however slow the
# prompt speed: each chunk reads every weight once, so tiny chunks would mostly read.
MIN_CHUNK_TOKENS = 16
# The most prompt tokens a chunk holds when the request asked for the prompt's logprobs: each keeps a
# row of logits over the whole vocabulary.
PROMPT_LOGPROBS_CHUNK_TOKENS = 64


def chunk_tokens(most: int, stall_seconds: float, seconds_per_token: float | None) -> int:
    """Return how many prompt tokens take about `stall_seconds` at the given speed, between
    min(most, MIN_CHUNK_TOKENS) and `most`; `most` where no stall or no speed is given."""
    if stall_seconds <= 0 or not seconds_per_token:
        return most
    return max(min(most, MIN_CHUNK_TOKENS), int(min(most, stall_seconds / seconds_per_token)))


def prompt_shares(budget: int, remaining: list[int]) -> list[int]:
    """Split a step's prompt budget among prompts (oldest first) by shortest remaining first.

    The oldest prompt is served first with at least min(its remaining, MIN_CHUNK_TOKENS), so it
    always advances; the rest of the budget goes to the prompts with the fewest tokens left.
    """
    shares = [0] * len(remaining)
    if not remaining:
        return shares
    shares[0] = min(remaining[0], MIN_CHUNK_TOKENS, budget)
    budget -= shares[0]
    for index in sorted(range(len(remaining)), key=lambda index: (remaining[index], index)):
        if budget <= 0:
            break
        more = min(budget, remaining[index] - shares[index])
        shares[index] += more
        budget -= more
    return shares


class PromptPass:
    """Run prompt chunks of sequences; after a prompt's last chunk, take each choice's first token."""

    def __init__(self, runner: SequenceModel, prefixes: PrefixStore, delivery: Delivery, speller: TokenSpeller,
                 facts: EngineFacts):
        self.runner = runner
        self.prefixes = prefixes
        self.delivery = delivery
        self.speller = speller
        self.facts = facts

    def run(self, sequence: Sequence, tokens: int) -> list[Sequence] | None:
        """Process the next `tokens` prompt tokens (past its stored prefix); after the last, take each choice's
        first token from the last position's logits (one prompt pass for all of a request's choices).

        Return None while prompt tokens remain, else the choices that go on (their KV state each
        their own). A fault fails the request's choices alone.
        """
        group = sequence.group
        try:
            began = time.monotonic()
            start = len(sequence.generation.input_ids) - len(sequence.next_input)
            chunk, sequence.next_input = sequence.next_input[:tokens], sequence.next_input[tokens:]
            scoring = sequence.generation.params.prompt_logprobs is not None
            samplers = [choice.sampler for choice in group]
            with torch.inference_mode():
                logits = self.runner.prefill(sequence.kv, chunk, 0 if scoring else 1)
                if scoring:
                    self._score_prompt(sequence, start, logits)
                if not sequence.next_input:
                    self.store(sequence)
                    for choice in sequence.siblings:
                        self.runner.copy(sequence.kv, choice.kv)
                    last = logits[-1:]
                    # A row per choice: each is biased, masked and drawn from on its own.
                    logits = biased(samplers, last if len(group) == 1 else last.repeat(len(group), 1))
                    mask_logits(logits, [choice.generation.grammar for choice in group])
            elapsed = time.monotonic() - began
            sequence.prompt_seconds += elapsed
            log.debug("prompt chunk: %d tokens in %.3f s", len(chunk), elapsed)
            if sequence.next_input:
                return None
            if sequence.cached_prompt_tokens:
                self.facts.prefix_cache_hits = (self.facts.prefix_cache_hits or 0) + 1
                if self.prefixes.shared is not None:
                    self.facts.shared_prefix_hits = self.prefixes.shared_hits
            for choice in sequence.siblings:
                choice.prompt_seconds = sequence.prompt_seconds
            if scoring:
                self._send_prompt_logprobs(sequence)
            # A continuation's forced tokens may already end the reply; max_tokens 0 asks for the prompt pass alone.
            if sequence.generation.forced_ids or not sequence.generation.params.max_tokens:
                if all([self.delivery.forced_reply_ended(choice) for choice in group]):
                    return []
            token_ids = sample_tokens(samplers, logits)
            logprobs = token_logprobs(samplers, logits, token_ids)
        except Exception as exc:  # one bad prompt must not stop the others
            log.exception("prompt pass failed")
            for choice in group:
                choice.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            return []
        return [choice for choice, token_id, logprob in zip(group, token_ids, logprobs, strict=True)
                if self.delivery.advance_or_fail(choice, token_id, logprob)]

    def store(self, sequence: Sequence, finished_turn: bool = False) -> None:
        """Keep the KV state a sequence holds for every worker of the host, and a finished turn beyond it;
        a failure only costs reuse."""
        length = self.runner.length(sequence.kv)
        try:
            ids = [*sequence.generation.input_ids, *sequence.taken_ids][:length]
            scope = sequence.generation.kv_scope
            self.prefixes.store(ids, self.runner.stored_shape(length), self.runner.read(sequence.kv, length), scope)
            if finished_turn:
                self.prefixes.share(ids, scope)
            self.facts.prefix_cache_bytes = self.prefixes.bytes
        except Exception:
            log.exception("a sequence's KV state could not be stored")

    def _score_prompt(self, sequence: Sequence, start: int, logits: torch.Tensor) -> None:
        """Keep the logprobs of the prompt tokens that the chunk starting at position `start` predicts."""
        prompt_ids = sequence.generation.prompt_ids
        next_ids = prompt_ids[start + 1:start + 1 + logits.shape[0]]
        if not next_ids:
            return
        top = sequence.generation.params.prompt_logprobs
        for token_id, scored in zip(next_ids, prompt_token_logprobs(logits, next_ids, top), strict=True):
            sequence.prompt_logprobs.append(self.speller.logprob(token_id, scored.logprob, scored.top))

    def _send_prompt_logprobs(self, sequence: Sequence) -> None:
        """Send the prompt's token logprobs to each choice, its first token (which has none) spelled alone."""
        first = self.speller.bytes_of(sequence.generation.prompt_ids[0]).decode("utf-8", errors="replace")
        event = PromptLogprobs(first, tuple(sequence.prompt_logprobs))
        for choice in sequence.group:
            choice.generation.send(event)
        sequence.prompt_logprobs = []
