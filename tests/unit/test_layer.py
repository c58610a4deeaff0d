"""The fused decoder-layer operators (kernels/csrc/layer.cpp) against transformers' operations.

attention_inputs and mlp must give, bit for bit, what the same layer gives run one operation at a
time (torch's rotary, sums, SiLU and products, corechat's products and RMSNorm); corechat's RMSNorm
must stay within two bfloat16 steps (it rounds twice) of transformers' Qwen2RMSNorm (it sums the mean of
squares in its own order). Rows must not change each other's results, nor threads the results.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from service.engine import kernels
from service.engine.quantized import INT4, INT4M, INT8, QUANTIZE
from service.settings import Settings
from tests.support import torch_threads

HEAD_DIM = 64
EPS = 1e-6


@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    """Load (building if needed) this CPU's kernels."""
    kernels.load(Path(Settings().kernels_dir))


def transformers_norm(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Return Qwen2RMSNorm's output (transformers' own module)."""
    norm = Qwen2RMSNorm(hidden.shape[-1], eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(hidden)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return how many bfloat16 steps separate two tensors of finite values, elementwise."""
    def ordered(t):
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("width", [64, 896, 1536])
def test_rms_norm_is_transformers_norm_within_its_two_roundings(width):
    """A last-bit difference in the mean can move each of the norm's two roundings by one step."""
    generator = torch.Generator().manual_seed(width)
    weight = (torch.rand(width, generator=generator) + 0.5).bfloat16()
    rows = [torch.randn(400, width, generator=generator) * 3,
            torch.full((1, width), 1e-38), torch.full((1, width), 3e38), torch.zeros(1, width),
            torch.randn(1, width, generator=generator) * 1e-20]
    hidden = torch.cat(rows).bfloat16()
    ours = torch.ops.corechat.rms_norm(hidden, weight, EPS)
    theirs = transformers_norm(hidden, weight)
    assert torch.isfinite(ours).all()
    assert ulps_apart(ours, theirs).max() <= 2
    assert (ours == theirs).float().mean() > 0.999


