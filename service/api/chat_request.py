"""The request body of chat completions: parsed strictly, every problem named by its field."""

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, ValidationError, field_validator

from ..errors import InvalidRequest
from . import nesting
from .chat_parts import (
    ChatMessage,
    ChatTemplateKwargs,
    FunctionChoice,
    FunctionDefinition,
    GrammarFields,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    StreamOptions,
    StrictModel,
    TextFormat,
    Tool,
)

MAX_STOP_STRINGS = 4
# The most choices (n) one request may ask for; each is a running sequence of its own.
MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds of logit_bias: entries, and each value (-100 bans a token, 100 all but forces it).
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100.0
# The longest cache_salt taken: a secret of 256 bits is 43 characters of base64.
MAX_CACHE_SALT_CHARS = 256
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")
INT64 = 2**63 - 1
# OpenAI's reasoning_effort values, and those that mean no thinking for a model that can only think or not.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
EFFORTS_WITHOUT_THINKING = ("none", "minimal")
StopString = Annotated[str, StringConstraints(min_length=1)]


class SamplingFields(StrictModel):
    """The sampling fields chat and legacy completions share, and what fills SamplingParams from them."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64)
    seed: int | None = Field(None, ge=-(2**63), le=INT64)
    stop: StopString | list[StopString] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's extension: > 1 makes tokens already in the prompt or reply less likely (as transformers does).
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description=(
        "How many choices to sample from one prompt pass (at most 8, and at most MAX_RUNNING): each takes a running "
        "place. With a seed, choice i draws with a seed derived from it and i (choice 0 with the seed itself); "
        "greedy choices are all the same."))
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
        "vLLM's field: stored KV state and cached replies are reused only by requests with the same salt (and, "
        "with API keys, the same key). Use a random secret of 32 bytes or more, shared by whoever may reuse."))
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = Field(
        None, description="Token ids (as strings) to a value from -100 to 100 added to that token's logit before "
        "sampling and any grammar mask: -100 bans the token, 100 all but forces it. At most 300 entries.")

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_as_keys(cls, value):
        """Allow at most 300 entries, each keyed by a token id written as a decimal integer, as OpenAI does."""
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, not {len(value)}")
        for key in value:
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(
                    f"the key {key!r} is not a token id (a non-negative integer as a string, such as \"1234\")"
                )
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value):
        """Allow up to four stop strings, as OpenAI does."""
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Return the stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """Return logit_bias as (token id, value) pairs by id, leaving out the zeros, which change nothing."""
        return tuple(sorted((int(key), float(value)) for key, value in (self.logit_bias or {}).items() if value))

    @property
    def choice_count(self) -> int:
        """Return how many choices the request asked for (null means 1)."""
        return self.n or 1

    @property
    def requested_max_tokens(self) -> int | None:
        """Return the reply's length the request asked for, or None for the server's default."""
        raise NotImplementedError

    @property
    def max_tokens_param(self) -> str:
        """Return the name of the field that sets the reply's length, for errors about it."""
        raise NotImplementedError


