"""OpenAI's legacy `functions` and `function_call`, which older SDKs and frameworks still send.

A request in that form becomes a tools request (each function a tool, `function_call` the
tool_choice, one call at most) before it is prepared, so it is rendered, constrained, cached and
parsed as tools are; only the reply goes back in the legacy shape: `message.function_call` (or
`delta.function_call` pieces) and `finish_reason: "function_call"`. Earlier turns in that form map
the same way: an assistant's `function_call` becomes its one tool call, and a `function` message
the `tool` message answering it.
"""

from .chat_parts import ChatMessage, FunctionChoice, NamedToolChoice, Tool, ToolCall
from .chat_request import ChatCompletionRequest

# The id an earlier turn's legacy call gets: the legacy form has none, and a template that prints ids
# then sees the same one on the call and on its result.
LEGACY_CALL_ID = "call_function"


def as_tools_request(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """Return a request that uses `functions` as the same request in tools form (others as they are)."""
    if request.functions is None and not any(message.function_call or message.role == "function"
                                             for message in request.messages):
        return request
    update: dict = {"messages": [_as_tools_message(message) for message in request.messages]}
    if request.functions is not None:
        choice = request.function_call
        update.update(
            tools=[Tool(type="function", function=function) for function in request.functions],
            tool_choice=NamedToolChoice(type="function", function=choice) if isinstance(choice, FunctionChoice)
            else choice or "auto",
            parallel_tool_calls=False,
        )
    return request.model_copy(update=update)


def _as_tools_message(message: ChatMessage) -> ChatMessage:
    """Return a legacy function call or function result as the tool call or tool message it stands for."""
    if message.function_call is not None:
        call = ToolCall(id=LEGACY_CALL_ID, type="function", function=message.function_call)
        return message.model_copy(update={"function_call": None, "tool_calls": [*(message.tool_calls or []), call]})
    if message.role == "function":
        return message.model_copy(update={"role": "tool", "tool_call_id": LEGACY_CALL_ID})
    return message


def function_call_delta(tool_call_deltas: list[dict]) -> dict | None:
    """Join the deltas of a reply's first tool call into one `delta.function_call` (None when they hold none).

    The legacy shape carries one call: a reply's later calls have no place in it.
    """
    first = [delta for delta in tool_call_deltas if delta["index"] == 0]
    if not first:
        return None
    piece = {"name": first[0]["function"]["name"]} if "id" in first[0] else {}
    piece["arguments"] = "".join(delta["function"]["arguments"] for delta in first)
    return piece