def norm_as_defined(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """corechat's RMSNorm computed here, one float32 operation at a time: each row's squares summed
    into 8 lanes (element i into lane i % 8, in order), the lanes added as kernels.h's sum_lanes, then
    weight * bf16(x * (1 / sqrt(mean + eps)))."""
    rows, width = hidden.shape
    x = hidden.float()
    lanes = torch.zeros(rows, 8)
    for start in range(0, width, 8):
        chunk = x[:, start:start + 8]
        lanes[:, : chunk.shape[1]] = lanes[:, : chunk.shape[1]] + chunk * chunk
    even = (lanes[:, 0] + lanes[:, 4]) + (lanes[:, 2] + lanes[:, 6])
    total = even + ((lanes[:, 1] + lanes[:, 5]) + (lanes[:, 3] + lanes[:, 7]))
    # numpy's float32 division and square root, each rounded once (torch's 1 / x is a reciprocal an
    # ulp away at times).
    inverse = torch.from_numpy(np.float32(1.0) / np.sqrt(total.numpy() / np.float32(width) + np.float32(EPS)))
    return (weight.float() * (x * inverse[:, None]).bfloat16().float()).bfloat16()


@pytest.mark.parametrize("width", [8, 20, 64, 100, 896, 4864])
def test_rms_norm_gives_the_bits_of_its_defined_order(width):
    """Eight elements at a time and the tail one by one: every width gives the bits of the order it
    defines, down to the smallest numbers and beside NaN and inf (rows of their own). An order changed
    moves a row's float32 mean by an ulp, which flips about one bfloat16 output in 2^16: hence 400,000
    random elements a width."""
    generator = torch.Generator().manual_seed(width)
    weight = (torch.rand(width, generator=generator) + 0.5).bfloat16()
    hidden = torch.cat([torch.randn(400_000 // width, width, generator=generator) * 3, torch.full((1, width), 1e-38),
                        torch.full((1, width), 3e38), torch.randn(1, width, generator=generator) * 1e-30,
                        torch.zeros(1, width)]).bfloat16()
    poisoned = hidden[:2].clone()
    poisoned[0, width // 2], poisoned[1, -1] = float("nan"), float("inf")
    hidden = torch.cat([hidden, poisoned])
    ours = torch.ops.corechat.rms_norm(hidden, weight, EPS)
    want = norm_as_defined(hidden, weight)
    # NaN where the definition gives NaN (torch writes its own NaN's bits), the same bits elsewhere.
    assert torch.equal(ours.isnan(), want.isnan()) and want[-2:].isnan().any(dim=1).all()
    assert torch.equal(ours.nan_to_num(0.0).view(torch.int16), want.nan_to_num(0.0).view(torch.int16))


def random_quantized(fmt, outputs: int, inputs: int, generator: torch.Generator):
    """Return quantized random weights, their scales and a float32 bias, as QuantizedLinear holds them."""
    weight = torch.randn(outputs, inputs, generator=generator) * 0.05
    stored, scales = QUANTIZE[fmt.name](weight)
    return stored, scales, torch.randn(outputs, generator=generator) * 0.1


def values_int8(fmt) -> tuple:
    """Return a layer's product formats as the 4-bit conversions store them: the value product int8."""
    return (fmt, fmt, INT8, fmt, fmt, fmt, fmt)


# Every format alone, and the 4-bit formats with their int8 value product (converted.py: format_of).
LAYER_FORMATS = [INT8, INT4, INT4M, values_int8(INT4), values_int8(INT4M)]
LAYER_FORMAT_IDS = ["int8", "int4", "int4m", "int4-values-int8", "int4m-values-int8"]


class Layer:
    """A random decoder layer's weights: `heads` query heads on half as many key/value heads, q/k/v with biases,
    and with `head_norms` Qwen3's query and key norms. `fmt` is one format for every product, or the
    seven products' formats (q, k, v, o, gate, up, down)."""

    def __init__(self, fmt, width: int, intermediate: int, seed: int, heads: int = 4, head_norms: bool = False):
        generator = torch.Generator().manual_seed(seed)
        self.formats, self.width = list(fmt) if isinstance(fmt, tuple) else [fmt] * 7, width
        kv_width = heads // 2 * HEAD_DIM
        shapes = [heads * HEAD_DIM, kv_width, kv_width, width, intermediate, intermediate, width]
        inputs = [width] * 6 + [intermediate]
        self.products = [random_quantized(product_format, outputs, size, generator)
                         for product_format, outputs, size in zip(self.formats, shapes, inputs, strict=True)]
        self.outputs = shapes
        # o, gate, up and down have no bias in Qwen2.
        self.products[3:] = [(weight, scales, None) for weight, scales, _ in self.products[3:]]
        self.norms = [(torch.rand(width, generator=generator) + 0.5).bfloat16() for _ in range(2)]
        self.head_norms = [(torch.rand(HEAD_DIM, generator=generator) + 0.5).bfloat16()
                           for _ in range(2)] if head_norms else []

    def arguments(self, first: int, last: int) -> tuple:
        """Return products first..last-1 as the fused operators take them."""
        chosen = self.products[first:last]
        return ([p[0] for p in chosen], [p[1] for p in chosen], [p[2] for p in chosen], self.outputs[first:last],
                [fmt.code for fmt in self.formats[first:last]])

    def product(self, index: int, inputs: torch.Tensor) -> torch.Tensor:
        """Run one product alone, as the per-operation forward does."""
        weight, scales, bias = self.products[index]
        return torch.ops.corechat.quantized_linear(inputs, weight, scales, bias, self.formats[index].code,
                                                   self.outputs[index], False)


def rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [rows, heads * HEAD_DIM]."""
    heads = states.view(states.shape[0], -1, HEAD_DIM)
    rotated = torch.cat((-heads[..., HEAD_DIM // 2:], heads[..., : HEAD_DIM // 2]), dim=-1)
    return ((heads * cos[:, None]) + (rotated * sin[:, None])).view(states.shape)


def one_by_one(layer: Layer, hidden, cos, sin):
    """Run the layer's two blocks one operation at a time. The queries' first columns stand in for
    attention's output (the attention kernel has its own tests)."""
    states = torch.ops.corechat.rms_norm(hidden, layer.norms[0], EPS)
    query, key, value = (layer.product(index, states) for index in range(3))
    if layer.head_norms:
        query, key = (torch.ops.corechat.rms_norm(states.view(-1, HEAD_DIM), weight, EPS).view(states.shape)
                      for states, weight in zip((query, key), layer.head_norms))
    query, key = rotary(query, cos, sin), rotary(key, cos, sin)
    attended = query[:, : layer.width].contiguous()
    summed = hidden + layer.product(3, attended)
    states = torch.ops.corechat.rms_norm(summed, layer.norms[1], EPS)
    out = summed + layer.product(6, F.silu(layer.product(4, states)) * layer.product(5, states))
    return (query, key, value), out


def fused(layer: Layer, hidden, cos, sin):
    """Run the same through the fused operators."""
    query_norm, key_norm = layer.head_norms or (None, None)
    inputs = torch.ops.corechat.attention_inputs(hidden, layer.norms[0], EPS, *layer.arguments(0, 3), cos, sin,
                                                 HEAD_DIM, query_norm=query_norm, key_norm=key_norm, head_eps=EPS)
    attended = inputs[0][:, : layer.width].contiguous()
    out = torch.ops.corechat.mlp(hidden, attended, layer.norms[1], EPS, *layer.arguments(3, 7))
    return tuple(inputs), out


def rows_of(count: int, width: int, seed: int):
    """Return hidden states and a rotary's cos and sin for `count` rows at positions 0, 7, 14, ..."""
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(count, width, generator=generator) * 2).bfloat16()
    positions = torch.arange(count)[:, None] * 7.0
    frequencies = 1e6 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = torch.cat([positions * frequencies] * 2, dim=-1)
    return hidden, angles.cos().bfloat16(), angles.sin().bfloat16()


def assert_fused_as_one_by_one(layer: Layer, rows: int, seed: int) -> None:
    """Check the fused operators give, on 1 and 2 threads, the bits of the operations one by one (on one thread)."""
    hidden, cos, sin = rows_of(rows, layer.width, seed=seed)
    with torch_threads(1):
        expected_inputs, expected_out = one_by_one(layer, hidden, cos, sin)
    for threads in (1, 2):
        with torch_threads(threads):
            got_inputs, got_out = fused(layer, hidden, cos, sin)
        assert all(torch.equal(got, want) for got, want in zip(got_inputs, expected_inputs, strict=True))
        assert torch.equal(got_out, expected_out)


@pytest.mark.parametrize("fmt", LAYER_FORMATS, ids=LAYER_FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_fused_blocks_give_the_bits_of_their_operations_one_by_one(fmt, rows):
    """17 and 40 rows split the elementwise loops across threads (16 rows a task)."""
    assert_fused_as_one_by_one(Layer(fmt, width=256, intermediate=640, seed=rows), rows, seed=rows)


@pytest.mark.parametrize("fmt", [INT8, INT4, INT4M], ids=["int8", "int4", "int4m"])
@pytest.mark.parametrize("rows", [1, 17])
def test_qwen3_head_norms_give_the_bits_of_corechats_norm_on_each_head_before_the_rotary(fmt, rows):
    """Qwen3's q_norm and k_norm: each head of each row through corechat's RMSNorm, then the rotary."""
    layer = Layer(fmt, width=256, intermediate=640, seed=200 + rows, head_norms=True)
    assert_fused_as_one_by_one(layer, rows, seed=rows)


@pytest.mark.parametrize("fmt", LAYER_FORMATS, ids=LAYER_FORMAT_IDS)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_wide_layers_share_their_products_tiles_among_threads_without_changing_a_bit(fmt, rows):
    """Wide enough to run in parallel (ops.cpp: kParallelBytes): q, k and v, then gate and up, are one
    range of tiles the threads take in chunks that cross from one product into the next."""
    assert_fused_as_one_by_one(Layer(fmt, width=1024, intermediate=4096, seed=100 + rows, heads=16), rows, seed=rows)


@pytest.mark.parametrize("head_dim", [20, 48])
def test_the_rotary_of_heads_whose_halves_are_not_whole_vectors_gives_transformers_bits(head_dim):
    """Each half of a head eight elements at a time and the rest one by one (a half of 10 or 24): the
    rotary gives apply_rotary_pos_emb's bits, as it does on 64-element heads."""
    generator = torch.Generator().manual_seed(head_dim)
    width, rows = 64, 5
    products = [random_quantized(INT8, outputs, width, generator) for outputs in (2 * head_dim, head_dim, head_dim)]
    hidden = (torch.randn(rows, width, generator=generator) * 2).bfloat16()
    norm = (torch.rand(width, generator=generator) + 0.5).bfloat16()
    angles = torch.arange(rows)[:, None] * 3.0 * 1e4 ** (-torch.arange(0, head_dim, 2) / head_dim)
    angles = torch.cat([angles] * 2, dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = torch.ops.corechat.attention_inputs(hidden, norm, EPS, [p[0] for p in products], [p[1] for p in products],
                                              [p[2] for p in products], [2 * head_dim, head_dim, head_dim],
                                              [INT8.code] * 3, cos, sin, head_dim)
    states = torch.ops.corechat.rms_norm(hidden, norm, EPS)
    for index, outputs in enumerate((2 * head_dim, head_dim)):
        weight, scales, bias = products[index]
        projected = torch.ops.corechat.quantized_linear(states, weight, scales, bias, INT8.code, outputs, False)
        heads = projected.view(rows, -1, head_dim)
        turned = torch.cat((-heads[..., head_dim // 2:], heads[..., : head_dim // 2]), dim=-1)
        want = ((heads * cos[:, None]) + (turned * sin[:, None])).view(rows, -1)
        assert torch.equal(got[index], want), index


def test_a_rows_fused_result_does_not_depend_on_the_rows_beside_it():
    layer = Layer(INT8, width=128, intermediate=256, seed=5)
    hidden, cos, sin = rows_of(33, 128, seed=5)
    _, together = fused(layer, hidden, cos, sin)
    for row in (0, 16, 32):
        _, alone = fused(layer, hidden[row:row + 1], cos[row:row + 1], sin[row:row + 1])
        assert torch.equal(alone[0], together[row])


def test_fused_operators_refuse_mismatched_arguments():
    layer = Layer(INT8, width=128, intermediate=256, seed=6)
    hidden, cos, sin = rows_of(2, 128, seed=6)
    weights, scales, biases, outputs, code = layer.arguments(0, 3)
    with pytest.raises(RuntimeError, match="takes 3 products"):
        torch.ops.corechat.attention_inputs(hidden, layer.norms[0], EPS, weights[:2], scales[:2], biases[:2],
                                            outputs[:2], code[:2], cos, sin, HEAD_DIM)
    with pytest.raises(RuntimeError, match="takes 3 products"):
        torch.ops.corechat.attention_inputs(hidden, layer.norms[0], EPS, weights, scales, biases, outputs, code[:2],
                                            cos, sin, HEAD_DIM)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.corechat.attention_inputs(hidden, layer.norms[0], EPS, weights, scales, biases, outputs, code,
                                            cos[:1], sin[:1], HEAD_DIM)
    with pytest.raises(RuntimeError, match="head norm weight must be a contiguous bfloat16 vector of 64"):
        torch.ops.corechat.attention_inputs(hidden, layer.norms[0], EPS, weights, scales, biases, outputs, code,
                                            cos, sin, HEAD_DIM, query_norm=layer.norms[0], head_eps=EPS)
    with pytest.raises(RuntimeError, match="weight must be a contiguous bfloat16 vector"):
        torch.ops.corechat.rms_norm(hidden, layer.norms[0][:64], EPS)
    with pytest.raises(RuntimeError, match="contiguous bfloat16 matrix"):
        torch.ops.corechat.rms_norm(hidden.float(), layer.norms[0], EPS)


@pytest.mark.parametrize("fmt", LAYER_FORMATS, ids=LAYER_FORMAT_IDS)
def test_run_products_runs_every_registered_product_and_refuses_what_it_cannot(fmt):
    """The step probe's products-only pass: every layer's products at their shapes (each product checks
    its input's width against its weights), and its own checks."""
    layers = [Layer(fmt, width=128, intermediate=256, seed=seed) for seed in (7, 8)]
    norms, epsilons, weights, scales, biases, outputs, formats = [], [], [], [], [], [], []
    for layer in layers:
        norms += layer.norms
        epsilons += [EPS, EPS]
        formats += [product_format.code for product_format in layer.formats]
        for weight, scale, bias in layer.products:
            weights.append(weight)
            scales.append(scale)
            biases.append(bias)
        outputs += layer.outputs
    model = torch.ops.corechat.register_layers(norms, epsilons, weights, scales, biases, outputs, formats, HEAD_DIM,
                                               HEAD_DIM ** -0.5, [], [])
    for rows in (1, 5):
        assert torch.ops.corechat.run_products(model, rows) is None
    with pytest.raises(RuntimeError, match="rows must be above 0"):
        torch.ops.corechat.run_products(model, 0)
    with pytest.raises(RuntimeError, match="no registered layers"):
        torch.ops.corechat.run_products(model + 1000, 1)
    with pytest.raises(RuntimeError, match="head norms are two per layer"):
        torch.ops.corechat.register_layers(norms, epsilons, weights, scales, biases, outputs, formats, HEAD_DIM,
                                           HEAD_DIM ** -0.5, layers[0].norms, [EPS])
    with pytest.raises(RuntimeError, match="seven products per layer"):
        torch.ops.corechat.register_layers(norms, epsilons, weights, scales, biases, outputs, formats[:-1], HEAD_DIM,
                                           HEAD_DIM ** -0.5, [], [])
