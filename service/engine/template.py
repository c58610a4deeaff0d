"""A conversation to prompt token ids, through the model's own chat template and tokenizer."""

from dataclasses import dataclass

from jinja2 import Environment, TemplateError, TemplateSyntaxError, meta

from .grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# How Qwen3 (and DeepSeek-R1, QwQ) mark a reply's thinking.
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class TemplateRefused(ValueError):
    """The model's chat template refused a conversation (a role order it does not support, say)."""


@dataclass(frozen=True)
class ReasoningMarkers:
    """How a model's reply marks its thinking, and whether the prompt already opened it (a template that
    ends its generation prompt with the opening marker, so the reply starts inside the thinking)."""

    open: str
    close: str
    opened_by_prompt: bool = False


def template_kwargs(enable_thinking: bool | None) -> dict:
    """Return the variables a template is given beside the messages (none it was not asked for, so that a
    template's own default holds)."""
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


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

    def reasoning_markers(self, prompt_ids: list[int]) -> ReasoningMarkers | None:
        """Return how a reply to this prompt marks its thinking, or None for a template that never thinks (one
        without `<think>`, as Qwen2's): the reply is then content alone."""
        template = self.tokenizer.chat_template
        if not isinstance(template, str) or THINK_OPEN not in template or THINK_CLOSE not in template:
            return None
        # The marker is one token in the models that use it; a few more cover the newline after it.
        ending = self.decode(prompt_ids[-4:]).rstrip()
        return ReasoningMarkers(THINK_OPEN, THINK_CLOSE, opened_by_prompt=ending.endswith(THINK_OPEN))

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

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None) -> str:
        """Render a conversation through the model's chat template, ready for the reply (or, without the
        generation prompt, as it stands).

        Raise TemplateRefused when the template rejects the conversation: many templates call
        raise_exception() on a role order they do not support (two system messages, a conversation
        starting with the assistant). A template that does not compile is the model's fault, not
        the request's, and raises as it is. `enable_thinking` goes to the template when set (Qwen3's
        reads it; a template that does not ignores it).
        """
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs(enable_thinking))
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
                    add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> list[int]:
        """Render a conversation (for the reply, unless told otherwise) and tokenize it, message text as ordinary text."""
        if self.trust_control_tokens:
            return self.encode(self.render(messages, tools, add_generation_prompt=add_generation_prompt,
                                           enable_thinking=enable_thinking))
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
                sanitize_control_tokens=True, **template_kwargs(enable_thinking),
            )
        except TemplateSyntaxError:
            raise
        except TemplateError as exc:
            raise TemplateRefused(str(exc)) from None
        return list(encoded["input_ids"])
