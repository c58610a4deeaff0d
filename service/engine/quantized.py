"""Quantized weight formats (DTYPE=int8, int4 or int4m): how each rounds and lays out a matrix for
corechat's kernels, and the Linear that multiplies by it (converted.py writes them into one file).

Every Linear of the decoder layers and the output layer is stored quantized; the rest (embedding,
norms, biases) stays bfloat16. The 4-bit formats keep their output layer in int6 and each layer's
value product in int8 (converted.py: format_of), and round the rest by GPTQ on a calibration text
(gptq.py), into the same layout.
  int8: groups of 32 weights of a row, one float16 scale each (symmetric, -127..127), as llama.cpp's
        q8_0 (8.5 bits per weight).
  int4: groups of 32 weights, one float16 scale each (symmetric, -8..7), two groups' weights
        sharing a byte's nibbles (4.5 bits per weight); the output layer is int6, as llama.cpp's
        q4_0 keeps its output layer at 6 bits (q6_K, or q8_0 for rows that are not whole multiples
        of 256): the logits' own rounding weighs most.
  int4m: int4's layout with a float16 scale and a float16 minimum per group of 32, each weight
        0..15 steps above its group's minimum, as llama.cpp's q4_1 (5 bits per weight); the output
        layer is int6.
  int6 (no DTYPE; the 4-bit DTYPEs' output layer): int8's rotated groups at -31..31, each weight's
        low 4 bits in int4's nibbles and its top 2 bits in a quarter-block after them (6.5 bits).
Weights are stored with an offset that makes them unsigned (+128, +32, +8; int4m's steps need none), in
tiles of 16 rows whose blocks of 32 inputs lie as the kernel's vpdpbusd reads them (tiles.py lays them
out; kernels/csrc/kernels.h reads them), so a tile streams one sequential run of memory.
All products, prompt passes and decode steps alike, run torch.ops.corechat.quantized_linear: the
activations are rounded to int8 in blocks of 32 and each output is summed in one fixed order, so a
token's result depends neither on the other rows of its batch nor on how its prompt was cut.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from . import gptq
from .tiles import (
    GROUP,
    GROUP_INPUTS,
    TILE_OUTPUTS,
    pack_int6,
    pack_nibbles,
    pad_rows,
    tile_int8,
    tile_scales,
    tile_scales_and_minimums,
    unpack_int6,
    unpack_nibbles,
    untile_int8,
    untile_scales,
)

# Part of the converted file's name and metadata (converted.py): bump it whenever what a format writes
# changes, so a file written by another version is never read as this one's.
FORMAT_VERSION = 11
# The offsets the kernels read (kernels.h), which the converter writes: check_layout holds them (and
# tiles.py's layout) to the loaded kernels' own.
INT8_OFFSET = 128
INT6_OFFSET = 32
INT4_OFFSET = 8
# The levels each 4-bit format rounds to (int4's stored + INT4_OFFSET).
INT4_LEVELS, INT4M_LEVELS = (-8, 7), (0, 15)


@dataclass(frozen=True)
class WeightFormat:
    """A quantized weight format: its kernel code, what it says of itself, and its input-width rule."""

    name: str
    code: int
    description: str
    width_multiple: int
    # Bits stored per weight, the scales aside: a stored row of n inputs is n * bits / 8 bytes.
    bits: int
    # Whether its groups are stored rotated by the Hadamard matrix (and the kernels rotate the
    # activation blocks they meet).
    rotated: bool = False


INT8 = WeightFormat("int8", 0, "int8 weights with a float16 scale per Hadamard-rotated group of 32", GROUP, 8, True)
INT4 = WeightFormat("int4", 1, "int4 weights with a float16 scale per group of 32", GROUP, 4)
INT4M = WeightFormat("int4m", 2, "int4 weights with a float16 scale and minimum per group of 32", GROUP, 4)
INT6 = WeightFormat("int6", 3, "int6 weights with a float16 scale per Hadamard-rotated group of 32", GROUP, 6, True)
# The DTYPEs; int6 is only stored (the 4-bit DTYPEs' output layer).
FORMATS = {fmt.name: fmt for fmt in (INT8, INT4, INT4M)}
STORED_FORMATS = {**FORMATS, INT6.name: INT6}
PACKED = (INT4, INT4M)
# The formats rounded by GPTQ where the converter has their inputs' moments (quantize_* take them).
CALIBRATED = (INT4, INT4M, INT6)
ACTIVATIONS = "activations rounded to int8 per block of 32 (rotated as the weights are)"
# What torch.ops.corechat.layout() must report for this module's files to be read right.
LAYOUT = {"block": GROUP, "tile_outputs": TILE_OUTPUTS, "group_inputs": GROUP_INPUTS, "int8_offset": INT8_OFFSET,
          "int6_offset": INT6_OFFSET, "int4_offset": INT4_OFFSET, "int8_groups": INT8.code, "int4_groups": INT4.code,
          "int4_mins": INT4M.code, "int6_groups": INT6.code, "int8_rotated": int(INT8.rotated),
          "int6_rotated": int(INT6.rotated)}


class LayoutMismatch(RuntimeError):
    """The loaded kernels read another weight layout than this module writes."""


def kernels_layout() -> dict[str, int]:
    """Return the layout the loaded kernels read, by name (torch.ops.corechat.layout())."""
    names, values = torch.ops.corechat.layout()
    return dict(zip(names, values, strict=True))


def check_layout() -> None:
    """Raise LayoutMismatch unless the loaded kernels read the layout this module writes."""
    read = kernels_layout()
    if read != LAYOUT:
        raise LayoutMismatch(f"corechat's kernels read the layout {read}, but service/engine/quantized.py "
                             f"writes {LAYOUT}: the two must change together")


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored quantized; the output layer returns float32 logits."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: WeightFormat,
                 out_features: int, float32_output: bool):
        super().__init__()
        self.register_buffer("qweight", weight, persistent=False)
        self.register_buffer("qscale", scales, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.format = fmt
        self.float32_output = float32_output
        self.out_features = out_features
        self.in_features = weight.shape[1] * 8 // fmt.bits

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Multiply by the quantized weight (activations rounded per block of 32 inside the kernel)."""
        # A decode step's rows are a contiguous matrix already: no reshape then, each a call on cold caches.
        matrix = inputs.dim() == 2 and inputs.is_contiguous()
        flat = inputs if matrix else inputs.reshape(-1, self.in_features).contiguous()
        output = torch.ops.corechat.quantized_linear(flat, self.qweight, self.qscale, self.bias, self.format.code,
                                                     self.out_features, self.float32_output)
        return output if matrix else output.reshape(*inputs.shape[:-1], self.out_features)


