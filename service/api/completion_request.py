"""The request body of legacy text completions (`POST /v1/completions`): parsed strictly, every problem named by its
field, the sampling fields shared with chat."""

from typing import Annotated

from pydantic import Field

from ..errors import InvalidRequest
from .chat_parts import GrammarFields, StreamOptions
from .chat_request import INT64, MAX_CHOICES, SamplingFields, parse_body

# OpenAI's bound of the legacy `logprobs`: the most likely alternatives reported at each position.
MAX_LEGACY_LOGPROBS = 5
# OpenAI's default length of a legacy completion.
DEFAULT_COMPLETION_TOKENS = 16

TokenId = Annotated[int, Field(ge=0, le=INT64)]


class CompletionRequest(SamplingFields, GrammarFields):
    """A `POST /v1/completions` body: one prompt, as text or as token ids, continued as it is (no chat template)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="The text to continue, or its token ids. One prompt per request: a list of several is a 400.")
    model: str | None = None
    max_tokens: int | None = Field(DEFAULT_COMPLETION_TOKENS, ge=0, le=INT64, description=(
        "The most tokens to generate (16 when omitted or null, as OpenAI); 0 with `echo` returns the prompt alone."))
    echo: bool | None = Field(False, description="Begin the text (and the logprobs) with the prompt.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS, description=(
        "Report each token's log probability and this many most likely alternatives; with `echo`, the prompt's "
        "tokens too (the first has none: null)."))
    suffix: str | None = Field(None, description="Refused: the model's template has no fill-in-the-middle.")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description=(
        "Only equal to `n` (the default): every choice sampled is returned, none held back as worse."))
    user: str | None = Field(None, description="Accepted and ignored.")

    @property
    def requested_max_tokens(self) -> int:
        """Return max_tokens, 16 when omitted or null."""
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """Return the name of the field that sets the reply's length."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        """Tell whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def one_prompt(self) -> str | list[int]:
        """Return the prompt as text or token ids (a list holding one prompt unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt


def parse_completion_request(body) -> CompletionRequest:
    """Validate a decoded JSON body, raising InvalidRequest naming the first bad field."""
    request = parse_body(CompletionRequest, body)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
        raise InvalidRequest(f"'prompt' is a list of {len(prompt)} prompts; this server takes one prompt per request "
                             "(send each as its own request)", param="prompt")
    if not request.one_prompt:
        raise InvalidRequest("'prompt' is empty; give text or token ids to continue", param="prompt")
    if request.best_of is not None and request.best_of != request.choice_count:
        raise InvalidRequest(f"'best_of' is {request.best_of} and 'n' is {request.choice_count}: this server "
                             "returns every choice it samples, so best_of may only equal n", param="best_of")
    if request.suffix:
        raise InvalidRequest("'suffix' is not supported: the model's template has no fill-in-the-middle",
                             param="suffix")
    return request
