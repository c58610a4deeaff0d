"""Choose the next token of every row of a step from its logits, as OpenAI's sampling parameters describe."""

import hashlib
import random
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import torch

from .draws import draw, kernel_op, largest, take_rows

# Below float32's smallest normal number a temperature no longer divides float32 logits safely (a
# subnormal or zero divisor makes inf or NaN), and softmax(logits / T) is already one-hot there for
# any logits float32 can tell apart: such temperatures are greedy, computed as such.
GREEDY_BELOW_TEMPERATURE = torch.finfo(torch.float32).smallest_normal

# Changes whenever the same seed at the same position may draw another token from the same logits.
# It is part of the engine's fingerprint, so a cache never replays a seeded reply another sampler drew.
SAMPLER_VERSION = 3

# What sample_tokens returns for a row whose logits are not finite: no vocabulary's id, so it can
# never pass for text.
NO_TOKEN = -1


class NonFiniteLogits(ValueError):
    """A row's logits hold NaN or an infinite maximum: the model's numbers blew up, so no token is right."""


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
    # OpenAI's logit_bias: (token id, value) pairs, by id, added to the model's logits before anything else.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The prompt's own token logprobs (legacy completions' echo), with this many alternatives at each
    # position; None for none. The prompt pass then keeps the logits of every position.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """Tell whether the request always takes the most likely token."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


def step_seed(seed: int, position: int) -> int:
    """Return the seed of the draw for the token at `position` of a reply seeded with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def choice_seed(seed: int, index: int) -> int:
    """Return the seed of choice `index` of a request seeded with `seed` that asked for several (n > 1).

    The first choice keeps the seed, so it is the reply the same request with n = 1 gets; each other
    one's is a hash of the seed and its index. Each draw depends on its choice's seed and position
    alone, so every choice is reproducible whatever the batch around it.
    """
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:choice:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


# The ids a sampler's seen_ids holds before it first grows.
SEEN_CAPACITY = 64


@dataclass
class Sampler:
    """Per-sequence sampling state: its seed, its position in the reply and the counts of tokens it produced.

    Each draw is seeded from the request's seed and the token's position alone (a counter-based
    scheme): a reply continued from any position, in any batch, draws what the original would have.
    """

    params: SamplingParams
    vocab_size: int
    # The prompt's tokens, which repetition_penalty counts as seen.
    prompt_ids: InitVar[Sequence[int]] = ()
    seed: int = field(init=False)
    position: int = field(init=False, default=0)
    output_counts: torch.Tensor | None = field(init=False, default=None)
    # Each token of the prompt and the reply once, in order of first sight (repetition_penalty only):
    # the first seen_count entries of seen_ids, a tensor grown by doubling, so that a step reads them
    # without building a tensor from a list of a long conversation's thousands of ids.
    seen_ids: torch.Tensor | None = field(init=False, default=None, repr=False)
    _seen: set[int] = field(init=False, default_factory=set, repr=False)
    # logit_bias as tensors, built once: the ids it moves and by how much.
    bias_ids: torch.Tensor | None = field(init=False, default=None, repr=False)
    bias_values: torch.Tensor | None = field(init=False, default=None, repr=False)
    # Set by sample_tokens when this row's logits were not finite; record raises it.
    failure: NonFiniteLogits | None = field(init=False, default=None, repr=False)

    def __post_init__(self, prompt_ids: Sequence[int]):
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.output_counts = torch.zeros(self.vocab_size, dtype=torch.float32)
        if self.params.logit_bias:
            ids, values = zip(*self.params.logit_bias)
            self.bias_ids = torch.tensor(ids, dtype=torch.long)
            self.bias_values = torch.tensor(values, dtype=torch.float32)
        if self.params.repetition_penalty != 1.0:
            ids = list(dict.fromkeys(token for token in prompt_ids if token < self.vocab_size))
            self.seen_ids = torch.zeros(max(SEEN_CAPACITY, 2 * len(ids)), dtype=torch.long)
            self.seen_ids[: len(ids)] = torch.tensor(ids, dtype=torch.long)
            self._seen.update(ids)

    @property
    def seen_count(self) -> int:
        """Return how many of seen_ids' entries are tokens seen (0 without repetition_penalty)."""
        return len(self._seen)

    def uniform(self) -> float:
        """Return the uniform number in [0, 1) that draws the token at the current position."""
        # The seed's top 53 bits, a float64's precision: every value is exact and below 1.
        return (step_seed(self.seed, self.position) >> 10) * 2.0**-53

    def record(self, token_id: int) -> None:
        """Move past a token of the reply (sampled or forced), counting it for the penalties; raise the
        row's NonFiniteLogits instead where sample_tokens found no token for it."""
        if self.failure is not None:
            raise self.failure
        self.position += 1
        if self.output_counts is not None and token_id < self.output_counts.shape[0]:
            self.output_counts[token_id] += 1
        if self.seen_ids is not None and token_id not in self._seen and token_id < self.vocab_size:
            if len(self._seen) == self.seen_ids.shape[0]:
                self.seen_ids = torch.cat([self.seen_ids, torch.zeros_like(self.seen_ids)])
            # Through numpy's view of the tensor: an element written without a torch operator call.
            self.seen_ids.numpy()[len(self._seen)] = token_id
            self._seen.add(token_id)


