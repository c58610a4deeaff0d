"""What chat and legacy completions share between request and engine: queueing one generation or a group of
choices, each choice's seed, the bounds on choices, and the usage and interruption a reply reports."""

import dataclasses

from .engine import (
    ChoiceEvent,
    ChoiceGroup,
    EngineOverloaded,
    EngineUnavailable,
    Finished,
    Generation,
    SamplingParams,
    choice_seed,
)
from .errors import RETRY_AFTER_SECONDS, ContextLengthExceeded, InvalidRequest, Overloaded
from .protocol import PromptTokensDetails, Usage


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
