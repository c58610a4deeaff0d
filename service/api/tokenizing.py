"""`POST /tokenize` and `POST /detokenize`: text or a conversation to the model's token ids and back.

The bodies are those of both peers a frontend may have been written for: llama.cpp's server
(`content` in, `tokens` out; `tokens` in, `content` out) and vLLM's (`prompt` or `messages` in,
`tokens`, `count` and `max_model_len` out; `tokens` in, `prompt` out). The work is the engine's
tokenizer and chat template; this class checks the request against them and knows nothing of Flask.
"""

from ..engine import TemplateRefused
from ..errors import InvalidRequest
from .chat import ChatCompletions
from .chat_request import check_messages, parse_body
from .limits import check_message_count, check_prompt_text
from .naming import resolve_model_name
from .responses import DetokenizeResponse, TokenizeResponse
from .serving import model_unavailable
from .tokenize_request import DetokenizeRequest, TokenizeRequest


class Tokenization:
    """Tokenize and detokenize with one worker's engine, within the limits chat requests have."""

    def __init__(self, chat: ChatCompletions):
        self.chat = chat
        self.engine = chat.engine
        self.settings = chat.settings

    def tokenize(self, body) -> TokenizeResponse:
        """Return the token ids of a request's text or conversation, or raise a 4xx."""
        request = parse_body(TokenizeRequest, body)
        resolve_model_name(self.settings, request.model)
        given = [name for name in ("content", "prompt", "messages") if getattr(request, name) is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of 'content', 'prompt' or 'messages'"
                                 + (f"; this request gives {' and '.join(given)}" if given else ""),
                                 param=given[1] if len(given) > 1 else None)
        template = self.engine.template
        if template is None:
            raise model_unavailable()
        if request.messages is not None:
            tokens = self._tokenize_messages(request)
        else:
            name = given[0]
            text = getattr(request, name)
            check_prompt_text(text, param=name)
            add_special = request.add_special_tokens if request.add_special_tokens is not None else request.add_special
            if add_special is None:
                add_special = name == "prompt"
            tokens = template.encode(text, add_special_tokens=add_special)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.chat.token_limit()[0])

    def _tokenize_messages(self, request: TokenizeRequest) -> list[int]:
        """Render and tokenize a conversation as a chat request's prompt is (control tokens as text, unless trusted)."""
        check_message_count(len(request.messages), self.settings)
        check_messages(request.messages)
        messages = [message.for_template() for message in request.messages]
        check_prompt_text("".join(message["content"] + message.get("name", "") for message in messages))
        try:
            kwargs = request.chat_template_kwargs
            return self.engine.template.encode_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                                    enable_thinking=kwargs.enable_thinking if kwargs else None)
        except TemplateRefused as exc:
            raise InvalidRequest(f"the model's chat template refused these messages: {exc}", param="messages") from None

    def detokenize(self, body) -> DetokenizeResponse:
        """Return the text of a request's token ids, or raise a 4xx naming the first id that is not one."""
        request = parse_body(DetokenizeRequest, body)
        resolve_model_name(self.settings, request.model)
        template = self.engine.template
        if template is None:
            raise model_unavailable()
        limit, limit_name = self.chat.token_limit()
        if len(request.tokens) > limit:
            raise InvalidRequest(f"'tokens' has {len(request.tokens)} ids, more than {limit_name} holds",
                                 param="tokens")
        vocab_size = template.vocab_size
        for index, token_id in enumerate(request.tokens):
            if token_id >= vocab_size:
                raise InvalidRequest(f"invalid 'tokens[{index}]': {token_id} is not a token id of this model (its ids "
                                     f"run from 0 to {vocab_size - 1})", param=f"tokens[{index}]")
        text = template.decode(request.tokens)
        return DetokenizeResponse(prompt=text, content=text)
