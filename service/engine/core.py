"""The engine: one thread per worker owns the model; request threads talk to it through queues."""

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import Environment, TemplateError, TemplateSyntaxError, meta
from transformers import AutoConfig, DynamicCache

from .loading import (
    load_generation_defaults,
    load_model,
    load_tokenizer,
    model_fingerprint,
    resolve_model_dir,
)
from .batching import DecodeBatch
from .grammar import Grammars, mask_logits
from .memory import kv_bytes_per_token, kv_token_budget, most_tokens, reserved_kv_tokens, return_freed_memory
from .prefixes import PrefixStore
from .prepare import prepare_model
from .sampling import SAMPLER_VERSION, Sampler, SamplingParams, TokenLogprobs, sample_tokens, token_logprobs
from .text import TextAssembler, TokenLogprob, TokenSpeller

log = logging.getLogger(__name__)

# int8 and int4 keep bf16 for everything but the Linear weights (see quantized.py).
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.bfloat16, "int4": torch.bfloat16}
WARMUP_MESSAGES = [{"role": "user", "content": "Hello! Say something short."}]
WARMUP_TOKENS = 8
IDLE_POLL_SECONDS = 0.5


class EngineOverloaded(RuntimeError):
    """The worker's waiting queue is full."""


class EngineUnavailable(RuntimeError):
    """The engine failed to load or is shutting down."""


class TemplateRefused(ValueError):
    """The model's chat template refused a conversation (a role order it does not support, say)."""


@dataclass(frozen=True)
class Started:
    """The engine took the request off the queue."""

    queue_seconds: float
    # True when the response cache serves the reply: no engine queue was involved.
    cached: bool = False


@dataclass(frozen=True)
class TextDelta:
    """A piece of generated text: whole characters, no stop string."""

    text: str
    # The tokens that completed this text since the previous piece: what a continuation is forced with.
    token_ids: tuple[int, ...] = ()
    # Their log probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The generation ended; the last event of a successful generation."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float
    decode_seconds: float
    cached_prompt_tokens: int = 0
    # True when the response cache served the reply: the timings are not the engine's.
    cached: bool = False


@dataclass(frozen=True)
class Failed:
    """The generation failed inside the engine; the last event of a failed generation."""

    message: str


Event = Started | TextDelta | Finished | Failed


def events_until_last(source):
    """Yield a source's events (anything with `next_event`) up to and including its Finished or Failed."""
    while True:
        event = source.next_event()
        yield event
        if isinstance(event, (Finished, Failed)):
            return


