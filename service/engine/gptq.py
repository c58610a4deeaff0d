"""Rounding that minds the inputs a matrix meets (GPTQ, Frantar et al. 2022), for the 4-bit formats.

Rounding each weight to its nearest level (as llama.cpp's q4_0 and q4_1 do) leaves every error where it
falls. GPTQ rounds a matrix one input column at a time and moves the columns not yet rounded to absorb
each column's error, as far as the inputs the matrix meets let them: H = sum of x x^T over a calibration
text's tokens (the calibration package) says how the inputs go together. Each group's scale and
minimum are chosen first, by the format's own search (quantized.py: int4_grid, int4m_grid) weighing
each input by H's diagonal, so the stored format and the kernels that read it do not change, and a
group already on a grid that reaches its ends stays there. On SmolLM2 moved off its grid
(bench/quality.py --off-grid, docs/benchmark.md), int4m's KL divergence from float32 goes from 0.339
(q4_1's nearest rounding) to 0.079 with the value products in int8 (converted.py); the grid search
and the rounding order below took it from 0.130 to there.
"""

from collections.abc import Callable

import torch
from torch import nn

# Added to H's diagonal, as a fraction of its mean. Some is needed: inputs the calibration text never
# varies would leave H singular. More than GPTQ's usual 0.01 because the calibration text is short (a
# few thousand tokens): off the grid, int4m's KL divergence on the float32 forward is 0.093, 0.076,
# 0.075 and 0.076 at 0.1, 0.3, 1 and 3 (bench/probes/grid_probe.py).
DAMPING = 1.0


def rounded(weight: torch.Tensor, moments: torch.Tensor, group: int, grid: Callable,
            levels_on: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round `weight` [rows, inputs] on the format's grid of groups of `group` inputs: `grid(groups
    [rows, blocks, group], importance [blocks, group])` gives their float16 scales and minimums [rows,
    blocks], `levels_on(groups, scales, minimums)` the levels they round to. Return the scales and
    minimums [rows, blocks] and the levels [rows, inputs]. `moments` is the inputs' [inputs, inputs]
    sum of x x^T.

    Each group's grid is chosen first, from the weights as given, weighing each input by its mean
    square (H's diagonal). The columns are then rounded in order of that diagonal, largest first (GPTQ's
    "act order"): the inputs that weigh most are rounded while the most columns remain to absorb their
    errors. They go `group` columns at a time: a batch's columns are rounded together, then the later
    columns take the batch's errors at once."""
    rows, inputs = weight.shape
    hessian = moments.float().clone()
    unseen = hessian.diagonal() == 0
    hessian[unseen, unseen] = 1.0
    importance = hessian.diagonal().clone()
    scales, minimums = grid(weight.float().reshape(rows, -1, group), importance.reshape(-1, group))
    hessian.diagonal().add_(DAMPING * hessian.diagonal().mean())
    order = torch.argsort(importance, descending=True, stable=True)
    hessian = hessian[order][:, order]
    # The upper Cholesky factor of H's inverse: row i holds how column i's error spreads to the later columns.
    spread = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    # Transposed and in rounding order, so that a column is one contiguous run; each column's grid beside it.
    work = weight.float().T[order].contiguous()
    column_scales, column_minimums = (part.float().T[order // group] for part in (scales, minimums))
    levels = torch.empty(inputs, rows)
    for start in range(0, inputs, group):
        stop = min(start + group, inputs)
        part = work[start:stop]
        errors = torch.empty_like(part)
        local = spread[start:stop, start:stop]
        for column in range(stop - start):
            scale, minimum = column_scales[start + column], column_minimums[start + column]
            level = levels_on(part[column][:, None, None], scale[:, None], minimum[:, None])[:, 0, 0]
            levels[order[start + column]] = level
            error = (part[column] - (level * scale + minimum)) / local[column, column]
            part[column:] -= local[column, column:, None] * error[None]
            errors[column] = error
        work[stop:] -= spread[start:stop, stop:].T @ errors
    return scales, minimums, levels.T.contiguous()


def layer_moments(model, windows: torch.Tensor, quantize_layer: Callable[[dict[str, torch.Tensor]], None],
                  output_name: str | None = None) -> bool:
    """Run the calibration windows [count, length] through the model's decoder and call quantize_layer
    with each decoder layer's Linear weight names -> their inputs' moments as soon as that layer has
    run, so only one layer's moments are held at a time; then, given `output_name`, with that name ->
    the moments of the decoder's output (the final norm's, the output layer's input). Return False
    (calling nothing) for a model whose decoder layers are not at model.model.layers."""
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
            states = model.model(input_ids=windows).last_hidden_state
    finally:
        for hook in hooks:
            hook.remove()
    if output_name is not None:
        flat = states.reshape(-1, states.shape[-1]).float()
        quantize_layer({output_name: flat.T @ flat})
    return True
