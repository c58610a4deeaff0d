"""corechat's draw (sampling.cpp: torch.ops.corechat.draw_tokens) chooses exactly the token its definition,
written here in Python over the kernel's own weights, names, at every extreme of its numbers; the
weights are the same bits on every kernel path and within a few ulp of e^x."""

import collections

import numpy
import pytest
import torch

from service.engine import kernels
from service.engine.draws import CANDIDATES, WHOLE_ROW
from service.engine.sampling import Sampler, SamplingParams, sample_tokens

INF = float("inf")
SMALLEST_NORMAL = torch.finfo(torch.float32).smallest_normal
LARGEST = torch.finfo(torch.float32).max
# sampling.cpp's kHeld (candidates held) and kernels.h's kWeightBlock and kWeightFloor.
HELD = 4096
BLOCK = 1024
FLOOR = -87.0
TEMPERATURES = (SMALLEST_NORMAL, 0.7, 1.0, 2.0, 1e30)
TOP_P = (1.0, 0.8, 0.99999999, 1e-300, 5e-324, 0.0)
UNIFORMS = (0.0, 0.3, 0.999, 1.0 - 2.0**-53)


@pytest.fixture(scope="module")
def paths():
    kernels.load()
    return {name: kernels.PATHS[name] for name in kernels.available_paths()}


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


def block_sums(weights: numpy.ndarray) -> list[float]:
    """Each block's sum as weights.inc defines it: 16 float32 lanes in order, then the lanes in float64."""
    sums = []
    for start in range(0, len(weights), BLOCK):
        block = weights[start:start + BLOCK]
        lanes = numpy.zeros(16, dtype=numpy.float32)
        for at in range(0, len(block), 16):
            piece = numpy.zeros(16, dtype=numpy.float32)
            piece[:len(block[at:at + 16])] = block[at:at + 16]
            lanes = lanes + piece
        total = 0.0
        for lane in lanes.tolist():
            total += lane
        sums.append(total)
    return sums


def ranked(values: list[float]) -> list[tuple[float, int]]:
    """Return a row's finite logits with their ids, largest first, the lower id first among equals."""
    return sorted(((value, index) for index, value in enumerate(values) if value > -INF), key=lambda c: (-c[0], c[1]))


def largest(order: list[tuple[float, int]], count: int) -> list[tuple[float, int]]:
    """Return the `count` largest of a ranked row and every tie of the last."""
    if len(order) <= count:
        return order
    end = count
    while end < len(order) and order[end][0] == order[count - 1][0]:
        end += 1
    return order[:end]


def nucleus(weights: list[float], threshold: float, known: bool) -> int:
    """How many of the most likely stay under top_p (0: the candidates cannot tell)."""
    kept, before = 0, 0.0
    while kept < len(weights) and before < threshold:
        before += weights[kept]
        kept += 1
    if before < threshold and not known:
        return 0
    kept = max(kept, 1)
    while kept < len(weights) and weights[kept] == weights[kept - 1]:
        kept += 1
    return 0 if kept == len(weights) and not known else kept


def draw_kept(candidates: list[tuple[float, int]], weights: list[float], kept: int, uniform: float) -> int:
    """The kept token where uniform * their total falls in their running sum, in vocabulary order."""
    chosen = sorted((index, weight) for (_, index), weight in zip(candidates[:kept], weights[:kept]))
    total = 0.0
    for _, weight in chosen:
        total += weight
    running, last = 0.0, chosen[0][0]
    for index, weight in chosen:
        if weight > 0.0:
            running += weight
            last = index
            if running > uniform * total:
                return index
    return last


def draw_whole(weights: list[float], sums: list[float], total: float, uniform: float) -> int:
    """The token where uniform * total falls in the whole row's running sum: its block by the blocks' sums."""
    target, running, block = uniform * total, 0.0, 0
    while block < len(sums) - 1 and running + sums[block] <= target:
        running += sums[block]
        block += 1
    last = -1
    for index in range(block * BLOCK, min(len(weights), (block + 1) * BLOCK)):
        if weights[index] > 0.0:
            running += weights[index]
            last = index
            if running > target:
                return index
    return last if last >= 0 else max(index for index in range(min(len(weights), (block + 1) * BLOCK))
                                      if weights[index] > 0.0)


