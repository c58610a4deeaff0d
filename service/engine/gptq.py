"""Rounding that minds the inputs a matrix meets (GPTQ, Frantar et al. 2022), for the 4-bit formats.

Rounding each weight to its nearest level (as llama.cpp's q4_0 and q4_1 do) leaves every error where it
falls. GPTQ rounds a matrix one input column at a time and moves the columns not yet rounded to absorb
each column's error, as far as the inputs the matrix meets let them: H = sum of x x^T over a calibration
text's tokens (the calibration package) says how the inputs go together. Each group's scale and
minimum are set by the format's own rule from its weights as they stand when the group's first column
is reached, so the stored format and the kernels that read it do not change, and a weight already on
the format's grid stays where it is. On SmolLM2 moved off its grid, GPTQ alone takes int4m's KL
divergence from float32 from 0.339 to 0.294, and with the value products in int8 (converted.py) to
0.130 (docs/benchmark.md).
"""

from collections.abc import Callable

import torch
from torch import nn

# Added to H's diagonal, as a fraction of its mean. Some is needed: inputs the calibration text never
# varies would leave H singular. More than GPTQ's usual 0.01 because the calibration text is short (a
# few thousand tokens): off the grid, int4m's KL divergence was 0.189, 0.160, 0.140, 0.129 and 0.142
# at 0.001, 0.01, 0.1, 1 and 3 (bench/quality.py --off-grid).
DAMPING = 1.0


def rounded(weight: torch.Tensor, moments: torch.Tensor, group: int, grid: Callable,
            levels_on: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round `weight` [rows, inputs] on the format's grid of groups of `group` inputs: `grid` gives
    groups [rows, 1, group] their float16 scales and minimums [rows, 1], `levels_on(groups, scales,
    minimums)` the levels they round to. Return the scales and minimums [rows, blocks] and the levels
    [rows, inputs]. `moments` is the inputs' [inputs, inputs] sum of x x^T. A group's columns are
    rounded together, then the later columns take their errors at once."""
    rows, inputs = weight.shape
    # Transposed, so that a column is one contiguous run.
    work = weight.float().T.contiguous()
    hessian = moments.float().clone()
    unseen = hessian.diagonal() == 0
    hessian[unseen, unseen] = 1.0
    hessian.diagonal().add_(DAMPING * hessian.diagonal().mean())
    # The upper Cholesky factor of H's inverse: row i holds how column i's error spreads to the later columns.
    spread = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    scales = torch.empty(inputs // group, rows, dtype=torch.float16)
    minimums = torch.empty_like(scales)
    levels = torch.empty(inputs, rows)
    for block, start in enumerate(range(0, inputs, group)):
        stop = start + group
        part = work[start:stop]
        errors = torch.empty_like(part)
        local = spread[start:stop, start:stop]
        block_scales, block_minimums = grid(part.T[:, None, :])
        scales[block], minimums[block] = block_scales[:, 0], block_minimums[:, 0]
        scale, minimum = block_scales[:, 0].float(), block_minimums[:, 0].float()
        for column in range(group):
            level = levels_on(part[column][:, None, None], scale[:, None], minimum[:, None])[:, 0, 0]
            levels[start + column] = level
            error = (part[column] - (level * scale + minimum)) / local[column, column]
            part[column:] -= local[column, column:, None] * error[None]
            errors[column] = error
        work[stop:] -= spread[start:stop, stop:].T @ errors
    return scales.T.contiguous(), minimums.T.contiguous(), levels.T.contiguous()


def layer_moments(model, windows: torch.Tensor, quantize_layer: Callable[[dict[str, torch.Tensor]], None]) -> bool:
    """Run the calibration windows [count, length] through the model's decoder and call quantize_layer
    with each decoder layer's Linear weight names -> their inputs' moments as soon as that layer has
    run, so only one layer's moments are held at a time. Return False (calling nothing) for a model
    whose decoder layers are not at model.model.layers."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return False
    moments: dict[str, torch.Tensor] = {}
    # Linears that read the same input (query, key and value; gate and up) share one sum; the input is
    # held beside it, so its id is not reused by another tensor while the layer runs.
    by_input: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def collect(name: str):
        def pre_hook(module, args) -> None:
            """Add this batch's x x^T to the module's sum."""
            inputs = args[0]
            if id(inputs) not in by_input:
                flat = inputs.reshape(-1, inputs.shape[-1]).float()
                by_input[id(inputs)] = inputs, flat.T @ flat
            moments[name] = by_input[id(inputs)][1]
        return pre_hook

    def layer_done(module, args, output) -> None:
        """Hand the finished layer's moments over and let them go."""
        quantize_layer(dict(moments))
        moments.clear()
        by_input.clear()

    hooks = [layer.register_forward_hook(layer_done) for layer in layers]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            hooks.append(module.register_forward_pre_hook(collect(f"{name}.weight")))
    try:
        with torch.inference_mode():
            model.model(input_ids=windows)
    finally:
        for hook in hooks:
            hook.remove()
    return True
