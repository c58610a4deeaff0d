"""The Responses API's serving class: a Responses request prepared as the chat request it means, its reply
written as a response (output.py), kept when `store` asks, and stored responses read back.

It runs through routes.serve_generation as chat does, so the cache, the engine call, the metrics and
the limits are chat's; it knows nothing of Flask's request and response objects.
"""

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from ...cache.stored_responses import StoredResponses, StoreUnavailable
from ...engine import ChoiceGroup, EventSource, Failed, Finished, Generation, KvScope, TextDelta
from ...errors import RETRY_AFTER_SECONDS, InvalidRequest, NotFound, Overloaded
from ..chat import ChatCompletions, PreparedChat, ReplyParsers
from ..serving import interrupted, read_whole_reply
from ..sse import PING, sse_event
from .conversation import chat_request, check_call_ids, responses_field_names
from .objects import OutputFunctionCall, OutputMessage, OutputReasoning, ResponseObject, StoredResponse, StreamEvent
from .output import ResponseFacts, ResponseWriter, new_item_id
from .request import FunctionCallItem, MessageItem, ReasoningItem, ResponsesRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResponsesCall:
    """A Responses request as the view hands it over: the parsed body and whose it is."""

    request: ResponsesRequest
    # A hash of the API key the request came with (None when the API needs no key): the scope its stored
    # responses live in.
    owner: str | None

    @property
    def stream(self) -> bool:
        """Tell whether the response streams."""
        return bool(self.request.stream)

    @property
    def cache_salt(self) -> None:
        """Return no cache salt: the Responses API has no such field (the cache scope is the key's)."""
        return None


@dataclass(frozen=True)
class PreparedResponse(PreparedChat):
    """A Responses request checked against the model, as the chat request it means; its completion_id is the
    response's id (`resp_…`)."""

    call: ResponsesCall
    # The conversation the reply answers: the previous response's items, then this input's.
    history: tuple
    # Whether the response is kept when it ends.
    store: bool

    def facts(self) -> ResponseFacts:
        """Return what the response object says of its request."""
        return ResponseFacts(response_id=self.completion_id, created_at=self.created, model=self.model_name,
                             request=self.call.request, temperature=self.params.temperature, top_p=self.params.top_p,
                             store=self.store)

    def writer(self) -> ResponseWriter:
        """Return the writer of the response, with the parsers chat would split its reply with."""
        return ResponseWriter(self.facts(), ReplyParsers(self.reasoning_parser(), self.tool_call_parser()))


def framed(event: StreamEvent) -> str:
    """Frame one event of a streamed response."""
    return sse_event(event.type, event.model_dump_json())


