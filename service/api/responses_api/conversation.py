"""From a Responses request to the chat request it means, and the chat path's errors back into its field names.

The chat path (chat_request.py, chat.py) then checks and serves it as any chat completion: what it
refuses it refuses with the same rules, named here as the Responses request names the field.
"""

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager

from ...errors import APIError, InvalidRequest
from ..chat_parts import JsonObjectFormat, TextFormat
from ..chat_request import ChatCompletionRequest, parse_chat_request
from .request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ReasoningItem,
    ResponsesJsonSchemaFormat,
    ResponsesRequest,
    TextConfig,
    parts_text,
)

# The chat request's fields and what the Responses request calls them; in messages, `messages` and
# `response_format` are renamed where quoted as a field ('messages'), not where `messages` is a plain word.
RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
CHAT_NAME = re.compile(r"(?<=')(messages|response_format)\b|\b(max_completion_tokens)\b")


def chat_messages(items: list) -> list[dict]:
    """Turn items into chat messages: a function call joins the assistant turn it follows (or opens one), its
    output becomes a tool message, and a reasoning item becomes the `reasoning_content` of the assistant turn that
    follows it (the template decides whether the model reads it again: Qwen3's keeps only the thinking of the
    turns after the last user message)."""
    messages: list[dict] = []
    thinking = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            thinking += item.text
            continue
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": parts_text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and not thinking:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": parts_text(item.output)})
        if thinking and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thinking
        thinking = ""
    return messages


def check_call_ids(items: list, first_input: int) -> None:
    """Refuse a function call output that answers no function call before it (items before `first_input` come from
    the previous response, already checked)."""
    called = set()
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in called:
            param = f"input[{index - first_input}].call_id"
            raise InvalidRequest(f"no function call with call_id '{item.call_id}' comes before this output",
                                 param=param)


def _tool_choice(request: ResponsesRequest) -> str | dict | None:
    """Return chat's tool_choice for the request's (none without tools, where the default `auto` means nothing)."""
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if choice is None or (choice in ("auto", "none") and not request.tools):
        return None
    return choice


def _response_format(text: TextConfig | None) -> dict | None:
    """Return chat's response_format for `text.format`."""
    format_ = text.format if text is not None else None
    if isinstance(format_, TextFormat | JsonObjectFormat):
        return {"type": format_.type}
    if isinstance(format_, ResponsesJsonSchemaFormat):
        spec = {"name": format_.name, "description": format_.description, "schema": format_.schema_,
                "strict": format_.strict}
        return {"type": "json_schema", "json_schema": {key: value for key, value in spec.items() if value is not None}}
    return None


def chat_request(request: ResponsesRequest, history: list) -> ChatCompletionRequest:
    """Build and check the chat request a Responses request means: `instructions` as the first (system) message,
    then the conversation `history` (the previous response's items and this input)."""
    instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
    tools = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
             for tool in request.function_tools]
    body = {
        "messages": instructions + chat_messages(history),
        "model": request.model,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": tools or None,
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text),
        "reasoning_effort": request.reasoning.effort if request.reasoning is not None else None,
    }
    with responses_field_names():
        return parse_chat_request({key: value for key, value in body.items() if value is not None})


def renamed(error: APIError) -> APIError:
    """Return a chat path's error naming the Responses request's fields instead of the chat request's."""
    if error.param is None and not CHAT_NAME.search(error.message):
        return error
    renamed_error = copy.copy(error)
    renamed_error.message = CHAT_NAME.sub(lambda match: RESPONSES_NAMES[match.group()], error.message)
    renamed_error.args = (renamed_error.message,)
    if error.param is not None:
        head = re.match(r"[a-z_]+", error.param)
        if head is not None and head.group() in RESPONSES_NAMES:
            # An index into chat's messages is no index into the input (instructions and calls shift it).
            renamed_error.param = RESPONSES_NAMES[head.group()]
    return renamed_error


@contextmanager
def responses_field_names() -> Iterator[None]:
    """Re-raise the chat path's errors with the Responses request's field names."""
    try:
        yield
    except APIError as error:
        raise renamed(error) from None
