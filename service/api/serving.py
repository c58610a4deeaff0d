"""What chat and legacy completions share between request and engine: the engine they call (ChatEngine),
queueing one generation or a group of choices, each choice's seed, the bounds on choices, and the usage
and interruption a reply reports."""

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..engine import (
    ChoiceEvent,
    ChoiceGroup,
    EngineOverloaded,
    EngineUnavailable,
    EventSource,
    Failed,
    Finished,
    Generation,
    KvScope,
    PromptLogprobs,
    SamplingParams,
    Started,
    TextDelta,
    choice_seed,
)
from ..errors import (
    RETRY_AFTER_SECONDS,
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    Overloaded,
)
from ..settings import Settings
from .responses import PromptTokensDetails, Usage

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from ..engine.cores import SharedCores
    from ..engine.facts import EngineFacts
    from ..engine.template import ChatTemplate

log = logging.getLogger(__name__)


class ChatEngine(Protocol):
    """What the app calls on a worker's engine: service.engine.Engine, or whatever a test passes to create_app.

    The views and serving classes read its template and limits, queue generations and read its
    state; the worker's hooks (service/process/lifecycle.py) start and stop it.
    """

    # The chat template, token ids and their text; None until start() has loaded the tokenizer.
    template: "ChatTemplate | None"
    # The model's generation_config.json, the sampling defaults a request may leave out (None until start()).
    generation_defaults: "GenerationConfig | None"
    # The longest sequence the model takes (0 until loaded), and the tokens the KV budget holds (0: no budget).
    context_length: int
    kv_token_budget: int
    # Names the weights and sampler: cached replies are keyed by it ("" until loaded).
    fingerprint: str
    # What the engine measured; the worker's hooks add where it runs.
    facts: "EngineFacts"

    @property
    def ready(self) -> bool:
        """Tell whether the engine serves requests (loaded and warmed up)."""

    @property
    def failed(self) -> bool:
        """Tell whether loading failed for good."""

    @property
    def running(self) -> int:
        """Return the number of sequences being generated."""

    @property
    def waiting(self) -> int:
        """Return the places the queued requests take."""

    def snapshot_facts(self) -> "EngineFacts":
        """Return a consistent copy of the facts."""

    def submit(self, prompt_ids: list[int], params: SamplingParams, forced_ids: tuple[int, ...] = (),
               kv_scope: KvScope = KvScope()) -> Generation:
        """Queue a generation; raise EngineOverloaded when the worker is full, EngineUnavailable when closed."""

    def submit_choices(self, prompt_ids: list[int], choice_params: list[SamplingParams],
                       kv_scope: KvScope = KvScope()) -> ChoiceGroup:
        """Queue several choices of one prompt (n > 1) as one request; errors as submit's."""

    def start(self, on_ready: Callable[[], None] | None = None,
              on_failure: Callable[[str, bool], None] | None = None, cores: "SharedCores | None" = None) -> None:
        """Load the tokenizer now, then the model in the engine's thread; call on_ready or on_failure there."""

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is ready; return whether it is."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine's thread after its current step."""


@dataclasses.dataclass(frozen=True)
class PreparedReply:
    """What chat and legacy completions both hold of a request checked against the model."""

    prompt_ids: list[int]
    # Every choice's parameters (n of them): the first choice's are `params`.
    choice_params: tuple[SamplingParams, ...]
    completion_id: str
    created: int
    # The name the reply carries: the one the request sent, as vLLM and OpenAI echo it.
    model_name: str

    @property
    def params(self) -> SamplingParams:
        """Return how the first choice samples, which is what the cache keys a reply by."""
        return self.choice_params[0]


