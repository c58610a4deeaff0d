"""corechat's C++ kernels: every SIMD path against the plain reference, the reference against float
math, and a row's result against the rows that share its call.

The library is the one `make setup` built for this CPU (built here if missing). Paths this CPU
cannot run (AVX-512 VNNI on an AVX2 machine) are compiled but not run; the report says which.
"""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
import torch

from service.engine import kernels
from service.engine.quantized import INT4, INT8, dequantize, quantize_int4, quantize_int8
from service.settings import Settings
from support import cpu_ticks_by_thread

MAX_RUNNING = Settings().max_running
# (outputs, inputs): odd output counts, one block, an odd number of blocks (int8 only: int4 pairs
# its groups), the 0.5B model's widths.
SHAPES = [(1, 64), (3, 96), (37, 128), (129, 192), (300, 896), (61, 4864), (5, 32)]
# Every batch size the batcher uses, and prompt chunks across the kernel's 64-row chunk.
ROWS = list(range(1, MAX_RUNNING + 1)) + [63, 64, 65, 130]


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
    return (quantize_int8 if fmt is INT8 else quantize_int4)(weight)


def product(fmt, inputs, weight, scales, outputs, bias=None, float32_output=True, path="reference") -> torch.Tensor:
    """Run the kernel on one path."""
    return torch.ops.corechat.quantized_linear(inputs, weight, scales, bias, fmt.code, outputs, float32_output,
                                               kernels.PATHS[path])


def expected_product(fmt, inputs: torch.Tensor, weight, scales, outputs: int) -> torch.Tensor:
    """Compute the kernel's product independently: activations rounded per block of 32, sums in float64."""
    rows, width = inputs.shape
    blocks = inputs.float().reshape(rows, width // 32, 32)
    block_scales = blocks.abs().amax(dim=2) / 127
    inverse = torch.where(block_scales > 0, 1 / block_scales, torch.zeros_like(block_scales))
    levels = torch.round(blocks * inverse[:, :, None]).clamp(-127, 127)
    activations = (levels * block_scales[:, :, None]).double().reshape(rows, width)
    return activations @ dequantize(fmt, weight, scales, outputs).double().t()


def test_avx2_path_exists_here():
    """This machine's CPU has AVX2: the fast path must be built and chosen, not the reference."""
    assert "avx2" in kernels.available_paths()


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=["int8", "int4"])
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


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=["int8", "int4"])
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


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=["int8", "int4"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(fmt):
    """Row r alone and row r among 1..MAX_RUNNING others (or a prompt's 130) give the same bits."""
    generator = torch.Generator().manual_seed(3)
    weight, scales = quantized(fmt, 257, 896, generator)
    x = torch.randn(130, 896, generator=generator).to(torch.bfloat16)
    for path in kernels.available_paths():
        alone = torch.cat([product(fmt, x[row : row + 1], weight, scales, 257, path=path) for row in range(130)])
        for rows in ROWS:
            assert torch.equal(product(fmt, x[:rows], weight, scales, 257, path=path), alone[:rows]), (path, rows)


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run the block with torch's intra-op thread count set, restoring it after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
        product(INT8, torch.randn(1, 48), torch.zeros(8, 48, dtype=torch.int8), scales, 8)
    with pytest.raises(RuntimeError, match="scales"):
        product(INT8, torch.randn(1, 64), weight, scales[:4], 8)
    with pytest.raises(RuntimeError, match="padded"):
        product(INT8, torch.randn(1, 64), weight, scales, 12)
    with pytest.raises(RuntimeError, match="multiples of 64"):
        product(INT4, torch.randn(1, 96), torch.zeros(8, 48, dtype=torch.uint8), torch.zeros(8, 8, dtype=torch.float16),
                8)


def test_int4_quantization_keeps_each_groups_extreme_and_bounds_the_error():
    """The largest-magnitude weight of a group is stored as -8 times its scale; others within half a
    step, or a step where +8 steps had to be clamped to 7."""
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(5))
    packed, scales = quantize_int4(weight)
    restored = dequantize(INT4, packed, scales, 16)
    groups, restored_groups = weight.reshape(16, 4, 32), restored.reshape(16, 4, 32)
    extreme = groups.abs().argmax(dim=2, keepdim=True)
    assert torch.allclose(restored_groups.gather(2, extreme), groups.gather(2, extreme), rtol=1e-3)
    scales = scales[:, :4].float()
    step = scales.abs()[:, :, None]
    clamped = groups / scales[:, :, None] > 7.5
    bound = torch.where(clamped, step, step / 2) * (1 + 1e-3)
    assert ((restored_groups - groups).abs() <= bound).all()


def test_avx512_vnni_path_compiles():
    """The VNNI path cannot run on every CI machine, but it must always compile."""
    commands, _ = kernels._compile_commands(Path("/tmp"), [kernels.AVX512_VNNI])
    command = next(command for command in commands if command[-3].endswith("avx512_vnni.cpp"))
    subprocess.run([*command[:-2], "-o", "/dev/null"], check=True)


