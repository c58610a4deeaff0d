"""The legacy text-completions serving class: a raw prompt (no chat template) to OpenAI's `text_completion` objects.

It shares chat's limits, sampling defaults and queueing (service/chat.py) and knows nothing of Flask.
"""

import logging
import time
import uuid
from dataclasses import dataclass

from .chat import ChatCompletions, interrupted, submit, usage_of
from .completion_schemas import CompletionRequest
from .engine import (EventSource, Failed, Finished, Generation, PromptLogprobs, SamplingParams, Started, TextDelta,
                     TokenLogprob)
from .errors import RETRY_AFTER_SECONDS, InternalError, InvalidRequest, Overloaded
from .limits import check_prompt_text, check_prompt_tokens
from .naming import resolve_model_name
from .protocol import Completion, CompletionChoice, CompletionLogprobs
from .sse import DONE, PING, sse_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedCompletion:
    """A legacy completion checked against the model: its prompt's token ids and text, and how to sample."""

    request: CompletionRequest
    prompt_ids: list[int]
    # What `echo` begins the text with: the prompt as sent, or its token ids' text.
    prompt_text: str
    params: SamplingParams
    completion_id: str
    created: int
    model_name: str


class LegacyLogprobs:
    """Gather tokens' log probabilities in legacy completions' shape, offsets counted from the choice's start."""

    def __init__(self):
        self.offset = 0
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_unscored(self, token: str) -> None:
        """Add a token nothing predicts (a prompt's first): its text, no log probability."""
        self._add(token, None, None)

    def add(self, entry: TokenLogprob) -> None:
        """Add a scored token; its alternatives go by text, the token itself among them as OpenAI lists it."""
        top = {alternative.token: alternative.logprob for alternative in entry.top}
        top.setdefault(entry.token, entry.logprob)
        self._add(entry.token, entry.logprob, top)

    def _add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        """Append one token's entry and move the offset past its text."""
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def take(self) -> dict:
        """Return the entries gathered since the last take, as plain data, and start afresh (the offset goes on)."""
        taken = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                 "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return taken


def add_prompt_logprobs(gathered: LegacyLogprobs, event: PromptLogprobs) -> None:
    """Add the prompt's tokens, the first unscored."""
    gathered.add_unscored(event.first_token)
    for entry in event.entries:
        gathered.add(entry)