def check_width(fmt: WeightFormat, inputs: int) -> None:
    """Raise ValueError unless a format can hold rows of `inputs` weights."""
    if inputs % fmt.width_multiple:
        raise ValueError(f"{fmt.name} needs input widths that are multiples of {fmt.width_multiple}, not {inputs}")


def hadamard() -> torch.Tensor:
    """Return the orthonormal 32 x 32 Hadamard matrix in Sylvester's order: symmetric, its own inverse."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < GROUP:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix / GROUP**0.5


def rotate_groups(matrix: torch.Tensor) -> torch.Tensor:
    """Multiply each group of 32 along the last dimension by the Hadamard matrix (float64 products, the
    matrix's dtype kept); applied twice it gives the matrix back."""
    groups = matrix.double().reshape(*matrix.shape[:-1], -1, GROUP)
    return (groups @ hadamard()).reshape(matrix.shape).to(matrix.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a matrix symmetrically per group of 32 inputs of a row, as llama.cpp's q8_0 does, after
    rotating each group by the Hadamard matrix (the kernels rotate each activation block the same
    way, kernels.h, so the product is the same): weights -127..127 stored + 128 as bytes, and a float16
    scale per group (its largest magnitude / 127), padded and laid out as the kernel reads them. The
    rounding uses the float16 scale that is stored.

    The rotation spreads an outlier over its group, so the group's other weights, and above all the
    activations, which are rounded per block at run time, keep finer steps
    (bench/probes/rounding.py measures it on the real model).
    """
    outputs, inputs = weight.shape
    check_width(INT8, inputs)
    scales, levels = rotated_levels(weight, 127)
    stored = pad_rows((levels + INT8_OFFSET).to(torch.uint8), fill=INT8_OFFSET)
    return tile_int8(stored), tile_scales(scales)


def rotated_levels(weight: torch.Tensor, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the float16 scales [outputs, blocks] and levels [outputs, inputs] of a matrix's groups
    rotated by the Hadamard matrix and rounded symmetrically to -largest..largest steps of their
    largest magnitude / largest (int8, int6); the rounding uses the float16 scale that is stored."""
    outputs, inputs = weight.shape
    groups = rotate_groups(weight.float()).reshape(outputs, inputs // GROUP, GROUP)
    # A group whose largest magnitude is under `largest` x 2^-14 gets a subnormal float16 scale, with
    # fewer significant bits. Left as it is: the error that adds is at most largest x 2^-25 per weight,
    # below half the step of any group with a normal scale, so it only shows in a matrix whose weights
    # are all that small, which trained models' are not; clamping the scale up to 2^-14 would coarsen
    # those groups' steps instead.
    scales, minimums = symmetric_grid(groups, None, largest)
    levels = levels_on(groups, scales.float(), minimums.float(), -largest, largest)
    return scales, levels.reshape(outputs, inputs)


def symmetric_grid(groups: torch.Tensor, importance: torch.Tensor | None,
                   largest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the float16 scales of groups [rows, blocks, 32] rounded symmetrically to -largest..largest
    steps (each group's largest magnitude / largest), and their minimums (all 0): int8's and int6's
    grid, the same whatever the inputs' importance (a grid's signature, gptq.rounded)."""
    scales = (groups.abs().amax(dim=2) / largest).to(torch.float16)
    return scales, torch.zeros_like(scales)


def levels_on(groups: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Round groups [rows, blocks, 32] to the nearest of low..high steps of each group's scale above its
    minimum (level 0 where the scale is 0: the group is its minimum); any float dtype, kept."""
    safe = torch.where(scales != 0, scales, torch.ones_like(scales))
    levels = torch.round((groups - minimums[:, :, None]) / safe[:, :, None]).clamp(low, high)
    return torch.where(scales[:, :, None] != 0, levels, torch.zeros_like(levels))


# The grids a 4-bit group chooses among, besides its plain rule's: the steps that put the group's
# extreme weights -1.0, -0.9, ..., +1.0 of a level inside the plain rule's ends, each scale (and minimum)
# then refitted by least squares to the levels it rounds to, as llama.cpp chooses its k-quants' grids
# (make_qx_quants, make_qkx2_quants).
SEARCH_OFFSETS = [tenth / 10 for tenth in range(-10, 11)]


def refitted(groups: torch.Tensor, importance: torch.Tensor, levels: torch.Tensor,
             with_minimum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the scales and minimums (0 without a minimum) [rows, blocks] that make `levels` fit the
    groups best in the importance-weighted squared error, and where that fit is usable: finite, and a
    scale that is not 0 (positive with a minimum; without one its sign is the extreme's, as q4_0's)."""
    weighted = importance * levels
    level_squares, cross = (weighted * levels).sum(dim=2), (weighted * groups).sum(dim=2)
    if not with_minimum:
        scales = cross / torch.where(level_squares > 0, level_squares, torch.ones_like(level_squares))
        minimums = torch.zeros_like(scales)
    else:
        level_sum, total, weight_sum = weighted.sum(dim=2), importance.sum(dim=2), (importance * groups).sum(dim=2)
        determinant = level_squares * total - level_sum * level_sum
        safe = torch.where(determinant > 0, determinant, torch.ones_like(determinant))
        scales = (cross * total - level_sum * weight_sum) / safe
        minimums = (level_squares * weight_sum - level_sum * cross) / safe
    usable = ((scales > 0) if with_minimum else (scales != 0)) & torch.isfinite(minimums) & scales.half().isfinite()
    return scales, minimums, usable


def best_grid(groups: torch.Tensor, importance: torch.Tensor, candidates, low: int,
              high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return, per group, the float16 scale and minimum among `candidates` (pairs of [rows, blocks]
    tensors, and where each is usable) whose nearest rounding leaves the smallest importance-weighted
    squared error; the first candidate wins ties and holds where no other is usable."""
    best = None
    for scales, minimums, usable in candidates:
        scales, minimums = scales.to(torch.float16), minimums.to(torch.float16)
        levels = levels_on(groups, scales.float(), minimums.float(), low, high)
        error = (importance * (levels * scales.float()[:, :, None] + minimums.float()[:, :, None] - groups).square()).sum(dim=2)
        if best is None:
            best = [error, scales, minimums]
            continue
        better = usable & (error < best[0])
        best = [torch.where(better, error, best[0]), torch.where(better, scales, best[1]),
                torch.where(better, minimums, best[2])]
    return best[1], best[2]


def int4_grid(groups: torch.Tensor, importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return int4's float16 scales for groups [rows, blocks, 32] (minimums all 0).

    Without `importance`, the plain rule: the group's largest-magnitude weight exactly at -8 (as
    llama.cpp's q4_0 puts it, so the scale takes that weight's sign) or at 7, whichever leaves the
    group the smaller squared error. With each input's importance [blocks, 32] (gptq.py: the mean
    square of its inputs), that grid and SEARCH_OFFSETS' scales refitted are the candidates, and the
    one with the smallest weighted error is kept.
    """
    extreme = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    zeros = torch.zeros_like(extreme)
    always = torch.ones_like(extreme, dtype=torch.bool)
    ends = ((extreme / extreme_level, zeros, always) for extreme_level in (-8, 7))
    plain, _ = best_grid(groups, torch.ones_like(groups), ends, *INT4_LEVELS)
    if importance is None:
        return plain, torch.zeros_like(plain)
    weights = importance.expand_as(groups)

    def candidates():
        yield plain.float(), zeros, always
        for offset in SEARCH_OFFSETS:
            levels = levels_on(groups, extreme / -(8 + offset), zeros, *INT4_LEVELS)
            yield refitted(groups, weights, levels, with_minimum=False)

    scales, _ = best_grid(groups, weights, candidates(), *INT4_LEVELS)
    return scales, torch.zeros_like(scales)


def int4m_grid(groups: torch.Tensor, importance: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return int4m's float16 scales and minimums for groups [rows, blocks, 32].

    Without `importance`, llama.cpp's q4_1 rule: the minimum is the group's smallest weight and the
    scale a fifteenth of its range, so both extremes sit on the grid. With each input's importance
    [blocks, 32], that rule and SEARCH_OFFSETS' grids with scale and minimum refitted are the
    candidates, and the one with the smallest weighted error is kept; a group already on a grid that
    reaches both its ends keeps it exactly.
    """
    smallest, largest = groups.amin(dim=2), groups.amax(dim=2)
    span = largest - smallest
    if importance is None:
        return (span / 15).to(torch.float16), smallest.to(torch.float16)
    weights = importance.expand_as(groups)
    always = torch.ones_like(span, dtype=torch.bool)

    def candidates():
        yield span / 15, smallest, always
        for offset in SEARCH_OFFSETS:
            levels = levels_on(groups, span / (15 + offset), smallest, *INT4M_LEVELS)
            yield refitted(groups, weights, levels, with_minimum=True)

    return best_grid(groups, weights, candidates(), *INT4M_LEVELS)


def round_4bit(weight: torch.Tensor, grid, low: int, high: int,
               moments: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round a matrix per group of 32 on `grid`'s float16 scales and minimums; return them and the
    levels [rows, inputs]. Without `moments`, the plain rule's grid and each weight's nearest level;
    with the inputs' second moments (gptq.py), a grid searched with each input weighed by its mean
    square, and a rounding that minds the products. (The search without the moments, plain or
    weighted by the weights' magnitude, left the nearest rounding less faithful: docs/benchmark.md.)"""
    if moments is not None:
        return gptq.rounded(weight, moments, GROUP, grid, partial(levels_on, low=low, high=high))
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    scales, minimums = grid(groups, None)
    levels = levels_on(groups, scales.float(), minimums.float(), low, high)
    return scales, minimums, levels.reshape(weight.shape)


def quantize_int6(weight: torch.Tensor, moments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a matrix as int8 does (rotated groups of 32, symmetric, a float16 scale each), to
    -31..31 steps, stored + 32 in 6 bits (pack_int6). llama.cpp keeps its 4-bit types' output layer in
    6 bits (q6_K) too, or 8: the logits' rounding weighs most, and int4 there costs too much. With the
    inputs' second moments, rounded by GPTQ (gptq.py) on the same grid, in the rotated space: the
    moments rotated on both sides as the weights' groups are."""
    outputs, inputs = weight.shape
    check_width(INT6, inputs)
    if moments is None:
        scales, levels = rotated_levels(weight, INT6_OFFSET - 1)
    else:
        rotated_moments = rotate_groups(rotate_groups(moments.double()).T)
        scales, _, levels = gptq.rounded(rotate_groups(weight.float()), rotated_moments, GROUP,
                                         partial(symmetric_grid, largest=INT6_OFFSET - 1),
                                         partial(levels_on, low=1 - INT6_OFFSET, high=INT6_OFFSET - 1))
    return pack_int6(pad_rows((levels + INT6_OFFSET).to(torch.uint8), fill=INT6_OFFSET)), tile_scales(scales)


def quantize_int4(weight: torch.Tensor, moments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a matrix per group of 32 to -8..7 times a float16 scale (int4_grid), packed as the
    kernel reads it. The rounding uses the float16 scale that is stored. Each block of a tile holds its
    16 rows' groups of 4 inputs side by side, group p's in the low nibbles and group p + 4's in the high
    ones; the scales lie [tiles, blocks, 16 rows].
    """
    outputs, inputs = weight.shape
    check_width(INT4, inputs)
    scales, _, levels = round_4bit(weight, int4_grid, *INT4_LEVELS, moments)
    nibbles = pad_rows((levels + INT4_OFFSET).to(torch.uint8), fill=INT4_OFFSET)
    return pack_nibbles(nibbles), tile_scales(scales)


def quantize_int4m(weight: torch.Tensor, moments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a matrix per group of 32 to 0..15 steps of a float16 scale above a float16 minimum
    (int4m_grid), as llama.cpp's q4_1 does; the rounding uses the float16 values that are stored.
    Packed as int4's nibbles; the scales and minimums lie [tiles, blocks, 2, 16 rows].
    """
    outputs, inputs = weight.shape
    check_width(INT4M, inputs)
    scales, minimums, levels = round_4bit(weight, int4m_grid, *INT4M_LEVELS, moments)
    nibbles = pad_rows(levels.to(torch.uint8))
    return pack_nibbles(nibbles), tile_scales_and_minimums(scales, minimums)


def dequantize(fmt: WeightFormat, weight: torch.Tensor, scales: torch.Tensor, outputs: int) -> torch.Tensor:
    """Return the float32 matrix [outputs, inputs] a stored quantized one stands for (int8's and int6's
    groups rotated back)."""
    rows = weight.shape[0]
    if fmt is INT8:
        levels = untile_int8(weight).float() - INT8_OFFSET
    elif fmt is INT6:
        levels = unpack_int6(weight) - INT6_OFFSET
    else:
        levels = unpack_nibbles(weight) - (INT4_OFFSET if fmt is INT4 else 0)
    inputs = levels.shape[1]
    blocks = inputs // GROUP
    minimums = torch.zeros(rows, blocks)
    if fmt is INT4M:
        parts = scales.reshape(rows // TILE_OUTPUTS, blocks, 2, TILE_OUTPUTS)
        scales, minimums = (parts[:, :, half].reshape(rows, blocks) for half in (0, 1))
        minimums = untile_scales(minimums)
    steps = levels.reshape(rows, blocks, GROUP) * untile_scales(scales)[:, :, None]
    restored = (steps + minimums[:, :, None]).reshape(rows, inputs)
    return (rotate_groups(restored) if fmt.rotated else restored)[:outputs]


QUANTIZE = {INT8.name: quantize_int8, INT4.name: quantize_int4, INT4M.name: quantize_int4m, INT6.name: quantize_int6}
