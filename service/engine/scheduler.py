"""The engine thread's loop: admit queued generations, pass prompts in chunks, decode running ones a token per step.

A generation starts only when its places (one per choice) and the KV pages of its prompt plus
max_tokens are free; it holds those pages until it ends, so what runs never outgrows KV_CACHE_MB
and what does not fit waits in the queue (kvpool.py). Cancellations and deadlines are checked for
every waiting and running generation every step.
"""

import logging
import queue
import threading
import time

import torch

from .cores import SharedCores
from .events import Failed, Finished, Generation, Started
from .facts import EngineFacts
from .grammar import mask_logits
from .logprobs import token_logprobs
from .memory import most_tokens, pages_needed, return_freed_memory
from .prefixes import PrefixStore
from .prompts import PROMPT_LOGPROBS_CHUNK_TOKENS, PromptPass, chunk_tokens, prompt_shares
from .runners import SequenceModel
from .sampling import Sampler, biased, sample_tokens
from .sequences import Delivery, Sequence, places
from .speculation import Speculator
from .text import TextAssembler, TokenSpeller

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5


class Scheduler:
    """Run the generations of one loaded model, taking them from the queue `submit` fills.

    Only the engine thread calls it. It writes what it sees (batch sizes, prefix-cache use, decode
    overhead, requests finished) into the engine's `facts`.
    """

    def __init__(self, settings, runner: SequenceModel, tokenizer, *, vocab_size: int, pending: queue.Queue,
                 prefixes: PrefixStore, eos_ids: set[int], speller: TokenSpeller, facts: EngineFacts,
                 cores: SharedCores):
        self.settings = settings
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pending = pending
        self.prefixes = prefixes
        self.facts = facts
        self.cores = cores
        self.delivery = Delivery(eos_ids, speller, facts)
        self.prompts = PromptPass(runner, prefixes, self.delivery, speller, facts)
        self.speculator = (Speculator(runner, settings.speculative_tokens, self.delivery, facts)
                           if runner.exact_rows and settings.speculative_tokens else None)
        # Sequences taken off the queue and not yet ended; read by other threads for /readyz and submit.
        self.running = 0
        # Prompt tokens taken off the queue and not yet through their pass; read by the worker's
        # event loop (whether it gathers more streams).
        self.prompt_tokens_left = 0
        self._decode_seconds = 0.0
        self._forward_seconds = 0.0
        # The last prompt chunk's CPU-thread seconds per token (None until one ran), for cutting the
        # next: a lone prompt runs on lent cores, one beside streams often on the worker's own.
        self._thread_seconds_per_prompt_token: float | None = None

    def serve(self, stopping: threading.Event) -> None:
        """Admit queued requests, advance prompts by a chunk, then every running sequence by one token, until stopping.

        Running sequences end cancelled when stopping comes. A fault of the loop itself fails them
        and is raised: the loop's state is unknown then.
        """
        active: list[Sequence] = []
        prefilling: list[Sequence] = []
        try:
            while not stopping.is_set():
                self._drop_cancelled_waiting()
                self._admit(active, prefilling)
                self._prefill_some(active, prefilling)
                self._decode_step(active, self._draft_rows(active, prefilling))
                busy = self.running
                self.running = len(active) + places(prefilling)
                self.prompt_tokens_left = sum(len(sequence.next_input) for sequence in prefilling)
                self.delivery.send_ended()
                if busy and not self.running:
                    self.cores.release()
                    # Going idle: glibc keeps what the finished requests freed (prompts, texts,
                    # logits) inside its arenas unless it lies at a heap's top; hand it back now.
                    return_freed_memory()
        except Exception as exc:
            log.exception("the engine loop failed; failing every request of this worker")
            self.delivery.send_ended()
            for sequence in active + [choice for sequence in prefilling for choice in sequence.group]:
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            self.running = self.prompt_tokens_left = 0
            raise
        for sequence in active + [choice for sequence in prefilling for choice in sequence.group]:
            sequence.in_batch = False
            self.delivery.finish(sequence, "cancelled")
            self._release(sequence)
        self.running = 0
        self.delivery.send_ended()

    def run_to_end(self, generations: list[Generation]) -> None:
        """Run generations to their end without admitting others (the warm-up)."""
        sequences = [self._begin(generation) for generation in generations]
        active: list[Sequence] = []
        for sequence in sequences:
            self._join(active, self._run_prompt(sequence, len(sequence.next_input)))
        while active:
            self._decode_step(active)
        self.delivery.send_ended()

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

    def _admit(self, active: list[Sequence], prefilling: list[Sequence]) -> None:
        """Take queued requests while places (one per choice) and KV pages are free (blocking briefly when idle)."""
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
                self.prompt_tokens_left += len(prefilling[-1].next_input)
            except Exception as exc:  # one request's bad parameters must not stop the others
                log.exception("a generation failed to start")
                for choice in generation.choices:
                    choice.send(Failed(f"generation failed: {type(exc).__name__}"))
            # Counted before its first token goes out, so a client that saw a token sees it running.
            self.running = len(active) + places(prefilling)

    def _next_fits(self, active: list[Sequence], prefilling: list[Sequence]) -> bool:
        """Tell whether the oldest queued request (all its choices) fits the free running places and KV pages;
        a request of n choices waits until n places are free."""
        try:
            # Only this thread takes from the queue, so the head stays the one get() returns.
            head = self.pending.queue[0]
        except IndexError:
            return True
        if head.cancelled:
            return True
        if len(active) + places(prefilling) + head.places > self.settings.max_running:
            return False
        return pages_needed(head) <= self.runner.pool.free_pages

    def _begin(self, generation: Generation) -> Sequence:
        """Reserve the KV room of a generation's choices and start its lead from the longest stored prefix of its prompt."""
        now = time.monotonic()
        deadline_seconds = generation.params.deadline_seconds or self.settings.max_generation_seconds
        input_ids = generation.input_ids
        group: list[Sequence] = []
        try:
            for choice in generation.choices:
                group.append(Sequence(
                    generation=choice,
                    sampler=Sampler(choice.params, self.vocab_size, choice.prompt_ids),
                    text=TextAssembler(self.tokenizer, choice.params.stop),
                    kv=self.runner.reserve(most_tokens(choice)),
                    started_at=now,
                    next_input=input_ids,
                    deadline=now + deadline_seconds,
                ))
            sequence, sequence.siblings = group[0], group[1:]
            # A stored prefix has no logits: a request for the prompt's logprobs passes its whole prompt.
            if generation.params.prompt_logprobs is None:
                layers, cached = self.prefixes.lookup(input_ids, generation.kv_scope)
                if cached:
                    self.runner.load(sequence.kv, layers, cached)
                    sequence.next_input, sequence.cached_prompt_tokens = input_ids[cached:], cached
                    for choice in sequence.siblings:
                        choice.cached_prompt_tokens = cached
        except Exception:
            for choice in group:
                self._release(choice)
            raise
        self.delivery.force(sequence, generation.forced_ids)
        return sequence

    def _release(self, sequence: Sequence) -> None:
        """Give a sequence's KV room back (once)."""
        if sequence.kv is not None:
            self.runner.release(sequence.kv)
            sequence.kv = None

    # Prompt chunks --------------------------------------------------------------------------

    def _prefill_some(self, active: list[Sequence], prefilling: list[Sequence]) -> None:
        """Share one step's prompt budget among the prompts in their pass, shortest remaining first.

        The budget is PREFILL_CHUNK_TOKENS, cut shorter while streams decode so that they wait
        about PREFILL_STALL_SECONDS at most (prompts.py). Prompts whose client left or whose
        deadline passed end first, wherever they stand. Prompts that are done join the batch.
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
            going_on = self._run_prompt(sequence, share)
            if going_on is not None:
                done.append(sequence)
                joining += going_on
        if tokens:
            # Measured over the whole step: several prompts' pieces, each reading every weight once.
            self._thread_seconds_per_prompt_token = (time.monotonic() - began) * self.cores.threads / tokens
        prefilling[:] = [sequence for sequence in prefilling if not any(sequence is ended for ended in done)]
        self._join(active, joining)

    def _run_prompt(self, sequence: Sequence, tokens: int) -> list[Sequence] | None:
        """Run a chunk of a prompt; once it is done, release the choices that do not go on and return the rest."""
        going_on = self.prompts.run(sequence, tokens)
        if going_on is not None:
            for choice in sequence.group:
                if not any(choice is going for going in going_on):
                    self._release(choice)
        return going_on

    def _end_given_up_prompts(self, prefilling: list[Sequence]) -> None:
        """End prompts in their pass whose client left or whose deadline passed, freeing their place and KV."""
        now = time.monotonic()
        given_up = [sequence for sequence in prefilling if sequence.generation.cancelled or now >= sequence.deadline]
        if not given_up:
            return
        prefilling[:] = [sequence for sequence in prefilling if not any(sequence is ended for ended in given_up)]
        for sequence in given_up:
            for choice in sequence.group:
                self.delivery.finish(choice, "cancelled" if sequence.generation.cancelled else "length")
                self._release(choice)

    @staticmethod
    def _join(active: list[Sequence], joining: list[Sequence]) -> None:
        """Add sequences whose prompt pass is done to the decode batch: each keeps its own KV room."""
        for sequence in joining:
            sequence.in_batch = True
        active.extend(joining)

    # Decode steps ---------------------------------------------------------------------------

    def _draft_rows(self, active: list[Sequence], prefilling: list[Sequence]) -> int:
        """Return the rows this step's drafts may add: those a full batch (MAX_RUNNING rows) would run, none
        while a prompt is in its pass or a request waits (its place or pages not free)."""
        if self.speculator is None or prefilling or not self.pending.empty():
            return 0
        return max(0, self.settings.max_running - len(active))

    def _decode_step(self, active: list[Sequence], draft_rows: int = 0) -> None:
        """Generate a token for every running sequence in one forward pass, more where its drafts (in up to
        `draft_rows` extra rows) are what it would have chosen; drop those that end."""
        for sequence in active:
            if sequence.generation.cancelled:
                sequence.in_batch = False
                self.delivery.finish(sequence, "cancelled")
        self._leave(active)
        if not active:
            return
        self.facts.largest_batch = max(self.facts.largest_batch or 0, len(active))
        began = time.perf_counter()
        try:
            drafted = self.speculator.propose(active, draft_rows) if self.speculator is not None else None
            with torch.inference_mode():
                if drafted is None:
                    logits = self.runner.decode([sequence.kv for sequence in active],
                                                [sequence.next_input[0] for sequence in active])
                else:
                    logits = self.speculator.forward(active, drafted)
                forward_done = time.perf_counter()
                samplers = [sequence.sampler for sequence in active]
                logits = biased(samplers, logits)
                mask_logits(logits, [sequence.generation.grammar for sequence in active])
            token_ids = sample_tokens(samplers, logits)
            logprobs = token_logprobs(samplers, logits, token_ids)
        except Exception as exc:  # the step's state is unknown now: fail its sequences, keep serving
            log.exception("decode step failed")
            for sequence in active:
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
                sequence.in_batch = False
                sequence.final = None
            self._release_all(active)
            active.clear()
            return
        for index, (sequence, token_id, logprob) in enumerate(zip(active, token_ids, logprobs, strict=True)):
            if drafted is not None and drafted.drafts[index]:
                goes_on = self.speculator.take(sequence, token_id, logprob, drafted, index)
            else:
                goes_on = self.delivery.advance_or_fail(sequence, token_id, logprob)
            if not goes_on and sequence.final is None:
                sequence.in_batch = False  # failed: no reply to keep
        self._leave(active)
        self._count_decode_overhead(forward_done - began, time.perf_counter() - began)

    def _count_decode_overhead(self, forward_seconds: float, step_seconds: float) -> None:
        """Record the share of decode time spent outside the model's forward (sampling, text, bookkeeping)."""
        self._decode_seconds += step_seconds
        self._forward_seconds += forward_seconds
        self.facts.decode_overhead_fraction = round(1 - self._forward_seconds / self._decode_seconds, 4)

    def _leave(self, active: list[Sequence]) -> None:
        """Remove the sequences that ended from the batch; the replies that ended well keep their KV
        state for the conversation's next turn, then get their final event. Nothing else is touched."""
        ended = [sequence for sequence in active if not sequence.in_batch or sequence.final is not None]
        if not ended:
            return
        active[:] = [sequence for sequence in active if sequence.in_batch and sequence.final is None]
        for sequence in ended:
            if sequence.final is not None:
                self.prompts.store(sequence, finished_turn=True)
                self.delivery.end(sequence.generation, sequence.final)
        self._release_all(ended)

    def _release_all(self, sequences: list[Sequence]) -> None:
        """Give back the KV room of sequences that left."""
        for sequence in sequences:
            self._release(sequence)
