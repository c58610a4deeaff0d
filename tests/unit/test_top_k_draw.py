"""The top-k draw in one pass (sampling.cpp: torch.ops.corechat.top_k_tokens) chooses exactly the token
its definition does, written here over a sorted row in Python, at every extreme of its numbers."""

import collections
import math

import pytest
import torch

from service.engine import kernels
from service.engine.sampling import CANDIDATES, WHOLE_ROW, Sampler, SamplingParams, sample_tokens

INF = float("inf")
SMALLEST_NORMAL = torch.finfo(torch.float32).smallest_normal
LARGEST = torch.finfo(torch.float32).max
# The candidates the kernel holds (sampling.cpp: kHeld).
HELD = 4096


@pytest.fixture(scope="module")
def top_k_tokens():
    kernels.load()
    return torch.ops.corechat.top_k_tokens


def ranked(row: list[float]) -> list[tuple[float, int]]:
    """Return a row's finite logits with their ids, largest first, the lower id first among equals."""
    return sorted(((value, index) for index, value in enumerate(row) if value > -INF), key=lambda c: (-c[0], c[1]))


def defined_draw(ranked: list[tuple[float, int]], top_k: int, temperature: float, top_p: float, uniform: float) -> int:
    """The draw by its definition: the top_k largest finite logits and their ties, weights exp((logit -
    largest) / T) in float64, the most likely holding less than top_p of their total before them kept
    (at least one, with every token as likely as the last kept), drawn in vocabulary order."""
    end = top_k
    while end < len(ranked) and ranked[end][0] == ranked[top_k - 1][0]:  # the k-th's ties, next to it
        end += 1
    ranked = ranked[:end]
    weights = [math.exp((value - ranked[0][0]) / temperature) for value, _ in ranked]
    total = 0.0
    for weight in weights:
        total += weight
    kept = len(ranked)
    if top_p < 1.0:
        before, kept = 0.0, 0
        while kept < len(ranked) and before < top_p * total:
            before += weights[kept]
            kept += 1
        kept = max(kept, 1)
        while kept < len(ranked) and weights[kept] == weights[kept - 1]:
            kept += 1
    chosen = sorted((index, weight) for (_, index), weight in zip(ranked[:kept], weights[:kept]))
    whole = 0.0
    for _, weight in chosen:
        whole += weight
    running, last = 0.0, chosen[0][0]
    for index, weight in chosen:
        if weight > 0.0:
            running += weight
            last = index
            if running > uniform * whole:
                return index
    return last


