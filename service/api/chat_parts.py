"""The parts of a chat request that are objects of their own: messages (text parts, tool calls), tool and
function definitions and choices, response formats, grammar fields and stream options, on one strict base model."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from . import nesting

# OpenAI's rule for function and schema names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class StrictModel(BaseModel):
    """Strict types (no "1" for 1, no NaN), unknown fields ignored as OpenAI's clients expect."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)


class ChatTemplateKwargs(StrictModel):
    """Variables for the model's chat template (vLLM's and llama.cpp's `chat_template_kwargs`)."""

    # Only variables corechat passes on are taken: another would reach no template, so it is refused by name.
    model_config = ConfigDict(extra="forbid")

    enable_thinking: bool | None = Field(None, description=(
        "Qwen3's switch: false renders an empty `<think></think>` block so the model answers at once; true or "
        "absent lets it think first. A template without the variable ignores it."))


class TextPart(StrictModel):
    """One text part of a message given as a list of parts."""

    type: Literal["text"]
    text: str


class CalledFunction(StrictModel):
    """The function an assistant message called, with its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCall(StrictModel):
    """One tool call of an earlier assistant message."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(StrictModel):
    """One message of the conversation."""

    # `function` is the legacy role of a function's result, answering an assistant's `function_call`.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # null only on an assistant message that carries tool_calls (or the legacy function_call).
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: CalledFunction | None = None
    # An assistant message's thinking given back (as llama.cpp and vLLM take it): the template decides whether the
    # model reads it again (Qwen3's keeps only the thinking of the turns after the last user message).
    reasoning_content: str | None = None

    @property
    def text(self) -> str:
        """Return the content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """Return the message as the chat template expects it (tool arguments as objects, as templates print them;
        `name` kept for the templates that render it, as transformers and vLLM pass it)."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": nesting.loads(call.function.arguments)}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None and role == "assistant":
            message["reasoning_content"] = self.reasoning_content
        return message


FunctionName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


class FunctionDefinition(StrictModel):
    """A function the model may call; `parameters` is a JSON schema of its arguments."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def arguments_schema(self) -> dict:
        """Return the schema the arguments follow (any object when none was given)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(StrictModel):
    """A tool the model may call: only functions exist."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(StrictModel):
    """The function a named tool_choice forces."""

    name: FunctionName


class NamedToolChoice(StrictModel):
    """A tool_choice that forces one function."""

    type: Literal["function"]
    function: FunctionChoice


class TextFormat(StrictModel):
    """Free text, the default."""

    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    """Any JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    """A named JSON schema the reply must follow."""

    model_config = ConfigDict(populate_by_name=True)

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(StrictModel):
    """JSON following a schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StreamOptions(StrictModel):
    """Options of a streamed reply."""

    include_usage: bool = False


STRUCTURED_OUTPUT_KEYS = ("choice", "regex", "grammar", "json")


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs`: exactly one of a list of choices, a regex, a Lark grammar or a JSON schema."""

    # So the OpenAPI document says what _known_keys_only enforces: no other keys.
    model_config = ConfigDict(extra="forbid")

    choice: list[str] | None = Field(None, min_length=1, description="The reply is exactly one of these strings.")
    regex: str | None = Field(None, description="The whole reply matches this regular expression (Rust's `regex` "
                              "syntax, as llguidance takes it: no look-around, no backreferences).")
    grammar: str | None = Field(None, description="The reply follows this Lark grammar, as llguidance takes it (its "
                                "`start` rule).")
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="The reply is JSON following this "
                                               "schema (an object, or its JSON text).")

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, value):
        """Refuse keys this server does not enforce (vLLM's others among them), naming them, instead of
        ignoring a constraint the client expects to hold."""
        if isinstance(value, dict):
            unknown = sorted(key for key in value if key not in STRUCTURED_OUTPUT_KEYS)
            if unknown:
                raise ValueError(f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                                 f"supported; give exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self):
        """Refuse none or several constraints: a reply follows one grammar."""
        given = self.given
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}"
                             + (f"; this request gives {' and '.join(given)}" if given else ""))
        return self

    @property
    def given(self) -> list[str]:
        """Return the keys given (not null), by their wire names."""
        values = {"choice": self.choice, "regex": self.regex, "grammar": self.grammar, "json": self.json_}
        return [key for key, value in values.items() if value is not None]


class GrammarFields(StrictModel):
    """The fields that constrain a reply by a grammar, on chat and legacy completions alike."""

    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "vLLM's field: exactly one of `choice`, `regex`, `grammar` (Lark) or `json` (a schema), enforced by "
        "constrained decoding."))
    grammar: str | None = Field(None, description="llama.cpp's field: a GBNF grammar (its `root` rule) the reply "
                                "follows, enforced by constrained decoding.")

