"""A step's tokens from its logits once sampling.py has biased and penalized them: the greedy rows' and the
drawn rows' by corechat's kernels (kernels/csrc/sampling.cpp), and torch's draw by probabilities for
the drawn rows the kernel leaves (a top_k past CANDIDATES, a nucleus wider than CANDIDATES tokens,
ties past what it holds)."""

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

# A non-negative float32's bit pattern orders as its value does: its high 16 bits (sign, exponent and
# 7 mantissa bits), read in place as the odd int16 of a little-endian float, name a bucket of values
# within 2^-7 of each other, greater in a higher bucket.
BUCKETS = 1 << 15
# Most rows' kept tokens are among this many most likely ones; the others need their whole row.
CANDIDATES = 256
# What corechat's draw returns for a row it leaves to the draw by probabilities (sampling.cpp).
WHOLE_ROW = -2


class DrawParameters(Protocol):
    """What a draw reads of a request's sampling parameters (sampling.SamplingParams)."""

    temperature: float
    top_p: float
    top_k: int


class Drawn(Protocol):
    """A row's sampler as a draw sees it (sampling.Sampler): its parameters and the uniform number of its position."""

    @property
    def params(self) -> DrawParameters:
        """Return the request's sampling parameters."""

    def uniform(self) -> float:
        """Return the uniform number in [0, 1) that draws the token at the current position."""


@functools.cache
def kernel_op(name: str) -> Callable[..., torch.Tensor]:
    """Return torch.ops.corechat.<name>, loading the kernels where no model did (an engine loads them at
    every DTYPE; a tool calling the sampler alone may not have): looked up once, not every token."""
    try:
        return getattr(torch.ops.corechat, name)
    except (AttributeError, RuntimeError):
        from . import kernels
        kernels.load()
        return getattr(torch.ops.corechat, name)


def largest(logits: torch.Tensor) -> list[int]:
    """Return each row's first largest logit's id, for rows without NaN: torch.argmax's choice, made by
    corechat's kernel (kernels/csrc/sampling.cpp: greedy_tokens)."""
    return kernel_op("greedy_tokens")(logits.contiguous()).tolist()


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Return the given rows of a tensor, without a copy where they are all of them in order."""
    return tensor if rows == list(range(tensor.shape[0])) else tensor[rows]


def draw(samplers: Sequence[Drawn], logits: torch.Tensor) -> list[int]:
    """Draw each row's token from its logits over its temperature, restricted to its top-k and top-p tokens
    (every row's largest logit finite: sample_tokens sets the other rows aside).

    corechat's kernel draws a row in one or two passes over its logits (sampling.cpp: weights in
    float32 by kernels.h's exp, sums in float64): among its top_k largest logits and their ties where
    top_k is at most CANDIDATES, else over the whole vocabulary, top_p's nucleus found among the
    CANDIDATES most likely. It leaves to the probabilities below (torch's softmax) a top_k past
    CANDIDATES, a nucleus wider than CANDIDATES tokens, and ties past what it holds.
    """
    tokens = kernel_op("draw_tokens")(logits.contiguous(), [max(sampler.params.top_k, 0) for sampler in samplers],
                            [sampler.params.temperature for sampler in samplers],
                            [min(max(sampler.params.top_p, 0.0), 1.0) for sampler in samplers],
                            [sampler.uniform() for sampler in samplers]).tolist()
    rest = [row for row, token in enumerate(tokens) if token == WHOLE_ROW]
    if rest:
        for row, token in zip(rest, draw_by_probabilities([samplers[row] for row in rest], take_rows(logits, rest))):
            tokens[row] = token
    return tokens


def draw_by_probabilities(samplers: Sequence[Drawn], logits: torch.Tensor) -> list[int]:
    """Draw each row's token from its softmax(logits / temperature) in float32, by its top_k and top_p:
    the rows the kernel leaves, whose kept tokens its candidates cannot hold, so over the whole row."""
    rows, vocab = logits.shape
    maxima = logits.amax(dim=-1, keepdim=True)
    temperatures = torch.tensor([[sampler.params.temperature] for sampler in samplers], dtype=torch.float32)
    # Shifted so the largest is 0: a small temperature then sends the others towards -inf
    # instead of overflowing the largest to inf (inf - inf is NaN inside softmax).
    probabilities = torch.softmax((logits - maxima).div_(temperatures), dim=-1)
    top_k = [sampler.params.top_k if 0 < sampler.params.top_k < vocab else 0 for sampler in samplers]
    floors = kept_floors(probabilities, top_k, [sampler.params.top_p for sampler in samplers])
    return draw_kept(probabilities, floors, [sampler.uniform() for sampler in samplers])


def draw_kept(probabilities: torch.Tensor, floors: torch.Tensor, uniforms: Sequence[float]) -> list[int]:
    """Draw each row's token among those at or above its floor, by inverse transform sampling in
    vocabulary order (the zeros of the dropped tokens leave the running sums unchanged)."""
    kept = probabilities if not floors.any() else torch.where(probabilities >= floors[:, None], probabilities, 0)
    weights = kept.double()
    cumulative = weights.cumsum(dim=-1)
    totals = cumulative[:, -1:].contiguous()
    targets = torch.tensor(uniforms, dtype=torch.float64)[:, None] * totals
    # Never a token of weight 0, even where rounding makes u * total the total.
    chosen = torch.minimum(torch.searchsorted(cumulative, targets, right=True), torch.searchsorted(cumulative, totals))
    return chosen[:, 0].tolist()


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
