"""The engine thread's loop: admit queued generations, pass prompts in chunks, decode running ones a token per step."""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .batching import DecodeBatch
from .cores import SharedCores
from .events import Failed, Finished, Generation, PromptLogprobs, Started, TextDelta
from .facts import EngineFacts
from .grammar import mask_logits
from .kvcache import new_cache, reserve
from .memory import reserved_kv_tokens, return_freed_memory
from .prefixes import PrefixStore
from .sampling import Sampler, TokenLogprobs, biased, prompt_token_logprobs, sample_tokens, token_logprobs
from .text import TextAssembler, TokenLogprob, TokenSpeller

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5
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


@dataclass
class _Sequence:
    """The engine's state for one running generation."""

    generation: Generation
    sampler: Sampler
    text: TextAssembler
    cache: DynamicCache
    started_at: float
    next_input: list[int]
    completion_tokens: int = 0
    # Tokens taken since the last text piece went out, sent along with the next one.
    unsent_ids: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    first_token_at: float | None = None
    deadline: float | None = field(default=None)
    # Tokens taken after the input ids; the cache holds all but the last (never fed yet).
    taken_ids: list[int] = field(default_factory=list)
    # The final event of a sequence that ended in the batch, sent once it left.
    final: Finished | None = None
    # The prompt's own token logprobs so far, when the request asked for them.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The other choices of a request with n > 1, waiting on this sequence's prompt pass (their `cache` is
    # this one's until they join the batch, each as a row copied from it).
    siblings: list["_Sequence"] = field(default_factory=list)

    @property
    def group(self) -> list["_Sequence"]:
        """Return this sequence and its sibling choices."""
        return [self, *self.siblings]


def places(prefilling: list[_Sequence]) -> int:
    """Return the running places prompts in their pass take: one per choice."""
    return sum(1 + len(sequence.siblings) for sequence in prefilling)


