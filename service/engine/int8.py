"""8-bit weights: each Linear's weight as int8 with one bf16 scale per output row.

Converted once into a safetensors file beside the others and memory-mapped like them, so every
worker reads the same page-cache pages (no private packed copy, no fp32 detour at load).

Two matrix products read that one file. Decoding uses torch's `_weight_int8pack_mm`: bf16
activations, int8 weights, half the bytes of bf16 per token. Prompt passes (inside `prompt_pass`)
round their activations to int8 too, one scale per token, and multiply int8 by int8 with
`torch._int_mm` (oneDNN, VNNI where the CPU has it): 2-3x faster than the weight-only product,
which is slow with many rows (README, Performance). The choice follows the kind of pass, never the
number of rows, so a token's rounding does not depend on how its prompt was cut or what else runs.
"""

import fcntl
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .loading import map_safetensors, safetensors_files

log = logging.getLogger(__name__)

INT8_SUFFIX = ".int8"
SCALE_SUFFIX = ".scale"
OUTPUT_LAYER = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


@dataclass
class Int8Mode:
    """What a model's Int8Linear layers share: whether prompt passes round activations, and whether one runs."""

    prompt_activations: bool
    in_prompt_pass: bool = False


@contextmanager
def prompt_pass(model):
    """Mark the forwards inside as a prompt pass (for a model without int8 layers, nothing changes)."""
    mode = getattr(model, "int8_mode", None)
    if mode is None:
        yield
        return
    mode.in_prompt_pass = True
    try:
        yield
    finally:
        mode.in_prompt_pass = False


class Int8Linear(nn.Module):
    """A bias-optional Linear whose weight is int8 rows times bf16 row scales."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, mode: Int8Mode):
        super().__init__()
        self.mode = mode
        self.register_buffer("weight_int8", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Multiply activations by the int8 weight: rounded to int8 too in prompt passes, else bf16."""
        flat = inputs.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.mode.prompt_activations and self.mode.in_prompt_pass:
            output = int8_matmul(flat, self.weight_int8, self.scales)
        else:
            output = torch._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            output.add_(self.bias)
        return output.reshape(*inputs.shape[:-1], self.out_features)


def int8_matmul(inputs: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Quantize bf16 rows to int8 (one scale each), multiply by the int8 weight, rescale to bf16."""
    inputs = inputs.to(torch.float32, copy=True)
    row_scales = (inputs.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    rows = inputs.div_(row_scales).round_().to(torch.int8)
    # In place: at prompt sizes the product is megabytes, and fresh temporaries cost page faults.
    return torch._int_mm(rows, weight.t()).float().mul_(row_scales).mul_(scales).to(torch.bfloat16)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a matrix symmetrically per output row; return int8 rows and bf16 scales."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
    rows = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return rows, scales.to(torch.bfloat16)


def int8_weight_names(model) -> dict[str, str]:
    """Map each quantized Linear's module name to the checkpoint name of its weight."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            names[name] = f"{name}.weight"
    names["lm_head"] = OUTPUT_LAYER
    return names


def int8_file_for(model_dir: Path, converted_dir: Path, fingerprint: str) -> Path:
    """Return where a model's int8 weights live: beside it, or in the converted folder if it is read-only."""
    beside = model_dir / f"corechat-int8-{fingerprint}.safetensors"
    if beside.is_file() or os.access(model_dir, os.W_OK):
        return beside
    return converted_dir / beside.name


def convert_to_int8(model_dir: Path, model, target: Path) -> None:
    """Write the int8 rows and scales of every Linear (the output layer included) to one file."""
    state = {}
    for path in safetensors_files(model_dir):
        state.update(map_safetensors(path))
    tensors = {}
    for weight_name in int8_weight_names(model).values():
        source = state.get(weight_name)
        if source is None and weight_name == OUTPUT_LAYER:
            source = state[EMBEDDING]  # tied output layer
        rows, scales = quantize_rows(source)
        tensors[weight_name + INT8_SUFFIX], tensors[weight_name + SCALE_SUFFIX] = rows, scales
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    save_file(tensors, str(temporary))
    os.chmod(temporary, 0o644)
    os.replace(temporary, target)


def apply_int8(model, model_dir: Path, converted_dir: Path, fingerprint: str, prompt_activations: bool) -> Path:
    """Swap every Linear of a loaded bf16 model for an Int8Linear over the mapped int8 file.

    With prompt_activations, products inside `prompt_pass` round their activations to int8 as well.
    """
    target = int8_file_for(model_dir, converted_dir, fingerprint)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Workers start together: one converts while the others wait, then all map the same file.
    # Each converting on its own and renaming over the other's would leave workers mapping
    # different inodes, and so holding one copy each instead of sharing one.
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            log.info("converting the weights to int8 once, into %s", target)
            convert_to_int8(model_dir, model, target)
    tensors = map_safetensors(target)
    model.int8_mode = Int8Mode(prompt_activations)
    for module_name, weight_name in int8_weight_names(model).items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        bias = old.bias.detach() if old.bias is not None else None
        setattr(parent, child, Int8Linear(tensors[weight_name + INT8_SUFFIX], tensors[weight_name + SCALE_SUFFIX],
                                          bias, model.int8_mode))
    return target
