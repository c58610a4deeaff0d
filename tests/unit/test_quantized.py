"""The converted weights file (service/engine/converted.py): its layout tied to the kernels', and only
this version's conversion of this model ever read."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.engine import kernels, quantized
from service.engine.converted import (
    DIGEST,
    apply_quantized,
    conversion_metadata,
    converted_file_for,
    names_conversion,
    stored_metadata,
)
from service.engine.loading import load_model, load_tokenizer
from service.engine.quantized import INT8, LAYOUT, LayoutMismatch, check_layout, kernels_layout
from service.settings import Settings

FINGERPRINT = "0123456789abcdef"


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    """Load (building if needed) this CPU's kernels."""
    kernels.load(Path(Settings().kernels_dir))


@pytest.fixture()
def model_dir(tiny_model_dir, tmp_path) -> Path:
    """Return a copy of the tiny model without any converted file."""
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy, ignore=shutil.ignore_patterns("corechat-*", ".*"))
    return copy


def test_the_kernels_read_the_layout_the_converter_writes():
    """torch.ops.corechat.layout() reports kernels.h's constants, and they are the converter's."""
    assert kernels_layout() == LAYOUT
    check_layout()


def test_a_converter_whose_layout_differs_from_the_kernels_converts_nothing(monkeypatch, model_dir, tmp_path):
    """Had kernels.h's interleave changed without the converter's, loading stops with the reason."""
    monkeypatch.setattr(quantized, "LAYOUT", {**LAYOUT, "interleave": 8})
    model = load_model(model_dir, torch.bfloat16)
    with pytest.raises(LayoutMismatch, match="interleave"):
        apply_quantized(model, load_tokenizer(model_dir), INT8, model_dir, tmp_path / "converted", FINGERPRINT)
    assert not list(model_dir.glob("corechat-*"))


def test_a_converted_files_name_carries_the_kernels_layout(model_dir, tmp_path):
    """A change of layout in kernels.h (and so in the converter) names another file."""
    layout = kernels_layout()
    name = converted_file_for(INT8, model_dir, tmp_path, FINGERPRINT).name
    assert f"-t{layout['tile_outputs']}k{layout['group_inputs']}g{layout['block']}-" in name
    assert name.endswith(f"-{FINGERPRINT}.safetensors")


@pytest.mark.parametrize("stale", ["older-version", "another-model", "another-layout", "no-digest", "no-metadata",
                                   "truncated"])
def test_a_stale_or_foreign_converted_file_is_converted_again_not_read(model_dir, tmp_path, stale):
    """A file at the converted file's name that another version, model or layout wrote (or one without
    its tensors' digest, or a truncated one) is replaced by a fresh conversion, which the model then reads."""
    target = converted_file_for(INT8, model_dir, tmp_path / "converted", FINGERPRINT)
    expected = conversion_metadata(INT8, FINGERPRINT)
    wrong = {"older-version": {**expected, "version": "2"}, "another-model": {**expected, "fingerprint": "f" * 16},
             "another-layout": {**expected, "layout": "i8u32g32"}, "no-digest": expected, "no-metadata": None}
    if stale == "truncated":
        target.write_bytes(b"\x08\x00\x00")
    else:
        save_file({"lm_head.weight.qweight": torch.zeros(4, 32, dtype=torch.int8)}, str(target), metadata=wrong[stale])
    model = load_model(model_dir, torch.bfloat16)
    tokenizer = load_tokenizer(model_dir)
    converted, digest = apply_quantized(model, tokenizer, INT8, model_dir, tmp_path / "converted", FINGERPRINT)
    assert converted == target
    assert names_conversion(stored_metadata(target), INT8, FINGERPRINT)
    assert stored_metadata(target)[DIGEST] == digest
    assert model.lm_head.qweight.shape[0] == model.config.vocab_size


def test_a_conversion_that_died_leaves_no_temporary_behind(model_dir, tmp_path):
    """A worker killed mid-conversion leaves its temporary (hundreds of MB for a real model); the next
    conversion, under the same lock, removes it. Another model's temporary is left to its own lock."""
    target = converted_file_for(INT8, model_dir, tmp_path / "converted", FINGERPRINT)
    dead_writers = [target.with_name(f".{target.name}.{pid}.tmp") for pid in (4242, 4243)]
    other_model = target.with_name(f".{target.name.replace(FINGERPRINT, 'f' * 16)}.4244.tmp")
    for temporary in [*dead_writers, other_model]:
        temporary.write_bytes(b"half a conversion")
    model = load_model(model_dir, torch.bfloat16)
    apply_quantized(model, load_tokenizer(model_dir), INT8, model_dir, tmp_path / "converted", FINGERPRINT)
    assert not any(temporary.exists() for temporary in dead_writers)
    assert other_model.exists()
    assert sorted(path.name for path in model_dir.glob(".*.tmp")) == [other_model.name]
