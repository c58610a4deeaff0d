"""The request bodies of `POST /tokenize` and `POST /detokenize`: llama.cpp's and vLLM's fields, parsed strictly
(no "1" for 1, no `true` for 1), so every id is a non-negative integer before the tokenizer sees it."""

from typing import Annotated

from pydantic import Field

from .chat_parts import ChatMessage, ChatTemplateKwargs, StrictModel

TokenId = Annotated[int, Field(ge=0)]


class TokenizeRequest(StrictModel):
    """A `POST /tokenize` body: exactly one of llama.cpp's `content`, vLLM's `prompt` or vLLM's `messages`."""

    model: str | None = None
    content: str | None = Field(None, description="Text to tokenize (llama.cpp's name).")
    prompt: str | None = Field(None, description="Text to tokenize (vLLM's name).")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A conversation, rendered through the model's chat template as a chat "
        "request's would be.")
    add_generation_prompt: bool = Field(
        True, description="With `messages`: end with the assistant's turn opening, as a chat request's prompt does.")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(
        None, description="With `messages`: the chat request's field of the same name (`enable_thinking`).")
    add_special_tokens: bool | None = Field(
        None, description="With text: add the tokenizer's own BOS/EOS tokens, for models that have them (vLLM's "
        "name; default true).")
    add_special: bool | None = Field(None, description="llama.cpp's name for `add_special_tokens` (default false).")


class DetokenizeRequest(StrictModel):
    """A `POST /detokenize` body: token ids of this model, at most one sequence's worth."""

    model: str | None = None
    tokens: list[TokenId] = Field(min_length=1)
