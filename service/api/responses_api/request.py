"""The request body of `POST /v1/responses`: parsed strictly, every problem named by its field.

Fields OpenAI defines that corechat cannot honour are declared so that each is refused by name (REFUSED),
never dropped; a field OpenAI does not define is refused too, as OpenAI refuses it, so a chat field sent
here by mistake (`seed`, `stop`) is never silently ignored.
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from ...errors import InvalidRequest
from ..chat_parts import FunctionName, JsonObjectFormat, StrictModel, TextFormat
from ..chat_request import INT64, ReasoningEffort, check_call_arguments, parse_body

# OpenAI's bounds of `metadata`: pairs, and the length of each key and value.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# The verbosity a reply has when none is asked for: the only one honoured.
DEFAULT_VERBOSITY = "medium"
# Service tiers that ask for nothing but the one way corechat serves.
PLAIN_SERVICE_TIERS = ("auto", "default")
# The tag of every union member that stands for a type corechat does not take (a tag that is no field name,
# so it never shows in an error's `param`).
UNSUPPORTED = "Unsupported"


def _type_of(value, default: str | None = None) -> str | None:
    """Return the `type` of an item given as JSON or as a model."""
    return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)


def tagged(tags: dict[str, str], default: str | None = None) -> Discriminator:
    """Pick a union's member by its `type` (`default` when absent): `tags` maps each type taken to its member's tag,
    and any other type goes to the member that refuses it by name."""
    return Discriminator(lambda value: tags.get(_type_of(value, default), UNSUPPORTED))


class Unsupported(StrictModel):
    """A part, item, tool or tool_choice of a type corechat does not take: parsed only to be refused by its type."""

    type: str


class InputText(StrictModel):
    """A text part of an input message."""

    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """A text part of an earlier reply given back (its annotations and logprobs are not read)."""

    type: Literal["output_text"]
    text: str


ContentPart = Annotated[
    Annotated[InputText, Tag("InputText")] | Annotated[OutputText, Tag("OutputText")]
    | Annotated[Unsupported, Tag(UNSUPPORTED)],
    tagged({"input_text": "InputText", "output_text": "OutputText"}),
]


def parts_text(content: str | list[ContentPart]) -> str:
    """Return a message's or a tool output's content as one string."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(StrictModel):
    """A message of the conversation (`type` may be left out, as OpenAI's easy input message does)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(StrictModel):
    """A function call of an earlier reply, given back."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: FunctionName
    arguments: str


class FunctionCallOutputItem(StrictModel):
    """The result of a function call, answering the call of the same `call_id`."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


class ReasoningText(StrictModel):
    """A thinking model's thinking, as its reply wrote it (between Qwen3's <think> markers)."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    """The thinking of an earlier reply, given back: it belongs to the assistant turn that follows it."""

    type: Literal["reasoning"]
    id: str | None = None
    content: list[ReasoningText] | None = None
    # Declared to be refused unless empty or null (check_items): corechat writes neither, so neither is the model's
    # own writing.
    summary: list[Any] = Field(default_factory=list)
    encrypted_content: str | None = None

    @property
    def text(self) -> str:
        """Return the thinking as one string."""
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")] | Annotated[ReasoningItem, Tag("Reasoning")]
    | Annotated[Unsupported, Tag(UNSUPPORTED)],
    tagged({"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
            "reasoning": "Reasoning"}, default="message"),
]


class FunctionTool(StrictModel):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description=(
        "true: the arguments follow `parameters`, enforced by grammar. Omitted or null: they are not enforced "
        "(OpenAI's Responses API defaults this to true)."))


ToolItem = Annotated[
    Annotated[FunctionTool, Tag("Function")] | Annotated[Unsupported, Tag(UNSUPPORTED)],
    tagged({"function": "Function"}),
]


class FunctionToolChoice(StrictModel):
    """A tool_choice that forces one function."""

    type: Literal["function"]
    name: FunctionName


ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = Annotated[
    Annotated[ToolChoiceMode, Tag("Mode")] | Annotated[FunctionToolChoice, Tag("Function")]
    | Annotated[Unsupported, Tag(UNSUPPORTED)],
    Discriminator(lambda value: "Mode" if isinstance(value, str) else
                  "Function" if _type_of(value) == "function" else UNSUPPORTED),
]


class ResponsesJsonSchemaFormat(StrictModel):
    """JSON following a schema, in the Responses API's flat shape."""

    # Echoed in the response as sent: `schema`, not the attribute's name.
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["json_schema"]
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    """How the reply's text is shaped."""

    format: Annotated[TextFormat | JsonObjectFormat | ResponsesJsonSchemaFormat,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Only `medium`, the default.")


class ReasoningConfig(StrictModel):
    """How a thinking model (Qwen3) thinks: `effort` switches its thinking on or off, as chat's reasoning_effort."""

    # Every key is kept, so that one corechat does not take is refused by name (_check_reasoning), never dropped.
    model_config = ConfigDict(extra="allow")

    effort: ReasoningEffort | None = Field(None, description=(
        "none and minimal turn thinking off, low to xhigh leave it on (Qwen3 has no budget between); a model "
        "that does not think ignores it."))
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Refused unless null.")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Refused unless null.")