def store_failed(exc: StoreUnavailable) -> Overloaded:
    """Build the 503 of a store Redis did not answer."""
    log.warning("the response store failed (%s)", exc)
    return Overloaded("the response store (Redis) did not answer; retry",
                      headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class ResponsesServing:
    """Prepare, run, render and keep responses for one worker's chat serving class."""

    def __init__(self, chat: ChatCompletions, store: StoredResponses | None):
        self.chat = chat
        self.engine = chat.engine
        self.store = store

    def prepare(self, call: ResponsesCall) -> PreparedResponse:
        """Build the chat request the Responses request means and prepare it as chat does, or raise a 4xx."""
        request = call.request
        store = self._store_asked(request)
        previous = self._previous_conversation(call) if request.previous_response_id is not None else []
        history = [*previous, *request.input_items]
        check_call_ids(history, len(previous))
        with responses_field_names():
            prepared = self.chat.prepare(chat_request(request, history))
        fields = {field.name: getattr(prepared, field.name) for field in dataclasses.fields(PreparedChat)}
        fields["completion_id"] = new_item_id("resp")
        return PreparedResponse(**fields, call=call, history=tuple(history), store=store)

    def _store_asked(self, request: ResponsesRequest) -> bool:
        """Return whether the response is kept: as asked, else whenever there is a store (OpenAI's default)."""
        if self.store is None:
            for name in ("store", "previous_response_id"):
                if getattr(request, name) not in (None, False):
                    raise InvalidRequest(f"'{name}' needs a Redis (REDIS_URL): this server keeps no responses "
                                         "without one", param=name, code="store_unavailable")
            return False
        return request.store is not False

    def _previous_conversation(self, call: ResponsesCall) -> list:
        """Return the conversation of the response the request continues, or raise its 404."""
        response_id = call.request.previous_response_id
        stored = self._find(call.owner, response_id)
        if stored is None:
            raise NotFound(f"no stored response has the id '{response_id}'", param="previous_response_id",
                           code="previous_response_not_found")
        return list(stored.conversation)

    def _find(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """Return one of the owner's stored responses, or None."""
        try:
            document = self.store.find(owner, response_id)
        except StoreUnavailable as exc:
            raise store_failed(exc) from None
        return None if document is None else StoredResponse.model_validate_json(document)

    def retrieve(self, owner: str | None, response_id: str) -> ResponseObject:
        """Return one of the owner's stored responses, or raise a 404 (the same whether it expired, never existed,
        or is another key's)."""
        stored = self._find(owner, response_id) if self.store is not None else None
        if stored is None:
            raise NotFound(f"no stored response has the id '{response_id}'", param="response_id")
        return stored.response

    def start(self, prepared: PreparedResponse, forced_ids: tuple[int, ...] = (),
              kv_scope: KvScope = KvScope()) -> Generation | ChoiceGroup:
        """Queue the reply's generation as chat does, or raise a 4xx or 503."""
        with responses_field_names():
            return self.chat.start(prepared, forced_ids, kv_scope)

    def stream(self, prepared: PreparedResponse, source: EventSource) -> Iterator[str]:
        """Yield a response's typed events as Server-Sent Events; a failure after the first byte ends the stream
        with `response.failed`. The source is cancelled in `finally`, so a client that goes away frees its slot."""
        writer = prepared.writer()
        try:
            yield from map(framed, writer.begin())
            while True:
                event = source.next_event(timeout=self.chat.settings.sse_ping_seconds)
                if event is None:
                    yield PING
                elif isinstance(event, TextDelta):
                    yield from map(framed, writer.feed(event.text))
                elif isinstance(event, Finished):
                    if event.finish_reason == "cancelled":
                        yield framed(writer.fail(interrupted().message))
                        break
                    yield from map(framed, writer.end(event))
                    try:
                        self._keep(prepared, writer)
                    except Overloaded as exc:
                        yield framed(writer.fail(exc.message))
                        break
                    yield framed(writer.last_event())
                    break
                elif isinstance(event, Failed):
                    yield framed(writer.fail(event.message))
                    break
        finally:
            source.cancel()

    def complete(self, prepared: PreparedResponse, source: EventSource) -> ResponseObject:
        """Wait for the whole reply and return the response, kept first when `store` asks."""
        writer = prepared.writer()

        def take(_index: int, event) -> None:
            if isinstance(event, TextDelta):
                writer.feed(event.text)

        _, finished = read_whole_reply(source, 1, take)
        writer.end(finished)
        self._keep(prepared, writer)
        return writer.response

    def _keep(self, prepared: PreparedResponse, writer: ResponseWriter) -> None:
        """Store an ended response with its conversation when `store` asks, or raise a 503."""
        if not prepared.store:
            return
        replies = [_given_back(item) for item in writer.output]
        stored = StoredResponse(response=writer.response, conversation=[*prepared.history, *replies])
        try:
            self.store.keep(prepared.call.owner, prepared.completion_id, stored.model_dump_json().encode())
        except StoreUnavailable as exc:
            raise store_failed(exc) from None


def _given_back(item: OutputMessage | OutputFunctionCall | OutputReasoning
                ) -> MessageItem | FunctionCallItem | ReasoningItem:
    """Return an output item as the input item a continuation gives back to the model."""
    if isinstance(item, OutputMessage):
        return MessageItem(role="assistant", content=item.content[0].text)
    if isinstance(item, OutputFunctionCall):
        return FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)
    return ReasoningItem(type="reasoning", id=item.id, content=item.content)
