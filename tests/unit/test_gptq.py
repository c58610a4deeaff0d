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
from service.engine.quantized import INT4, INT4M, INT8, QUANTIZE, dequantize, padded_rows
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


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_gptq_brings_the_products_closer_than_nearest_rounding(fmt):
    """On the inputs it was calibrated on, and on fresh ones alike, the products of the GPTQ-rounded
    matrix lie closer to the float products than those of the nearest rounding (0.83-0.86 of the
    squared error at DAMPING 1; about 0.55 at GPTQ's usual 0.01, which fits the short calibration
    text worse)."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    calibration, fresh = correlated_inputs(2048, 256, seed=2), correlated_inputs(512, 256, seed=3)
    moments = calibration.T @ calibration
    for inputs in (calibration, fresh):
        expected = inputs @ weight.T
        nearest = (inputs @ restored(fmt, weight).T - expected).square().sum()
        minded = (inputs @ restored(fmt, weight, moments).T - expected).square().sum()
        assert minded < 0.9 * nearest


@pytest.mark.parametrize("fmt", FOUR_BIT, ids=lambda fmt: fmt.name)
def test_gptq_stores_the_formats_own_levels_and_scales(fmt):
    """GPTQ's matrix is an ordinary matrix of the format: each group's weights lie on its stored
    float16 scale (and minimum) within the level range, so the kernels read it as before; the rows the
    kernels' tiles pad to 16 stay at the padding level."""
    weight = torch.randn(20, 128, generator=torch.Generator().manual_seed(4))
    inputs = correlated_inputs(1024, 128, seed=5)
    packed, scales = QUANTIZE[fmt.name](weight, inputs.T @ inputs)
    assert packed.shape[0] == padded_rows(20)
    back = dequantize(fmt, packed, scales, 20).reshape(20, 4, 32)
    again = dequantize(fmt, *QUANTIZE[fmt.name](back.reshape(20, 128)), 20).reshape(20, 4, 32)
    # Nearest rounding of weights already on a group's grid gives them back, grid and all, wherever
    # the group reaches its grid's ends, as GPTQ's groups take their grid from their own weights.
    assert (back == again).float().mean() > 0.9
    assert torch.isfinite(back).all()


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
    another, and the bits are the nearest rounding's; a few unseen inputs among seen ones keep every
    weight finite and on the grid."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(8))
    assert torch.equal(restored(fmt, weight, torch.zeros(128, 128)), restored(fmt, weight))
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
    nearest rounding would), stores the value products and the output layer as int8, and writes the
    tensors' digest that the engine's fingerprint includes."""
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
            assert (stored is INT8) == (weight_name == "lm_head.weight" or ".v_proj." in weight_name)
            if stored is INT8:
                continue
            weight = source[weight_name]
            packed, scales = file.get_tensor(weight_name + WEIGHT_SUFFIX), file.get_tensor(weight_name + SCALE_SUFFIX)
            nearest = QUANTIZE[fmt.name](weight)[0]
            differs += not torch.equal(packed, nearest)
            assert torch.isfinite(dequantize(fmt, packed, scales, weight.shape[0])).all()
    assert differs == sum(format_of(fmt, name) is fmt for name in names.values())


def test_a_model_whose_layers_are_not_found_is_left_to_nearest_rounding():
    """A model without model.layers is not run: layer_moments calls nothing and says so."""
    called = []
    assert gptq.layer_moments(torch.nn.Linear(4, 4), torch.zeros(1, 4, dtype=torch.long), called.append) is False
    assert called == []
