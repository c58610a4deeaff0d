"""The engine's face to request threads: load and warm up the model, queue generations, report facts.

One engine thread per worker owns the model and runs the scheduler (scheduler.py); request threads
submit here and read their events from the Generation they get back (events.py).
"""

import hashlib
import logging
import queue
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from .cores import SharedCores, no_sharing
from .events import ChoiceGroup, Failed, Generation, KvScope
from .facts import EngineFacts, EngineState
from .grammar import Grammars
from .loading import (
    inherited_tokenizer,
    load_generation_defaults,
    load_model,
    load_tokenizer,
    model_fingerprint,
    read_into_page_cache,
    resolve_model_dir,
)
from .memory import KVBudget, kv_bytes_per_token, pages_needed, return_freed_memory
from .prefixes import PrefixStore, SharedPrefixes
from .prepare import prepare_model
from .quantized import FORMATS
from .runners import PagedModel, TransformersModel
from .sampling import SAMPLER_VERSION, SamplingParams
from .scheduler import Scheduler
from .sequence_files import SequenceFormat, forward_code_version
from .template import ChatTemplate
from .text import TokenSpeller

log = logging.getLogger(__name__)

# The quantized formats keep bf16 for everything but the Linear weights (see quantized.py).
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, **dict.fromkeys(FORMATS, torch.bfloat16)}
WARMUP_MESSAGES = [{"role": "user", "content": "Hello! Say something short."}]
WARMUP_TOKENS = 8


class EngineOverloaded(RuntimeError):
    """The worker's waiting queue is full."""


class EngineUnavailable(RuntimeError):
    """The engine failed to load or is shutting down."""


