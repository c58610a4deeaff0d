"""The converted weights file: every quantized Linear of a model in one safetensors file beside it
(or in CONVERTED_WEIGHTS_DIR), converted once and memory-mapped by every worker.

The file is memory-mapped like the model's own, so every worker reads the same page-cache pages, and
it holds exactly the layout the kernels read (quantized.py, tiles.py): nothing is repacked per worker.
Its name and metadata carry the format, its version, the layout and the model's fingerprint, so a file of any
other is converted again, never read; the metadata also holds a digest of its tensors. The 4-bit
formats run the model once over the calibration text while converting (gptq.py): 2-2.5 minutes
for Qwen2.5-0.5B on 2 cores, once.
"""

import fcntl
import hashlib
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from . import gptq
from .calibration import calibration_windows
from .loading import map_safetensors, safetensors_files
from .quantized import (
    CALIBRATED,
    FORMAT_VERSION,
    INT6,
    INT8,
    PACKED,
    QUANTIZE,
    QuantizedLinear,
    WeightFormat,
    check_layout,
)
from .tiles import LAYOUT_TOKEN

log = logging.getLogger(__name__)

WEIGHT_SUFFIX = ".qweight"
SCALE_SUFFIX = ".qscale"
OUTPUT_LAYER = "lm_head.weight"
VALUE_SUFFIX = ".self_attn.v_proj.weight"
EMBEDDING = "model.embed_tokens.weight"
DIGEST = "digest"


def format_of(fmt: WeightFormat, weight_name: str) -> WeightFormat:
    """Return the format a weight is stored in under DTYPE `fmt`. The output layer: int8 under int8, and
    int6 under the 4-bit formats, as llama.cpp's q4_0 and q4_K_M keep it at 6 bits (q6_K; q8_0 where
    its rows are not whole multiples of 256, as on Qwen2.5-0.5B and SmolLM2). The 4-bit formats' value
    products: int8, as q4_K_M keeps them at more bits: on SmolLM2 they are 3% of a layer's weights
    and, rounded to 4 bits alone, a third of int4m's KL divergence."""
    if weight_name == OUTPUT_LAYER:
        return INT6 if fmt in PACKED else INT8
    if fmt in PACKED and weight_name.endswith(VALUE_SUFFIX):
        return INT8
    return fmt