def biased(samplers: Sequence[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Return the logits [rows, vocab] with each row's logit_bias added (float32, a new tensor), or as they
    are when no row has one.

    Every row's pairs go in with one indexed add over the batch, whatever the number of rows.
    """
    rows = [row for row, sampler in enumerate(samplers) if sampler.bias_ids is not None]
    if not rows:
        return logits
    ids = torch.cat([samplers[row].bias_ids for row in rows])
    values = torch.cat([samplers[row].bias_values for row in rows])
    counts = torch.tensor([samplers[row].bias_ids.shape[0] for row in rows])
    row_index = torch.repeat_interleave(torch.tensor(rows), counts)
    return logits.float().index_put_((row_index, ids), values, accumulate=True)


def sample_tokens(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """Return each row's next token from `logits` [rows, vocab], row i taken by samplers[i].

    Rows are computed together, but every operation works within a row, so a row's token never
    depends on the other rows or on how many there are. A row whose logits are not finite gets
    NO_TOKEN and its sampler a NonFiniteLogits, which its record raises: the scheduler fails that
    sequence alone (greedy or drawn), and the other rows take their tokens.
    """
    logits = penalized(samplers, logits.float())
    tokens = [NO_TOKEN] * len(samplers)
    # A NaN anywhere in a row, or an infinite largest logit, makes the row's maximum non-finite;
    # argmax would return the NaN's index as if it were the likeliest token.
    finite = kernel_op("finite_rows")(logits.contiguous())
    for row, sampler in enumerate(samplers):
        if not finite[row]:
            sampler.failure = NonFiniteLogits("the model's logits are not finite (NaN or infinite)")
    greedy = [row for row, sampler in enumerate(samplers) if finite[row] and sampler.params.greedy]
    drawn = [row for row, sampler in enumerate(samplers) if finite[row] and not sampler.params.greedy]
    if greedy:
        for row, token in zip(greedy, largest(take_rows(logits, greedy)), strict=True):
            tokens[row] = token
    if drawn:
        for row, token in zip(drawn, draw([samplers[row] for row in drawn], take_rows(logits, drawn))):
            tokens[row] = token
    return tokens


def penalized(samplers: Sequence[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Return the logits lowered by each row's repetition, then presence and frequency penalties (a new
    tensor where any apply), in the order vLLM applies them."""
    repeated = [row for row, sampler in enumerate(samplers) if sampler.seen_count]
    if repeated:
        # Only the seen tokens change: a few hundred values, in one operator (kernels/csrc/sampling.cpp).
        logits = kernel_op("repetition_penalized")(
            logits.contiguous(), [samplers[row].seen_ids for row in repeated],
            [samplers[row].seen_count for row in repeated], repeated,
            [samplers[row].params.repetition_penalty for row in repeated])
    rows = [row for row, sampler in enumerate(samplers) if sampler.output_counts is not None]
    if not rows:
        return logits
    counts = torch.stack([samplers[row].output_counts[: logits.shape[-1]] for row in rows])
    frequency = torch.tensor([[samplers[row].params.frequency_penalty] for row in rows])
    presence = torch.tensor([[samplers[row].params.presence_penalty] for row in rows])
    lowered = logits[rows] - frequency * counts - presence * (counts > 0).float()
    return logits.index_put((torch.tensor(rows),), lowered)