class ResponsesStreamOptions(StrictModel):
    """Options of a streamed response; corechat adds no obfuscation to its events, whatever this asks."""

    include_obfuscation: bool | None = None


class ResponsesRequest(StrictModel):
    """A `POST /v1/responses` body."""

    model: str | None = None
    input: str | list[InputItem] | None = Field(None, description=(
        "Text (one user message) or items: messages, and function calls with their outputs. Required unless "
        "previous_response_id is given."))
    instructions: str | None = Field(None, description=(
        "A system message put first; not carried over to a response that continues this one."))
    max_output_tokens: int | None = Field(None, ge=1, le=INT64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = Field(None, description=(
        "Keep the response for GET /v1/responses/{id} and previous_response_id (in Redis, RESPONSES_STORE_TTL_SECONDS)."
        " Omitted: true when REDIS_URL is set, false without it; true without REDIS_URL is a 400."))
    previous_response_id: str | None = Field(None, min_length=1, description=(
        "Continue a stored response of the same API key: its whole conversation comes before `input`."))
    tools: list[ToolItem] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]] | None = Field(
        None, description="Up to 16 pairs, echoed in the response.")
    user: str | None = Field(None, description="Accepted and echoed.")
    safety_identifier: str | None = Field(None, description="Accepted and echoed.")
    prompt_cache_key: str | None = Field(None, description=(
        "Accepted and echoed: prompt reuse is automatic (PREFIX_CACHE_MB)."))
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description="Accepted and ignored.")
    service_tier: str | None = Field(None, description="Only `auto` or `default`.")
    truncation: Literal["auto", "disabled"] | None = Field(None, description=(
        "Only `disabled`: an input too long for the context is a 400 `context_length_exceeded`."))
    reasoning: ReasoningConfig | None = Field(None, description=(
        "Only `effort`: a thinking model's (Qwen3's) switch, as chat's reasoning_effort; its thinking comes back "
        "as a `reasoning` output item."))
    # Declared to be refused by name (REFUSED).
    background: bool | None = Field(None, description="Only false.")
    include: list[str] | None = Field(None, description="Only empty.")
    top_logprobs: int | None = Field(None, description="Refused.")
    max_tool_calls: int | None = Field(None, description="Refused.")
    conversation: Any = Field(None, description="Refused: continue with previous_response_id.")
    prompt: Any = Field(None, description="Refused.")
    context_management: Any = Field(None, description="Refused.")
    moderation: Any = Field(None, description="Refused.")
    image: Any = Field(None, description="Refused.")
    access_programs: Any = Field(None, description="Refused.")
    background_options: Any = Field(None, description="Refused.")
    prompt_cache_options: Any = Field(None, description="Refused.")

    @property
    def input_items(self) -> list:
        """Return the input as items (text is one user message)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def function_tools(self) -> list[FunctionTool]:
        """Return the function tools (every tool, once the request is checked)."""
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]


# Each field OpenAI defines that corechat cannot honour: why, and the values that ask for nothing.
REFUSED: dict[str, tuple[str, tuple]] = {
    "background": ("responses run while the request waits; stream to see one as it is written", (None, False)),
    "include": ("no output beyond the reply's items is produced", (None, [])),
    "top_logprobs": ("log probabilities are served by /v1/chat/completions", (None,)),
    "max_tool_calls": ("the number of calls is not capped", (None,)),
    "conversation": ("conversations are not kept; continue one with previous_response_id", (None,)),
    "prompt": ("prompt templates are not kept", (None,)),
    "context_management": ("the context is not compacted", (None,)),
    "moderation": ("nothing is moderated", (None,)),
    "image": ("the model reads and writes text only", (None,)),
    "access_programs": ("there are no access programs", (None,)),
    "background_options": ("responses run while the request waits", (None,)),
    "prompt_cache_options": ("prompt reuse is automatic (PREFIX_CACHE_MB)", (None,)),
    "truncation": ("an input too long for the context is refused, never cut", (None, "disabled")),
    "service_tier": ("every request is served alike", (None, *PLAIN_SERVICE_TIERS)),
}


def not_supported(param: str, why: str) -> InvalidRequest:
    """Build the 400 of a field or type corechat does not support."""
    return InvalidRequest(f"'{param}' is not supported by this server: {why}", param=param,
                          code="unsupported_parameter")


def _check_refused(request: ResponsesRequest) -> None:
    """Refuse every field that asks for what corechat cannot do."""
    for name, (why, plain) in REFUSED.items():
        if getattr(request, name) not in plain:
            raise not_supported(name, why)
    if request.text is not None and request.text.verbosity not in (None, DEFAULT_VERBOSITY):
        raise not_supported("text.verbosity", f"only '{DEFAULT_VERBOSITY}', the default, is served")
    if request.reasoning is not None:
        _check_reasoning(request.reasoning)
    metadata = request.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(len(key) > MAX_METADATA_KEY_CHARS for key in metadata):
        raise InvalidRequest(f"invalid 'metadata': at most {MAX_METADATA_PAIRS} pairs, each key at most "
                             f"{MAX_METADATA_KEY_CHARS} characters", param="metadata")


def _check_reasoning(reasoning: ReasoningConfig) -> None:
    """Refuse every key of `reasoning` but its effort."""
    for name in ("summary", "generate_summary"):
        if getattr(reasoning, name) is not None:
            raise not_supported(f"reasoning.{name}", "the model writes no summary of its thinking; its whole "
                                "thinking is the reasoning item's content")
    for name in reasoning.model_extra or {}:
        raise not_supported(f"reasoning.{name}", "only 'reasoning.effort' is taken")


def check_items(items: list, where: str = "input") -> None:
    """Refuse item and part types the model cannot read, and function calls whose arguments are no JSON object."""
    for index, item in enumerate(items):
        place = f"{where}[{index}]"
        if isinstance(item, Unsupported):
            raise not_supported(f"{place}.type", f"items of type '{item.type}' are not taken; only 'message', "
                                "'function_call', 'function_call_output' and 'reasoning'")
        if isinstance(item, ReasoningItem):
            _check_reasoning_item(item, place)
            continue
        content = item.output if isinstance(item, FunctionCallOutputItem) else getattr(item, "content", "")
        field = "output" if isinstance(item, FunctionCallOutputItem) else "content"
        for number, part in enumerate([] if isinstance(content, str) else content):
            if isinstance(part, Unsupported):
                raise not_supported(f"{place}.{field}[{number}].type",
                                    f"parts of type '{part.type}' are not taken: the model reads text only")
        if isinstance(item, FunctionCallItem):
            check_call_arguments(item.arguments, f"{place}.arguments")


def _check_reasoning_item(item: ReasoningItem, place: str) -> None:
    """Refuse what a reasoning item holds beyond the thinking the model wrote."""
    if item.summary:
        raise not_supported(f"{place}.summary", "a summary is not the model's own writing; only the reasoning "
                            "item's content goes back to it")
    if item.encrypted_content is not None:
        raise not_supported(f"{place}.encrypted_content", "no encrypted reasoning is made or read here")


def _check_tools(request: ResponsesRequest) -> None:
    """Refuse built-in tools, and a tool_choice the tools cannot meet."""
    for index, tool in enumerate(request.tools or []):
        if isinstance(tool, Unsupported):
            raise not_supported(f"tools[{index}].type", f"built-in tools ('{tool.type}') are not served; only "
                                "'function' tools, which the client runs")
    choice = request.tool_choice
    if isinstance(choice, Unsupported):
        raise not_supported("tool_choice.type", f"a tool_choice of type '{choice.type}' is not taken; only 'none', "
                            "'auto', 'required' or {\"type\": \"function\", \"name\": ...}")
    names = [tool.name for tool in request.function_tools]
    if isinstance(choice, FunctionToolChoice) and choice.name not in names:
        raise InvalidRequest(f"invalid 'tool_choice': no tool named '{choice.name}' is in 'tools'", param="tool_choice")
    forcing = choice == "required" or isinstance(choice, FunctionToolChoice)
    structured = request.text is not None and isinstance(request.text.format,
                                                         JsonObjectFormat | ResponsesJsonSchemaFormat)
    if forcing and structured:
        raise InvalidRequest("'text.format' cannot be combined with a tool_choice that forces a tool call",
                             param="text.format")


def parse_responses_request(body) -> ResponsesRequest:
    """Validate a decoded JSON body, raising InvalidRequest naming the first bad or unsupported field."""
    if isinstance(body, dict):
        for name in body:
            if name not in ResponsesRequest.model_fields:
                raise InvalidRequest(f"unknown parameter '{name}': the Responses API has no such field",
                                     param=name, code="unknown_parameter")
    request = parse_body(ResponsesRequest, body)
    _check_refused(request)
    if request.input is None and request.previous_response_id is None:
        raise InvalidRequest("'input' is a required property (unless previous_response_id is given)", param="input")
    if isinstance(request.input, list) and not request.input and request.previous_response_id is None:
        raise InvalidRequest("'input' must hold at least one item", param="input")
    check_items(request.input_items)
    _check_tools(request)
    return request


def check_retrieve_query(query) -> None:
    """Refuse the query parameters of OpenAI's retrieve that ask for more than the stored object (a replayed stream,
    extra output)."""
    if query:
        raise not_supported(next(iter(query)), "a stored response is returned whole, as it was kept")