def quantized_weight_names(model) -> dict[str, str]:
    """Map each quantized Linear's module name to the checkpoint name of its weight."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            names[name] = f"{name}.weight"
    names["lm_head"] = OUTPUT_LAYER
    return names


def conversion_metadata(fmt: WeightFormat, fingerprint: str) -> dict[str, str]:
    """Return the metadata that names a converted file of this format, version and layout, for this model
    (the file also holds its tensors' DIGEST)."""
    return {"format": fmt.name, "version": str(FORMAT_VERSION), "layout": LAYOUT_TOKEN, "fingerprint": fingerprint}


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """Return a hash of the tensors' names and bytes. GPTQ's rounding follows a calibration forward whose
    last bits depend on the CPU, so two hosts may convert one model differently: the digest joins the
    engine's fingerprint, and hosts whose weights differ never share cached replies or KV state."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def stored_metadata(path: Path) -> dict[str, str] | None:
    """Return a safetensors file's metadata ({} where it has none), or None where it is missing or unreadable."""
    try:
        with safe_open(path, "pt") as file:
            return file.metadata() or {}
    except (OSError, SafetensorError):
        return None


def names_conversion(found: dict[str, str] | None, fmt: WeightFormat, fingerprint: str) -> bool:
    """Tell whether a file's metadata is this version's conversion of this model to this format and layout."""
    if found is None or not found.get(DIGEST):
        return False
    return {key: value for key, value in found.items() if key != DIGEST} == conversion_metadata(fmt, fingerprint)


def holds_conversion(path: Path, fmt: WeightFormat, fingerprint: str) -> bool:
    """Tell whether a file is this version's conversion of this model to this format and layout."""
    return names_conversion(stored_metadata(path), fmt, fingerprint)


def converted_file_for(fmt: WeightFormat, model_dir: Path, converted_dir: Path, fingerprint: str) -> Path:
    """Return where a model's converted weights live: beside it, or in the converted folder if it is
    read-only and holds no good conversion."""
    beside = model_dir / f"corechat-{fmt.name}-v{FORMAT_VERSION}-{LAYOUT_TOKEN}-{fingerprint}.safetensors"
    if os.access(model_dir, os.W_OK) or holds_conversion(beside, fmt, fingerprint):
        return beside
    return converted_dir / beside.name


def convert(fmt: WeightFormat, model_dir: Path, model, tokenizer, target: Path, fingerprint: str) -> str:
    """Write the quantized weights and scales of every Linear (the output layer included: format_of) to one
    file, and return their digest; the 4-bit formats' layers and output layer are rounded by GPTQ on the
    calibration text (gptq.py), where the model's decoder layers can be found."""
    state = {}
    for path in safetensors_files(model_dir):
        state.update(map_safetensors(path))
    tensors = {}

    def quantize(weight_name: str, moments=None) -> None:
        source = state.get(weight_name)
        if source is None and weight_name == OUTPUT_LAYER:
            source = state[EMBEDDING]  # tied output layer
        stored = format_of(fmt, weight_name)
        if source.shape[1] % stored.width_multiple:
            raise ValueError(f"{stored.name} needs Linear input widths that are multiples of {stored.width_multiple}; "
                             f"{weight_name} has {source.shape[1]}")
        rounding = QUANTIZE[stored.name]
        stored_tensors = rounding(source, moments) if stored in CALIBRATED else rounding(source)
        tensors[weight_name + WEIGHT_SUFFIX], tensors[weight_name + SCALE_SUFFIX] = stored_tensors

    def quantize_layer(moments) -> None:
        for weight_name, layer_moments in moments.items():
            quantize(weight_name, layer_moments)

    if fmt in PACKED:
        gptq.layer_moments(model, calibration_windows(tokenizer), quantize_layer, OUTPUT_LAYER)
    for weight_name in quantized_weight_names(model).values():
        if weight_name + WEIGHT_SUFFIX not in tensors:
            quantize(weight_name)
    digest = tensors_digest(tensors)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temporary), metadata={**conversion_metadata(fmt, fingerprint), DIGEST: digest})
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return digest


def apply_quantized(model, tokenizer, fmt: WeightFormat, model_dir: Path, converted_dir: Path,
                    fingerprint: str) -> tuple[Path, str]:
    """Swap every Linear of a loaded bf16 model for a QuantizedLinear over the mapped converted file
    (kernels loaded); return the file and its tensors' digest."""
    check_layout()
    target = converted_file_for(fmt, model_dir, converted_dir, fingerprint)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Workers start together: one converts while the others wait, then all map the same file.
    # Each converting on its own and renaming over the other's would leave workers mapping
    # different inodes, and so holding one copy each instead of sharing one.
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Every writer converts under this lock, so a temporary found while holding it is a dead
        # writer's: a worker killed mid-conversion (by the OOM killer, say) leaves hundreds of MB.
        for leftover in target.parent.glob(f".{target.name}.*.tmp"):
            log.warning("removing %s, left by a conversion that did not finish", leftover)
            leftover.unlink(missing_ok=True)
        found = stored_metadata(target)
        if names_conversion(found, fmt, fingerprint):
            digest = found[DIGEST]
        else:
            if target.exists():
                # Another version's, another model's, or a truncated file: read as this one, it would be garbage.
                log.warning("%s holds no conversion of this model by this corechat (metadata %s); converting again",
                            target, found)
            log.info("converting the weights to %s once, into %s", fmt.name, target)
            digest = convert(fmt, model_dir, model, tokenizer, target, fingerprint)
    tensors = map_safetensors(target)
    for module_name, weight_name in quantized_weight_names(model).items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        # Biases are small: a private float32 copy lets the kernel add them before its one rounding.
        bias = old.bias.detach().float() if old.bias is not None else None
        setattr(parent, child, QuantizedLinear(tensors[weight_name + WEIGHT_SUFFIX], tensors[weight_name + SCALE_SUFFIX],
                                               bias, format_of(fmt, weight_name), old.out_features,
                                               float32_output=module_name == "lm_head"))
    return target, digest
