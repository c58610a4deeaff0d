"""One response written as its reply arrives: the output items, the stream events that build them, the whole object.

A whole response and a streamed one are written by the same ResponseWriter (a whole one drops the
events), so both hold the same items. A thinking model's thinking, split off by reasoning.py as chat
splits it, goes to a reasoning item first; the reply's text goes to a message item; the tool-call
blocks toolcalls.py parses out of it become function_call items; an item is closed (its `.done`
events) when the next begins or the reply ends, and a reply with neither text nor calls still has
its (empty) message, as OpenAI's does.
"""

import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

from ...engine import Finished
from ..chat import ReplyParsers
from ..serving import usage_of
from .objects import (
    DEFAULT_TEXT,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    OutputFunctionCall,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputTextPart,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from .request import ReasoningText, ResponsesRequest


def new_item_id(prefix: str) -> str:
    """Return a fresh output item id in OpenAI's style (`msg_…`, `fc_…`, `rs_…`)."""
    return f"{prefix}_{secrets.token_hex(24)}"


def usage_of_response(finished: Finished) -> ResponseUsage:
    """Build a response's usage from its generation's, as chat counts it."""
    usage = usage_of(finished)
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens,
                                                cache_write_tokens=0),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=usage.total_tokens,
    )


@dataclass(frozen=True)
class ResponseFacts:
    """What a response object says of its request, fixed before its reply begins."""

    response_id: str
    created_at: int
    model: str
    request: ResponsesRequest
    temperature: float
    top_p: float
    store: bool


@dataclass
class _OpenItem:
    """The output item being written: its type, id, index in the output, and its text or arguments so far."""

    kind: Literal["message", "function_call", "reasoning"]
    item_id: str
    output_index: int
    pieces: list[str] = field(default_factory=list)
    # A function call's id and name (None and "" for a message or reasoning).
    call_id: str | None = None
    name: str = ""


