"""Choose the next token from logits, as OpenAI's sampling parameters describe."""

import hashlib
import random
from dataclasses import dataclass, field

import torch

# Below float32's smallest normal number a temperature no longer divides float32 logits safely (a
# subnormal or zero divisor makes inf or NaN), and softmax(logits / T) is already one-hot there for
# any logits float32 can tell apart: such temperatures are greedy, computed as such.
GREEDY_BELOW_TEMPERATURE = torch.finfo(torch.float32).smallest_normal


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    deadline_seconds: float | None = None
    # > 1 lowers the logits of tokens already in the prompt or the reply (transformers' rule).
    repetition_penalty: float = 1.0
    # An llguidance grammar the reply must follow (service/engine/grammar.py), or None for free text.
    grammar: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        """Tell whether the request always takes the most likely token."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


def step_seed(seed: int, position: int) -> int:
    """Return the seed of the draw for the token at `position` of a reply seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class Sampler:
    """Per-sequence sampling state: its seed, its position in the reply and the counts of tokens it produced.

    Each draw is seeded from the request's seed and the token's position alone (a counter-based
    scheme): a reply continued from any position, in any batch, draws what the original would have.
    """

    params: SamplingParams
    vocab_size: int
    generator: torch.Generator = field(init=False)
    seed: int = field(init=False)
    position: int = field(init=False, default=0)
    output_counts: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self):
        self.generator = torch.Generator()
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.output_counts = torch.zeros(self.vocab_size, dtype=torch.float32)

    def next_token(self, logits: torch.Tensor) -> int:
        """Return the next token id from the last position's logits (1-D)."""
        logits = logits.float()
        if self.output_counts is not None:
            counts = self.output_counts[: logits.shape[-1]]
            logits = logits - self.params.frequency_penalty * counts
            logits = logits - self.params.presence_penalty * (counts > 0).float()
        if self.params.greedy:
            return int(torch.argmax(logits))
        # Shifted so the largest is 0: a small temperature then sends the others towards -inf
        # instead of overflowing the largest to inf (inf - inf is NaN inside softmax).
        logits = (logits - logits.max()) / self.params.temperature
        if self.params.top_k > 0 and self.params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= self.params.top_p
            # A top_p below float32's range (1e-300) compares as 0, which would drop every token.
            drop[0] = False
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        probabilities = torch.softmax(logits, dim=-1)
        self.generator.manual_seed(step_seed(self.seed, self.position))
        return int(torch.multinomial(probabilities, 1, generator=self.generator))

    def record(self, token_id: int) -> None:
        """Move past a token of the reply (sampled or forced), counting it for the penalties."""
        self.position += 1
        if self.output_counts is not None and token_id < self.output_counts.shape[0]:
            self.output_counts[token_id] += 1