class Engine:
    """Owns the tokenizer and model of one worker and generates for every request it accepts."""

    def __init__(self, settings, shared_prefixes: SharedPrefixes | None = None):
        """`shared_prefixes` keeps finished turns' KV state for other hosts (SHARED_KV_TTL_SECONDS)."""
        self.settings = settings
        self.shared_prefixes = shared_prefixes
        self.tokenizer = None
        # Turns conversations into prompt token ids; made by start().
        self.template: ChatTemplate | None = None
        self.model = None
        self.model_dir = None
        self.fingerprint = ""
        self.generation_defaults = None
        self.grammars: Grammars | None = None
        self.context_length = 0
        # This worker's KV memory in pages (KV_CACHE_MB), and the most tokens one sequence may hold in it.
        self.kv_budget: KVBudget | None = None
        self.kv_token_budget = 0
        self.facts = EngineFacts()
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
        # Made once the model is loaded, in the engine thread.
        self._scheduler: Scheduler | None = None

    # Lifecycle -----------------------------------------------------------------------------

    def start(self, on_ready=None, on_failure=None, cores: SharedCores | None = None) -> None:
        """Load the tokenizer now (failing fast on a bad MODEL), then load and warm up in a thread.

        The engine thread calls on_ready() once it serves, and on_failure(reason, while_loading)
        when the model fails to load or the engine loop fails, after every request got its last
        event (a worker exits there). With `cores`, the engine uses the cores idle workers lend.
        """
        self._on_ready, self._on_failure = on_ready, on_failure
        self.cores = cores or no_sharing(torch.get_num_threads())
        self.model_dir = resolve_model_dir(self.settings.model, Path(self.settings.converted_weights_dir))
        inherited = inherited_tokenizer(self.model_dir)
        self.tokenizer = inherited if inherited is not None else load_tokenizer(self.model_dir)
        self.facts.tokenizer_inherited = inherited is not None
        self.template = ChatTemplate(self.tokenizer, trust_control_tokens=self.settings.trust_control_tokens_in_messages)
        self.generation_defaults = load_generation_defaults(self.model_dir)
        self._eos_ids = self._find_eos_ids()
        config = AutoConfig.from_pretrained(self.model_dir)
        self.grammars = Grammars(self.tokenizer, config.vocab_size, sorted(self._eos_ids))
        self._speller = TokenSpeller(self.tokenizer)
        bytes_per_token = kv_bytes_per_token(config, DTYPES[self.settings.dtype])
        self.kv_budget = KVBudget.of(self.settings.kv_cache_mb, bytes_per_token)
        self.kv_token_budget = self.kv_budget.tokens
        self.facts.update(kv_bytes_per_token=bytes_per_token, kv_token_budget=self.kv_token_budget,
                          state=EngineState.LOADING)
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
        return self.facts.state is EngineState.FAILED

    @property
    def waiting(self) -> int:
        """Return the places the queued requests take (one per choice), none started yet."""
        with self._pending.mutex:
            return sum(generation.places for generation in self._pending.queue)

    @property
    def running(self) -> int:
        """Return the number of sequences being generated."""
        return self._scheduler.running if self._scheduler is not None else 0

    @property
    def prompt_tokens_left(self) -> int:
        """Return the prompt tokens still to pass: the queued requests' and those in their pass."""
        with self._pending.mutex:
            queued = sum(len(generation.prompt_ids) for generation in self._pending.queue)
        return queued + (self._scheduler.prompt_tokens_left if self._scheduler is not None else 0)

    def _run(self) -> None:
        """Load, warm up, then serve until stopped (the engine thread)."""
        try:
            self._load_weights()
            if self.settings.warmup:
                self._warm_up()
                self.cores.release()
        except Exception as exc:  # a bad model must not take the worker down silently
            log.exception("model failed to load")
            self._fail(f"the model failed to load: {type(exc).__name__}: {exc}", while_loading=True)
            return
        # Building the tokenizer parsed an 18 MB JSON into objects that are dropped again: about
        # 70 MB per worker that glibc would otherwise keep.
        return_freed_memory()
        self.facts.update(state=EngineState.READY, requests_finished=0)
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready()
        try:
            self._scheduler.serve(self._stopping)
        except Exception as exc:  # the scheduler failed its requests; the worker cannot trust the loop any more
            self._fail(f"the engine loop failed: {type(exc).__name__}: {exc}", while_loading=False)
            return
        # Every request must get a last event, or its thread waits forever and the worker cannot exit.
        self._close("the server is shutting down")

    def _load_weights(self) -> None:
        """Map the weights and record how long it took."""
        began = time.monotonic()
        dtype = DTYPES[self.settings.dtype]
        self.model = load_model(self.model_dir, dtype)
        # Counted before quantizing turns the Linear weights into buffers, which parameters() skips.
        parameters = sum(p.numel() for p in self.model.parameters())
        files_fingerprint = model_fingerprint(self.model_dir, self.tokenizer, Path(self.settings.converted_weights_dir))
        prepared = prepare_model(self.model, self.tokenizer, self.settings.dtype, self.model_dir, Path(self.settings.converted_weights_dir),
                                 Path(self.settings.kernels_dir), files_fingerprint, between_layers=self.cores.take,
                                 kernel_path=self.settings.kernel_path)
        weight_format = prepared.weight_format
        read_into_page_cache(self.model.get_input_embeddings().weight)
        self.facts.update(kernel_paths=prepared.kernel_paths, quantization=prepared.quantization,
                          converted_weights=prepared.converted_weights, forward=prepared.forward)
        if prepared.converted_weights is not None:
            log.info("%s weights mapped from %s", self.settings.dtype, prepared.converted_weights)
        self.fingerprint = hashlib.sha256(f"{files_fingerprint}:{weight_format}:{prepared.weights_digest}:"
                                          f"sampler-{SAMPLER_VERSION}".encode()).hexdigest()[:16]
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
        runner = (PagedModel(prepared.lean, self.kv_budget) if prepared.lean is not None
                  else TransformersModel(self.model, self.kv_budget))
        self._scheduler = Scheduler(
            self.settings, runner, self.tokenizer, vocab_size=self.model.config.vocab_size, pending=self._pending,
            prefixes=PrefixStore(
                SequenceFormat(self.model.config.num_hidden_layers, DTYPES[self.settings.dtype], runner.stored_shape),
                self.settings.prefix_cache_mb * 1024 * 1024, self.settings.prefix_store_root,
                f"{self.fingerprint}-{self.settings.dtype}-{runner.kv_layout}-{forward_code_version()}",
                shared=self.shared_prefixes, turn_end_ids=self._eos_ids),
            eos_ids=self._eos_ids, speller=self._speller, facts=self.facts, cores=self.cores,
        )
        log.info("model %s loaded in %.2f s (%s)", self.model_dir, self.facts.load_seconds, dtype)

    def _warm_up(self) -> None:
        """Run one real short generation so the first request does not pay for lazy initialisation."""
        began = time.monotonic()
        prompt_ids = self.template.encode_chat(WARMUP_MESSAGES)
        generation = Generation(prompt_ids, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0))
        self._scheduler.run_to_end([generation])
        self.facts.warmup_seconds = round(time.monotonic() - began, 3)
        log.info("warm-up generation took %.2f s", self.facts.warmup_seconds)

    def _close(self, reason: str) -> None:
        """Refuse requests from now on, then tell every queued one that the engine cannot serve it."""
        with self._admission:
            self._closed_reason = self._closed_reason or reason
        while True:
            try:
                queued = self._pending.get_nowait()
            except queue.Empty:
                return
            for generation in queued.choices:
                generation.send(Failed(reason))

    def _fail(self, reason: str, *, while_loading: bool) -> None:
        """Stop serving for good: not ready, every queued request failed, the worker told."""
        self._ready.clear()
        self.facts.update(state=EngineState.FAILED, error=reason)
        self._close(reason)
        if self._on_failure is not None:
            self._on_failure(reason, while_loading)

    def _find_eos_ids(self) -> set[int]:
        """Collect the ids that end a reply: the generation config's and the tokenizer's EOS."""
        configured = self.generation_defaults.eos_token_id
        ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def snapshot_facts(self) -> EngineFacts:
        """Return a consistent copy of the facts, safe to read while the engine thread writes them."""
        return self.facts.snapshot()

    # Requests ------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, forced_ids: tuple[int, ...] = (),
               kv_scope: KvScope = KvScope()) -> Generation:
        """Queue a generation (continuing `forced_ids` if given) whose stored KV state is `kv_scope`'s; raise
        EngineOverloaded when the queue is full, EngineUnavailable when closed.

        A generation that could never fit the KV budget, even alone, is a caller's error (ValueError).
        """
        generation = self._generation(prompt_ids, params, forced_ids, kv_scope)
        self._fetch_shared_prefix(generation)
        self._queue(generation)
        return generation

    def submit_choices(self, prompt_ids: list[int], choice_params: list[SamplingParams],
                       kv_scope: KvScope = KvScope()) -> ChoiceGroup:
        """Queue several choices of one prompt (n > 1), each sampled with its own parameters, as one request.

        They take one place in the queue and n running places, share one prompt pass and decode as n
        rows; errors as submit's.
        """
        group = ChoiceGroup([self._generation(prompt_ids, params, (), kv_scope) for params in choice_params])
        self._fetch_shared_prefix(group.lead)
        self._queue(group.lead)
        return group

    def _generation(self, prompt_ids: list[int], params: SamplingParams, forced_ids: tuple[int, ...],
                    kv_scope: KvScope) -> Generation:
        """Make a generation with its grammar's matcher."""
        # Made here, in the request's thread: the first one builds the view of the vocabulary, which the engine must not wait for.
        grammar = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        return Generation(prompt_ids, params, forced_ids, grammar, kv_scope)

    def _fetch_shared_prefix(self, generation: Generation) -> None:
        """Fetch the generation's conversation from beyond the host into the host's prefix store, here in the
        request's thread: the engine's thread must never wait for the network."""
        scheduler = self._scheduler
        if scheduler is not None and generation.params.prompt_logprobs is None:
            scheduler.prefixes.prefetch(generation.input_ids, generation.kv_scope)

    def _queue(self, generation: Generation) -> None:
        """Put a generation (and its sibling choices) in the queue if its places are free."""
        if self.kv_budget is not None and pages_needed(generation) > self.kv_budget.pages:
            raise ValueError(f"{generation.places} x {len(generation.prompt_ids) + generation.params.max_tokens} tokens "
                             f"exceed the KV budget of {self.kv_token_budget} tokens")
        full = EngineOverloaded(f"all {self.settings.max_queue} queue places of this worker are taken")
        with self._admission:
            if self._closed_reason is not None or self._stopping.is_set():
                raise EngineUnavailable(self._closed_reason or "the engine is shutting down")
            if self.running + self.waiting + generation.places > self.settings.request_places:
                raise full
            try:
                self._pending.put_nowait(generation)
            except queue.Full:
                raise full from None
