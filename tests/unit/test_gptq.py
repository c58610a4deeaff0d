"""GPTQ's rounding of the 4-bit formats (service/engine/gptq.py) and the conversion that uses it
(service/engine/converted.py): the stored format unchanged, the products closer, a grid kept exactly."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from service.engine import gptq, kernels
from service.engine.calibration import WINDOW, calibration_windows
from service.engine.converted import (
    DIGEST,
    SCALE_SUFFIX,
    WEIGHT_SUFFIX,
    apply_quantized,
    format_of,
    quantized_weight_names,
    stored_metadata,
)
from service.engine.loading import load_model, load_tokenizer
from service.engine.quantized import (
    INT4,
    INT4_LEVELS,
    INT4_OFFSET,
    INT4M,
    INT4M_LEVELS,
    INT6,
    INT8,
    QUANTIZE,
    dequantize,
    int4_grid,
    int4m_grid,
    levels_on,
)
from service.engine.tiles import padded_rows, unpack_nibbles
from service.settings import Settings

FINGERPRINT = "0123456789abcdef"
FOUR_BIT = [INT4, INT4M]


def correlated_inputs(count: int, width: int, seed: int) -> torch.Tensor:
    """Return inputs as a layer meets them: features that go together and channels of very different
    sizes, the same structure for every seed (only the samples differ)."""
    structure = torch.Generator().manual_seed(0)
    mixing = torch.randn(width, width, generator=structure) / width**0.25
    channels = torch.exp(torch.randn(width, generator=structure))
    samples = torch.randn(count, width, generator=torch.Generator().manual_seed(seed))
    return (samples + samples @ mixing) * channels


def restored(fmt, weight: torch.Tensor, moments: torch.Tensor | None = None) -> torch.Tensor:
    """Return what the format stores for a weight, dequantized."""
    return dequantize(fmt, *QUANTIZE[fmt.name](weight, moments), weight.shape[0])


@pytest.mark.parametrize("fmt", [*FOUR_BIT, INT6], ids=lambda fmt: fmt.name)
def test_gptq_brings_the_products_closer_than_nearest_rounding(fmt):
    """On the inputs it was calibrated on, and on fresh ones alike, the products of the GPTQ-rounded
    matrix lie closer to the float products than those of the nearest rounding (0.34-0.52 of the
    squared error for the 4-bit formats; int6, the output layer's, rounded in its rotated space)."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    calibration, fresh = correlated_inputs(2048, 256, seed=2), correlated_inputs(512, 256, seed=3)
    moments = calibration.T @ calibration
    for inputs in (calibration, fresh):
        expected = inputs @ weight.T
        nearest = (inputs @ restored(fmt, weight).T - expected).square().sum()
        minded = (inputs @ restored(fmt, weight, moments).T - expected).square().sum()
        assert minded < 0.7 * nearest


GRIDS = {"int4": (int4_grid, INT4_LEVELS), "int4m": (int4m_grid, INT4M_LEVELS)}


def weighted_error(groups, importance, scales, minimums, levels_range) -> torch.Tensor:
    """Return each group's importance-weighted squared error when rounded to its nearest level."""
    scales, minimums = scales.float(), minimums.float()
    levels = levels_on(groups, scales, minimums, *levels_range)
    return (importance * (levels * scales[:, :, None] + minimums[:, :, None] - groups).square()).sum(dim=2)


def nearest_on_searched_grid(fmt, weight: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """Return a matrix rounded to its nearest levels on the grid the format's search picks with each
    input's importance [inputs]."""
    grid, levels_range = GRIDS[fmt.name]
    groups = weight.reshape(weight.shape[0], -1, 32)
    scales, minimums = grid(groups, importance.reshape(-1, 32))
    levels = levels_on(groups, scales.float(), minimums.float(), *levels_range)
    return (levels * scales.float()[:, :, None] + minimums.float()[:, :, None]).reshape(weight.shape)


@pytest.mark.parametrize("name", GRIDS)
def test_the_grid_search_never_rounds_a_group_worse_than_the_plain_rule(name):
    """Each group's chosen grid leaves an importance-weighted error no larger than the plain rule that
    serves without importance (q4_1's minimum and range; q4_0's extreme at -8, or at 7 where that fits
    better), and a smaller one for most groups: groups with outliers, and inputs whose importance
    spans six orders of magnitude."""
    grid, levels_range = GRIDS[name]
    generator = torch.Generator().manual_seed(12)
    groups = torch.randn(64, 8, 32, generator=generator)
    groups[:, :, 5] *= 8  # an outlier input in every group
    importance = torch.exp(torch.randn(8, 32, generator=generator) * 3)
    scales, minimums = grid(groups, importance)
    plain_scales, plain_minimums = grid(groups, None)
    if name == "int4":
        extreme = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
        assert torch.isin((extreme / plain_scales.float()).round(), torch.tensor([-8.0, 7.0])).all()
    else:
        assert torch.equal(plain_minimums, groups.amin(dim=2).half())
        assert torch.equal(plain_scales, ((groups.amax(dim=2) - groups.amin(dim=2)) / 15).half())
    chosen = weighted_error(groups, importance, scales, minimums, levels_range)
    plain = weighted_error(groups, importance, plain_scales, plain_minimums, levels_range)
    assert scales.dtype == minimums.dtype == torch.float16
    assert (chosen <= plain).all()
    assert (chosen < plain).float().mean() > 0.9


@pytest.mark.parametrize("name", GRIDS)
def test_the_grid_search_handles_zero_subnormal_and_float16_bound_groups(name):
    """A group of zeros keeps a zero grid; subnormal and float16-bound groups get finite grids whose
    rounding stays finite; one input of zero importance among others changes nothing of that."""
    grid, levels_range = GRIDS[name]
    groups = torch.randn(4, 4, 32, generator=torch.Generator().manual_seed(13))
    groups[0, 0] = 0.0
    groups[1, 1] = 1e-40
    groups[1, 2] = torch.linspace(-1e-38, 1e-38, 32)
    groups[2, 3] = 60000.0
    groups[2, 3, 7] = -65504.0
    importance = torch.ones(4, 32)
    importance[0, 3] = 0.0
    scales, minimums = grid(groups, importance)
    assert scales.isfinite().all() and minimums.isfinite().all()
    assert scales[0, 0] == 0 and minimums[0, 0] == 0
    levels = levels_on(groups, scales.float(), minimums.float(), *levels_range)
    assert (levels * scales.float()[:, :, None] + minimums.float()[:, :, None]).isfinite().all()


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_independent_inputs_make_gptq_the_nearest_rounding_on_the_weighted_grid(fmt):
    """Moments with no cross terms (inputs that never move together) spread no column's error to another:
    GPTQ gives the nearest rounding on the grid its search picks with H's diagonal as the importance,
    whatever order it rounds the columns in."""
    generator = torch.Generator().manual_seed(14)
    weight = torch.randn(16, 128, generator=generator)
    diagonal = torch.exp(torch.randn(128, generator=generator) * 2)
    assert torch.equal(restored(fmt, weight, torch.diag(diagonal)), nearest_on_searched_grid(fmt, weight, diagonal))


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_gptq_stores_the_formats_own_levels_and_scales(fmt):
    """GPTQ's matrix is an ordinary matrix of the format: each group's weights lie within the level range
    on the float16 scale (and minimum) the format's search picked for the group's weights as given,
    with each input weighed by its mean square, so the kernels read it as before; the rows the
    kernels' tiles pad to 16 stay at the padding level."""
    weight = torch.randn(20, 128, generator=torch.Generator().manual_seed(4))
    inputs = correlated_inputs(1024, 128, seed=5)
    moments = inputs.T @ inputs
    packed, scales = QUANTIZE[fmt.name](weight, moments)
    assert packed.shape[0] == padded_rows(20)
    assert (unpack_nibbles(packed)[20:] == (INT4_OFFSET if fmt is INT4 else 0)).all()
    back = dequantize(fmt, packed, scales, 20).reshape(20, 4, 32)
    grid, (low, high) = GRIDS[fmt.name]
    searched_scales, searched_minimums = grid(weight.reshape(20, 4, 32), moments.diagonal().reshape(4, 32))
    steps = (back - searched_minimums.float()[:, :, None]) / searched_scales.float()[:, :, None]
    assert (steps - steps.round()).abs().max() < 1e-3
    assert steps.round().min() >= low and steps.round().max() <= high


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_weights_on_the_grid_stay_there_under_gptq(fmt):
    """A matrix whose groups already lie on the format's grid (SmolLM2's GGUF weights lie on q4_1's)
    makes no error to spread: GPTQ returns it bit for bit, as the nearest rounding does."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(32, 256, generator=generator) * 0.05
    on_grid = restored(fmt, weight)
    assert torch.equal(restored(fmt, on_grid), on_grid)
    inputs = correlated_inputs(1024, 256, seed=7)
    assert torch.equal(restored(fmt, on_grid, inputs.T @ inputs), on_grid)


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_inputs_the_calibration_never_saw_leave_gptq_as_nearest_rounding(fmt):
    """Moments of all zeros (no input ever varied) make H the identity: no column's error reaches
    another, and the bits are the nearest rounding on the grid searched with every input weighing the
    same; a few unseen inputs among seen ones keep every weight finite and on the grid."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(8))
    expected = nearest_on_searched_grid(fmt, weight, torch.ones(128))
    assert torch.equal(restored(fmt, weight, torch.zeros(128, 128)), expected)
    inputs = correlated_inputs(512, 128, seed=9)
    inputs[:, 40:72] = 0
    back = restored(fmt, weight, inputs.T @ inputs)
    assert torch.isfinite(back).all()


def test_gptq_handles_zero_and_subnormal_groups_and_the_bounds_of_float16():
    """Groups of zeros, of subnormal float32 weights, and at float16's largest values come back finite,
    a zero group as zeros, beside ordinary groups."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(10))
    weight[0, :32] = 0.0
    weight[1, :32] = 1e-40
    weight[2, 32:64] = 60000.0
    weight[2, 33] = -60000.0
    inputs = correlated_inputs(512, 128, seed=11)
    for fmt in FOUR_BIT:
        back = restored(fmt, weight, inputs.T @ inputs)
        assert torch.isfinite(back).all()
        assert torch.equal(back[0, :32], torch.zeros(32))


@pytest.fixture()
def model_dir(tiny_model_dir, tmp_path) -> Path:
    """Return a copy of the tiny model without any converted file."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy, ignore=shutil.ignore_patterns("corechat-*", ".*"))
    return copy


def test_the_calibration_text_is_whole_windows_of_the_models_tokens(tiny_model_dir):
    """The calibration text gives at least four windows of WINDOW tokens, as the tokenizer reads it."""
    windows = calibration_windows(load_tokenizer(tiny_model_dir))
    assert windows.shape[0] >= 4 and windows.shape[1] == WINDOW


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_a_4bit_conversion_rounds_by_gptq_keeps_values_int8_and_names_its_digest(model_dir, tmp_path, fmt):
    """Converting the tiny model to a 4-bit format rounds every layer's Linear by GPTQ (not as the
    nearest rounding would), the output layer as int6 by GPTQ on the decoder's output and the value
    products as int8, and writes the tensors' digest that the engine's fingerprint includes."""
    kernels.load(Path(Settings().kernels_dir))
    model = load_model(model_dir, torch.bfloat16)
    names = quantized_weight_names(model)
    target, digest = apply_quantized(model, load_tokenizer(model_dir), fmt, model_dir, tmp_path / "converted",
                                     FINGERPRINT)
    assert stored_metadata(target)[DIGEST] == digest and len(digest) == 16
    source = load_model(model_dir, torch.bfloat16).state_dict()
    differs = 0
    with safe_open(target, "pt") as file:
        for weight_name in names.values():
            stored = format_of(fmt, weight_name)
            assert (stored is INT8) == (".v_proj." in weight_name)
            assert (stored is INT6) == (weight_name == "lm_head.weight")
            if stored is INT8:
                continue
            weight = source.get(weight_name, source["model.embed_tokens.weight"])
            packed, scales = file.get_tensor(weight_name + WEIGHT_SUFFIX), file.get_tensor(weight_name + SCALE_SUFFIX)
            nearest = QUANTIZE[stored.name](weight)[0]
            differs += not torch.equal(packed, nearest)
            assert torch.isfinite(dequantize(stored, packed, scales, weight.shape[0])).all()
    assert differs == sum(format_of(fmt, name) is not INT8 for name in names.values())


def test_a_model_whose_layers_are_not_found_is_left_to_nearest_rounding():
    """A model without model.layers is not run: layer_moments calls nothing and says so."""
    called = []
    assert gptq.layer_moments(torch.nn.Linear(4, 4), torch.zeros(1, 4, dtype=torch.long), called.append) is False
    assert called == []
