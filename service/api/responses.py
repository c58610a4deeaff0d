"""The response objects of the API, defined once: the views render them and /openapi.json describes them
(the error object lives with the errors, in service/errors.py).

Rendered with `model_dump(exclude_unset=True)`: a field with a default goes out only when it is set, so
each object carries exactly the fields OpenAI's carries in that case (`usage` on a stream's chunks only
with `include_usage`, `tool_calls` only when the reply called tools), while a field set to None is
sent as `null`. A stream's chunks are built as plain data, per token (chat.py);
tests/e2e/test_responses.py holds each to ChatCompletionChunk byte for byte.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ErrorResponse
from .chat_parts import CalledFunction, ToolCall
from .chat_request import MAX_CHOICES, MAX_TOP_LOGPROBS

FinishReason = Literal["stop", "length", "tool_calls", "function_call"]
CompletionId = Annotated[str, Field(pattern="^chatcmpl-")]
Count = Annotated[int, Field(ge=0)]
Byte = Annotated[int, Field(ge=0, le=255)]


def _without_default(schema: dict) -> None:
    """Drop the `default: null` of an omitted field from its schema: a client never sees that null."""
    schema.pop("default", None)


def omitted() -> Any:
    """Declare a field left out of the object unless set. Its type has no None, so it is never sent as null:
    the unset default is not validated, and rendering leaves it out."""
    return Field(None, json_schema_extra=_without_default)


class _Response(BaseModel):
    """A response object: built by the server from checked values, so it validates without coercion."""

    model_config = ConfigDict(strict=True, extra="forbid")


class PromptTokensDetails(_Response):
    """How the prompt's tokens were processed."""

    # Prompt tokens whose KV state came from the host's prefix store instead of a prompt pass.
    cached_tokens: Count


class Usage(_Response):
    """The tokens a completion took."""

    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(_Response):
    """One of the most likely tokens at a position, with its log probability."""

    token: str
    logprob: Annotated[float, Field(le=0)]
    bytes: list[Byte] | None


class TokenLogprob(TopLogprob):
    """A token of the reply: its log probability and the `top_logprobs` most likely alternatives."""

    top_logprobs: Annotated[list[TopLogprob], Field(max_length=MAX_TOP_LOGPROBS)]


class ChoiceLogprobs(_Response):
    """Each token's log probability under the distribution the sampler drew from."""

    content: list[TokenLogprob]


LogprobsField = Annotated[
    ChoiceLogprobs | None,
    Field(description="With `logprobs: true` the reply's tokens' log probabilities; otherwise null."),
]


class AssistantMessage(_Response):
    """The reply; `content` is null when the reply is tool calls alone (or, for a request that sent the legacy
    `functions`, its one `function_call`)."""

    role: Literal["assistant"]
    content: str | None
    # A thinking model's thinking (Qwen3's <think> block), apart from the content, as llama.cpp and vLLM give it.
    reasoning_content: str = omitted()
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] = omitted()
    function_call: CalledFunction = omitted()


class Choice(_Response):
    """One choice of a whole reply (n of them, indexed from 0)."""

    index: Count
    message: AssistantMessage
    logprobs: LogprobsField
    finish_reason: FinishReason


class ChatCompletion(_Response):
    """A whole reply to `POST /v1/chat/completions`."""

    id: CompletionId
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)]
    usage: Usage


class DeltaFunctionCall(_Response):
    """A piece of a streamed call's function: the name in its first piece, then `arguments` text."""

    name: str = omitted()
    arguments: str = omitted()


class DeltaToolCall(_Response):
    """A piece of a streamed tool call: the first carries its id, type and name; later ones (same `index`) add
    `function.arguments` text."""

    index: Count
    id: Annotated[str, Field(pattern="^call_")] = omitted()
    type: Literal["function"] = omitted()
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    """What a chunk adds to the reply: the role first, then reasoning (a thinking model's), content or tool-call
    pieces (for a request that sent the legacy `functions`, `function_call` pieces: the name first, then
    `arguments` text)."""

    role: Literal["assistant"] = omitted()
    content: str = omitted()
    reasoning_content: str = omitted()
    tool_calls: Annotated[list[DeltaToolCall], Field(min_length=1)] = omitted()
    function_call: DeltaFunctionCall = omitted()


