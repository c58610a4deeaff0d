"""The request body of chat completions: parsed strictly, every problem named by its field."""

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from .errors import InvalidRequest

MAX_STOP_STRINGS = 4
INT64 = 2**63 - 1


class _Strict(BaseModel):
    """Strict types (no "1" for 1, no NaN), unknown fields ignored as OpenAI's clients expect."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)


class TextPart(_Strict):
    """One text part of a message given as a list of parts."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message of the conversation."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        """Return the content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """Return the message as the chat template expects it."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text}


class StreamOptions(_Strict):
    """Options of a streamed reply."""

    include_usage: bool = False


StopString = Annotated[str, StringConstraints(min_length=1)]


class ChatCompletionRequest(_Strict):
    """A `POST /v1/chat/completions` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64)
    seed: int | None = Field(None, ge=-(2**63), le=INT64)
    stop: StopString | list[StopString] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # null means the default for both, as OpenAI accepts.
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=1)

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
    def requested_max_tokens(self) -> int | None:
        """Return max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Tell whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


def _reject_constant(name: str):
    """Refuse NaN and Infinity, which JSON does not have."""
    raise InvalidRequest(f"{name} is not valid JSON; numbers must be finite")


def parse_json_body(data: bytes):
    """Decode a request body as strict JSON."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _param_name(location: tuple) -> str:
    """Turn a pydantic error location into OpenAI's param notation, e.g. messages[0].content."""
    name = ""
    for part in location:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[constrained-str]", "constrained-str"):
            continue  # which alternative of a union failed says nothing to the client
        else:
            name += f".{part}" if name else str(part)
    return name


def parse_chat_request(body) -> ChatCompletionRequest:
    """Validate a decoded JSON body, raising InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        # Of a union's alternatives, the one that got furthest names the real problem.
        errors = exc.errors(include_url=False)
        first = max(errors, key=lambda error: (len(error["loc"]), -errors.index(error)))
        param = _param_name(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"'{param}' is a required property"
        elif param == "n":
            message = "only n=1 is supported"
        else:
            message = f"invalid '{param}': {message}"
        raise InvalidRequest(message, param=param or None) from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None
