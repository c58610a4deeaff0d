"""A real model moved off the grid its GGUF file stored it on, for judging weight formats fairly.

SmolLM2's only installable copy is a Q4_1 GGUF file: its layers' weights lie exactly on q4_1's grid (a
minimum plus 0..15 steps per group of 32) and its embedding on q8_0's, so a format that can hold that
grid (int4m, q4_1, q8_0's output layer) stores them almost without loss, which says little of a model
trained in floating point. This moves every weight of every matrix by uniform noise within half a step of
that grid (seeded), so each group's weights fill their range as a float model's do, while the model stays
the same model within its own quantization error.
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GROUP = 32
# Steps across a group's range on the grid the GGUF file stored each matrix on: Q8_0 (-127..127) for the
# embedding, Q4_1 (0..15) for the rest.
EMBEDDING_STEPS, LAYER_STEPS = 254, 15


def moved_off_grid(name: str, weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Return a matrix with each weight moved by uniform noise within half its group's grid step."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return weight
    groups = weight.float().reshape(-1, GROUP)
    steps = EMBEDDING_STEPS if "embed_tokens" in name else LAYER_STEPS
    step = (groups.amax(dim=1, keepdim=True) - groups.amin(dim=1, keepdim=True)) / steps
    noise = (torch.rand(groups.shape, generator=generator) - 0.5) * step
    return (groups + noise).reshape(weight.shape).to(weight.dtype)


def off_grid_model(model_dir: Path, root: Path, seed: int = 0) -> Path:
    """Return a copy of a model folder with its matrices moved off their grid (built once under `root`)."""
    target = root / f"{model_dir.name}-off-grid-{seed}"
    if (target / "model.safetensors").is_file():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in model_dir.iterdir():
        # The model's own files only: not corechat's conversions, locks or hashes of the original weights.
        if path.is_file() and not path.name.startswith((".", "corechat-")) and path.name != "model.safetensors":
            shutil.copy2(path, partial / path.name)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(model_dir / "model.safetensors")
    save_file({name: moved_off_grid(name, tensor, generator).contiguous() for name, tensor in sorted(tensors.items())},
              str(partial / "model.safetensors"))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
