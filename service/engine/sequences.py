"""A running generation's engine state, and how its tokens become events: text, its end, its failure."""

import logging
import time
from dataclasses import dataclass, field

from .drafts import PromptLookup
from .events import Failed, Finished, Generation, TextDelta
from .facts import EngineFacts
from .logprobs import TokenLogprobs
from .sampling import Sampler
from .text import TextAssembler, TokenLogprob, TokenSpeller

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    """The engine's state for one running generation (one choice of a request)."""

    generation: Generation
    sampler: Sampler
    text: TextAssembler
    # Its room of KV state (the runner's), until it ends.
    kv: object | None
    started_at: float
    next_input: list[int]
    deadline: float
    completion_tokens: int = 0
    # Tokens taken since the last text piece went out, sent along with the next one.
    unsent_ids: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    first_token_at: float | None = None
    # Tokens taken after the input ids; the KV state holds all but the last (never fed yet).
    taken_ids: list[int] = field(default_factory=list)
    # Whether it decodes in the batch (its prompt pass done).
    in_batch: bool = False
    # The final event of a sequence that ended in the batch, sent once it left.
    final: Finished | None = None
    # The prompt's own token logprobs so far, when the request asked for them.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The other choices of a request with n > 1, waiting on this sequence's prompt pass (each with room
    # of its own, which the prompt's KV state is copied into when they join the batch).
    siblings: list["Sequence"] = field(default_factory=list)
    # Its prompt and reply indexed for draft tokens, made at its first speculative step.
    lookup: PromptLookup | None = None
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0

    @property
    def group(self) -> list["Sequence"]:
        """Return this sequence and its sibling choices."""
        return [self, *self.siblings]


def places(prefilling: list[Sequence]) -> int:
    """Return the running places prompts in their pass take: one per choice."""
    return sum(1 + len(sequence.siblings) for sequence in prefilling)


class Delivery:
    """Turn a sequence's taken tokens into its events; hold back final events until `send_ended`."""

    def __init__(self, eos_ids: set[int], speller: TokenSpeller, facts: EngineFacts):
        self.eos_ids = eos_ids
        self.speller = speller
        self.facts = facts
        # Final events of sequences that ended this step, sent by send_ended.
        self._ended: list[tuple[Generation, Finished]] = []

    def force(self, sequence: Sequence, forced_ids: tuple[int, ...]) -> None:
        """Put a continuation's sampler and text where the original generation stood after `forced_ids`.

        Their text was sent before, so it is assembled (for stop strings and split characters) but not sent.
        """
        for token_id in forced_ids:
            sequence.sampler.record(token_id)
            sequence.text.add(token_id)
            if sequence.generation.grammar is not None:
                sequence.generation.grammar.consume_token(token_id)
        sequence.completion_tokens = len(forced_ids)

    def forced_reply_ended(self, sequence: Sequence) -> bool:
        """Finish a continuation whose forced tokens already end the reply (max_tokens or a stop string)."""
        if sequence.text.stopped:
            self.finish(sequence, "stop")
            return True
        if sequence.completion_tokens >= sequence.generation.params.max_tokens:
            self.finish(sequence, "length")
            return True
        return False

    def advance_or_fail(self, sequence: Sequence, token_id: int, logprob: TokenLogprobs | None = None) -> bool:
        """Advance a sequence; a fault in its bookkeeping or text fails that sequence alone."""
        try:
            return self.advance(sequence, token_id, logprob)
        except Exception as exc:
            log.exception("a sequence failed while taking its next token")
            sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            return False

    def advance(self, sequence: Sequence, token_id: int, logprob: TokenLogprobs | None = None) -> bool:
        """Take a sequence's next token and deliver its text; return whether it goes on."""
        generation = sequence.generation
        if sequence.first_token_at is None:
            sequence.first_token_at = time.monotonic()
        sequence.sampler.record(token_id)
        if generation.grammar is not None and not generation.grammar.consume_token(token_id):
            raise ValueError(f"the grammar refused token {token_id}: {generation.grammar.get_error()}")
        sequence.completion_tokens += 1
        sequence.taken_ids.append(token_id)
        sequence.next_input = [token_id]
        if token_id in self.eos_ids:
            self.finish(sequence, "stop")
            return False
        sequence.unsent_ids.append(token_id)
        if logprob is not None:
            sequence.unsent_logprobs.append(self.speller.logprob(token_id, logprob.logprob, logprob.top))
        delta = sequence.text.add(token_id)
        if delta:
            generation.send(TextDelta(delta, tuple(sequence.unsent_ids), tuple(sequence.unsent_logprobs)))
            sequence.unsent_ids.clear()
            sequence.unsent_logprobs.clear()
        if sequence.text.stopped:
            self.finish(sequence, "stop")
            return False
        if sequence.completion_tokens >= generation.params.max_tokens or time.monotonic() >= sequence.deadline:
            self.finish(sequence, "length")
            return False
        return True

    def finish(self, sequence: Sequence, finish_reason: str) -> None:
        """Send the held-back text and hold the final event of a sequence.

        A sequence in the batch that ended well keeps its final event until it left the batch
        (Scheduler._leave), which stores the reply's KV state first: the conversation's next turn,
        which only a client that saw this end sends, finds it.
        """
        rest = sequence.text.finish() if finish_reason != "cancelled" else ""
        if rest:
            sequence.generation.send(TextDelta(rest, tuple(sequence.unsent_ids), tuple(sequence.unsent_logprobs)))
        decode_seconds = time.monotonic() - (sequence.first_token_at or sequence.started_at)
        self.facts.requests_finished += 1
        finished = Finished(
            finish_reason=finish_reason,
            prompt_tokens=len(sequence.generation.prompt_ids),
            completion_tokens=sequence.completion_tokens,
            prompt_seconds=sequence.prompt_seconds,
            decode_seconds=decode_seconds,
            cached_prompt_tokens=sequence.cached_prompt_tokens,
            accepted_draft_tokens=sequence.accepted_draft_tokens,
            rejected_draft_tokens=sequence.rejected_draft_tokens,
        )
        if sequence.in_batch and finish_reason != "cancelled":
            sequence.final = finished
        else:
            self.end(sequence.generation, finished)

    def end(self, generation: Generation, finished: Finished) -> None:
        """Hold a final event for send_ended."""
        self._ended.append((generation, finished))

    def send_ended(self) -> None:
        """Send the final events of the sequences that ended, once `running` no longer counts them:
        a client that saw its reply end never sees its place still taken."""
        for generation, finished in self._ended:
            generation.send(finished)
        self._ended.clear()