class Scheduler:
    """Run the generations of one loaded model, taking them from the queue `submit` fills.

    Only the engine thread calls it. It writes what it sees (batch sizes, prefix-cache use, decode
    overhead, requests finished) into the engine's `facts`.
    """

    def __init__(self, settings, model, tokenizer, *, pending: queue.Queue, prefixes: PrefixStore, eos_ids: set[int],
                 speller: TokenSpeller, kv_token_budget: int, facts: EngineFacts, cores: SharedCores):
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.pending = pending
        self.prefixes = prefixes
        self.eos_ids = eos_ids
        self.speller = speller
        # Cache tokens (padding included) the running sequences may reach together.
        self.kv_token_budget = kv_token_budget
        self.facts = facts
        self.cores = cores
        # Sequences taken off the queue and not yet ended; read by other threads for /readyz and submit.
        self.running = 0
        self._decode_seconds = 0.0
        self._forward_seconds = 0.0
        # The last prompt chunk's CPU-thread seconds per token (None until one ran), for cutting the
        # next: a lone prompt runs on lent cores, one beside streams often on the worker's own.
        self._thread_seconds_per_prompt_token: float | None = None
        # Final events of sequences that ended this step, sent by _send_ended.
        self._ended: list[tuple[Generation, Finished]] = []

    def serve(self, stopping: threading.Event) -> None:
        """Admit queued requests, advance prompts by a chunk, then every running sequence by one token, until stopping.

        Running sequences end cancelled when stopping comes. A fault of the loop itself fails them
        and is raised: the loop's state is unknown then.
        """
        active: list[_Sequence] = []
        prefilling: list[_Sequence] = []
        batch = DecodeBatch(self.model.config)
        try:
            while not stopping.is_set():
                self._drop_cancelled_waiting()
                self._admit(active, prefilling)
                self._prefill_some(active, prefilling, batch)
                self._decode_step(active, batch)
                busy = self.running
                self.running = len(active) + places(prefilling)
                self._send_ended()
                if busy and not self.running:
                    self.cores.release()
                    # Going idle: glibc keeps what the finished requests freed (caches, prompts,
                    # texts) inside its arenas unless it lies at a heap's top; hand it back now.
                    return_freed_memory()
        except Exception as exc:
            log.exception("the engine loop failed; failing every request of this worker")
            self._send_ended()
            for sequence in active + [choice for sequence in prefilling for choice in sequence.group]:
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            self.running = 0
            raise
        for sequence in active + [choice for sequence in prefilling for choice in sequence.group]:
            self._finish(sequence, "cancelled")
        self.running = 0
        self._send_ended()

    def run_to_end(self, generations: list[Generation]) -> None:
        """Run generations to their end without admitting others (the warm-up)."""
        batch = DecodeBatch(self.model.config)
        sequences = [self._begin(generation) for generation in generations]
        active = [going for sequence in sequences for going in self._prefill(sequence, len(sequence.next_input))]
        if active:
            batch.join([sequence.cache for sequence in active])
        while active:
            self._decode_step(active, batch)
        self._send_ended()

    # Admission ------------------------------------------------------------------------------

    def _drop_cancelled_waiting(self) -> None:
        """Take generations whose client left out of the queue at once, so their places free up."""
        with self.pending.mutex:
            cancelled = [generation for generation in self.pending.queue if generation.cancelled]
            for generation in cancelled:
                self.pending.queue.remove(generation)
            if cancelled:
                self.pending.not_full.notify(len(cancelled))
        for generation in cancelled:
            for choice in generation.choices:
                choice.send(Finished("cancelled", len(generation.prompt_ids), 0, 0.0, 0.0))

    def _admit(self, active: list[_Sequence], prefilling: list[_Sequence]) -> None:
        """Take queued requests while places (one per choice) and KV memory are free (blocking briefly when idle)."""
        while len(active) + places(prefilling) < self.settings.max_running:
            idle = not active and not prefilling
            if not idle and not self._next_fits(active, prefilling):
                # It waits, counted and pinged, and so does everything behind it: a long prompt
                # is not overtaken by short ones for ever.
                break
            try:
                generation = self.pending.get(timeout=IDLE_POLL_SECONDS) if idle else self.pending.get_nowait()
            except queue.Empty:
                break
            if generation.cancelled:
                for choice in generation.choices:
                    choice.send(Finished("cancelled", len(generation.prompt_ids), 0, 0.0, 0.0))
                continue
            taken_at = time.monotonic()
            # Its places are counted before it hears it started: a client that saw it start sees it running.
            self.running = len(active) + places(prefilling) + generation.places
            generation.send(Started(taken_at - generation.submitted_at, taken_at=taken_at))
            try:
                prefilling.append(self._begin(generation))
            except Exception as exc:  # one request's bad parameters must not stop the others
                log.exception("a generation failed to start")
                for choice in generation.choices:
                    choice.send(Failed(f"generation failed: {type(exc).__name__}"))
            # Counted before its first token goes out, so a client that saw a token sees it running.
            self.running = len(active) + places(prefilling)

    def _next_fits(self, active: list[_Sequence], prefilling: list[_Sequence]) -> bool:
        """Tell whether the oldest queued request (all its choices) fits the running places and the KV budget
        next to the running sequences; a request of n choices waits until n places are free."""
        try:
            # Only this thread takes from the queue, so the head stays the one get() returns.
            head = self.pending.queue[0]
        except IndexError:
            return True
        if head.cancelled:
            return True
        if len(active) + places(prefilling) + head.places > self.settings.max_running:
            return False
        running = active + [choice for sequence in prefilling for choice in sequence.group]
        generations = [sequence.generation for sequence in running] + list(head.choices)
        return reserved_kv_tokens(generations) <= self.kv_token_budget

    def _begin(self, generation: Generation) -> _Sequence:
        """Create the engine state of a generation, starting from the longest stored prefix of its prompt."""
        now = time.monotonic()
        deadline_seconds = generation.params.deadline_seconds or self.settings.max_generation_seconds
        input_ids = generation.input_ids
        # A stored prefix has no logits: a request for the prompt's logprobs passes its whole prompt.
        cache, cached = (None, 0) if generation.params.prompt_logprobs is not None else self.prefixes.lookup(input_ids)
        # Room for the whole prompt at once: its pass never copies the cache to grow it.
        cache = reserve(cache if cache is not None else new_cache(self.model.config), len(input_ids))
        group = [
            _Sequence(
                generation=choice,
                sampler=Sampler(choice.params, self.model.config.vocab_size, choice.prompt_ids),
                text=TextAssembler(self.tokenizer, choice.params.stop),
                cache=cache,
                started_at=now,
                next_input=input_ids[cached:],
                cached_prompt_tokens=cached,
                deadline=now + deadline_seconds,
            )
            for choice in generation.choices
        ]
        sequence, sequence.siblings = group[0], group[1:]
        self._force(sequence, generation.forced_ids)
        return sequence

    @staticmethod
    def _force(sequence: _Sequence, forced_ids: tuple[int, ...]) -> None:
        """Put a continuation's sampler and text where the original generation stood after `forced_ids`.

        Their text was sent before, so it is assembled (for stop strings and split characters) but not sent.
        """
        for token_id in forced_ids:
            sequence.sampler.record(token_id)
            sequence.text.add(token_id)
            if sequence.generation.grammar is not None:
                sequence.generation.grammar.consume_token(token_id)
        sequence.completion_tokens = len(forced_ids)

    # Prompt chunks --------------------------------------------------------------------------

    def _prefill_some(self, active: list[_Sequence], prefilling: list[_Sequence], batch: DecodeBatch) -> None:
        """Share one step's prompt budget among the prompts in their pass, shortest remaining first.

        The budget is PREFILL_CHUNK_TOKENS, cut shorter while streams decode so that they wait
        about PREFILL_STALL_SECONDS at most. A short question behind a long pasted document gets
        its first token after its own few tokens, not after the document; the oldest prompt still
        takes at least MIN_CHUNK_TOKENS of every step, so a stream of short prompts cannot stop it.
        Prompts whose client left or whose deadline passed end first, wherever they stand. Prompts
        that are done join the batch. Where a prompt is cut never changes its logits (the kernels
        compute each row alone: tests/test_batch_invariance.py).
        """
        self._end_given_up_prompts(prefilling)
        if not prefilling:
            return
        budget = self.settings.prefill_chunk_tokens
        if active and self._thread_seconds_per_prompt_token is not None:
            seconds_per_token = self._thread_seconds_per_prompt_token / self.cores.threads
            budget = chunk_tokens(budget, self.settings.prefill_stall_seconds, seconds_per_token)
        shares = prompt_shares(budget, [len(sequence.next_input) for sequence in prefilling])
        began, tokens, joining, done = time.monotonic(), 0, [], []
        for sequence, share in zip(list(prefilling), shares, strict=True):
            if sequence.generation.params.prompt_logprobs is not None:
                share = min(share, PROMPT_LOGPROBS_CHUNK_TOKENS)
            if not share:
                continue
            tokens += share
            going_on = self._prefill(sequence, share)
            if going_on is not None:
                done.append(sequence)
                joining += going_on
        if tokens:
            # Measured over the whole step: several prompts' pieces, each reading every weight once.
            self._thread_seconds_per_prompt_token = (time.monotonic() - began) * self.cores.threads / tokens
        prefilling[:] = [sequence for sequence in prefilling if not any(sequence is ended for ended in done)]
        if joining:
            self._join(active, batch, joining)

    def _end_given_up_prompts(self, prefilling: list[_Sequence]) -> None:
        """End prompts in their pass whose client left or whose deadline passed, freeing their place and KV."""
        now = time.monotonic()
        given_up = [sequence for sequence in prefilling if sequence.generation.cancelled or now >= sequence.deadline]
        if not given_up:
            return
        prefilling[:] = [sequence for sequence in prefilling if not any(sequence is ended for ended in given_up)]
        for sequence in given_up:
            for choice in sequence.group:
                self._finish(choice, "cancelled" if sequence.generation.cancelled else "length")

    def _join(self, active: list[_Sequence], batch: DecodeBatch, joining: list[_Sequence]) -> None:
        """Move sequences whose prompt pass is done into the decode batch.

        A join that fails (most likely out of memory) leaves the batch as it was; the joining
        sequences already sent their first token, so each ends with an error event.
        """
        try:
            # The choices of one prompt hand in the same cache: each gets a row copied from it.
            batch.join([sequence.cache for sequence in joining])
        except Exception as exc:
            log.exception("joining the decode batch failed")
            for sequence in joining:
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            return
        active.extend(joining)
        for sequence in joining:
            sequence.cache = None  # the batch holds its KV state now

    def _forced_reply_ended(self, sequence: _Sequence) -> bool:
        """Finish a continuation whose forced tokens already end the reply (max_tokens or a stop string)."""
        if sequence.text.stopped:
            self._finish(sequence, "stop")
            return True
        if sequence.completion_tokens >= sequence.generation.params.max_tokens:
            self._finish(sequence, "length")
            return True
        return False

    def _prefill(self, sequence: _Sequence, tokens: int) -> list[_Sequence] | None:
        """Process the next `tokens` prompt tokens (past its stored prefix); after the last, take each choice's
        first token from the last position's logits (one prompt pass for all of a request's choices).

        Return None while prompt tokens remain, else the choices that go on.
        """
        group = sequence.group
        if sequence.generation.cancelled:
            for choice in group:
                self._finish(choice, "cancelled")
            return []
        try:
            began = time.monotonic()
            start = len(sequence.generation.input_ids) - len(sequence.next_input)
            chunk, sequence.next_input = sequence.next_input[:tokens], sequence.next_input[tokens:]
            scoring = sequence.generation.params.prompt_logprobs is not None
            samplers = [choice.sampler for choice in group]
            with torch.inference_mode():
                output = self.model(
                    input_ids=torch.tensor([chunk]),
                    cache=sequence.cache,
                    use_cache=True,
                    logits_to_keep=0 if scoring else 1,
                )
                if scoring:
                    self._score_prompt(sequence, start, output.logits[0])
                if not sequence.next_input:
                    self.prefixes.store_cache(sequence.generation.input_ids, sequence.cache)
                    last = output.logits[0, -1:]
                    # A row per choice: each is biased, masked and drawn from on its own.
                    logits = biased(samplers, last if len(group) == 1 else last.repeat(len(group), 1))
                    mask_logits(logits, [choice.generation.grammar for choice in group])
            elapsed = time.monotonic() - began
            sequence.prompt_seconds += elapsed
            log.debug("prompt chunk: %d tokens in %.3f s on %d threads", len(chunk), elapsed, self.cores.threads)
            if sequence.next_input:
                return None
            self.facts.prefix_cache_bytes = self.prefixes.bytes
            if sequence.cached_prompt_tokens:
                self.facts.prefix_cache_hits = (self.facts.prefix_cache_hits or 0) + 1
            for choice in sequence.siblings:
                choice.prompt_seconds = sequence.prompt_seconds
            if scoring:
                self._send_prompt_logprobs(sequence)
            # A continuation's forced tokens may already end the reply; max_tokens 0 asks for the prompt pass alone.
            if sequence.generation.forced_ids or not sequence.generation.params.max_tokens:
                if all([self._forced_reply_ended(choice) for choice in group]):
                    return []
            token_ids = sample_tokens(samplers, logits)
            logprobs = token_logprobs(samplers, logits, token_ids)
        except Exception as exc:  # one bad prompt must not stop the others
            log.exception("prompt pass failed")
            for choice in group:
                choice.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            return []
        return [choice for choice, token_id, logprob in zip(group, token_ids, logprobs, strict=True)
                if self._advance_or_fail(choice, token_id, logprob)]

    def _score_prompt(self, sequence: _Sequence, start: int, logits: torch.Tensor) -> None:
        """Keep the logprobs of the prompt tokens that the chunk starting at position `start` predicts."""
        prompt_ids = sequence.generation.prompt_ids
        next_ids = prompt_ids[start + 1:start + 1 + logits.shape[0]]
        if not next_ids:
            return
        top = sequence.generation.params.prompt_logprobs
        for token_id, scored in zip(next_ids, prompt_token_logprobs(logits, next_ids, top), strict=True):
            sequence.prompt_logprobs.append(self.speller.logprob(token_id, scored.logprob, scored.top))

    def _send_prompt_logprobs(self, sequence: _Sequence) -> None:
        """Send the prompt's token logprobs to each choice, its first token (which has none) spelled alone."""
        first = self.speller.bytes_of(sequence.generation.prompt_ids[0]).decode("utf-8", errors="replace")
        event = PromptLogprobs(first, tuple(sequence.prompt_logprobs))
        for choice in sequence.group:
            choice.generation.send(event)
        sequence.prompt_logprobs = []

    # Decode steps ---------------------------------------------------------------------------

    def _decode_step(self, active: list[_Sequence], batch: DecodeBatch) -> None:
        """Generate one token for every running sequence in one forward pass; drop those that end."""
        cancelled = [row for row, sequence in enumerate(active) if sequence.generation.cancelled]
        for row in cancelled:
            self._finish(active[row], "cancelled")
        self._leave(active, batch, cancelled)
        if not active:
            return
        self.facts.largest_batch = max(self.facts.largest_batch or 0, len(active))
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = batch.step(self.model, [sequence.next_input[0] for sequence in active])
                forward_done = time.perf_counter()
                samplers = [sequence.sampler for sequence in active]
                logits = biased(samplers, logits)
                mask_logits(logits, [sequence.generation.grammar for sequence in active])
            token_ids = sample_tokens(samplers, logits)
            logprobs = token_logprobs(samplers, logits, token_ids)
        except Exception as exc:  # the batch's state is unknown now: fail its sequences, keep serving
            log.exception("decode step failed")
            for sequence in active:
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            self._leave(active, batch, list(range(len(active))))
            return
        ended = [row for row, (sequence, token_id, logprob) in enumerate(zip(active, token_ids, logprobs, strict=True))
                 if not self._advance_or_fail(sequence, token_id, logprob)]
        self._leave(active, batch, ended)
        self._count_decode_overhead(forward_done - began, time.perf_counter() - began)

    def _count_decode_overhead(self, forward_seconds: float, step_seconds: float) -> None:
        """Record the share of decode time spent outside the model's forward (sampling, text, batch upkeep)."""
        self._decode_seconds += step_seconds
        self._forward_seconds += forward_seconds
        self.facts.decode_overhead_fraction = round(1 - self._forward_seconds / self._decode_seconds, 4)

    def _leave(self, active: list[_Sequence], batch: DecodeBatch, rows: list[int]) -> None:
        """Remove ended sequences from the running list and the batch; the replies that ended well
        keep their KV state for the conversation's next turn, then get their final event."""
        if not rows:
            return
        for row in rows:
            sequence = active[row]
            if sequence.final is not None:
                self._store_reply(sequence, batch, row)
                self._ended.append((sequence.generation, sequence.final))
        batch.leave(rows)
        active[:] = [sequence for row, sequence in enumerate(active) if row not in set(rows)]

    def _store_reply(self, sequence: _Sequence, batch: DecodeBatch, row: int) -> None:
        """Keep the KV state of a sequence's prompt and reply; a failure to keep it only costs reuse."""
        length = batch.lengths[row]
        try:
            self.prefixes.store([*sequence.generation.input_ids, *sequence.taken_ids][:length], batch.row_layers(row))
            self.facts.prefix_cache_bytes = self.prefixes.bytes
        except Exception:
            log.exception("a reply's KV state could not be stored")

    def _advance_or_fail(self, sequence: _Sequence, token_id: int, logprob: TokenLogprobs | None = None) -> bool:
        """Advance a sequence; a fault in its bookkeeping or text fails that sequence alone."""
        try:
            return self._advance(sequence, token_id, logprob)
        except Exception as exc:
            log.exception("a sequence failed while taking its next token")
            sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            return False

    def _advance(self, sequence: _Sequence, token_id: int, logprob: TokenLogprobs | None = None) -> bool:
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
            self._finish(sequence, "stop")
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
            self._finish(sequence, "stop")
            return False
        if sequence.completion_tokens >= generation.params.max_tokens or time.monotonic() >= sequence.deadline:
            self._finish(sequence, "length")
            return False
        return True

    def _finish(self, sequence: _Sequence, finish_reason: str) -> None:
        """Send the held-back text and the final event of a sequence."""
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
        )
        if sequence.cache is None and finish_reason != "cancelled":
            # In the batch: _leave keeps the reply's KV state first, so the conversation's next
            # turn, which only a client that saw this end sends, finds it.
            sequence.final = finished
        else:
            self._ended.append((sequence.generation, finished))

    def _send_ended(self) -> None:
        """Send the final events of the sequences that ended, once `running` no longer counts them:
        a client that saw its reply end never sees its place still taken."""
        for generation, finished in self._ended:
            generation.send(finished)
        self._ended.clear()