def defined_draw(order: list[tuple[float, int]], weights: list[float], sums: list[float], top_k: int, top_p: float,
                 uniform: float) -> int:
    """The draw by its definition over a ranked row and the kernel's weights of it (WHOLE_ROW where the
    kernel leaves the row to torch: a top_k past CANDIDATES, a nucleus the candidates cannot tell)."""
    width = len(weights)
    top_k = 0 if top_k >= width else top_k
    if top_k > CANDIDATES:
        return WHOLE_ROW
    if top_k:
        candidates = largest(order, top_k)
        kept_weights = [weights[index] for _, index in candidates]
        kept = nucleus(kept_weights, top_p * sum_in_order(kept_weights), True) if top_p < 1.0 else len(candidates)
        return draw_kept(candidates, kept_weights, kept, uniform)
    total = sum_in_order(sums)
    if top_p >= 1.0:
        return draw_whole(weights, sums, total, uniform)
    candidates = largest(order, min(CANDIDATES, width))
    kept_weights = [weights[index] for _, index in candidates]
    kept = nucleus(kept_weights, top_p * total, len(candidates) == width)
    return draw_kept(candidates, kept_weights, kept, uniform) if kept else WHOLE_ROW


def sum_in_order(values: list[float]) -> float:
    total = 0.0
    for value in values:
        total += value
    return total


@pytest.mark.parametrize("width", [1, 15, 17, 1024, 1041, 151_936], ids=lambda width: f"width-{width}")
def test_token_weights_are_the_same_bits_on_every_path_and_within_a_few_ulp_of_e_to_the_x(paths, width):
    logits = rows_of_every_shape(width)
    for temperature in TEMPERATURES:
        temperatures = [temperature] * len(logits)
        reference = torch.ops.corechat.token_weights(logits, temperatures, paths["reference"])
        for name, path in paths.items():
            assert torch.equal(torch.ops.corechat.token_weights(logits, temperatures, path).view(torch.int32),
                               reference.view(torch.int32)), name
        values = logits.numpy()
        largest = values.max(axis=1, keepdims=True)
        with numpy.errstate(invalid="ignore", over="ignore"):
            x = (values - largest) / numpy.float32(temperature)  # float32 throughout, as the kernel
        exact = numpy.where(x >= FLOOR, numpy.exp(x.astype(numpy.float64)), 0.0)
        ulp = numpy.spacing(exact.astype(numpy.float32))
        assert numpy.all(numpy.abs(reference.numpy() - exact) <= 4 * ulp), temperature


@pytest.mark.parametrize("width", [1, 15, 17, 1041, 5000, 151_936], ids=lambda width: f"width-{width}")
def test_every_row_draws_the_token_its_definition_names(paths, width):
    """Every shape of row, top_k off, from 1 to CANDIDATES and past them, top_p and temperature at their
    edges, uniforms at 0 and next to 1: each path's token is the definition's, bit for bit."""
    logits = rows_of_every_shape(width)
    checked = whole = 0
    for temperature in TEMPERATURES:
        weights = torch.ops.corechat.token_weights(logits, [temperature] * len(logits), paths["reference"])
        for row, row_weights in zip(logits, weights):
            values, kernel_weights = row.tolist(), row_weights.tolist()
            order = ranked(values)
            sums = block_sums(row_weights.numpy())
            ties = max(collections.Counter(v for v in values if v > -INF).values())
            for top_k in (0, 1, 2, 20, CANDIDATES, CANDIDATES + 1, width):
                for top_p in TOP_P:
                    params = [(top_k, temperature, top_p, uniform) for uniform in UNIFORMS]
                    arguments = [list(each) for each in zip(*params)]
                    batch = row.expand(len(params), -1).contiguous()
                    tokens = torch.ops.corechat.draw_tokens(batch, *arguments, paths["reference"]).tolist()
                    for path in paths.values():
                        assert torch.ops.corechat.draw_tokens(batch, *arguments, path).tolist() == tokens
                    if tokens == [WHOLE_ROW] * len(params) and ties > HELD // 2:
                        whole += 1  # ties past what the kernel holds
                        continue
                    want = [defined_draw(order, kernel_weights, sums, top_k, top_p, uniform) for uniform in UNIFORMS]
                    assert tokens == want, (top_k, top_p, temperature)
                    checked += 1
    assert checked > 3 * whole  # the integer and bfloat16 rows of the whole vocabulary tie by thousands


