"""The chat-completions serving class: from a validated request to OpenAI's wire format.

The views stay thin; this class knows the engine's events and OpenAI's objects, and nothing of
Flask's request and response objects.
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
    ReasoningMarkers,
    TemplateRefused,
    TextDelta,
    TokenLogprob,
)
from ..errors import InternalError, InvalidRequest
from .chat_parts import CalledFunction, NamedToolChoice
from .chat_request import ChatCompletionRequest
from .constraints import Constraint, chat_constraint, refused_when_compiled
from .legacy_functions import as_tools_request, function_call_delta
from .limits import check_message_count, check_prompt_text, check_prompt_tokens
from .naming import resolve_model_name
from .reasoning import ReasoningParser
from .responses import AssistantMessage, ChatCompletion, Choice
from .sampling_params import SamplingResolver
from .serving import (
    PreparedReply,
    check_choices,
    choice_params,
    interrupted,
    read_whole_reply,
    split_choice,
    submit,
    usage_of,
)
from .sse import DONE, PING, sse_data
from .toolcalls import ToolCallParser, merge_deltas

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedChat(PreparedReply):
    """A chat request checked against the model: its prompt's token ids and how to sample."""

    request: ChatCompletionRequest
    # The grammar the reply follows and the field that asked for it, or None for free text.
    constraint: Constraint | None
    # How the reply marks its thinking, or None for a model that never thinks (its reply is content alone).
    reasoning: ReasoningMarkers | None

    def tool_call_parser(self) -> ToolCallParser | None:
        """Return a parser of the reply's tool-call blocks when the model was offered tools, else None."""
        return ToolCallParser() if self.request.tools_offered else None

    def reasoning_parser(self) -> ReasoningParser | None:
        """Return a parser that splits the reply's thinking from its content when the model thinks, else None."""
        return ReasoningParser(self.reasoning) if self.reasoning is not None else None


def render_logprob(entry: TokenLogprob) -> dict:
    """Render a token's logprob entry in OpenAI's shape."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [{"token": top.token, "logprob": top.logprob, "bytes": list(top.bytes)} for top in entry.top],
    }


@dataclass(frozen=True)
class ReplyParsers:
    """One choice's parsers: its thinking split off first, then its tool calls parsed out of the rest."""

    reasoning: ReasoningParser | None
    tool_calls: ToolCallParser | None