class Generation:
    """A request's handle: the events the engine sends it, and a way to cancel it.

    `forced_ids` start the reply with tokens generated before (a continuation): they are processed
    with the prompt, count as completion tokens, and their text is not sent again.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, forced_ids: tuple[int, ...] = (), grammar=None):
        self.prompt_ids = prompt_ids
        self.params = params
        self.forced_ids = tuple(forced_ids)
        # The llguidance matcher of params.grammar, advanced by each token of the reply.
        self.grammar = grammar
        self.submitted_at = time.monotonic()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._cancelled = threading.Event()

    @property
    def input_ids(self) -> list[int]:
        """Return the tokens the engine processes before it samples: the prompt, then the forced ones."""
        return [*self.prompt_ids, *self.forced_ids]

    def cancel(self) -> None:
        """Ask the engine to stop this generation at its next token."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Tell whether cancel() was called."""
        return self._cancelled.is_set()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """Return the next event, or None if none came within timeout seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def events(self):
        """Yield every event up to and including the last one."""
        return events_until_last(self)

    def send(self, event: Event) -> None:
        """Deliver an event to the request (engine side)."""
        self._events.put(event)


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


class Engine:
    """Owns the tokenizer and model of one worker and generates for every request it accepts."""

    def __init__(self, settings):
        self.settings = settings
        self.tokenizer = None
        self.model = None
        self.model_dir = None
        self.fingerprint = ""
        self.generation_defaults = None
        self.grammars: Grammars | None = None
        self.context_length = 0
        # Cache tokens (padding included) this worker's running sequences may reach together.
        self.kv_token_budget = 0
        self.facts: dict[str, object] = {"state": "created", "requests_finished": 0}
        self._eos_ids: set[int] = set()
        self._speller: TokenSpeller | None = None
        # Bounded by submit(): running plus queued stay within MAX_RUNNING + MAX_QUEUE, so a burst
        # submitted before this thread takes any is not refused while running places are free.
        self._pending: queue.Queue[Generation] = queue.Queue(maxsize=settings.request_places)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        # Held while a request is queued and while the engine stops taking requests, so no request
        # lands in the queue after the engine gave the queued ones their last event.
        self._admission = threading.Lock()
        self._closed_reason: str | None = None
        self._on_ready = None
        self._on_failure = None
        self._thread: threading.Thread | None = None
        self._running = 0
        self._prefixes: PrefixStore | None = None
        self._decode_seconds = 0.0
        self._forward_seconds = 0.0

    # Lifecycle -----------------------------------------------------------------------------

    def start(self, on_ready=None, on_failure=None) -> None:
        """Load the tokenizer now (failing fast on a bad MODEL), then load and warm up in a thread.

        The engine thread calls on_ready() once it serves, and on_failure(reason, while_loading)
        when the model fails to load or the engine loop fails, after every request got its last
        event (a worker exits there).
        """
        self._on_ready, self._on_failure = on_ready, on_failure
        self.model_dir = resolve_model_dir(self.settings.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.generation_defaults = load_generation_defaults(self.model_dir)
        self._eos_ids = self._find_eos_ids()
        config = AutoConfig.from_pretrained(self.model_dir)
        self.grammars = Grammars(self.tokenizer, config.vocab_size, sorted(self._eos_ids))
        self._speller = TokenSpeller(self.tokenizer)
        bytes_per_token = kv_bytes_per_token(config, DTYPES[self.settings.dtype])
        self.kv_token_budget = kv_token_budget(self.settings.kv_cache_mb, bytes_per_token)
        self.facts.update(kv_bytes_per_token=bytes_per_token, kv_token_budget=self.kv_token_budget)
        self.facts["state"] = "loading"
        self._thread = threading.Thread(target=self._run, name="corechat-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # No engine thread will drain the queue: requests queued before it started or after it
            # ended still get their last event here.
            self._close("the server is shutting down")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded and warmed up; return whether it is."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        """Tell whether the engine serves requests."""
        return self._ready.is_set()

    @property
    def failed(self) -> bool:
        """Tell whether loading failed for good."""
        return self.facts["state"] == "failed"

    @property
    def waiting(self) -> int:
        """Return the number of requests queued and not yet started."""
        return self._pending.qsize()

    @property
    def running(self) -> int:
        """Return the number of sequences being generated."""
        return self._running

    def _run(self) -> None:
        """Load, warm up, then serve until stopped (the engine thread)."""
        try:
            self._load_weights()
            if self.settings.warmup:
                self._warm_up()
        except Exception as exc:  # a bad model must not take the worker down silently
            log.exception("model failed to load")
            self._fail(f"the model failed to load: {type(exc).__name__}: {exc}", while_loading=True)
            return
        # Building the tokenizer parsed an 18 MB JSON into objects that are dropped again: about
        # 70 MB per worker that glibc would otherwise keep.
        return_freed_memory()
        self.facts.update(state="ready", requests_finished=0)
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready()
        self._serve()

    def _load_weights(self) -> None:
        """Map the weights and record how long it took."""
        began = time.monotonic()
        dtype = DTYPES[self.settings.dtype]
        self.model = load_model(self.model_dir, dtype)
        # Counted before quantizing turns the Linear weights into buffers, which parameters() skips.
        parameters = sum(p.numel() for p in self.model.parameters())
        self._prefixes = PrefixStore(self.model.config, self.settings.prefix_cache_mb * 1024 * 1024)
        files_fingerprint = model_fingerprint(self.model_dir, self.tokenizer)
        prepared = prepare_model(self.model, self.settings.dtype, self.model_dir, Path(self.settings.converted_weights_dir),
                                 Path(self.settings.kernels_dir), files_fingerprint)
        weight_format = prepared.pop("weight_format")
        self.facts.update(prepared)
        if "converted_weights" in prepared:
            log.info("%s weights mapped from %s", self.settings.dtype, prepared["converted_weights"])
        self.fingerprint = hashlib.sha256(
            f"{files_fingerprint}:{weight_format}:sampler-{SAMPLER_VERSION}".encode()).hexdigest()[:16]
        limit = getattr(self.model.config, "max_position_embeddings", 0) or 32768
        self.context_length = min(limit, self.settings.max_model_len or limit)
        self.facts.update(
            load_seconds=round(time.monotonic() - began, 3),
            dtype=self.settings.dtype,
            parameters=parameters,
            torch_threads=torch.get_num_threads(),
            context_length=self.context_length,
            fingerprint=self.fingerprint,
        )
        log.info("model %s loaded in %.2f s (%s)", self.model_dir, self.facts["load_seconds"], dtype)

    def _warm_up(self) -> None:
        """Run one real short generation so the first request does not pay for lazy initialisation."""
        began = time.monotonic()
        prompt_ids = self.encode_chat(WARMUP_MESSAGES)
        generation = Generation(prompt_ids, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0))
        self._decode_until_done([self._begin(generation)])
        self.facts["warmup_seconds"] = round(time.monotonic() - began, 3)
        log.info("warm-up generation took %.2f s", self.facts["warmup_seconds"])

    def _close(self, reason: str) -> None:
        """Refuse requests from now on, then tell every queued one that the engine cannot serve it."""
        with self._admission:
            self._closed_reason = self._closed_reason or reason
        while True:
            try:
                self._pending.get_nowait().send(Failed(reason))
            except queue.Empty:
                return

    def _fail(self, reason: str, *, while_loading: bool) -> None:
        """Stop serving for good: not ready, every queued request failed, the worker told."""
        self._ready.clear()
        self.facts.update(state="failed", error=reason)
        self._close(reason)
        if self._on_failure is not None:
            self._on_failure(reason, while_loading)

    def snapshot_facts(self) -> dict[str, object]:
        """Return a copy of the facts, safe to iterate while the engine thread adds to them."""
        # dict.copy runs in C under the GIL, so no key is added halfway through it.
        return self.facts.copy()

    # Text ----------------------------------------------------------------------------------

    @property
    def template_supports_tools(self) -> bool:
        """Tell whether the chat template renders a `tools` list (a template that never reads it would drop them)."""
        template = self.tokenizer.chat_template
        if not isinstance(template, str):
            return False
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render a conversation through the model's chat template, ready for the reply.

        Raise TemplateRefused when the template rejects the conversation: many templates call
        raise_exception() on a role order they do not support (two system messages, a conversation
        starting with the assistant). A template that does not compile is the model's fault, not
        the request's, and raises as it is.
        """
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise TemplateRefused(str(exc)) from None

    def encode(self, prompt: str) -> list[int]:
        """Turn a rendered prompt into token ids (special tokens as the template wrote them)."""
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render a conversation for the reply and tokenize it, message text as ordinary text.

        Control tokens typed inside a message (`<|im_start|>`) cost a few ordinary tokens, so a message
        cannot open a turn of its own; TRUST_CONTROL_TOKENS_IN_MESSAGES parses them as the template would.
        """
        if self.settings.trust_control_tokens_in_messages:
            return self.encode(self.render_prompt(messages, tools))
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=True, sanitize_control_tokens=True
            )
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise TemplateRefused(str(exc)) from None
        return list(encoded["input_ids"])

    def _find_eos_ids(self) -> set[int]:
        """Collect the ids that end a reply: the generation config's and the tokenizer's EOS."""
        configured = self.generation_defaults.eos_token_id
        ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # Requests ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, forced_ids: tuple[int, ...] = ()) -> Generation:
        """Queue a generation (continuing `forced_ids` if given); raise EngineOverloaded when the queue is full, EngineUnavailable when closed.

        A generation that could never fit the KV budget, even alone, is a caller's error (ValueError).
        """
        # Made here, in the request's thread: the first one builds the view of the vocabulary, which the engine must not wait for.
        grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        generation = Generation(prompt_ids, params, forced_ids, grammar)
        if self.kv_token_budget and most_tokens(generation) > self.kv_token_budget:
            raise ValueError(f"{most_tokens(generation)} tokens exceed the KV budget of {self.kv_token_budget}")
        full = EngineOverloaded(f"all {self.settings.max_queue} queue places of this worker are taken")
        with self._admission:
            if self._closed_reason is not None or self._stopping.is_set():
                raise EngineUnavailable(self._closed_reason or "the engine is shutting down")
            if self._running + self._pending.qsize() >= self.settings.request_places:
                raise full
            try:
                self._pending.put_nowait(generation)
            except queue.Full:
                raise full from None
        return generation

    def _serve(self) -> None:
        """Admit queued requests, advance prompts by a chunk, then every running sequence by one token."""
        active: list[_Sequence] = []
        prefilling: list[_Sequence] = []
        batch = DecodeBatch(self.model.config)
        try:
            while not self._stopping.is_set():
                self._drop_cancelled_waiting()
                self._admit(active, prefilling)
                self._prefill_some(active, prefilling, batch)
                self._decode_step(active, batch)
                busy = self._running
                self._running = len(active) + len(prefilling)
                if busy and not self._running:
                    # Going idle: glibc keeps what the finished requests freed (caches, prompts,
                    # texts) inside its arenas unless it lies at a heap's top; hand it back now.
                    return_freed_memory()
        except Exception as exc:  # the loop's state is unknown now: end every request, then the worker
            log.exception("the engine loop failed; failing every request of this worker")
            for sequence in active + prefilling:
                sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            self._running = 0
            self._fail(f"the engine loop failed: {type(exc).__name__}: {exc}", while_loading=False)
            return
        for sequence in active + prefilling:
            self._finish(sequence, "cancelled")
        # Every request must get a last event, or its thread waits forever and the worker cannot exit.
        self._close("the server is shutting down")

    def _drop_cancelled_waiting(self) -> None:
        """Take generations whose client left out of the queue at once, so their places free up."""
        with self._pending.mutex:
            cancelled = [generation for generation in self._pending.queue if generation.cancelled]
            for generation in cancelled:
                self._pending.queue.remove(generation)
            if cancelled:
                self._pending.not_full.notify(len(cancelled))
        for generation in cancelled:
            generation.send(Finished("cancelled", len(generation.prompt_ids), 0, 0.0, 0.0))

    def _decode_until_done(self, sequences: list["_Sequence"]) -> None:
        """Run sequences to their end without admitting others (the warm-up)."""
        batch = DecodeBatch(self.model.config)
        active = [sequence for sequence in sequences if self._prefill(sequence, len(sequence.next_input))]
        if active:
            batch.join([sequence.cache for sequence in active])
        while active:
            self._decode_step(active, batch)

    def _admit(self, active: list[_Sequence], prefilling: list[_Sequence]) -> None:
        """Take queued requests while places and KV memory are free (blocking briefly when idle)."""
        while len(active) + len(prefilling) < self.settings.max_running:
            idle = not active and not prefilling
            if not idle and not self._next_fits(active + prefilling):
                # It waits, counted and pinged, and so does everything behind it: a long prompt
                # is not overtaken by short ones for ever.
                break
            try:
                generation = self._pending.get(timeout=IDLE_POLL_SECONDS) if idle else self._pending.get_nowait()
            except queue.Empty:
                break
            if generation.cancelled:
                generation.send(Finished("cancelled", len(generation.prompt_ids), 0, 0.0, 0.0))
                continue
            generation.send(Started(time.monotonic() - generation.submitted_at))
            try:
                prefilling.append(self._begin(generation))
            except Exception as exc:  # one request's bad parameters must not stop the others
                log.exception("a generation failed to start")
                generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            # Counted before its first token goes out, so a client that saw a token sees it running.
            self._running = len(active) + len(prefilling)

    def _next_fits(self, running: list[_Sequence]) -> bool:
        """Tell whether the oldest queued request fits the KV budget next to the running sequences."""
        try:
            # Only this thread takes from the queue, so the head stays the one get() returns.
            head = self._pending.queue[0]
        except IndexError:
            return True
        generations = [sequence.generation for sequence in running] + [head]
        return head.cancelled or reserved_kv_tokens(generations) <= self.kv_token_budget

    def _prefill_some(self, active: list[_Sequence], prefilling: list[_Sequence], batch: DecodeBatch) -> None:
        """Process up to PREFILL_CHUNK_TOKENS prompt tokens in whole chunks, oldest prompt first.

        Prompts that are done join the batch. Between two decode steps the running sequences wait
        for at most this much prompt work, so a long prompt arriving slows their tokens down
        instead of stopping them.
        """
        chunk = self.settings.prefill_chunk_tokens
        budget, joining = chunk, []
        # Whole chunks only, so where a prompt is cut never depends on what else is running.
        while prefilling and (budget == chunk or min(chunk, len(prefilling[0].next_input)) <= budget):
            sequence = prefilling[0]
            take = min(chunk, len(sequence.next_input))
            budget -= take
            goes_on = self._prefill(sequence, take)
            if goes_on is not None:
                prefilling.pop(0)
                if goes_on:
                    joining.append(sequence)
        if joining:
            batch.join([sequence.cache for sequence in joining])
            active.extend(joining)
            for sequence in joining:
                sequence.cache = None  # the batch holds its KV state now

    def _begin(self, generation: Generation) -> _Sequence:
        """Create the engine state of a generation, starting from the longest stored prefix of its prompt."""
        now = time.monotonic()
        deadline_seconds = generation.params.deadline_seconds or self.settings.max_generation_seconds
        input_ids = generation.input_ids
        cache, cached = self._prefixes.lookup(input_ids)
        sequence = _Sequence(
            generation=generation,
            sampler=Sampler(generation.params, self.model.config.vocab_size, generation.prompt_ids),
            text=TextAssembler(self.tokenizer, generation.params.stop),
            cache=cache if cache is not None else DynamicCache(config=self.model.config),
            started_at=now,
            next_input=input_ids[cached:],
            cached_prompt_tokens=cached,
            deadline=now + deadline_seconds,
        )
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

    def _forced_reply_ended(self, sequence: _Sequence) -> bool:
        """Finish a continuation whose forced tokens already end the reply (max_tokens or a stop string)."""
        if sequence.text.stopped:
            self._finish(sequence, "stop")
            return True
        if sequence.completion_tokens >= sequence.generation.params.max_tokens:
            self._finish(sequence, "length")
            return True
        return False

    def _prefill(self, sequence: _Sequence, tokens: int) -> bool | None:
        """Process the next `tokens` prompt tokens (past its stored prefix); after the last, take a token.

        Return None while prompt tokens remain, else whether the sequence goes on.
        """
        if sequence.generation.cancelled:
            self._finish(sequence, "cancelled")
            return False
        try:
            began = time.monotonic()
            chunk, sequence.next_input = sequence.next_input[:tokens], sequence.next_input[tokens:]
            with torch.inference_mode():
                output = self.model(
                    input_ids=torch.tensor([chunk]),
                    cache=sequence.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                if not sequence.next_input:
                    self._prefixes.store(sequence.generation.input_ids, sequence.cache)
                    mask_logits(output.logits[0, -1:], [sequence.generation.grammar])
            sequence.prompt_seconds += time.monotonic() - began
            if sequence.next_input:
                return None
            self.facts["prefix_cache_bytes"] = self._prefixes.bytes
            if sequence.cached_prompt_tokens:
                self.facts["prefix_cache_hits"] = self.facts.get("prefix_cache_hits", 0) + 1
            if sequence.generation.forced_ids and self._forced_reply_ended(sequence):
                return False
            logits = output.logits[0, -1:]
            token_id = sample_tokens([sequence.sampler], logits)[0]
            return self._advance(sequence, token_id, token_logprobs([sequence.sampler], logits, [token_id])[0])
        except Exception as exc:  # one bad prompt must not stop the others
            log.exception("prompt pass failed")
            sequence.generation.send(Failed(f"generation failed: {type(exc).__name__}"))
            return False

    def _decode_step(self, active: list[_Sequence], batch: DecodeBatch) -> None:
        """Generate one token for every running sequence in one forward pass; drop those that end."""
        cancelled = [row for row, sequence in enumerate(active) if sequence.generation.cancelled]
        for row in cancelled:
            self._finish(active[row], "cancelled")
        self._leave(active, batch, cancelled)
        if not active:
            return
        self.facts["largest_batch"] = max(self.facts.get("largest_batch", 0), len(active))
        began = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = batch.step(self.model, [sequence.next_input[0] for sequence in active])
                forward_done = time.perf_counter()
                mask_logits(logits, [sequence.generation.grammar for sequence in active])
            samplers = [sequence.sampler for sequence in active]
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
        self.facts["decode_overhead_fraction"] = round(1 - self._forward_seconds / self._decode_seconds, 4)

    @staticmethod
    def _leave(active: list[_Sequence], batch: DecodeBatch, rows: list[int]) -> None:
        """Remove ended sequences from the running list and the batch."""
        if rows:
            batch.leave(rows)
            active[:] = [sequence for row, sequence in enumerate(active) if row not in set(rows)]

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
        sequence.next_input = [token_id]
        if token_id in self._eos_ids:
            self._finish(sequence, "stop")
            return False
        sequence.unsent_ids.append(token_id)
        if logprob is not None:
            sequence.unsent_logprobs.append(self._speller.logprob(token_id, logprob.logprob, logprob.top))
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
        self.facts["requests_finished"] += 1
        sequence.generation.send(
            Finished(
                finish_reason=finish_reason,
                prompt_tokens=len(sequence.generation.prompt_ids),
                completion_tokens=sequence.completion_tokens,
                prompt_seconds=sequence.prompt_seconds,
                decode_seconds=decode_seconds,
                cached_prompt_tokens=sequence.cached_prompt_tokens,
            )
        )
