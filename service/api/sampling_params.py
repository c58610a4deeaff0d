"""From a request's sampling fields to the engine's SamplingParams, for chat and legacy completions alike: the
model's defaults for what a request leaves out, and its lengths checked against the context.

A prompt past the context is refused with OpenAI's `context_length_exceeded` code and message, which agents
read to compact their conversation and retry.
"""

from ..engine import SamplingParams
from ..errors import ContextLengthExceeded, InvalidRequest
from ..settings import Settings
from .chat_request import SamplingFields
from .serving import ChatEngine


class SamplingResolver:
    """Resolve and check sampling parameters against one worker's engine and settings."""

    def __init__(self, engine: ChatEngine, settings: Settings):
        self.engine = engine
        self.settings = settings

    def sampling_params(self, request: SamplingFields, prompt_tokens: int, grammar: str | None, *, logprobs: bool,
                        top_logprobs: int, prompt_logprobs: int | None = None,
                        prompt_param: str = "messages") -> SamplingParams:
        """Fill omitted parameters from the model's generation config and check the lengths (chat's and legacy
        completions' alike; `prompt_param` names the field a prompt too long for the context blames)."""
        limit, _ = self.token_limit()
        room = limit - prompt_tokens
        asked = request.requested_max_tokens
        param = request.max_tokens_param
        if room < 1:
            raise self.context_exceeded(prompt_tokens, asked, prompt_param=prompt_param, param=prompt_param)
        if asked is not None and asked > self.settings.max_tokens_limit:
            raise InvalidRequest(
                f"{param} is {asked}, above this server's limit of {self.settings.max_tokens_limit}",
                param=param,
            )
        if asked is not None and asked > room:
            raise self.context_exceeded(prompt_tokens, asked, prompt_param=prompt_param, param=param)
        temperature = self._or_model_default(request.temperature, "temperature", 1.0)
        top_p = self._or_model_default(request.top_p, "top_p", 1.0)
        top_k = self._or_model_default(request.top_k, "top_k", 0)
        return SamplingParams(
            max_tokens=asked if asked is not None else min(self.settings.default_max_tokens, room),
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            seed=request.seed,
            stop=request.stop_strings,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=self._repetition_penalty(request),
            grammar=grammar,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            logit_bias=self._logit_bias(request),
            prompt_logprobs=prompt_logprobs,
        )

    def context_exceeded(self, prompt_tokens: int, completion_tokens: int | None, *, prompt_param: str,
                         param: str) -> ContextLengthExceeded:
        """Build OpenAI's error for a prompt (`prompt_param`, "messages" or "prompt") and completion past the
        context, in OpenAI's words, blaming `param`."""
        limit, _ = self.token_limit()
        if limit == self._model_context():
            head = f"This model's maximum context length is {limit} tokens."
        else:
            head = (f"This model's maximum context length is {limit} tokens on this server (the KV cache budget of "
                    "a worker, KV_CACHE_MB).")
        if completion_tokens:
            return ContextLengthExceeded(
                f"{head} However, you requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the "
                f"{prompt_param}, {completion_tokens} in the completion). Please reduce the length of the "
                f"{prompt_param} or completion.", param=param)
        room = "" if prompt_tokens > limit else ", which leaves no room for the completion"
        return ContextLengthExceeded(
            f"{head} However, your {prompt_param} resulted in {prompt_tokens} tokens{room}. Please reduce the "
            f"length of the {prompt_param}.", param=param)

    def token_limit(self) -> tuple[int, str]:
        """Return the most tokens one sequence may hold, prompt and reply, and what sets that limit.

        The model's context, unless the worker's KV budget (KV_CACHE_MB) is smaller: a request
        beyond it could never start, so it is refused instead of queued for ever.
        """
        context = self._model_context()
        budget = self.engine.kv_token_budget
        if budget and budget < context:
            return budget, f"this server's KV cache budget of {budget} tokens per worker (KV_CACHE_MB)"
        return context, f"the model's context of {context} tokens"

    def _model_context(self) -> int:
        """Return the model's context length (MAX_MODEL_LEN when the engine has not said)."""
        return self.engine.context_length or self.settings.max_model_len or 32768

    def _logit_bias(self, request: SamplingFields) -> tuple[tuple[int, float], ...]:
        """Return the request's logit_bias pairs, refusing an id the tokenizer does not have."""
        vocab_size = self.engine.template.vocab_size
        for token_id in map(int, request.logit_bias or {}):
            if token_id >= vocab_size:
                raise InvalidRequest(f"invalid 'logit_bias': {token_id} is not a token id of this model (its ids run "
                                     f"from 0 to {vocab_size - 1})", param="logit_bias")
        return request.token_biases

    def _repetition_penalty(self, request: SamplingFields) -> float:
        """Return the request's repetition_penalty, else the model's generation config's (applied greedy or not, as
        transformers and vLLM apply it), else 1 (none)."""
        if request.repetition_penalty is not None:
            return request.repetition_penalty
        configured = getattr(self.engine.generation_defaults, "repetition_penalty", None)
        return float(configured) if configured is not None else 1.0

    def _or_model_default(self, asked, name: str, openai_default):
        """Return a sampling value the request gave, else the model's generation config's, else OpenAI's."""
        if asked is not None:
            return asked
        defaults = self.engine.generation_defaults
        configured = getattr(defaults, name, None) if getattr(defaults, "do_sample", False) else None
        return openai_default if configured is None else type(openai_default)(configured)
