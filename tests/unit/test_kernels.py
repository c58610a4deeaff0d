"""corechat's C++ quantized products: every SIMD path against the plain reference, the reference
against float math, and a row's result against the rows that share its call (attention:
test_attention.py).

The library is the one `make setup` built for this CPU (built here if missing). Paths this CPU
cannot run (AVX-512 VNNI on an AVX2 machine, AMX without AMX-INT8) are compiled but not run. The
AMX path takes 16 rows at a time: ROWS' prompt chunks (63 to 130 rows) run it, with a remainder.
"""

import fcntl
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import cpu_ticks_by_thread
from service.engine import kernels
from service.engine.quantized import (
    INT4,
    INT4M,
    INT6,
    INT8,
    QUANTIZE,
    dequantize,
    quantize_int4,
    quantize_int4m,
    quantize_int6,
    quantize_int8,
    rotate_groups,
)
from service.engine.tiles import pack_int6, padded_rows, tile_scales, unpack_int6
from service.settings import Settings
from tests.support import torch_threads
from tests.unit.kernel_misuse import CASES as MISUSE_CASES

MAX_RUNNING = Settings().max_running
# (outputs, inputs): odd output counts, one block, an odd number of blocks (int8 only: int4 pairs
# its groups), the 0.5B model's widths.
SHAPES = [(1, 64), (3, 96), (37, 128), (129, 192), (300, 896), (61, 4864), (5, 32)]
# Every batch size the batcher uses, and prompt chunks across the kernel's 64-row chunk.
ROWS = list(range(1, MAX_RUNNING + 1)) + [63, 64, 65, 130]
FORMATS = [INT8, INT4, INT4M, INT6]
# The formats whose weight groups and activation blocks are rotated.
ROTATED = (INT8, INT6)
FORMAT_IDS = [fmt.name for fmt in FORMATS]
SMALLEST_NORMAL = torch.finfo(torch.float32).smallest_normal
# The smallest largest magnitude whose block scale (largest / 127) is normal: smaller blocks quantize to zeros.
SCALE_BOUND = 127 * SMALLEST_NORMAL


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    """Load (building if needed) this CPU's kernels."""
    kernels.load(Path(Settings().kernels_dir))


def simd_paths() -> list[str]:
    """Return the paths besides the reference that this CPU runs."""
    return [path for path in kernels.available_paths() if path != "reference"]


def shapes(fmt) -> list[tuple[int, int]]:
    """Return the SHAPES a format can hold."""
    return [(outputs, inputs) for outputs, inputs in SHAPES if inputs % fmt.width_multiple == 0]


def quantized(fmt, outputs: int, inputs: int, generator: torch.Generator):
    """Return random weights of a format, quantized as the converter does."""
    weight = torch.randn(outputs, inputs, generator=generator) * 0.05
    return QUANTIZE[fmt.name](weight)


def product(fmt, inputs, weight, scales, outputs, bias=None, float32_output=True, path="reference") -> torch.Tensor:
    """Run the kernel on one path."""
    return torch.ops.corechat.quantized_linear(inputs, weight, scales, bias, fmt.code, outputs, float32_output,
                                               kernels.PATHS[path])


