"""Choose the next token of every row of a step from its logits, as OpenAI's sampling parameters describe."""

import functools
import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field

import torch

# Below float32's smallest normal number a temperature no longer divides float32 logits safely (a
# subnormal or zero divisor makes inf or NaN), and softmax(logits / T) is already one-hot there for
# any logits float32 can tell apart: such temperatures are greedy, computed as such.
GREEDY_BELOW_TEMPERATURE = torch.finfo(torch.float32).smallest_normal

# Changes whenever the same seed at the same position may draw another token from the same logits.
# It is part of the engine's fingerprint, so a cache never replays a seeded reply another sampler drew.
SAMPLER_VERSION = 3

# A non-negative float32's bit pattern orders as its value does: its high 16 bits (sign, exponent and
# 7 mantissa bits), read in place as the odd int16 of a little-endian float, name a bucket of values
# within 2^-7 of each other, greater in a higher bucket.
BUCKETS = 1 << 15
# Most rows' kept tokens are among this many most likely ones; the others need their whole row.
CANDIDATES = 256
# What sample_tokens returns for a row whose logits are not finite: no vocabulary's id, so it can
# never pass for text.
NO_TOKEN = -1
# What corechat's draw returns for a row it leaves to the draw by probabilities (sampling.cpp).
WHOLE_ROW = -2


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
            self.seen_ids[len(self._seen)] = token_id
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
    finite = torch.isfinite(logits.amax(dim=-1)).tolist()
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


@functools.cache
def _first_largest() -> Callable[[torch.Tensor], torch.Tensor]:
    """Return corechat's greedy kernel, or torch.argmax over the last dimension where the kernels are not
    loaded (a tool calling the sampler outside an engine, which loads them at every DTYPE): looked up
    once, not every token. Both choose alike."""
    try:
        return torch.ops.corechat.greedy_tokens
    except (AttributeError, RuntimeError):
        return functools.partial(torch.argmax, dim=-1)


def largest(logits: torch.Tensor) -> list[int]:
    """Return each row's first largest logit's id, for rows without NaN: torch.argmax's choice, made by
    corechat's kernel where the kernels are loaded."""
    return _first_largest()(logits.contiguous()).tolist()


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Return the given rows of a tensor, without a copy where they are all of them in order."""
    return tensor if rows == list(range(tensor.shape[0])) else tensor[rows]


def penalized(samplers: Sequence[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Return the logits lowered by each row's repetition, then presence and frequency penalties (a new
    tensor where any apply), in the order vLLM applies them."""
    repeated = [row for row, sampler in enumerate(samplers) if sampler.seen_count]
    if repeated:
        logits = logits.clone()
        for row in repeated:
            # Only the seen tokens change: a few hundred indexed values, not a pass over the vocabulary.
            seen = samplers[row].seen_ids[: samplers[row].seen_count]
            values = logits[row, seen]
            penalty = samplers[row].params.repetition_penalty
            logits[row, seen] = torch.where(values < 0, values * penalty, values / penalty)
    rows = [row for row, sampler in enumerate(samplers) if sampler.output_counts is not None]
    if not rows:
        return logits
    counts = torch.stack([samplers[row].output_counts[: logits.shape[-1]] for row in rows])
    frequency = torch.tensor([[samplers[row].params.frequency_penalty] for row in rows])
    presence = torch.tensor([[samplers[row].params.presence_penalty] for row in rows])
    lowered = logits[rows] - frequency * counts - presence * (counts > 0).float()
    return logits.index_put((torch.tensor(rows),), lowered)


@functools.cache
def _draw_kernel() -> Callable[..., torch.Tensor]:
    """Return corechat's draw, loading the kernels where the model did not (a float32 model's engine loads
    them for this too): every drawn row goes to it first, whatever the DTYPE."""
    try:
        return torch.ops.corechat.draw_tokens
    except (AttributeError, RuntimeError):
        from . import kernels
        kernels.load()
        return torch.ops.corechat.draw_tokens


