"""The legacy text-completions serving class: a raw prompt (no chat template) to OpenAI's `text_completion` objects.

It shares chat's limits, sampling defaults and queueing (chat.py) and knows nothing of Flask.
"""

import logging
import time
import uuid
from dataclasses import dataclass

from ..engine import (
    ChoiceEvent,
    ChoiceGroup,
    EventSource,
    Failed,
    Finished,
    Generation,
    GrammarRefused,
    KvScope,
    PromptLogprobs,
    TextDelta,
    TokenLogprob,
)
from ..errors import InternalError, InvalidRequest
from .chat import ChatCompletions
from .completion_request import CompletionRequest
from .constraints import Constraint, grammar_field_constraint, refused_when_compiled
from .limits import check_prompt_text, check_prompt_tokens
from .naming import resolve_model_name
from .responses import Completion, CompletionChoice, CompletionLogprobs
from .serving import (
    PreparedReply,
    check_choices,
    choice_params,
    interrupted,
    model_unavailable,
    read_whole_reply,
    split_choice,
    submit,
    usage_of,
)
from .sse import DONE, PING, sse_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedCompletion(PreparedReply):
    """A legacy completion checked against the model: its prompt's token ids and text, and how to sample."""

    request: CompletionRequest
    # The grammar the completion follows and the field that asked for it, or None for free text.
    constraint: Constraint | None
    # What `echo` begins the text with: the prompt as sent, or its token ids' text.
    prompt_text: str


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
            raise model_unavailable()
        prompt = request.one_prompt
        if isinstance(prompt, str):
            check_prompt_text(prompt, param="prompt")
            # As vLLM encodes a completion's prompt: the tokenizer's own BOS added, for the models that have one.
            prompt_ids, prompt_text = template.encode(prompt, add_special_tokens=True), prompt
        else:
            self._check_token_ids(prompt)
            prompt_ids, prompt_text = list(prompt), template.decode(prompt)
        check_prompt_tokens(len(prompt_ids), self.settings, param="prompt")
        constraint = grammar_field_constraint(request)
        logprobs = request.logprobs
        params = self.chat.sampling_params(
            request, len(prompt_ids), constraint.grammar if constraint is not None else None,
            logprobs=logprobs is not None, top_logprobs=logprobs or 0,
            prompt_logprobs=logprobs if request.echo and logprobs is not None else None, prompt_param="prompt")
        check_choices(self.settings, self.engine, request.choice_count, len(prompt_ids), params, prompt_param="prompt")
        return PreparedCompletion(request=request, constraint=constraint, prompt_ids=prompt_ids,
                                  prompt_text=prompt_text,
                                  choice_params=choice_params(params, request.choice_count),
                                  completion_id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                  model_name=model_name)

    def _check_token_ids(self, token_ids: list[int]) -> None:
        """Refuse a prompt of token ids holding one the tokenizer does not have."""
        vocab_size = self.engine.template.vocab_size
        for index, token_id in enumerate(token_ids):
            if token_id >= vocab_size:
                raise InvalidRequest(f"invalid 'prompt[{index}]': {token_id} is not a token id of this model (its ids "
                                     f"run from 0 to {vocab_size - 1})", param=f"prompt[{index}]")

    def start(self, prepared: PreparedCompletion, forced_ids: tuple[int, ...] = (),
              kv_scope: KvScope = KvScope()) -> Generation | ChoiceGroup:
        """Queue the generation or its choices (continuing `forced_ids`, a reply's first tokens), or raise 503."""
        try:
            return submit(self.engine, prepared.prompt_ids, prepared.choice_params, forced_ids, kv_scope)
        except GrammarRefused as exc:  # checked in prepare(); compiling against the vocabulary can still refuse
            raise refused_when_compiled(prepared.constraint, exc) from None

    # Rendering -----------------------------------------------------------------------------
    # Chunks are plain data framed by json.dumps, as chat's are; tests/e2e/test_completions.py validates them
    # as protocol.CompletionChunk.

    def _chunk(self, prepared: PreparedCompletion, text: str, finish_reason=None, logprobs: dict | None = None,
               index: int = 0) -> dict:
        """Build one streamed text_completion object of choice `index`."""
        chunk = {
            "id": prepared.completion_id,
            "object": "text_completion",
            "created": prepared.created,
            "model": prepared.model_name,
            "system_fingerprint": self.engine.fingerprint or None,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if prepared.request.include_usage:
            chunk["usage"] = None
        return chunk

    def stream(self, prepared: PreparedCompletion, source: EventSource):
        """Yield the SSE text of a completion; `source` gives engine events (a Generation, a group of choices or a
        replay).

        With `echo` each choice's first chunk is the prompt (with its logprobs once the prompt pass sends
        them). The source is cancelled in `finally`, so a client that goes away frees its engine slot.
        """
        count = len(prepared.choice_params)
        wants_logprobs = prepared.params.logprobs
        gathered = [LegacyLogprobs() for _ in range(count)]

        def taken(index: int) -> dict | None:
            return gathered[index].take() if wants_logprobs else None

        try:
            if prepared.request.echo and not wants_logprobs:
                for index in range(count):
                    yield sse_data(self._chunk(prepared, prepared.prompt_text, index=index))
            while True:
                event = source.next_event(timeout=self.settings.sse_ping_seconds)
                index, inner = split_choice(event)
                if event is None:
                    yield PING
                elif isinstance(inner, PromptLogprobs):
                    add_prompt_logprobs(gathered[index], inner)
                    yield sse_data(self._chunk(prepared, prepared.prompt_text, logprobs=taken(index), index=index))
                elif isinstance(inner, TextDelta):
                    for entry in inner.logprobs:
                        gathered[index].add(entry)
                    yield sse_data(self._chunk(prepared, inner.text, logprobs=taken(index), index=index))
                elif isinstance(event, ChoiceEvent):
                    if isinstance(inner, Finished) and inner.finish_reason != "cancelled":
                        yield sse_data(self._chunk(prepared, "", inner.finish_reason, logprobs=taken(index),
                                                   index=index))
                elif isinstance(event, Finished):
                    if event.finish_reason == "cancelled":
                        yield sse_data(interrupted().body().model_dump())
                        break
                    if count == 1:
                        yield sse_data(self._chunk(prepared, "", event.finish_reason, logprobs=taken(0)))
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
        """Wait for the whole completion (every choice) and return a text_completion object."""
        count = len(prepared.choice_params)
        pieces = [[prepared.prompt_text] if prepared.request.echo else [] for _ in range(count)]
        gathered = [LegacyLogprobs() for _ in range(count)]

        def take(index: int, delta) -> None:
            if isinstance(delta, TextDelta):
                pieces[index].append(delta.text)
                for entry in delta.logprobs:
                    gathered[index].add(entry)
            else:
                add_prompt_logprobs(gathered[index], delta)

        ended, finished = read_whole_reply(source, count, take)
        choices = [
            CompletionChoice(
                index=index, text="".join(pieces[index]), finish_reason=ended[index].finish_reason,
                logprobs=CompletionLogprobs(**gathered[index].take()) if prepared.params.logprobs else None,
            )
            for index in range(count)
        ]
        return Completion(
            id=prepared.completion_id,
            object="text_completion",
            created=prepared.created,
            model=prepared.model_name,
            system_fingerprint=self.engine.fingerprint or None,
            choices=choices,
            usage=usage_of(finished),
        )