class ResponseWriter:
    """Write one response: feed it the reply's text, end it with the generation's last event."""

    def __init__(self, facts: ResponseFacts, parsers: ReplyParsers):
        self.facts = facts
        self.parsers = parsers
        self.output: list[OutputMessage | OutputFunctionCall | OutputReasoning] = []
        self.response = self._response("in_progress")
        self._open: _OpenItem | None = None
        self._sequence = 0

    def _response(self, status, *, usage: ResponseUsage | None = None, error: ResponseError | None = None,
                  incomplete: IncompleteDetails | None = None) -> ResponseObject:
        """Build the response object as it stands."""
        request = self.facts.request
        return ResponseObject(
            id=self.facts.response_id, object="response", created_at=self.facts.created_at,
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
            status=status, error=error, incomplete_details=incomplete, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, metadata=dict(request.metadata or {}), model=self.facts.model,
            output=list(self.output), parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning, store=self.facts.store,
            temperature=self.facts.temperature, top_p=self.facts.top_p,
            text=request.text if request.text is not None and request.text.format is not None else DEFAULT_TEXT,
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=request.function_tools, truncation="disabled", background=False, service_tier="default",
            user=request.user, safety_identifier=request.safety_identifier, prompt_cache_key=request.prompt_cache_key,
            usage=usage,
        )

    def _event(self, kind: type, **fields) -> StreamEvent:
        """Build the next event of the stream, numbered in order."""
        event = kind(sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def begin(self) -> list[StreamEvent]:
        """Return the events that open the stream."""
        return [self._event(LifecycleEvent, type=kind, response=self.response)
                for kind in ("response.created", "response.in_progress")]

    def feed(self, text: str) -> list[StreamEvent]:
        """Take the next piece of the reply's text; return the events it completes."""
        if self.parsers.reasoning is None:
            return self._content(text)
        reasoning, content = self.parsers.reasoning.feed(text)
        return self._reasoning(reasoning) + self._content(content)

    def _content(self, text: str) -> list[StreamEvent]:
        """Write the reply's text after its thinking: as the message's text, less the tool-call blocks."""
        if self.parsers.tool_calls is None:
            return self._text(text)
        content, deltas = self.parsers.tool_calls.feed(text)
        return self._text(content) + self._calls(deltas)

    def end(self, finished: Finished) -> list[StreamEvent]:
        """Close the output at the reply's end; return the events that close it (the response's own last event is
        `last_event`, sent once the response is kept)."""
        events = []
        if self.parsers.reasoning is not None:
            reasoning, content = self.parsers.reasoning.finish()
            events += self._reasoning(reasoning) + self._content(content)
        if self.parsers.tool_calls is not None:
            content, deltas = self.parsers.tool_calls.finish()
            events += self._text(content) + self._calls(deltas)
        cut = finished.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        answered = any(not isinstance(item, OutputReasoning) for item in self.output)
        if not answered and (self._open is None or self._open.kind == "reasoning"):
            events += self._close(status) + self._open_message()
        events += self._close(status)
        self.response = self._response("incomplete" if cut else "completed", usage=usage_of_response(finished),
                                       incomplete=IncompleteDetails(reason="max_output_tokens") if cut else None)
        return events

    def last_event(self) -> StreamEvent:
        """Return the event that ends a stream whose reply ended: completed, or incomplete when cut."""
        kind = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        return self._event(LifecycleEvent, type=kind, response=self.response)

    def fail(self, message: str) -> StreamEvent:
        """Return the event that ends a stream whose reply failed after it began."""
        self.response = self._response("failed", error=ResponseError(code="server_error", message=message))
        return self._event(LifecycleEvent, type="response.failed", response=self.response)

    def _reasoning(self, text: str) -> list[StreamEvent]:
        """Add thinking to the open reasoning item, opening one with its (empty) text part first if needed."""
        if not text:
            return []
        events = []
        if self._open is None or self._open.kind != "reasoning":
            events += self._close("completed")
            self._open = _OpenItem("reasoning", new_item_id("rs"), len(self.output))
            events += [
                self._event(OutputItemEvent, type="response.output_item.added", output_index=self._open.output_index,
                            item=_reasoning_item(self._open, "in_progress", [])),
                self._event(ContentPartEvent, type="response.content_part.added", item_id=self._open.item_id,
                            output_index=self._open.output_index, content_index=0, part=_reasoning_part("")),
            ]
        self._open.pieces.append(text)
        events.append(self._event(ReasoningDeltaEvent, type="response.reasoning_text.delta",
                                  item_id=self._open.item_id, output_index=self._open.output_index, content_index=0,
                                  delta=text))
        return events

    def _text(self, text: str) -> list[StreamEvent]:
        """Add reply text to the open message, opening one (and closing a call or the thinking) first if needed."""
        if not text:
            return []
        events = []
        if self._open is None or self._open.kind != "message":
            events += self._close("completed") + self._open_message()
        self._open.pieces.append(text)
        events.append(self._event(TextDeltaEvent, type="response.output_text.delta", item_id=self._open.item_id,
                                  output_index=self._open.output_index, content_index=0, delta=text, logprobs=[]))
        return events

    def _calls(self, deltas: list[dict]) -> list[StreamEvent]:
        """Turn the parser's tool-call deltas into function_call items: a delta with an id opens one."""
        events = []
        for delta in deltas:
            arguments = delta["function"]["arguments"]
            if "id" in delta:
                events += self._close("completed")
                self._open = _OpenItem("function_call", new_item_id("fc"), len(self.output), call_id=delta["id"],
                                       name=delta["function"]["name"])
                events.append(self._event(OutputItemEvent, type="response.output_item.added",
                                          output_index=self._open.output_index,
                                          item=_call_item(self._open, "in_progress")))
            if arguments:
                self._open.pieces.append(arguments)
                events.append(self._event(ArgumentsDeltaEvent, type="response.function_call_arguments.delta",
                                          item_id=self._open.item_id, output_index=self._open.output_index,
                                          delta=arguments))
        return events

    def _open_message(self) -> list[StreamEvent]:
        """Open a message item with its one (empty) text part."""
        self._open = _OpenItem("message", new_item_id("msg"), len(self.output))
        return [
            self._event(OutputItemEvent, type="response.output_item.added", output_index=self._open.output_index,
                        item=_message_item(self._open, "in_progress", [])),
            self._event(ContentPartEvent, type="response.content_part.added", item_id=self._open.item_id,
                        output_index=self._open.output_index, content_index=0, part=_text_part("")),
        ]

    def _close(self, status: str) -> list[StreamEvent]:
        """Close the open item, if any, with `status`; it joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "reasoning":
            text = "".join(item.pieces)
            whole = _reasoning_item(item, status, [_reasoning_part(text)])
            events = [
                self._event(ReasoningDoneEvent, type="response.reasoning_text.done", **where, content_index=0,
                            text=text),
                self._event(ContentPartEvent, type="response.content_part.done", **where, content_index=0,
                            part=_reasoning_part(text)),
            ]
        elif item.kind == "message":
            text = "".join(item.pieces)
            whole = _message_item(item, status, [_text_part(text)])
            events = [
                self._event(TextDoneEvent, type="response.output_text.done", **where, content_index=0, text=text,
                            logprobs=[]),
                self._event(ContentPartEvent, type="response.content_part.done", **where, content_index=0,
                            part=_text_part(text)),
            ]
        else:
            whole = _call_item(item, status)
            events = [self._event(ArgumentsDoneEvent, type="response.function_call_arguments.done", **where,
                                  name=item.name, arguments=whole.arguments)]
        self.output.append(whole)
        events.append(self._event(OutputItemEvent, type="response.output_item.done", output_index=item.output_index,
                                  item=whole))
        return events


def _message_item(item: _OpenItem, status: str, parts: list[OutputTextPart]) -> OutputMessage:
    """Build a message as an output item."""
    return OutputMessage(type="message", id=item.item_id, status=status, role="assistant", content=parts)


def _call_item(item: _OpenItem, status: str) -> OutputFunctionCall:
    """Build a function call as an output item, with its arguments so far."""
    return OutputFunctionCall(type="function_call", id=item.item_id, call_id=item.call_id, name=item.name,
                              arguments="".join(item.pieces), status=status)


def _reasoning_item(item: _OpenItem, status: str, parts: list[ReasoningText]) -> OutputReasoning:
    """Build the thinking as an output item."""
    return OutputReasoning(type="reasoning", id=item.item_id, summary=[], content=parts, status=status)


def _reasoning_part(text: str) -> ReasoningText:
    """Build a reasoning item's text part."""
    return ReasoningText(type="reasoning_text", text=text)


def _text_part(text: str) -> OutputTextPart:
    """Build a message's text part."""
    return OutputTextPart(type="output_text", text=text, annotations=[], logprobs=[])