def model_unavailable() -> Overloaded:
    """Build the 503 of a worker whose model is not loaded, or no longer serves."""
    return Overloaded("the model is not available on this worker", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def interrupted() -> Overloaded:
    """Build the error for a reply the server stopped before its end (a stopping worker): OpenAI has
    no `cancelled` finish reason, and a retry gets the whole reply."""
    return Overloaded(
        "the reply was interrupted before its end (the worker is stopping); retry it",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def usage_of(finished: Finished) -> Usage:
    """Build the usage object of a finished generation."""
    return Usage(
        prompt_tokens=finished.prompt_tokens,
        completion_tokens=finished.completion_tokens,
        total_tokens=finished.prompt_tokens + finished.completion_tokens,
        # A reply the response cache replays computed none of its prompt.
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=finished.prompt_tokens if finished.cached else finished.cached_prompt_tokens),
    )


def split_choice(event):
    """Return the choice index an event belongs to and the event itself (0 for the one choice of n = 1)."""
    return (event.index, event.event) if isinstance(event, ChoiceEvent) else (0, event)


def read_whole_reply(source: EventSource, count: int,
                     take: Callable[[int, object], None]) -> tuple[list[Finished], Finished]:
    """Read a reply's events to its end, handing each choice's text and prompt log-probabilities to
    `take(index, event)`; return every choice's final event and the reply's own.

    The source is cancelled in `finally`, so a client that goes away frees its engine slot; a
    failure is a 500, an interrupted reply a 503 with Retry-After.
    """
    ended: list[Finished | None] = [None] * count
    finished = None
    try:
        for event in source.events():
            index, inner = split_choice(event)
            if isinstance(event, ChoiceEvent) and isinstance(inner, Finished):
                ended[index] = inner
            elif isinstance(event, Failed):
                raise InternalError(event.message)
            elif isinstance(event, Finished):
                finished = event
            elif isinstance(inner, TextDelta | PromptLogprobs):
                take(index, inner)
            elif not isinstance(inner, Started):
                log.warning("unexpected engine event %r", event)
    finally:
        source.cancel()
    if finished is None or finished.finish_reason == "cancelled":
        raise interrupted()
    if count == 1:
        ended[0] = finished
    return ended, finished


def choice_params(params: SamplingParams, count: int) -> tuple[SamplingParams, ...]:
    """Return the parameters of each of `count` choices: the same but for a seed of each choice's own."""
    if params.seed is None:
        return (params,) * count
    return tuple(dataclasses.replace(params, seed=choice_seed(params.seed, index)) for index in range(count))


def check_choices(settings: Settings, engine: ChatEngine, count: int, prompt_tokens: int,
                  params: SamplingParams, prompt_param: str = "messages") -> None:
    """Refuse more choices than can run at once, or than the worker's KV budget holds together (`prompt_param`,
    "messages" or "prompt", names the prompt in the message)."""
    if count > settings.max_running:
        raise InvalidRequest(f"'n' is {count}, above this server's {settings.max_running} running places "
                             "(MAX_RUNNING): a request's choices decode together", param="n")
    budget = engine.kv_token_budget
    needed = count * (prompt_tokens + params.max_tokens)
    if count > 1 and budget and needed > budget:
        # Each choice is a sequence of its own in the KV cache; OpenAI's words, so a client reads it as the others.
        raise ContextLengthExceeded(
            f"This server's KV cache holds {budget} tokens per worker (KV_CACHE_MB), which {count} choices share. "
            f"However, you requested {needed} tokens ({count} choices of {prompt_tokens} in the {prompt_param} and "
            f"{params.max_tokens} in the completion). Please reduce n or the length of the {prompt_param} or "
            "completion.", param="n")


def submit(engine: ChatEngine, prompt_ids: list[int], choices: tuple[SamplingParams, ...],
           forced_ids: tuple[int, ...], kv_scope: KvScope) -> Generation | ChoiceGroup:
    """Queue a generation (or a group of choices) on the engine, or raise the 503 of a full or unavailable worker."""
    try:
        if len(choices) > 1:
            return engine.submit_choices(prompt_ids, list(choices), kv_scope)
        return engine.submit(prompt_ids, choices[0], forced_ids, kv_scope)
    except EngineOverloaded as exc:
        raise Overloaded(str(exc), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineUnavailable:
        raise model_unavailable() from None