class TextCompletions:
    """Prepare, run and render legacy text completions with the chat serving class's engine and limits."""

    def __init__(self, chat: ChatCompletions):
        self.chat = chat
        self.engine = chat.engine
        self.settings = chat.settings

    def prepare(self, request: CompletionRequest) -> PreparedCompletion:
        """Tokenize the prompt as it is and resolve every sampling parameter, or raise a 4xx."""
        model_name = resolve_model_name(self.settings, request.model)
        template = self.engine.template
        if template is None:
            raise Overloaded("the model is not available on this worker", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        prompt = request.one_prompt
        if isinstance(prompt, str):
            check_prompt_text(prompt, param="prompt")
            # As vLLM encodes a completion's prompt: the tokenizer's own BOS added, for the models that have one.
            prompt_ids, prompt_text = template.encode(prompt, add_special_tokens=True), prompt
        else:
            self._check_token_ids(prompt)
            prompt_ids, prompt_text = list(prompt), template.decode(prompt)
        check_prompt_tokens(len(prompt_ids), self.settings, param="prompt")
        logprobs = request.logprobs
        params = self.chat.sampling_params(
            request, len(prompt_ids), None, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
            prompt_logprobs=logprobs if request.echo and logprobs is not None else None, prompt_param="prompt")
        return PreparedCompletion(request=request, prompt_ids=prompt_ids, prompt_text=prompt_text, params=params,
                                  completion_id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                  model_name=model_name)

    def _check_token_ids(self, token_ids: list[int]) -> None:
        """Refuse a prompt of token ids holding one the tokenizer does not have."""
        vocab_size = self.engine.template.vocab_size
        for index, token_id in enumerate(token_ids):
            if token_id >= vocab_size:
                raise InvalidRequest(f"invalid 'prompt[{index}]': {token_id} is not a token id of this model (its ids "
                                     f"run from 0 to {vocab_size - 1})", param=f"prompt[{index}]")

    def start(self, prepared: PreparedCompletion, forced_ids: tuple[int, ...] = ()) -> Generation:
        """Queue the generation (continuing `forced_ids`, a reply's first tokens), or raise 503."""
        return submit(self.engine, prepared.prompt_ids, prepared.params, forced_ids)

    # Rendering -----------------------------------------------------------------------------
    # Chunks are plain data framed by json.dumps, as chat's are; tests/test_completions.py validates them
    # as protocol.CompletionChunk.

    def _chunk(self, prepared: PreparedCompletion, text: str, finish_reason=None, logprobs: dict | None = None) -> dict:
        """Build one streamed text_completion object."""
        chunk = {
            "id": prepared.completion_id,
            "object": "text_completion",
            "created": prepared.created,
            "model": prepared.model_name,
            "system_fingerprint": self.engine.fingerprint or None,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if prepared.request.include_usage:
            chunk["usage"] = None
        return chunk

    def stream(self, prepared: PreparedCompletion, source: EventSource):
        """Yield the SSE text of a completion; `source` gives engine events (a Generation or a replay).

        With `echo` the first chunk is the prompt (with its logprobs once the prompt pass sends them).
        The source is cancelled in `finally`, so a client that goes away frees its engine slot.
        """
        wants_logprobs = prepared.params.logprobs
        gathered = LegacyLogprobs()
        try:
            if prepared.request.echo and not wants_logprobs:
                yield sse_data(self._chunk(prepared, prepared.prompt_text))
            while True:
                event = source.next_event(timeout=self.settings.sse_ping_seconds)
                if event is None:
                    yield PING
                elif isinstance(event, PromptLogprobs):
                    add_prompt_logprobs(gathered, event)
                    yield sse_data(self._chunk(prepared, prepared.prompt_text, logprobs=gathered.take()))
                elif isinstance(event, TextDelta):
                    for entry in event.logprobs:
                        gathered.add(entry)
                    yield sse_data(self._chunk(prepared, event.text, logprobs=gathered.take() if wants_logprobs else None))
                elif isinstance(event, Finished):
                    if event.finish_reason == "cancelled":
                        yield sse_data(interrupted().body().model_dump())
                        break
                    yield sse_data(self._chunk(prepared, "", event.finish_reason,
                                               logprobs=gathered.take() if wants_logprobs else None))
                    if prepared.request.include_usage:
                        usage_chunk = self._chunk(prepared, "")
                        usage_chunk.update(choices=[], usage=usage_of(event).model_dump())
                        yield sse_data(usage_chunk)
                    break
                elif isinstance(event, Failed):
                    yield sse_data(InternalError(event.message).body().model_dump())
                    break
            yield DONE
        finally:
            source.cancel()

    def complete(self, prepared: PreparedCompletion, source: EventSource) -> Completion:
        """Wait for the whole completion and return a text_completion object."""
        pieces = [prepared.prompt_text] if prepared.request.echo else []
        gathered = LegacyLogprobs()
        try:
            for event in source.events():
                if isinstance(event, TextDelta):
                    pieces.append(event.text)
                    for entry in event.logprobs:
                        gathered.add(entry)
                elif isinstance(event, PromptLogprobs):
                    add_prompt_logprobs(gathered, event)
                elif isinstance(event, Failed):
                    raise InternalError(event.message)
                elif isinstance(event, Finished):
                    finished = event
                elif not isinstance(event, Started):
                    log.warning("unexpected engine event %r", event)
        finally:
            source.cancel()
        if finished.finish_reason == "cancelled":
            raise interrupted()
        logprobs = CompletionLogprobs(**gathered.take()) if prepared.params.logprobs else None
        return Completion(
            id=prepared.completion_id,
            object="text_completion",
            created=prepared.created,
            model=prepared.model_name,
            system_fingerprint=self.engine.fingerprint or None,
            choices=[CompletionChoice(index=0, text="".join(pieces), logprobs=logprobs,
                                      finish_reason=finished.finish_reason)],
            usage=usage_of(finished),
        )