def draw(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """Draw each row's token from its logits over its temperature, restricted to its top-k and top-p tokens
    (every row's largest logit finite: sample_tokens sets the other rows aside).

    corechat's kernel draws a row in one or two passes over its logits (sampling.cpp: weights in
    float32 by kernels.h's exp, sums in float64): among its top_k largest logits and their ties where
    top_k is at most CANDIDATES, else over the whole vocabulary, top_p's nucleus found among the
    CANDIDATES most likely. It leaves to the probabilities below (torch's softmax) a top_k past
    CANDIDATES, a nucleus wider than CANDIDATES tokens, and ties past what it holds.
    """
    tokens = _draw_kernel()(logits.contiguous(), [max(sampler.params.top_k, 0) for sampler in samplers],
                            [sampler.params.temperature for sampler in samplers],
                            [min(max(sampler.params.top_p, 0.0), 1.0) for sampler in samplers],
                            [sampler.uniform() for sampler in samplers]).tolist()
    rest = [row for row, token in enumerate(tokens) if token == WHOLE_ROW]
    if rest:
        for row, token in zip(rest, draw_by_probabilities([samplers[row] for row in rest], take_rows(logits, rest))):
            tokens[row] = token
    return tokens


def draw_by_probabilities(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """Draw each row's token from its softmax(logits / temperature) in float32, by its top_k and top_p."""
    rows, vocab = logits.shape
    maxima = logits.amax(dim=-1, keepdim=True)
    temperatures = torch.tensor([[sampler.params.temperature] for sampler in samplers], dtype=torch.float32)
    # Shifted so the largest is 0: a small temperature then sends the others towards -inf
    # instead of overflowing the largest to inf (inf - inf is NaN inside softmax).
    probabilities = torch.softmax((logits - maxima).div_(temperatures), dim=-1)
    top_k = [sampler.params.top_k if 0 < sampler.params.top_k < vocab else 0 for sampler in samplers]
    top_p = [sampler.params.top_p for sampler in samplers]
    uniforms = [sampler.uniform() for sampler in samplers]
    tokens = [0] * rows
    restricted = [row for row in range(rows) if top_k[row] or top_p[row] < 1.0]
    whole = [row for row in range(rows) if not (top_k[row] or top_p[row] < 1.0)]
    if restricted:
        candidates, indices = torch.topk(take_rows(probabilities, restricted), min(CANDIDATES, vocab), dim=-1)
        floors = candidate_floors(candidates, [top_k[row] for row in restricted], [top_p[row] for row in restricted])
        # Where every kept token is a candidate (all of them more likely than the last candidate),
        # the draw needs the candidates alone; elsewhere it needs the whole row.
        covered = (floors > candidates[:, -1]) | (candidates.shape[-1] == vocab)
        inside = covered.nonzero()[:, 0].tolist()
        outside = (~covered).nonzero()[:, 0].tolist()
        if inside:
            drawn = draw_kept(candidates[inside], indices[inside], floors[inside],
                              [uniforms[restricted[row]] for row in inside])
            for row, token in zip(inside, drawn):
                tokens[restricted[row]] = token
        whole += [restricted[row] for row in outside]
    if whole:
        whole.sort()
        floors = kept_floors(take_rows(probabilities, whole), [top_k[row] for row in whole], [top_p[row] for row in whole])
        drawn = draw_kept(take_rows(probabilities, whole), None, floors, [uniforms[row] for row in whole])
        for row, token in zip(whole, drawn):
            tokens[row] = token
    return tokens


def draw_kept(probabilities: torch.Tensor, indices: torch.Tensor | None, floors: torch.Tensor,
              uniforms: Sequence[float]) -> list[int]:
    """Draw each row's token among those at or above its floor, by inverse transform sampling.

    Tokens are taken in vocabulary order (`indices` names the token of each column, None for the
    whole vocabulary), so the candidates alone and the whole row draw the same token: the zeros of
    the dropped tokens leave the running sums unchanged.
    """
    if indices is not None:
        order = indices.argsort(dim=-1)
        probabilities, indices = probabilities.gather(1, order), indices.gather(1, order)
    kept = probabilities if not floors.any() else torch.where(probabilities >= floors[:, None], probabilities, 0)
    weights = kept.double()
    cumulative = weights.cumsum(dim=-1)
    totals = cumulative[:, -1:].contiguous()
    targets = torch.tensor(uniforms, dtype=torch.float64)[:, None] * totals
    # Never a token of weight 0, even where rounding makes u * total the total.
    chosen = torch.minimum(torch.searchsorted(cumulative, targets, right=True), torch.searchsorted(cumulative, totals))
    if indices is not None:
        chosen = indices.gather(1, chosen)
    return chosen[:, 0].tolist()


def candidate_floors(candidates: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Return each row's smallest kept probability, as far as its most likely candidates (sorted) decide it.

    The floor is exact when it is above the last candidate; otherwise the row needs kept_floors.
    """
    rows, width = candidates.shape
    ks = torch.tensor([[k] for k in top_k])
    limited = ks[:, 0] > 0
    # top_k's floor, or the last candidate where top_k is off or reaches past the candidates.
    kth = candidates.gather(1, (ks.clamp(1, width) - 1).where(limited[:, None], width - 1))[:, 0]
    floors = torch.where(limited & (ks[:, 0] <= width), kth, candidates[:, -1])
    masses = candidates.double()
    cumulative = masses.cumsum(dim=-1)
    before = torch.cat([torch.zeros(rows, 1, dtype=torch.float64), cumulative[:, :-1]], dim=-1)
    # The mass top_k keeps: the softmax's own total where top_k is off, as the whole row's top_p takes it.
    in_top_k = (candidates >= floors[:, None]).sum(dim=-1, keepdim=True)
    totals = torch.where(limited[:, None], cumulative.gather(1, in_top_k - 1), 1.0)
    thresholds = torch.tensor(top_p, dtype=torch.float64)[:, None] * totals
    kept = (before < thresholds).sum(dim=-1, keepdim=True).clamp(1, width)
    # Where top_k reaches past the candidates, its mass is unknown here: the row stays uncovered.
    nucleus = torch.tensor([p < 1.0 for p in top_p]) & (ks[:, 0] <= width)
    return torch.where(nucleus, torch.maximum(floors, candidates.gather(1, kept - 1)[:, 0]), floors)


def kept_floors(probabilities: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Return each row's smallest kept probability: of the top_k most likely tokens (0: all), those top_p keeps.

    top_p keeps a token when the tokens more likely than it hold less than top_p of the mass top_k
    keeps (of the softmax's total where top_k is off; OpenAI's nucleus, the most likely token always
    in it); equally likely tokens are kept or dropped together, so the set does not depend on how a
    sort orders ties.
    """
    rows, vocab = probabilities.shape
    floors = torch.zeros(rows, dtype=probabilities.dtype)
    limited = [row for row in range(rows) if 0 < top_k[row] < vocab]
    if limited:
        ks = torch.tensor([[top_k[row] - 1] for row in limited])
        largest = torch.topk(take_rows(probabilities, limited), max(top_k[row] for row in limited), dim=-1).values
        floors[limited] = largest.gather(1, ks)[:, 0]
    nucleus = [row for row in range(rows) if top_p[row] < 1.0]
    if nucleus:
        floors[nucleus] = nucleus_floors(take_rows(probabilities, nucleus), floors[nucleus], [top_p[row] for row in nucleus],
                                         [row in limited for row in nucleus])
    return floors


def nucleus_floors(probabilities: torch.Tensor, floors: torch.Tensor, top_p: Sequence[float],
                   limited: Sequence[bool]) -> torch.Tensor:
    """Return each row's smallest probability top_p keeps of the tokens at or above its floor.

    A selection by buckets of the probabilities' bit patterns, not a sort of the vocabulary: the
    mass of each bucket tells which one holds the boundary, and only that bucket is sorted.
    """
    rows = probabilities.shape[0]
    candidates = torch.where(probabilities >= floors[:, None], probabilities, 0) if any(limited) else probabilities
    buckets = candidates.view(torch.int16)[:, 1::2]
    masses = torch.zeros(rows * BUCKETS, dtype=torch.float64)
    offsets = torch.arange(rows, dtype=torch.int32)[:, None] * BUCKETS
    masses.index_add_(0, (buckets + offsets).flatten(), candidates.double().flatten())
    masses = masses.view(rows, BUCKETS)
    from_top = masses.flip(-1).cumsum(dim=-1)
    above = torch.cat([torch.zeros(rows, 1, dtype=torch.float64), from_top[:, :-1]], dim=-1).flip(-1)
    totals = torch.where(torch.tensor(limited)[:, None], from_top[:, -1:], 1.0)
    thresholds = torch.tensor(top_p, dtype=torch.float64)[:, None] * totals
    # The lowest bucket with mass whose higher buckets hold less than top_p of it (the top bucket
    # holding mass always qualifies, so a top_p of 0 keeps the most likely token).
    qualifies = (masses > 0) & ((above < thresholds) | (above == 0))
    boundaries = torch.argmax(qualifies.to(torch.uint8), dim=-1).tolist()
    floors = torch.empty(rows, dtype=probabilities.dtype)
    for row, boundary in enumerate(boundaries):
        members = candidates[row][buckets[row] == boundary]
        members = torch.sort(members[members > 0], descending=True).values
        # The mass of the tokens more likely than each member: higher buckets, then members before it.
        before = above[row, boundary] + torch.cat([members.new_zeros(1, dtype=torch.float64),
                                                   members[:-1].double().cumsum(dim=-1)])
        kept = max(1, int((before < thresholds[row, 0]).sum()))
        floors[row] = members[kept - 1]
    return floors