class ChatCompletionRequest(SamplingFields, GrammarFields):
    """A `POST /v1/chat/completions` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64)
    # null means the default for both, as OpenAI accepts.
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # The legacy form of tools and tool_choice, answered in its own shape (legacy_functions.py).
    functions: list[FunctionDefinition] | None = Field(None, min_length=1)
    function_call: Literal["none", "auto"] | FunctionChoice | None = None
    # Declared to be refused, not silently dropped: the model reads and writes text only.
    modalities: list[Literal["text", "audio"]] | None = Field(None, description="Only [\"text\"].")
    audio: dict[str, Any] | None = Field(None, description="Refused: the model writes text only.")
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: ReasoningEffort | None = Field(None, description=(
        "For a model that thinks (Qwen3): none and minimal turn thinking off, low to xhigh leave it on (it has no "
        "budget between). chat_template_kwargs.enable_thinking, when given, decides instead."))

    @property
    def requested_max_tokens(self) -> int | None:
        """Return max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """Return the name of the field that set the reply's length, for errors about it."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def enable_thinking(self) -> bool | None:
        """Return what the template is told of thinking: chat_template_kwargs.enable_thinking, else what
        reasoning_effort means, else None (the template's own default)."""
        if self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking is not None:
            return self.chat_template_kwargs.enable_thinking
        if self.reasoning_effort is not None:
            return self.reasoning_effort not in EFFORTS_WITHOUT_THINKING
        return None

    @property
    def include_usage(self) -> bool:
        """Tell whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """Return the tool_choice in force: as given, else `auto` with tools and `none` without, as OpenAI does."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tools_offered(self) -> list[Tool]:
        """Return the tools the model is shown (none under tool_choice `none`)."""
        return [] if self.effective_tool_choice == "none" else list(self.tools or [])

    @property
    def forced_tools(self) -> list[Tool]:
        """Return the tools one of which the reply must call (empty when the model may answer in text)."""
        choice = self.effective_tool_choice
        if choice == "required":
            return list(self.tools or [])
        if isinstance(choice, NamedToolChoice):
            return [tool for tool in self.tools or [] if tool.function.name == choice.function.name]
        return []

    @property
    def strict_tools_under_auto(self) -> bool:
        """Tell whether the model may answer in text or call a tool, and some tool's arguments must follow its
        schema."""
        return self.effective_tool_choice == "auto" and any(tool.function.strict for tool in self.tools or [])

    @property
    def legacy_functions(self) -> bool:
        """Tell whether the reply's call goes out in the legacy shape, `function_call` (the request sent
        `functions`)."""
        return self.functions is not None

    @property
    def json_schema(self) -> dict | None:
        """Return the schema the reply must follow under response_format, or None for free text."""
        if isinstance(self.response_format, JsonObjectFormat):
            return {"type": "object"}
        if isinstance(self.response_format, JsonSchemaFormat):
            schema = self.response_format.json_schema.schema_
            return schema if schema is not None else {"type": "object"}
        return None


def _reject_constant(name: str):
    """Refuse NaN and Infinity, which JSON does not have."""
    raise InvalidRequest(f"{name} is not valid JSON; numbers must be finite")


def parse_json_body(data: bytes):
    """Decode a request body as strict JSON."""
    try:
        return nesting.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8") from None
    except nesting.TooDeep as exc:
        raise InvalidRequest(f"the request body is {exc}") from None
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


FIELD_NAME = re.compile(r"[a-z_]+")


def _param_name(location: tuple) -> str:
    """Turn a pydantic error location into OpenAI's param notation, e.g. messages[0].content."""
    name = ""
    for part in location:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "list[TextPart]") or not FIELD_NAME.fullmatch(part):
            continue  # which alternative of a union failed (a type or model name) says nothing to the client
        else:
            name += f".{part}" if name else str(part)
    return name


def check_messages(messages: list[ChatMessage]) -> None:
    """Check what one field's type cannot: which role carries which tool field, and the arguments' JSON."""
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.tool_calls is not None and message.role != "assistant":
            raise InvalidRequest(f"'{where}.tool_calls' is only allowed on assistant messages",
                                 param=f"{where}.tool_calls")
        if message.role == "tool" and message.tool_call_id is None:
            raise InvalidRequest(f"'{where}.tool_call_id' is a required property of tool messages",
                                 param=f"{where}.tool_call_id")
        if message.function_call is not None and message.role != "assistant":
            raise InvalidRequest(f"'{where}.function_call' is only allowed on assistant messages",
                                 param=f"{where}.function_call")
        if message.role == "function" and message.name is None:
            raise InvalidRequest(f"'{where}.name' is a required property of function messages", param=f"{where}.name")
        calls_a_function = message.role == "assistant" and (message.tool_calls or message.function_call)
        if message.content is None and not calls_a_function:
            raise InvalidRequest(f"'{where}.content' is a required property", param=f"{where}.content")
        called = [(f"{where}.tool_calls[{index}].function", call.function)
                  for index, call in enumerate(message.tool_calls or [])]
        if message.function_call is not None:
            called.append((f"{where}.function_call", message.function_call))
        for place, function in called:
            check_call_arguments(function.arguments, f"{place}.arguments")


