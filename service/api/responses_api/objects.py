"""The Responses API's objects, defined once: output.py builds them, the views render them, /openapi.json describes
them.

Every field is required and set when built, so an object renders whole (`null` where OpenAI sends null);
tests/app/test_responses_api.py validates each against the `openai` package's own types.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from ..chat_parts import TextFormat
from .request import (
    FunctionTool,
    FunctionToolChoice,
    InputItem,
    ReasoningConfig,
    ReasoningText,
    TextConfig,
    ToolChoiceMode,
)

Count = Annotated[int, Field(ge=0)]
ResponseId = Annotated[str, Field(pattern="^resp_")]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class _Object(BaseModel):
    """An object of the API: built by the server from checked values, so it validates without coercion."""

    model_config = ConfigDict(strict=True, extra="forbid")


class OutputTextPart(_Object):
    """The text of a reply's message (no annotations, no log probabilities: both always empty)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class OutputMessage(_Object):
    """The reply's text, as an output item."""

    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputTextPart]


class OutputFunctionCall(_Object):
    """A function call of the reply, as an output item: the client runs it and answers its `call_id`."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(_Object):
    """A thinking model's thinking (Qwen3's <think> block), as an output item before the reply's message."""

    type: Literal["reasoning"]
    id: str
    # Always empty: the model writes its whole thinking, never a summary of it.
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]
ContentPart = Annotated[OutputTextPart | ReasoningText, Field(discriminator="type")]


class InputTokensDetails(_Object):
    """How the input's tokens were processed."""

    # Input tokens whose KV state came from the host's prefix store (or a cached reply) instead of a prompt pass.
    cached_tokens: Count
    # OpenAI's tokens written under explicit cache breakpoints, which corechat does not have: always 0 (its prefix
    # store keeps prompts on its own, at no cost to the client).
    cache_write_tokens: Count


class OutputTokensDetails(_Object):
    """What the output's tokens were."""

    # Always 0, thinking or not: the engine's text pieces are whole characters, not tokens, so where in a piece's
    # tokens the thinking ended is not known exactly (chat completions count no reasoning tokens either).
    reasoning_tokens: Count


class ResponseUsage(_Object):
    """The tokens a response took."""

    input_tokens: Count
    input_tokens_details: InputTokensDetails
    output_tokens: Count
    output_tokens_details: OutputTokensDetails
    total_tokens: Count


class IncompleteDetails(_Object):
    """Why a response ended before the model ended it: its length limit (max_output_tokens, else the server's)."""

    reason: Literal["max_output_tokens"]


class ResponseError(_Object):
    """Why a response failed after it began."""

    code: Literal["server_error"]
    message: str


class ResponseObject(_Object):
    """A `response` object: returned whole, carried by the lifecycle events of a stream, stored and retrieved."""

    id: ResponseId
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: ResponseStatus
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningConfig | None
    store: bool
    temperature: float
    top_p: float
    text: TextConfig
    tool_choice: ToolChoiceMode | FunctionToolChoice
    tools: list[FunctionTool]
    truncation: Literal["disabled"]
    background: Literal[False]
    service_tier: Literal["default"]
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    usage: ResponseUsage | None


DEFAULT_TEXT = TextConfig(format=TextFormat(type="text"), verbosity="medium")


class LifecycleEvent(_Object):
    """A stream's events that carry the whole response as it stands: its start and its end."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: Count
    response: ResponseObject


class OutputItemEvent(_Object):
    """An output item begun (its empty shape) or done (whole)."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: Count
    output_index: Count
    item: OutputItem


class ContentPartEvent(_Object):
    """A message's text part, or a reasoning item's text, begun (empty) or done (whole)."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: Count
    item_id: str
    output_index: Count
    content_index: Count
    part: ContentPart


class TextDeltaEvent(_Object):
    """A piece of a message's text; the pieces join into the text of its `response.output_text.done`."""

    type: Literal["response.output_text.delta"]
    sequence_number: Count
    item_id: str
    output_index: Count
    content_index: Count
    delta: str
    logprobs: list[Any]


class TextDoneEvent(_Object):
    """A message's whole text."""

    type: Literal["response.output_text.done"]
    sequence_number: Count
    item_id: str
    output_index: Count
    content_index: Count
    text: str
    logprobs: list[Any]


class ReasoningDeltaEvent(_Object):
    """A piece of a reasoning item's text; the pieces join into the text of its `response.reasoning_text.done`."""

    type: Literal["response.reasoning_text.delta"]
    sequence_number: Count
    item_id: str
    output_index: Count
    content_index: Count
    delta: str


class ReasoningDoneEvent(_Object):
    """A reasoning item's whole text."""

    type: Literal["response.reasoning_text.done"]
    sequence_number: Count
    item_id: str
    output_index: Count
    content_index: Count
    text: str


class ArgumentsDeltaEvent(_Object):
    """A piece of a function call's arguments."""

    type: Literal["response.function_call_arguments.delta"]
    sequence_number: Count
    item_id: str
    output_index: Count
    delta: str


class ArgumentsDoneEvent(_Object):
    """A function call's whole arguments."""

    type: Literal["response.function_call_arguments.done"]
    sequence_number: Count
    item_id: str
    output_index: Count
    name: str
    arguments: str


StreamEvent = LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent | \
    ReasoningDeltaEvent | ReasoningDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent


class ResponseStreamEvent(RootModel[Annotated[StreamEvent, Field(discriminator="type")]]):
    """One event of a streamed response: sent as `event: <type>` and `data: <the event>`."""


class StoredResponse(BaseModel):
    """What is kept of a stored response: the object itself and the conversation a continuation starts from."""

    model_config = ConfigDict(extra="forbid")

    response: ResponseObject
    # Every item up to and including the reply's (instructions apart, which a continuation does not inherit).
    conversation: list[InputItem]


RESPONSES_API_MODELS = (ResponseObject, ResponseStreamEvent)