def butterfly(blocks: torch.Tensor) -> torch.Tensor:
    """The kernels' unnormalized fast Walsh-Hadamard transform of each block of 32, the same float32 sums."""
    size = blocks.shape[-1]
    h = 1
    while h < size:
        runs = blocks.reshape(*blocks.shape[:-1], size // (2 * h), 2, h)
        low, high = runs[..., 0, :], runs[..., 1, :]
        blocks = torch.stack((low + high, low - high), dim=-2).reshape(blocks.shape)
        h *= 2
    return blocks


def activation_blocks(fmt, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return the blocks of 32 the kernels round (int8's rotated), each block's step (largest / 127)
    and the scale it keeps (int8's carrying the rotation's 1 / sqrt(32); 0 unless normal)."""
    rows, width = inputs.shape
    blocks = inputs.float().reshape(rows, width // 32, 32)
    if fmt in ROTATED:
        blocks = butterfly(blocks)
    steps = blocks.abs().amax(dim=2) / 127
    block_scales = steps * (1 / torch.tensor(32.0).sqrt()) if fmt in ROTATED else steps
    return blocks, steps, torch.where(block_scales >= SMALLEST_NORMAL, block_scales, torch.zeros_like(block_scales))


def rounded_activations(fmt, inputs: torch.Tensor) -> torch.Tensor:
    """Round activations per block of 32 as the kernels do (int8's blocks rotated first), and return
    what the rounded values stand for, rotated back, in float64."""
    rows, width = inputs.shape
    blocks, steps, block_scales = activation_blocks(fmt, inputs)
    inverse = torch.where(block_scales > 0, 1 / steps, torch.zeros_like(steps))
    levels = torch.round(blocks * inverse[:, :, None]).clamp(-127, 127)
    activations = (levels * block_scales[:, :, None]).double().reshape(rows, width)
    return rotate_groups(activations) if fmt in ROTATED else activations


def expected_product(fmt, inputs: torch.Tensor, weight, scales, outputs: int) -> torch.Tensor:
    """Compute the kernel's product independently: activations rounded per block of 32, sums in float64."""
    return rounded_activations(fmt, inputs) @ dequantize(fmt, weight, scales, outputs).double().t()


def test_avx2_path_exists_here():
    """This machine's CPU has AVX2: the fast path must be built and chosen, not the reference."""
    assert "avx2" in kernels.available_paths()


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_reference_computes_the_quantized_product(fmt):
    """The reference is the rounded activations times the dequantized weights, up to float32 summing."""
    generator = torch.Generator().manual_seed(1)
    for outputs, inputs in shapes(fmt):
        weight, scales = quantized(fmt, outputs, inputs, generator)
        x = torch.randn(5, inputs, generator=generator)
        got = product(fmt, x, weight, scales, outputs).double()
        want = expected_product(fmt, x, weight, scales, outputs)
        bound = (x.abs().double() @ dequantize(fmt, weight, scales, outputs).abs().double().t()) * 3e-5
        assert ((got - want).abs() <= bound + 1e-6).all(), (outputs, inputs)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_every_simd_path_gives_the_references_bits(fmt):
    """Random shapes, odd sizes, every batcher row count and prompt chunks: bitwise equal outputs."""
    generator = torch.Generator().manual_seed(2)
    for outputs, inputs in shapes(fmt):
        weight, scales = quantized(fmt, outputs, inputs, generator)
        bias = torch.randn(outputs, generator=generator)
        for rows in ROWS:
            x = torch.randn(rows, inputs, generator=generator).to(torch.bfloat16)
            for float32_output in (True, False):
                want = product(fmt, x, weight, scales, outputs, bias, float32_output)
                for path in simd_paths():
                    got = product(fmt, x, weight, scales, outputs, bias, float32_output, path)
                    assert torch.equal(got, want), (path, outputs, inputs, rows, float32_output)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(fmt):
    """Row r alone and row r among 1..MAX_RUNNING others (or a prompt's 130) give the same bits."""
    generator = torch.Generator().manual_seed(3)
    weight, scales = quantized(fmt, 257, 896, generator)
    x = torch.randn(130, 896, generator=generator).to(torch.bfloat16)
    for path in kernels.available_paths():
        alone = torch.cat([product(fmt, x[row : row + 1], weight, scales, 257, path=path) for row in range(130)])
        for rows in ROWS:
            assert torch.equal(product(fmt, x[:rows], weight, scales, 257, path=path), alone[:rows]), (path, rows)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tell whether two float32 or bfloat16 tensors hold the same bits (NaNs included, which torch.equal refuses)."""
    as_integers = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.view(as_integers), b.view(as_integers))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_activation_makes_every_output_of_its_row_nan_on_every_path(fmt, poison):
    """A NaN or inf among a row's activations (first or last block) gives NaN in every output of that
    row, never finite numbers; the other rows keep their bits; every path gives the reference's bits."""
    generator = torch.Generator().manual_seed(9)
    outputs, inputs = 37, 128
    weight, scales = quantized(fmt, outputs, inputs, generator)
    bias = torch.randn(outputs, generator=generator)
    for rows in (1, 2, 6, 65):
        clean = torch.randn(rows, inputs, generator=generator)
        poisoned_rows = sorted({0, rows - 1})
        poisoned = clean.clone()
        poisoned[0, 5] = poison
        poisoned[rows - 1, inputs - 1] = poison
        others = [row for row in range(rows) if row not in poisoned_rows]
        for dtype in (torch.float32, torch.bfloat16):
            for float32_output in (True, False):
                reference = product(fmt, poisoned.to(dtype), weight, scales, outputs, bias, float32_output)
                finite = product(fmt, clean.to(dtype), weight, scales, outputs, bias, float32_output)
                assert reference[poisoned_rows].isnan().all(), (rows, dtype, float32_output)
                assert same_bits(reference[others], finite[others]), (rows, dtype, float32_output)
                for path in simd_paths():
                    got = product(fmt, poisoned.to(dtype), weight, scales, outputs, bias, float32_output, path)
                    assert same_bits(got, reference), (path, rows, dtype, float32_output)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_activations_at_floats_high_end_give_the_references_bits_on_every_path(fmt):
    """Blocks whose largest magnitude is float32's largest, or just below the size whose rotated sums
    overflow: every path rounds them as the reference does (a rotated block whose sums reach inf makes
    its row NaN, never a finite guess; unrotated, the products may overflow, alike), float32 and
    bfloat16 inputs alike."""
    generator = torch.Generator().manual_seed(12)
    outputs, inputs = 21, 256
    weight, scales = quantized(fmt, outputs, inputs, generator)
    largest = torch.finfo(torch.float32).max
    for size in (largest, largest / 32, float_next(largest / 32, 0.0), largest / 64, 1e30):
        x = (torch.rand(4, inputs, generator=generator) * 2 - 1) * size
        x[:, ::32] = size
        x[1] = -x[1]
        x[3, 1::2] = x[3, ::2]  # pairs alike: the rotation's differences are 0, its sums as large as they get
        for dtype in (torch.float32, torch.bfloat16):
            reference = product(fmt, x.to(dtype), weight, scales, outputs)
            if fmt in ROTATED and size == largest:
                assert reference.isnan().all(), dtype
            for path in simd_paths():
                got = product(fmt, x.to(dtype), weight, scales, outputs, path=path)
                assert same_bits(got, reference), (path, size, dtype)


def integral_weights(fmt, outputs: int, inputs: int, generator: torch.Generator):
    """Return random weights whose stored scales are 1 (integers reaching the format's extreme in every
    group), so that tiny activations give products that stay normal floats."""
    low, high = {INT8: (-127, 127), INT6: (-31, 31)}.get(fmt, (-8, 7))
    weight = torch.randint(low, high + 1, (outputs, inputs), generator=generator).double()
    weight[:, ::32] = low
    weight[:, 1::32] = high  # int4m's scale is its group's range / 15
    # int8 and int6 store each group rotated: rotating the integers first makes the stored groups the integers.
    return QUANTIZE[fmt.name](rotate_groups(weight) if fmt in ROTATED else weight.float())


def float_next(value: float, toward: float) -> float:
    """Return the float32 next to `value` in the direction of `toward`."""
    return float(torch.nextafter(torch.tensor(value), torch.tensor(toward)))


# Largest magnitudes of a block at float32's low end: the smallest subnormal, a subnormal, the smallest
# normal, the bound of a normal scale and the floats either side of it, and an ordinary size.
EXTREMES = [2.0**-149, 3e-39, SMALLEST_NORMAL, 3.7e-37, float_next(SCALE_BOUND, 0.0), SCALE_BOUND,
            float_next(SCALE_BOUND, 1.0), 1.0]


def extreme_rows(rows: int, inputs: int, generator: torch.Generator) -> torch.Tensor:
    """Return activations whose blocks each take a largest magnitude from EXTREMES (random sign), the
    other elements zeros, subnormals or random fractions of it."""
    blocks = rows * inputs // 32
    largest = torch.tensor(EXTREMES)[torch.randint(len(EXTREMES), (blocks, 1), generator=generator)]
    fractions = torch.rand(blocks, 32, generator=generator)
    kind = torch.randint(3, (blocks, 32), generator=generator)
    subnormals = 2.0**-149 * torch.randint(1, 2**23, (blocks, 32), generator=generator)
    values = torch.where(kind == 0, 0.0, torch.where(kind == 1, subnormals, largest * fractions))
    values = torch.minimum(values, largest)
    values[torch.arange(blocks), torch.randint(32, (blocks,), generator=generator)] = largest[:, 0]
    signs = torch.randint(2, (blocks, 32), generator=generator) * 2 - 1
    return (values * signs).reshape(rows, inputs)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_a_block_too_small_for_a_normal_scale_quantizes_to_zeros_on_every_path(fmt):
    """Blocks whose scale would be subnormal (largest magnitude, of the rotated block for int8, 0,
    subnormal, the smallest normal or just below 127 times it) add nothing (a subnormal scale's inverse
    overflows, which made zeros -127); at that bound and above they count."""
    generator = torch.Generator().manual_seed(10)
    outputs, inputs = 13, 256
    weight, scales = integral_weights(fmt, outputs, inputs, generator)
    for largest in EXTREMES:
        x = torch.rand(3, inputs, generator=generator) * largest
        x[:, ::32] = largest
        x[1] = -x[1]
        x[2, 1::2] = 0.0
        counted = (activation_blocks(fmt, x)[2] > 0).any(dim=1)
        if fmt not in ROTATED:
            assert counted.all().item() == (largest >= SCALE_BOUND), largest
        for path in kernels.available_paths():
            got = product(fmt, x, weight, scales, outputs, path=path)
            for row in range(3):
                if counted[row]:
                    assert (got[row] != 0).all(), (largest, path, row)
                else:
                    assert torch.equal(got[row], torch.zeros(outputs)), (largest, path, row)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_activations_at_floats_low_end_give_the_references_bits_on_every_path(fmt):
    """Fuzzed blocks of zeros, subnormals, the smallest normal and values either side of the normal-scale
    bound: the reference computes the rounded product, and every path gives its bits."""
    generator = torch.Generator().manual_seed(11)
    outputs, inputs = 37, 512
    weight, scales = integral_weights(fmt, outputs, inputs, generator)
    bias = torch.randn(outputs, generator=generator) * 1e-30
    dense = dequantize(fmt, weight, scales, outputs).abs().double()
    for rows in (1, 2, 5, 65):
        x = extreme_rows(rows, inputs, generator)
        for dtype in (torch.float32, torch.bfloat16):
            inputs_of_type = x.to(dtype)
            want = expected_product(fmt, inputs_of_type, weight, scales, outputs)
            got = product(fmt, inputs_of_type, weight, scales, outputs).double()
            bound = (inputs_of_type.double().abs() @ dense.t()) * 3e-5 + 1e-44
            assert ((got - want).abs() <= bound).all(), (rows, dtype)
            for float32_output in (True, False):
                reference = product(fmt, inputs_of_type, weight, scales, outputs, bias, float32_output)
                for path in simd_paths():
                    got = product(fmt, inputs_of_type, weight, scales, outputs, bias, float32_output, path)
                    assert same_bits(got, reference), (path, rows, dtype, float32_output)


def test_thread_count_does_not_change_the_output():
    """Each output is summed whole by one thread: 1 and 2 threads give the same bits."""
    generator = torch.Generator().manual_seed(4)
    weight, scales = quantized(INT8, 4864, 896, generator)
    x = torch.randn(8, 896, generator=generator).to(torch.bfloat16)
    with torch_threads(1):
        one = product(INT8, x, weight, scales, 4864, path="best")
    with torch_threads(2):
        two = product(INT8, x, weight, scales, 4864, path="best")
    assert torch.equal(one, two)


def test_use_path_makes_best_run_the_chosen_path_and_refuses_one_this_cpu_lacks():
    generator = torch.Generator().manual_seed(6)
    weight, scales = quantized(INT8, 64, 256, generator)
    x = torch.randn(3, 256, generator=generator).to(torch.bfloat16)
    reference = product(INT8, x, weight, scales, 64, path="reference")
    try:
        for path in kernels.available_paths():
            assert kernels.use_path(path)[-1] == path
            # The library's own answer: what `best` resolves to now.
            assert torch.ops.corechat.use_path(kernels.PATHS[path]) == path
            assert same_bits(product(INT8, x, weight, scales, 64, path="best"), reference)
        with pytest.raises(ValueError, match="not among"):
            kernels.use_path("neon")
        with pytest.raises(RuntimeError, match="no kernel path"):
            torch.ops.corechat.use_path(7)
    finally:
        assert kernels.use_path("best") == kernels.available_paths()


def test_a_product_runs_on_every_thread_it_is_given():
    """The library is built with OpenMP (without it at::parallel_for runs on one thread): a large
    product with two torch threads keeps two of this process's threads busy."""
    library = kernels.load(Path(Settings().kernels_dir))
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True,
                              check=True).stdout
    assert "GOMP_parallel" in imported
    generator = torch.Generator().manual_seed(5)
    weight, scales = quantized(INT8, 4864, 896, generator)
    x = torch.randn(64, 896, generator=generator).to(torch.bfloat16)
    with torch_threads(2):
        before = cpu_ticks_by_thread(os.getpid())
        for _ in range(40):
            product(INT8, x, weight, scales, 4864, path="best")
        after = cpu_ticks_by_thread(os.getpid())
    used = sorted((ticks - before.get(tid, 0) for tid, ticks in after.items()), reverse=True)
    assert used[0] > 0
    assert used[1] >= 0.25 * used[0], used[:4]


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    """Widths the formats cannot hold, mismatched scales and row counts are refused with a message."""
    weight, scales = quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        product(INT8, torch.randn(1, 48), torch.zeros(16, 48, dtype=torch.uint8), scales, 8)
    with pytest.raises(RuntimeError, match="scales"):
        product(INT8, torch.randn(1, 64), weight, scales[:4], 8)
    with pytest.raises(RuntimeError, match="padded"):
        product(INT8, torch.randn(1, 64), weight, scales, 17)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        product(INT4, torch.randn(1, 48), torch.zeros(16, 24, dtype=torch.uint8),
                torch.zeros(16, 1, dtype=torch.float16), 16)
    with pytest.raises(RuntimeError, match="uint8"):
        product(INT8, torch.randn(1, 64), weight.view(torch.int8), scales, 8)


@pytest.fixture(scope="module")
def misuse_outcomes() -> dict[str, dict]:
    """Run tests/unit/kernel_misuse.py's cases in a child process; return what each raised, by case (a case
    that crashed the child is the last one started, with the signal that ended it)."""
    child = subprocess.run([sys.executable, str(Path(__file__).parent / "kernel_misuse.py")], capture_output=True,
                           text=True, timeout=300, check=False)
    outcomes = {}
    for line in child.stdout.splitlines():
        report = json.loads(line)
        outcomes[report["case"]] = report
    if child.returncode != 0:
        crashed = list(outcomes)[-1]
        outcomes[crashed] = {"case": crashed, "crashed": -child.returncode, "stderr": child.stderr[-2000:]}
    return outcomes


@pytest.mark.parametrize("case", list(MISUSE_CASES))
def test_an_operator_given_a_bad_shape_dtype_or_device_raises_instead_of_crashing(misuse_outcomes, case):
    """Widths of 0, meta tensors, a down projection narrower than hidden, mismatched gate and up: each is
    a RuntimeError naming the problem, where some killed the process (SIGFPE, SIGSEGV) or read past a
    tensor's end."""
    outcome = misuse_outcomes.get(case, {"never run": "an earlier case crashed the child"})
    assert outcome.get("raised") == "RuntimeError", outcome
    assert re.search(MISUSE_CASES[case][1], outcome["message"]), outcome


def test_int4_quantization_keeps_each_groups_extreme_and_bounds_the_error():
    """The largest-magnitude weight of a group is stored as -8 or 7 times its scale, whichever leaves the
    group no more squared error than q4_0's -8 alone; others within half a step, or a step where +8
    steps had to be clamped to 7."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(5))
    packed, scales = quantize_int4(weight)
    restored = dequantize(INT4, packed, scales, 16)
    groups, restored_groups = weight.reshape(16, 4, 32), restored.reshape(16, 4, 32)
    extreme = groups.abs().argmax(dim=2, keepdim=True)
    assert torch.allclose(restored_groups.gather(2, extreme), groups.gather(2, extreme), rtol=1e-3)
    q4_0_scales = (groups.gather(2, extreme) / -8).half().float()
    q4_0 = (groups / q4_0_scales).round().clamp(-8, 7) * q4_0_scales
    errors, q4_0_errors = ((restored_groups - groups) ** 2).sum(2), ((q4_0 - groups) ** 2).sum(2)
    assert (errors <= q4_0_errors).all() and (errors < q4_0_errors).any()
    scales = scales.reshape(4, 16).t().float()  # stored [tiles, blocks, 16 rows]
    step = scales.abs()[:, :, None]
    clamped = groups / scales[:, :, None] > 7.5
    bound = torch.where(clamped, step, step / 2) * (1 + 1e-3)
    assert ((restored_groups - groups).abs() <= bound).all()


def test_int4m_quantization_keeps_each_groups_range_and_bounds_the_error():
    """Each group's smallest and largest weights come back within the float16 rounding of its minimum and
    scale, the others within half a step; a constant group (a zero range) comes back as its value."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(6))
    weight[3, 32:64] = 0.25
    packed, stored = quantize_int4m(weight)
    restored = dequantize(INT4M, packed, stored, 16)
    groups, restored_groups = weight.reshape(16, 4, 32), restored.reshape(16, 4, 32)
    step = (groups.amax(dim=2) - groups.amin(dim=2)) / 15
    slack = groups.abs().amax(dim=2) * 2**-10  # the float16 minimum's and scale's rounding
    assert ((restored_groups.amin(dim=2) - groups.amin(dim=2)).abs() <= slack).all()
    assert ((restored_groups.amax(dim=2) - groups.amax(dim=2)).abs() <= slack * 16).all()
    assert ((restored_groups - groups).abs() <= (step / 2 + slack * 16)[:, :, None]).all()
    assert torch.equal(restored_groups[3, 1], groups[3, 1])


def test_int4m_stores_weights_on_a_q4_1_grid_exactly():
    """Weights that are already q4_1 values (a float16 minimum plus 0..15 steps of a float16 scale, both
    extremes used), as a model shipped as q4_1 GGUF holds, come back bit for bit, and the kernels' product
    over them is the float64 product of the rounded activations and those weights, up to float32 summing."""
    generator = torch.Generator().manual_seed(7)
    outputs, inputs = 37, 256
    minimums = (torch.randn(outputs, inputs // 32, 1, generator=generator) * 0.05).half().float()
    scales = (torch.rand(outputs, inputs // 32, 1, generator=generator) * 0.01 + 1e-3).half().float()
    levels = torch.randint(0, 16, (outputs, inputs // 32, 32), generator=generator).float()
    levels[:, :, 0], levels[:, :, 31] = 0, 15
    weight = (minimums + levels * scales).reshape(outputs, inputs)
    packed, stored = quantize_int4m(weight)
    assert torch.equal(dequantize(INT4M, packed, stored, outputs), weight)
    x = torch.randn(4, inputs, generator=generator)
    bound = (x.abs().double() @ weight.abs().double().t()) * 3e-5
    assert ((product(INT4M, x, packed, stored, outputs).double() - expected_product(INT4M, x, packed, stored, outputs))
            .abs() <= bound).all()


@pytest.mark.parametrize("fmt", ROTATED, ids=lambda fmt: fmt.name)
def test_a_rotated_format_keeps_each_groups_precision_beside_a_hundredfold_outlier_group(fmt):
    """Each group of 32 has its own scale: in rows where one group is 100x the others, every group comes
    back within half its own step per rotated weight (its rotated largest magnitude / 254 for int8, / 62
    for int6's -31..31, the float16 scale's rounding aside; the rotation keeps the error's length), where
    one scale per row made the small groups' step 100x coarser; and on every path the product is the
    rounded activations times those weights, up to float32 summing."""
    generator = torch.Generator().manual_seed(12)
    outputs, inputs = 37, 256
    weight = torch.randn(outputs, inputs, generator=generator) * 0.05
    weight[:, 96:128] *= 100
    stored, scales = QUANTIZE[fmt.name](weight)
    restored = dequantize(fmt, stored, scales, outputs)
    groups, restored_groups = weight.reshape(outputs, -1, 32), restored.reshape(outputs, -1, 32)
    steps = {INT8: 254, INT6: 62}[fmt]
    half_step = rotate_groups(weight).reshape(outputs, -1, 32).abs().amax(dim=2) / steps * (1 + 2**-10)
    assert ((restored_groups - groups).norm(dim=2) <= half_step * 32**0.5).all()
    small = torch.arange(inputs // 32) != 3
    assert (half_step[:, small] < half_step[:, 3:4] / 20).all()
    x = torch.randn(5, inputs, generator=generator)
    want = expected_product(fmt, x, stored, scales, outputs)
    bound = (x.abs().double() @ restored.abs().double().t()) * 3e-5
    reference = product(fmt, x, stored, scales, outputs)
    assert ((reference.double() - want).abs() <= bound).all()
    for path in simd_paths():
        assert same_bits(product(fmt, x, stored, scales, outputs, path=path), reference), path


def test_int6_reads_every_stored_value_at_every_place_of_its_layout_on_every_path():
    """Stored 6-bit values 0..63 anywhere in a tile's block (0 too, which the converter never writes) come
    back from pack_int6's layout as they went in, and every path's product over them is the rounded
    activations times those weights (less 32 steps each), up to float32 summing, with the reference's
    bits; the converter stores its -31..31 levels as 1..63."""
    generator = torch.Generator().manual_seed(13)
    outputs, inputs = 37, 256
    values = torch.randint(0, 64, (padded_rows(outputs), inputs), generator=generator, dtype=torch.uint8)
    values[0, :64] = torch.arange(64, dtype=torch.uint8)
    packed = pack_int6(values)
    assert packed.shape == (padded_rows(outputs), inputs * 3 // 4)
    assert torch.equal(unpack_int6(packed), values.float())
    scales = tile_scales((torch.rand(outputs, inputs // 32, generator=generator) * 0.01 + 1e-3).half())
    restored = dequantize(INT6, packed, scales, outputs)
    x = torch.randn(5, inputs, generator=generator)
    bound = (x.abs().double() @ restored.abs().double().t()) * 3e-5
    reference = product(INT6, x, packed, scales, outputs)
    assert ((reference.double() - expected_product(INT6, x, packed, scales, outputs)).abs() <= bound).all()
    for path in simd_paths():
        for rows in (1, 2, 5):
            got = product(INT6, x[:rows], packed, scales, outputs, path=path)
            assert same_bits(got, reference[:rows]), (path, rows)
    assert (unpack_int6(quantize_int6(torch.randn(outputs, inputs, generator=generator))[0]) >= 1).all()


@pytest.mark.parametrize("isa", [kernels.AVX512_VNNI, kernels.AMX], ids=["avx512_vnni", "amx"])
def test_every_path_compiles(isa):
    """The VNNI and AMX paths cannot run on every CI machine, but they must always compile."""
    commands, _ = kernels._compile_commands(Path("/tmp"), [isa])
    command = next(command for command in commands if command[-3].endswith(isa.source))
    subprocess.run([*command[:-2], "-o", "/dev/null"], check=True)


def test_a_cpu_with_amx_runs_the_amx_path():
    """Where the CPU reports AMX-INT8, the library is built with the tile path and Linux grants the tile
    registers: a prompt's products run there, not on AVX-512 VNNI."""
    if not {"amx_tile", "amx_int8"} <= kernels.cpu_flags():
        assert "amx" not in kernels.available_paths()
        return
    assert kernels.available_paths()[-1] == "amx"


def test_builds_are_keyed_by_the_cpus_instruction_sets():
    """A virtualenv moved to a CPU without AVX2 (or with VNNI) looks for, and builds, another library."""
    avx2_only = {"avx2", "fma", "f16c"}
    with_vnni = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    with_amx = with_vnni | {"amx_tile", "amx_int8"}
    assert [isa.name for isa in kernels.instruction_sets(set())] == []
    assert [isa.name for isa in kernels.instruction_sets(avx2_only)] == ["avx2"]
    assert [isa.name for isa in kernels.instruction_sets(with_vnni)] == ["avx2", "avx512_vnni"]
    assert [isa.name for isa in kernels.instruction_sets(with_amx)] == ["avx2", "avx512_vnni", "amx"]
    assert [isa.name for isa in kernels.instruction_sets(avx2_only | {"amx_tile", "amx_int8"})] == ["avx2"]
    keys = {kernels.build_key(kernels.instruction_sets(flags)) for flags in (set(), avx2_only, with_vnni, with_amx)}
    assert len(keys) == 4


def fake_compiler(folder: Path, version: str, compiling: str = "exit 1") -> Path:
    """Write a stand-in for g++: it prints `version` for --version and runs `compiling` otherwise."""
    script = folder / f"g++-{abs(hash(version))}"
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n{compiling}\n')
    script.chmod(0o755)
    return script


def test_builds_are_keyed_by_the_compilers_version(monkeypatch, tmp_path):
    """A virtualenv whose g++ was upgraded builds again: another compiler's library may be other code."""
    sets = kernels.instruction_sets(kernels.cpu_flags())
    keys = {kernels.build_key(sets)}
    for version in ("g++ (Debian 12.2.0-14) 12.2.0", "g++ (Debian 13.1.0-1) 13.1.0"):
        monkeypatch.setattr(kernels, "COMPILER", str(fake_compiler(tmp_path, version)))
        keys.add(kernels.build_key(sets))
    assert len(keys) == 3


def test_a_hung_compiler_fails_the_build_within_its_timeout(monkeypatch, tmp_path):
    """A g++ that never returns is killed at the build's timeout, and the build fails saying so."""
    pids = tmp_path / "pids"
    monkeypatch.setattr(kernels, "COMPILER", str(fake_compiler(tmp_path, "hung", f"echo $$ >> {pids}; exec sleep 600")))
    began = time.monotonic()
    with pytest.raises(kernels.KernelBuildFailed, match="more than 2 s"):
        kernels.build(tmp_path / "key", [], timeout_seconds=2)
    assert time.monotonic() - began < 30
    started = [int(pid) for pid in pids.read_text().split()]
    assert started and not any(Path(f"/proc/{pid}").exists() for pid in started), "a hung compiler was left running"
    assert not list(tmp_path.glob(".key.*")), "the scratch folder was left behind"


def test_waiting_for_another_builder_is_bounded(tmp_path):
    """A worker waiting for a builder that hangs stops waiting with a message naming the lock."""
    directory = tmp_path / "key"
    directory.mkdir()
    with open(directory / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        began = time.monotonic()
        with pytest.raises(kernels.KernelBuildFailed, match=r"waited 1 s .*\.lock"):
            kernels.build_once(directory, [], lock_wait_seconds=1)
        assert 1 <= time.monotonic() - began < 10


def test_a_killed_builders_scratch_folder_is_removed_by_the_next_build(tmp_path):
    """Scratch folders are made under the build lock, so the next holder removes a killed builder's."""
    directory = tmp_path / "key"
    directory.mkdir()
    (directory / kernels.LIBRARY_NAME).write_bytes(b"a library")
    leftover = tmp_path / ".key.abc123"
    leftover.mkdir()
    (leftover / "ops.o").write_bytes(b"half an object")
    assert kernels.build_once(directory, []) == directory / kernels.LIBRARY_NAME
    assert not leftover.exists()


KERNELS_H_HELPERS = ("padded_outputs", "tile_block", "tile_scales", "bfloat16_to_float", "float_to_bfloat16",
                     "float16_to_float", "sum_lanes", "store_output", "sum_sixteen", "largest_of_sixteen",
                     "exp_nonpositive_lane")


def test_kernels_h_helpers_are_private_to_each_source_file(tmp_path):
    """kernels.h's helpers are compiled for several instruction sets: each source file must keep its own
    copy (a local symbol), or the linker keeps one file's copy (an AVX-512 one, say) for all of them.
    Built at -O0, so that none is inlined away, a file using every helper exports none of them."""
    source = tmp_path / "uses_helpers.cpp"
    source.write_text(
        '#include "kernels.h"\n'
        "using namespace corechat;\n"
        "float use(const Weights& w, Output out, uint16_t bits) {\n"
        "    float lanes[16] = {};\n"
        "    store_output(out, 0, 0, bfloat16_to_float(float_to_bfloat16(float16_to_float(bits))));\n"
        "    return sum_lanes(lanes) + padded_outputs(w.outputs) + *tile_block(w, 0, 0) + *tile_scales(w, 0, 0)\n"
        "        + exp_nonpositive_lane(sum_sixteen(lanes)) + largest_of_sixteen(lanes);\n"
        "}\n")
    compiled = tmp_path / "uses_helpers.o"
    subprocess.run([kernels.COMPILER, "-O0", "-std=c++20", "-Wall", "-Werror", f"-I{kernels.SOURCE_DIR}", "-c",
                    str(source), "-o", str(compiled)], check=True)
    symbols = subprocess.run(["nm", "-C", "--defined-only", str(compiled)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    defined = {helper: [line.split()[1] for line in symbols if f"::{helper}(" in line] for helper in KERNELS_H_HELPERS}
    assert all(defined.values()), defined  # each emitted out of line, so its binding shows
    assert all(kind == "t" for kinds in defined.values() for kind in kinds), defined


# Greedy tokens: each row's first largest logit, as torch.argmax chooses -----------------------------

@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 1000, 151_936, 151_937])
def test_greedy_tokens_choose_what_torch_argmax_chooses_at_every_width(width):
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(5, width, generator=generator)
    assert torch.equal(torch.ops.corechat.greedy_tokens(logits), torch.argmax(logits, dim=-1))
    # The largest at each place a vector loop treats apart: first, within the first vectors, the last
    # whole vector's end, the tail, last.
    for place in sorted({0, 7, 8, 15, 16, 31, (width // 16) * 16 - 1, width - 2, width - 1}):
        if 0 <= place < width:
            row = logits[0].clone()
            row[place] = 100.0
            assert int(torch.ops.corechat.greedy_tokens(row[None])[0]) == place, place


def test_greedy_tokens_take_the_first_of_equal_largest_logits_in_any_lane():
    width = 151_936
    for places in [(5, 6), (16, 5), (17, 33), (40, 24), (width - 1, width - 2), (width - 3, 3), (100, 99, 98)]:
        row = torch.zeros(1, width)
        row[0, list(places)] = 1.0
        assert int(torch.ops.corechat.greedy_tokens(row)[0]) == min(places) == int(torch.argmax(row)), places
    assert int(torch.ops.corechat.greedy_tokens(torch.zeros(1, width))[0]) == 0, "all equal: the first"


@pytest.mark.parametrize("values", ["forbidden", "extremes", "subnormals"])
def test_greedy_tokens_at_the_extremes_of_float32(values):
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 151_936, generator=generator)
    if values == "forbidden":  # a grammar's mask: most tokens -inf
        logits[:, torch.rand(151_936, generator=generator) < 0.99] = float("-inf")
    elif values == "extremes":
        logits[0, 1234] = torch.finfo(torch.float32).max
        logits[1] = torch.finfo(torch.float32).min
        logits[1, 77] = -torch.finfo(torch.float32).tiny
        logits[2, ::2] = float("-inf")
    else:
        logits = torch.full((3, 151_936), -1e-45)
        logits[0, 999] = 1e-45
        logits[1, 151_935] = 0.0
        logits[2, 20] = 2e-45
        logits[2, 21] = 1.1754942e-38  # the largest subnormal
    assert torch.equal(torch.ops.corechat.greedy_tokens(logits), torch.argmax(logits, dim=-1))


def test_greedy_tokens_of_no_rows_are_none():
    assert torch.ops.corechat.greedy_tokens(torch.zeros(0, 151_936)).shape == (0,)