def check_call_arguments(arguments: str, param: str) -> None:
    """Refuse a function call's arguments unless they are a JSON object (nested no deeper than nesting allows)."""
    try:
        value = nesting.loads(arguments)
    except nesting.TooDeep as exc:
        raise InvalidRequest(f"invalid '{param}': {exc}", param=param) from None
    except ValueError:
        raise InvalidRequest(f"invalid '{param}': not valid JSON", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"invalid '{param}': must be a JSON object", param=param)


def _check_function_fields(request: ChatCompletionRequest) -> None:
    """Check the legacy functions and function_call as tools and tool_choice are checked, and never beside them."""
    if request.functions is not None and (request.tools is not None or request.tool_choice is not None):
        raise InvalidRequest("'functions' cannot be combined with 'tools' or 'tool_choice'; send one form",
                             param="functions")
    if request.function_call is not None and request.functions is None:
        raise InvalidRequest("'function_call' is only allowed when 'functions' are given", param="function_call")
    names = [function.name for function in request.functions or []]
    if len(set(names)) != len(names):
        raise InvalidRequest("invalid 'functions': names must be unique", param="functions")
    if isinstance(request.function_call, FunctionChoice) and request.function_call.name not in names:
        raise InvalidRequest(f"invalid 'function_call': no function named '{request.function_call.name}' is in "
                             "'functions'", param="function_call")


def _check_tool_fields(request: ChatCompletionRequest) -> None:
    """Check tool_choice and logprobs against the fields they depend on."""
    choice = request.tool_choice
    if choice not in (None, "none") and not request.tools:
        raise InvalidRequest("'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and not request.forced_tools:
        raise InvalidRequest(f"invalid 'tool_choice': no tool named '{choice.function.name}' is in 'tools'",
                             param="tool_choice")
    names = [tool.function.name for tool in request.tools or []]
    if len(set(names)) != len(names):
        raise InvalidRequest("invalid 'tools': function names must be unique", param="tools")
    if request.forced_tools and request.json_schema is not None:
        raise InvalidRequest("'response_format' cannot be combined with a tool_choice that forces a tool call",
                             param="response_format")
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("'top_logprobs' is only allowed when 'logprobs' is true", param="top_logprobs")


def parse_body(model: type[BaseModel], body):
    """Validate a decoded JSON body as `model`, raising InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request_from(exc) from None


def invalid_request_from(exc: ValidationError) -> InvalidRequest:
    """Turn pydantic's errors into one InvalidRequest naming the field at fault."""
    # Of a union's alternatives, the one that got furthest names the real problem; at equal depth, one
    # whose tag (its literal `type`) matched says more than those whose tag did not.
    errors = exc.errors(include_url=False)
    mismatched = {error["loc"][:-1] for error in errors
                  if error["type"] == "literal_error" and error["loc"][-1] == "type"}
    first = max(errors,
                key=lambda error: (len(error["loc"]), error["loc"][:-1] not in mismatched, -errors.index(error)))
    param = _param_name(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = f"'{param}' is a required property"
    elif param == "n" and first["type"] in ("less_than_equal", "greater_than_equal"):
        message = f"invalid 'n': from 1 to {MAX_CHOICES} choices are allowed"
    elif first["type"] == "literal_error":
        # Each alternative of a union names only its own values; the client needs all of them.
        expected = [error["ctx"]["expected"] for error in errors
                    if error["type"] == "literal_error" and _param_name(error["loc"]) == param]
        message = f"invalid '{param}': expected {' or '.join(expected)}"
    else:
        message = f"invalid '{param}': {message}"
    return InvalidRequest(message, param=param or None)


def _check_text_only(request: ChatCompletionRequest) -> None:
    """Refuse audio output, which the model cannot write."""
    if request.audio is not None:
        raise InvalidRequest("'audio' is not supported: the model writes text only", param="audio")
    if request.modalities is not None and "audio" in request.modalities:
        raise InvalidRequest("'modalities' may only be [\"text\"]: the model writes text only", param="modalities")


def parse_chat_request(body) -> ChatCompletionRequest:
    """Validate a decoded JSON body, raising InvalidRequest naming the first bad field."""
    request = parse_body(ChatCompletionRequest, body)
    _check_text_only(request)
    check_messages(request.messages)
    _check_function_fields(request)
    _check_tool_fields(request)
    return request
