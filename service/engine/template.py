"""A conversation to prompt token ids, through the model's own chat template and tokenizer."""

from jinja2 import Environment, TemplateError, TemplateSyntaxError, meta

from .grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class TemplateRefused(ValueError):
    """The model's chat template refused a conversation (a role order it does not support, say)."""


class ChatTemplate:
    """Render and tokenize conversations as the model was trained to read them.

    Control tokens typed inside a message (`<|im_start|>`) cost a few ordinary tokens, so a message
    cannot open a turn of its own; `trust_control_tokens` (TRUST_CONTROL_TOKENS_IN_MESSAGES) parses
    them as the template would.
    """

    def __init__(self, tokenizer, *, trust_control_tokens: bool):
        self.tokenizer = tokenizer
        self.trust_control_tokens = trust_control_tokens

    @property
    def supports_tools(self) -> bool:
        """Tell whether the chat template renders a `tools` list (a template that never reads it would drop them)."""
        template = self.tokenizer.chat_template
        if not isinstance(template, str):
            return False
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))

    @property
    def vocab_size(self) -> int:
        """Return how many token ids the tokenizer knows (its vocabulary and added tokens); valid ids are below it."""
        return len(self.tokenizer)

    @property
    def tool_call_marker_ids(self) -> tuple[int, int] | None:
        """Return the ids of the tokens that open and close a tool call (Qwen2.5's `<tool_call>` and
        `</tool_call>`), or None when the tokenizer has no single token for each."""
        ids = []
        for marker in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
            encoded = self.tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                return None
            ids.append(encoded[0])
        return ids[0], ids[1]

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True) -> str:
        """Render a conversation through the model's chat template, ready for the reply (or, without the
        generation prompt, as it stands).

        Raise TemplateRefused when the template rejects the conversation: many templates call
        raise_exception() on a role order they do not support (two system messages, a conversation
        starting with the assistant). A template that does not compile is the model's fault, not
        the request's, and raises as it is.
        """
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise TemplateRefused(str(exc)) from None

    def encode(self, prompt: str, *, add_special_tokens: bool = False) -> list[int]:
        """Turn a rendered prompt into token ids (special tokens as the template wrote them; with
        `add_special_tokens`, the tokenizer's own BOS or EOS added, for the models that have them)."""
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        """Turn token ids back into the text they stand for, special tokens included, spaces as they are."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True) -> list[int]:
        """Render a conversation (for the reply, unless told otherwise) and tokenize it, message text as ordinary text."""
        if self.trust_control_tokens:
            return self.encode(self.render(messages, tools, add_generation_prompt=add_generation_prompt))
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
                sanitize_control_tokens=True,
            )
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise TemplateRefused(str(exc)) from None
        return list(encoded["input_ids"])