class ChatCompletions(SamplingResolver):
    """Prepare, run and render chat completions for one worker's engine."""

    @property
    def model_name(self) -> str:
        """Return the name replies carry when the request named no model."""
        return self.settings.served_model_name

    def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """Render and tokenize the prompt and resolve every sampling parameter, or raise a 4xx."""
        model_name = resolve_model_name(self.settings, request.model)
        request = as_tools_request(request)
        check_message_count(len(request.messages), self.settings)
        messages = [message.for_template() for message in request.messages]
        check_prompt_text("".join(message["content"] + message.get("name", "") + message.get("reasoning_content", "")
                                  for message in messages))
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools_offered]
        if tools and not self.engine.template.supports_tools:
            raise InvalidRequest("the model's chat template does not support tools; send the request without 'tools'",
                                 param="tools")
        constraint = chat_constraint(request, self.engine.template)
        try:
            prompt_ids = self.engine.template.encode_chat(messages, tools, enable_thinking=request.enable_thinking)
        except TemplateRefused as exc:
            raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param="messages") from None
        check_prompt_tokens(len(prompt_ids), self.settings)
        grammar = constraint.grammar if constraint is not None else None
        params = self.sampling_params(request, len(prompt_ids), grammar, logprobs=bool(request.logprobs),
                                      top_logprobs=request.top_logprobs or 0)
        check_choices(self.settings, self.engine, request.choice_count, len(prompt_ids), params)
        return PreparedChat(
            request=request,
            constraint=constraint,
            reasoning=self.engine.template.reasoning_markers(prompt_ids),
            prompt_ids=prompt_ids,
            choice_params=choice_params(params, request.choice_count),
            completion_id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model_name=model_name,
        )

    def start(self, prepared: PreparedChat, forced_ids: tuple[int, ...] = (),
              kv_scope: KvScope = KvScope()) -> Generation | ChoiceGroup:
        """Queue the generation (continuing `forced_ids`, a reply's first tokens), or raise 503."""
        try:
            return submit(self.engine, prepared.prompt_ids, prepared.choice_params, forced_ids, kv_scope)
        except GrammarRefused as exc:  # checked in prepare(); compiling against the vocabulary can still refuse
            raise refused_when_compiled(prepared.constraint, exc) from None

    # Rendering -----------------------------------------------------------------------------
    # A stream's chunks are built as plain data and framed by json.dumps: per token, that costs about
    # half what building and dumping responses.ChatCompletionChunk does. tests/e2e/test_responses.py checks
    # that every chunk validates as that model and renders byte for byte as the model renders it.

    def _chunk(self, prepared: PreparedChat, delta: dict, finish_reason=None, logprobs: list | None = None,
               index: int = 0) -> dict:
        """Build one chat.completion.chunk object of choice `index` (`logprobs`: the entries of the tokens it
        delivers)."""
        chunk = {
            "id": prepared.completion_id,
            "object": "chat.completion.chunk",
            "created": prepared.created,
            "model": prepared.model_name,
            "system_fingerprint": self.engine.fingerprint or None,
            "choices": [{"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                         "finish_reason": finish_reason}],
        }
        if prepared.request.include_usage:
            chunk["usage"] = None
        return chunk

    def stream(self, prepared: PreparedChat, source: EventSource):
        """Yield the SSE text of a reply; `source` gives engine events (a Generation, a group of choices or a replay).

        Each choice's chunks carry its index; with n > 1 they interleave as the choices' tokens come.
        The source is cancelled in `finally`, so a client that goes away frees its engine slot.
        """
        count = len(prepared.choice_params)
        parsers = [ReplyParsers(prepared.reasoning_parser(), prepared.tool_call_parser()) for _ in range(count)]
        # Entries of tokens whose text is still held back go out with the choice's next chunk.
        held: list[list[dict]] = [[] for _ in range(count)]
        try:
            for index in range(count):
                yield sse_data(self._chunk(prepared, {"role": "assistant", "content": ""}, index=index))
            while True:
                event = source.next_event(timeout=self.settings.sse_ping_seconds)
                index, inner = split_choice(event)
                if event is None:
                    yield PING
                elif isinstance(inner, TextDelta):
                    held[index] += map(render_logprob, inner.logprobs)
                    for delta in self._deltas(prepared, parsers[index], inner.text):
                        yield sse_data(self._chunk(prepared, delta, logprobs=held[index], index=index))
                        held[index] = []
                elif isinstance(event, ChoiceEvent):
                    if isinstance(inner, Finished) and inner.finish_reason != "cancelled":
                        yield from self._end_choice(prepared, index, parsers[index], held[index], inner)
                elif isinstance(event, Finished):
                    if event.finish_reason == "cancelled":
                        yield sse_data(interrupted().body().model_dump())
                        break
                    if count == 1:
                        yield from self._end_choice(prepared, 0, parsers[0], held[0], event)
                    if prepared.request.include_usage:
                        usage_chunk = self._chunk(prepared, {})
                        usage_chunk.update(choices=[], usage=usage_of(event).model_dump())
                        yield sse_data(usage_chunk)
                    break
                elif isinstance(event, Failed):
                    yield sse_data(InternalError(event.message).body().model_dump())
                    break
            yield DONE
        finally:
            source.cancel()

    def _end_choice(self, prepared: PreparedChat, index: int, parsers: ReplyParsers, held: list[dict],
                    finished: Finished):
        """Yield the SSE text that ends one choice: its held-back text and entries, then its finish reason."""
        for delta in self._deltas(prepared, parsers, None):
            yield sse_data(self._chunk(prepared, delta, logprobs=held, index=index))
            held = []
        if held:
            yield sse_data(self._chunk(prepared, {}, logprobs=held, index=index))
        yield sse_data(self._chunk(prepared, {}, self._finish_reason(prepared, finished, parsers.tool_calls),
                                   index=index))

    @staticmethod
    def _deltas(prepared: PreparedChat, parsers: ReplyParsers, text: str | None) -> list[dict]:
        """Return the deltas a piece of text makes (None: the end of the reply): the thinking split off first,
        then tool-call blocks parsed out of the rest (as the legacy `function_call` for a request that sent
        `functions`)."""
        ending, reasoning = text is None, ""
        if parsers.reasoning is not None:
            reasoning, text = parsers.reasoning.finish() if ending else parsers.reasoning.feed(text)
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        parser = parsers.tool_calls
        if parser is None:
            return deltas + ([{"content": text}] if text else [])
        content, calls = parser.feed(text) if text else ("", [])
        if ending:
            rest, last_calls = parser.finish()
            content, calls = content + rest, calls + last_calls
        deltas += [{"content": content}] if content else []
        if calls and prepared.request.legacy_functions:
            piece = function_call_delta(calls)
            deltas += [{"function_call": piece}] if piece is not None else []
        elif calls:
            deltas.append({"tool_calls": calls})
        return deltas

    @staticmethod
    def _finish_reason(prepared: PreparedChat, finished: Finished, parser: ToolCallParser | None) -> str:
        """Return OpenAI's finish reason: `tool_calls` (legacy: `function_call`) when a reply that ended by itself
        called tools, but `stop` after the call a named tool_choice forced, as OpenAI ends that one."""
        if parser is not None and parser.calls and finished.finish_reason == "stop":
            if prepared.request.legacy_functions:
                return "function_call"
            if isinstance(prepared.request.effective_tool_choice, NamedToolChoice):
                return "stop"
            return "tool_calls"
        return finished.finish_reason

    def complete(self, prepared: PreparedChat, source: EventSource) -> ChatCompletion:
        """Wait for the whole reply (every choice) and return a chat.completion object."""
        count = len(prepared.choice_params)
        pieces: list[list[str]] = [[] for _ in range(count)]
        logprobs: list[list[dict]] = [[] for _ in range(count)]

        def take(index: int, delta) -> None:
            if isinstance(delta, TextDelta):
                pieces[index].append(delta.text)
                logprobs[index] += map(render_logprob, delta.logprobs)

        ended, finished = read_whole_reply(source, count, take)
        return ChatCompletion(
            id=prepared.completion_id,
            object="chat.completion",
            created=prepared.created,
            model=prepared.model_name,
            system_fingerprint=self.engine.fingerprint or None,
            choices=[self._choice(prepared, index, "".join(pieces[index]), logprobs[index], ended[index])
                     for index in range(count)],
            usage=usage_of(finished),
        )

    def _choice(self, prepared: PreparedChat, index: int, text: str, logprobs: list[dict],
                finished: Finished) -> Choice:
        """Build one choice of a whole reply: its thinking, text, tool calls (or legacy function call) and finish
        reason."""
        calls, thinking = [], {}
        reasoning_parser = prepared.reasoning_parser()
        if reasoning_parser is not None:
            (reasoning, content), (more_reasoning, rest) = reasoning_parser.feed(text), reasoning_parser.finish()
            text = content + rest
            thinking = {"reasoning_content": reasoning + more_reasoning} if reasoning or more_reasoning else {}
        parser = prepared.tool_call_parser()
        if parser is not None:
            content, deltas = parser.feed(text)
            rest, last_deltas = parser.finish()
            text, calls = content + rest, merge_deltas(deltas + last_deltas)
        if calls and prepared.request.legacy_functions:
            message = AssistantMessage(role="assistant", content=text or None, **thinking,
                                       function_call=CalledFunction(**calls[0]["function"]))
        elif calls:
            message = AssistantMessage(role="assistant", content=text or None, **thinking, tool_calls=calls)
        else:
            message = AssistantMessage(role="assistant", content=text, **thinking)
        return Choice(
            index=index,
            message=message,
            logprobs={"content": logprobs} if prepared.params.logprobs else None,
            finish_reason=self._finish_reason(prepared, finished, parser),
        )
