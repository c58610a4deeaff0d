"""What chat and legacy completions share between request and engine: queueing one generation or a group of
choices, each choice's seed, the bounds on choices, and the usage and interruption a reply reports."""

import dataclasses
import logging
from collections.abc import Callable

from ..engine import (
    ChoiceEvent,
    ChoiceGroup,
    EngineOverloaded,
    EngineUnavailable,
    EventSource,
    Failed,
    Finished,
    Generation,
    PromptLogprobs,
    SamplingParams,
    Started,
    TextDelta,
    choice_seed,
)
from ..errors import RETRY_AFTER_SECONDS, ContextLengthExceeded, InternalError, InvalidRequest, Overloaded
from .responses import PromptTokensDetails, Usage

log = logging.getLogger(__name__)


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


def read_whole_reply(source: EventSource, count: int, take: Callable[[int, object], None]) -> tuple[list[Finished], Finished]:
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


def check_choices(settings, engine, count: int, prompt_tokens: int, params: SamplingParams) -> None:
    """Refuse more choices than can run at once, or than the worker's KV budget holds together."""
    if count > settings.max_running:
        raise InvalidRequest(f"'n' is {count}, above this server's {settings.max_running} running places (MAX_RUNNING): "
                             "a request's choices decode together", param="n")
    budget = engine.kv_token_budget
    needed = count * (prompt_tokens + params.max_tokens)
    if count > 1 and budget and needed > budget:
        raise ContextLengthExceeded(f"{count} choices of {prompt_tokens} prompt tokens and {params.max_tokens} completion "
                                    f"tokens need {needed} tokens of KV cache, above this server's budget of {budget} "
                                    "tokens per worker (KV_CACHE_MB)", param="n")


def submit(engine, prompt_ids: list[int], choices: tuple[SamplingParams, ...],
           forced_ids: tuple[int, ...]) -> Generation | ChoiceGroup:
    """Queue a generation (or a group of choices) on the engine, or raise the 503 of a full or unavailable worker."""
    try:
        if len(choices) > 1:
            return engine.submit_choices(prompt_ids, list(choices))
        return engine.submit(prompt_ids, choices[0], forced_ids)
    except EngineOverloaded as exc:
        raise Overloaded(str(exc), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineUnavailable:
        raise Overloaded(
            "the model is not available on this worker", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        ) from None