def test_ties_past_the_candidates_leave_the_row_to_the_draw_by_probabilities(paths):
    """Every token tied at the top_k-th logit: the kernel cannot hold them, says so, and the sampler then
    draws the row by its probabilities, the same token alone and beside a row the kernel draws."""
    width = 151_936
    tied = torch.zeros(1, width)
    assert torch.ops.corechat.draw_tokens(tied, [20], [1.0], [1.0], [0.5]).tolist() == [WHOLE_ROW]
    other = torch.randn(1, width, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.8, top_k=20, seed=4)
    alone = [sample_tokens([Sampler(params, width)], row)[0] for row in (tied, other)]
    assert 0 <= alone[0] < width
    assert sample_tokens([Sampler(params, width), Sampler(params, width)], torch.cat([tied, other])) == alone
    assert sample_tokens([Sampler(params, width), Sampler(params, width)], torch.cat([other, tied])) == alone[::-1]


@pytest.mark.parametrize("top_k, top_p, kept", [
    (4, 0.7, {1: 0.4 / 0.65, 3: 0.25 / 0.65}),  # top_k keeps 0.9 of the mass; 0.7 of it: 0.4 and 0.25
    (0, 1.0, {0: 0.04, 1: 0.4, 2: 0.1, 3: 0.25, 4: 0.06, 5: 0.15}),  # the whole vocabulary
    (0, 0.7, {1: 0.4 / 0.8, 3: 0.25 / 0.8, 5: 0.15 / 0.8}),  # 0.65 before 0.15 is less than 0.7: kept
], ids=["top_k-and-top_p", "temperature-alone", "top_p-alone"])
def test_draws_follow_the_kept_probabilities(top_k, top_p, kept):
    """Over many positions of one seed a row's draws follow its kept tokens' probabilities, renormalised."""
    logits = torch.log(torch.tensor([0.04, 0.4, 0.1, 0.25, 0.06, 0.15]))
    samplers = [Sampler(SamplingParams(max_tokens=1, temperature=1.0, top_k=top_k, top_p=top_p, seed=42), 6)
                for _ in range(20_000)]
    for position, sampler in enumerate(samplers):
        sampler.position = position
    draws = collections.Counter(sample_tokens(samplers, logits.expand(len(samplers), -1).contiguous()))
    assert set(draws) == set(kept)
    for token, share in kept.items():
        assert abs(draws[token] / 20_000 - share) < 0.015, draws


@pytest.mark.parametrize("bad", [
    {"top_k": [-1]}, {"temperatures": [0.0]}, {"temperatures": [SMALLEST_NORMAL / 2]}, {"temperatures": [1e39]},
    {"top_p": [1.5]}, {"uniforms": [1.0]}, {"uniforms": [-0.0 - 1e-300]}, {"top_p": []},
], ids=["top_k-negative", "temperature-0", "temperature-subnormal", "temperature-past-float32", "top_p-past-1",
        "uniform-1", "uniform-negative", "missing-top_p"])
def test_arguments_out_of_range_are_refused(bad):
    kernels.load()
    arguments = {"top_k": [5], "temperatures": [1.0], "top_p": [1.0], "uniforms": [0.5]} | bad
    with pytest.raises(RuntimeError):
        torch.ops.corechat.draw_tokens(torch.zeros(1, 10), arguments["top_k"], arguments["temperatures"],
                                       arguments["top_p"], arguments["uniforms"])