def rows_of_every_shape(width: int) -> torch.Tensor:
    """Flat, peaked and huge rows, rows of many ties (bfloat16-rounded, integers), forbidden (-inf) tokens,
    rows with fewer finite tokens than top_k, subnormal and largest-float logits."""
    generator = torch.Generator().manual_seed(11)
    rows = [torch.randn(width, generator=generator) * scale for scale in (0.01, 1.0, 8.0, 1e30)]
    rows.append((torch.randn(width, generator=generator) * 2).bfloat16().float())
    rows.append(torch.randint(0, 6, (width,), generator=generator).float())
    forbidden = torch.randn(width, generator=generator)
    forbidden[torch.rand(width, generator=generator) < 0.9] = -INF
    forbidden[width // 3] = 0.5
    rows.append(forbidden)
    few = torch.full((width,), -INF)
    few[[0, width // 2, width - 1]] = torch.tensor([1.0, 1.0, -2.0])
    rows.append(few)
    rows.append(torch.randn(width, generator=generator) * SMALLEST_NORMAL / 4)  # subnormals
    extreme = torch.randn(width, generator=generator)
    extreme[[0, min(7, width - 1), max(width - 2, 0)]] = torch.tensor([LARGEST, -LARGEST, LARGEST])
    rows.append(extreme)
    return torch.stack(rows)


@pytest.mark.parametrize("width", [1, 15, 17, 5000, 151_936], ids=lambda width: f"width-{width}")
def test_every_row_draws_the_token_its_definition_names(top_k_tokens, width):
    """Every shape of row, top_k from 1 to CANDIDATES (and past the width), top_p and temperature at their
    edges, uniforms at 0 and next to 1: the kernel's token is the definition's, bit for bit."""
    logits = rows_of_every_shape(width)
    uniforms = [0.0, 0.3, 0.999, 1.0 - 2.0**-53]
    checked = 0
    rows = [(row, row.tolist()) for row in logits]
    rows = [(row, values, ranked(values)) for row, values in rows]
    for top_k in (1, 2, 20, CANDIDATES):
        for top_p in (1.0, 0.8, 0.99999999, 1e-300, 5e-324, 0.0):
            for temperature in (SMALLEST_NORMAL, 0.7, 1.0, 1e30):
                params = [(min(top_k, width), temperature, top_p, uniform) for uniform in uniforms]
                for row, values, order in rows:
                    tokens = top_k_tokens(row.expand(len(uniforms), -1).contiguous(), *map(list, zip(*params))).tolist()
                    if tokens == [WHOLE_ROW] * len(params):
                        # Left whole only where some logit has more ties than half the kernel's candidates.
                        assert max(collections.Counter(v for v in values if v > -INF).values()) > HELD // 2
                        continue
                    assert tokens == [defined_draw(order, *each) for each in params], (top_k, top_p, temperature)
                    checked += 1
    assert checked >= 4 * 6 * 4 * (len(logits) - 1)


def test_ties_past_the_candidates_leave_the_row_to_the_whole_row_draw(top_k_tokens):
    """Every token tied at the top_k-th logit: the kernel cannot hold them, says so, and the sampler then
    draws the row by its probabilities, the same token alone and beside a row the kernel draws."""
    width = 151_936
    tied = torch.zeros(1, width)
    assert top_k_tokens(tied, [20], [1.0], [1.0], [0.5]).tolist() == [WHOLE_ROW]
    other = torch.randn(1, width, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.8, top_k=20, seed=4)
    alone = [sample_tokens([Sampler(params, width)], row)[0] for row in (tied, other)]
    assert 0 <= alone[0] < width
    assert sample_tokens([Sampler(params, width), Sampler(params, width)], torch.cat([tied, other])) == alone
    assert sample_tokens([Sampler(params, width), Sampler(params, width)], torch.cat([other, tied])) == alone[::-1]


def test_draws_follow_the_renormalised_top_k_and_top_p_probabilities():
    """Over many positions of one seed the draws of a top_k row follow its kept tokens' weights."""
    probabilities = torch.tensor([0.04, 0.4, 0.1, 0.25, 0.06, 0.15])
    logits = torch.log(probabilities)
    # top_k 4 keeps 0.4, 0.25, 0.15 and 0.1 (0.9 of the mass); top_p 0.7 of that, 0.63, keeps the tokens
    # with less before them: 0.4, 0.25 (0.65 before 0.15 is more: dropped).
    samplers = [Sampler(SamplingParams(max_tokens=1, temperature=1.0, top_k=4, top_p=0.7, seed=42), 6)
                for _ in range(20_000)]
    for position, sampler in enumerate(samplers):
        sampler.position = position
    draws = collections.Counter(sample_tokens(samplers, logits.expand(len(samplers), -1).contiguous()))
    assert set(draws) == {1, 3}
    assert abs(draws[1] / 20_000 - 0.4 / 0.65) < 0.015, draws


@pytest.mark.parametrize("bad", [
    {"top_k": [0]}, {"top_k": [CANDIDATES + 1]}, {"temperatures": [0.0]}, {"uniforms": [1.0]}, {"top_p": []},
], ids=["top_k-0", "top_k-past-candidates", "temperature-0", "uniform-1", "missing-top_p"])
def test_arguments_out_of_range_are_refused(top_k_tokens, bad):
    arguments = {"top_k": [5], "temperatures": [1.0], "top_p": [1.0], "uniforms": [0.5]} | bad
    with pytest.raises(RuntimeError):
        top_k_tokens(torch.zeros(1, 10), arguments["top_k"], arguments["temperatures"], arguments["top_p"],
                     arguments["uniforms"])