def test_builds_are_keyed_by_the_cpus_instruction_sets():
    """A virtualenv moved to a CPU without AVX2 (or with VNNI) looks for, and builds, another library."""
    avx2_only = {"avx2", "fma", "f16c"}
    with_vnni = avx2_only | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert [isa.name for isa in kernels.instruction_sets(set())] == []
    assert [isa.name for isa in kernels.instruction_sets(avx2_only)] == ["avx2"]
    assert [isa.name for isa in kernels.instruction_sets(with_vnni)] == ["avx2", "avx512_vnni"]
    keys = {kernels.build_key(kernels.instruction_sets(flags)) for flags in (set(), avx2_only, with_vnni)}
    assert len(keys) == 3


def expected_attention(query, keys, values, start: int, scale: float) -> torch.Tensor:
    """One row's decode attention in float64 over columns [start, width): (heads, dim)."""
    heads, kv_heads = query.shape[0], keys.shape[0]
    group = heads // kv_heads
    output = []
    for head in range(heads):
        k, v = keys[head // group, start:].double(), values[head // group, start:].double()
        weights = torch.softmax(k @ query[head].double() * scale, dim=0)
        output.append(weights @ v)
    return torch.stack(output)


def attention(query, keys, values, cache_rows, starts, ends, scale):
    """Run the attention kernel on int64 index lists."""
    index = {name: torch.tensor(v, dtype=torch.long) for name, v in (("c", cache_rows), ("s", starts), ("e", ends))}
    return torch.ops.corechat.attention(query, keys, values, index["c"], index["s"], index["e"], scale)


def test_decode_attention_matches_softmax_attention_and_ignores_padding():
    """Each row attends over its own columns: float64 math within bfloat16 rounding, and the same
    bits as the row alone in an unpadded cache."""
    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, width = 14, 2, 64, 300
    lengths = [300, 1, 17, 250, 64, 299, 8, 123]
    rows = len(lengths)
    query = torch.randn(rows, heads, dim, generator=generator).to(torch.bfloat16)
    keys = torch.randn(rows, kv_heads, width, dim, generator=generator).to(torch.bfloat16)
    values = torch.randn(rows, kv_heads, width, dim, generator=generator).to(torch.bfloat16)
    starts = [width - length for length in lengths]
    batched = attention(query, keys, values, list(range(rows)), starts, [width] * rows, dim**-0.5)
    for row, start in enumerate(starts):
        want = expected_attention(query[row], keys[row], values[row], start, dim**-0.5)
        assert torch.allclose(batched[row].double(), want, rtol=2e-2, atol=2e-2)
        own_keys = keys[row : row + 1, :, start:].contiguous()
        own_values = values[row : row + 1, :, start:].contiguous()
        alone = attention(query[row : row + 1], own_keys, own_values, [0], [0], [width - start], dim**-0.5)
        assert torch.equal(alone[0], batched[row]), row


def test_prompt_rows_attend_causally_and_as_a_decode_step_would():
    """A prompt's token p attends to keys 0..p, the same bits as decoding it after p earlier tokens."""
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, tokens = 14, 2, 64, 40
    query = torch.randn(tokens, heads, dim, generator=generator).to(torch.bfloat16)
    keys = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(torch.bfloat16)
    values = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(torch.bfloat16)
    prompt = attention(query, keys, values, [0] * tokens, [0] * tokens, list(range(1, tokens + 1)), 0.125)
    for token in range(tokens):
        step = attention(query[token : token + 1], keys[:, :, : token + 1].contiguous(),
                         values[:, :, : token + 1].contiguous(), [0], [0], [token + 1], 0.125)
        assert torch.equal(prompt[token], step[0]), token
        causal = expected_attention(query[token], keys[0, :, : token + 1], values[0, :, : token + 1], 0, 0.125)
        assert torch.allclose(prompt[token].double(), causal, rtol=2e-2, atol=2e-2)


def test_attention_reads_a_cache_in_place_from_the_start_of_larger_tensors():
    """A cache's views of its room (service/engine/kvcache.py) give the bits of the same keys
    contiguous; a cache whose tokens' vectors are not contiguous is refused, not misread."""
    generator = torch.Generator().manual_seed(8)
    rows, heads, kv_heads, dim, width, room = 3, 14, 2, 64, 37, 300
    query = torch.randn(rows, heads, dim, generator=generator).to(torch.bfloat16)
    keys_room = torch.randn(rows, kv_heads, room, dim, generator=generator).to(torch.bfloat16)
    values_room = torch.randn(rows, kv_heads, room, dim, generator=generator).to(torch.bfloat16)
    keys, values = keys_room[:, :, :width], values_room[:, :, :width]
    assert not keys.is_contiguous()
    spans = (list(range(rows)), [0, 5, 36], [width] * rows)
    in_place = attention(query, keys, values, *spans, 0.125)
    assert torch.equal(in_place, attention(query, keys.contiguous(), values.contiguous(), *spans, 0.125))
    with pytest.raises(RuntimeError, match="contiguous"):
        attention(query, keys.transpose(2, 3).contiguous().transpose(2, 3), values, *spans, 0.125)


def test_attention_refuses_rows_without_keys_or_cache():
    """An empty or out-of-range span would read nothing or outside the cache: an error, not garbage."""
    query = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    for cache_rows, starts, ends in (([0], [4], [4]), ([0], [0], [5]), ([1], [0], [4]), ([0], [2], [1])):
        with pytest.raises(RuntimeError, match="no key|no cache row"):
            attention(query, cache, cache, cache_rows, starts, ends, 1.0)