class ChunkChoice(_Response):
    """The choice a chunk adds to (its index; with n > 1 the choices' chunks interleave)."""

    index: Count
    delta: DeltaMessage
    logprobs: LogprobsField
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Response):
    """One `data:` event of a stream. The stream ends with `data: [DONE]`; `: ping` comments keep it alive
    while waiting. An error after the first event arrives as an ErrorResponse event. With
    `stream_options.include_usage` every chunk carries `usage` (null until the last, whose `choices` is
    empty)."""

    id: CompletionId
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: Annotated[list[ChunkChoice], Field(max_length=1)]
    usage: Usage | None = None


CompletionFinishReason = Literal["stop", "length"]


class CompletionLogprobs(_Response):
    """Legacy completions' logprobs: per token its text, log probability (null for a prompt's first token, which
    nothing predicts), most likely alternatives by text (the token itself among them; null where the log
    probability is) and where it starts in the choice's text (counted across a stream's chunks)."""

    tokens: list[str]
    token_logprobs: list[Annotated[float, Field(le=0)] | None]
    top_logprobs: list[dict[str, Annotated[float, Field(le=0)]] | None]
    text_offset: list[Count]


class CompletionChoice(_Response):
    """One choice of a whole text completion (n of them, indexed from 0)."""

    index: Count
    text: str
    logprobs: Annotated[CompletionLogprobs | None, Field(description="With `logprobs` set, the tokens' log "
                                                                     "probabilities; otherwise null.")]
    finish_reason: CompletionFinishReason


class Completion(_Response):
    """A whole reply to `POST /v1/completions`."""

    id: Annotated[str, Field(pattern="^cmpl-")]
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: Annotated[list[CompletionChoice], Field(min_length=1, max_length=MAX_CHOICES)]
    usage: Usage


class CompletionChunkChoice(_Response):
    """The choice a streamed text completion's chunk adds to: the text it adds (with `echo`, each choice's first
    is the prompt) and, in its last, the finish reason."""

    index: Count
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: CompletionFinishReason | None


class CompletionChunk(_Response):
    """One `data:` event of a streamed text completion, which ends with `data: [DONE]` as chat's do (pings,
    errors and `stream_options.include_usage` alike)."""

    id: Annotated[str, Field(pattern="^cmpl-")]
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: Annotated[list[CompletionChunkChoice], Field(max_length=1)]
    usage: Usage | None = None


class Model(_Response):
    """The served model, under one of the names it answers to."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Response):
    """The names the one served model answers to: MODEL_NAME's aliases, then the model's own id."""

    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(_Response):
    """The token ids of `POST /tokenize` (llama.cpp's `tokens`; vLLM's `tokens`, `count` and `max_model_len`)."""

    tokens: list[Count]
    count: Count
    max_model_len: Annotated[Count, Field(description="The most tokens one sequence, prompt and reply, may hold "
                                                      "on this server: the model's context, or the worker's KV budget "
                                                      "when smaller.")]


class DetokenizeResponse(_Response):
    """The text of `POST /detokenize`, under vLLM's name (`prompt`) and llama.cpp's (`content`)."""

    prompt: str
    content: str


class Health(_Response):
    """The process is alive."""

    status: Literal["ok"]


class Readiness(_Response):
    """This worker's state and counts. With API keys on, a caller without a key gets only these and
    requests_finished; otherwise the model and more facts (load and warm-up seconds, threads, ...) appear."""

    model_config = ConfigDict(extra="allow")

    status: str
    model: str = omitted()
    worker_pid: int
    running: Count
    waiting: Count


RESPONSE_MODELS = (ErrorResponse, ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, Model, ModelList,
                   TokenizeResponse, DetokenizeResponse, Health, Readiness)
