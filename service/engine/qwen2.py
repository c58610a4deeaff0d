"""A lean forward for Qwen2-family models (Qwen2, Qwen3, Llama): transformers' operations, without its
module machinery.

A decode step through transformers' modules spends much of its time in Python outside any operator
(module calls, decorators, keyword plumbing, mask building; bench/probes/step_probe.py). This
forward calls the products and the attention kernel directly over rows of tokens: a prompt chunk of
one sequence, or one token of each sequence of a decode step. Each row's keys and values go into its
sequence's pages of the worker's pool (kvpool.py) and it attends to its own sequence's positions up
to its own (kernels.h: PagedAttention), so a row's result depends neither on the other rows nor on
how its prompt was cut.

Quantized models (int8, int4, int4m) run all their decoder layers in one operator (kernels/csrc/layer.cpp:
run_layers, a layer's norm, products, Qwen3's head norms and rotary before attention, the attention, and the rest
after it), the same arithmetic as transformers' except RMSNorm's mean, which the kernel sums in its
own fixed order; the hook between layers (the engine's core sharing) runs once per forward.
bfloat16 models run transformers' operations one by one around the attention kernel.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .quantized import QuantizedLinear

# Llama's decoder is Qwen2's without the query, key and value biases (SmolLM2, Llama 3.2, TinyLlama);
# Qwen3's is Llama's with an RMSNorm over each query and key head before the rotary (q_norm, k_norm).
ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM")
# Head sizes the attention kernel takes.
HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class FusedLayer:
    """A quantized decoder layer's arguments to the fused operators, gathered once."""

    attention: tuple
    mlp: tuple
    # Qwen3's query and key norms (weights and epsilon), or None for a decoder without them.
    head_norms: tuple | None = None


def product_arguments(linears: list[QuantizedLinear]) -> tuple:
    """Return the weights, scales, biases, output counts and formats of products, as the operators take them."""
    return ([linear.qweight for linear in linears], [linear.qscale for linear in linears],
            [linear.bias for linear in linears], [linear.out_features for linear in linears],
            [linear.format.code for linear in linears])


def fused_layers(model) -> list[FusedLayer] | None:
    """Return the fused operators' arguments for every decoder layer, or None unless every product
    of every layer is quantized, and the output layer too (each product in its own format)."""
    if not isinstance(model.lm_head, QuantizedLinear):
        return None
    layers = []
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        before = [attention.q_proj, attention.k_proj, attention.v_proj]
        after = [attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        linears = before + after
        if not all(isinstance(linear, QuantizedLinear) for linear in linears):
            return None
        layers.append(FusedLayer(
            (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, *product_arguments(before)),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
             *product_arguments(after)),
            head_norms(attention),
        ))
    return layers


def head_norms(attention) -> tuple | None:
    """Return an attention block's query and key norms as (query weight, key weight, epsilon), or None."""
    query_norm, key_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    if query_norm is None or key_norm is None:
        return None
    if query_norm.variance_epsilon != key_norm.variance_epsilon:
        raise ValueError("the query and key norms of a layer have different epsilons")
    return query_norm.weight, key_norm.weight, query_norm.variance_epsilon


def rms_norm(hidden: torch.Tensor, norm) -> torch.Tensor:
    """Qwen2RMSNorm's operations (Qwen3RMSNorm's too, over the last dimension: a head for q_norm and k_norm)."""
    widened = hidden.to(torch.float32)
    variance = widened.pow(2).mean(-1, keepdim=True)
    widened = widened * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * widened.to(hidden.dtype)


def product(linear, inputs: torch.Tensor) -> torch.Tensor:
    """Apply a Linear or QuantizedLinear without a module call."""
    if isinstance(linear, QuantizedLinear):
        return linear.forward(inputs)
    return F.linear(inputs, linear.weight, linear.bias)


def rotate_half(states: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half."""
    half = states.shape[-1] // 2
    return torch.cat((-states[..., half:], states[..., :half]), dim=-1)


class RotaryTable:
    """The rotary embedding's cos and sin for positions [0, length), computed by the model's own rotary
    module a chunk of positions at a time as longer sequences come, so that a forward looks its rows'
    up with one index each instead of running the module's operators (a decode step's few
    microseconds each, but on caches the step's weights just swept). Each element is its own product
    of a position and a frequency, then its cos or sin, so a table row is the bits the module gives
    that position in any call. Rotary types whose frequencies change with the sequence's length
    (dynamic, longrope) are not tabled: the module runs every forward for them."""

    CHUNK = 512

    def __init__(self, rotary: torch.nn.Module, dtype: torch.dtype):
        self.rotary = rotary
        self.dtype = dtype
        rope_type = getattr(rotary, "rope_type", "default")
        self.tabled = "dynamic" not in rope_type and rope_type != "longrope"
        self.cos = self.sin = None

    def rows(self, hidden: torch.Tensor, positions: torch.Tensor, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return cos and sin [rows, head_dim] of each row's position, contiguous (`last`: the largest
        position, where the caller knows it)."""
        if not self.tabled:
            cos, sin = self.rotary(hidden, positions.unsqueeze(0))
            return cos[0].contiguous(), sin[0].contiguous()
        needed = (int(positions.max()) if last is None else last) + 1
        if self.cos is None or needed > self.cos.shape[0]:
            self._grow(needed)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)

    def _grow(self, needed: int) -> None:
        """Extend the table to a whole number of chunks holding position needed - 1."""
        have = 0 if self.cos is None else self.cos.shape[0]
        length = -(-needed // self.CHUNK) * self.CHUNK
        positions = torch.arange(have, length).unsqueeze(0)
        cos, sin = self.rotary(torch.empty(0, dtype=self.dtype), positions)
        self.cos = cos[0] if self.cos is None else torch.cat([self.cos, cos[0]])
        self.sin = sin[0] if self.sin is None else torch.cat([self.sin, sin[0]])


@dataclass(frozen=True)
class LeanModel:
    """A model the lean forward runs: the model, its fused layers if quantized (and their handle in
    torch.ops.corechat.run_layers), the hook that runs before a forward's layers, and its rotary table."""

    model: torch.nn.Module
    fused: list[FusedLayer] | None
    between_layers: Callable[[], object] | None
    rotary: RotaryTable
    registered: int | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """Return (layers, kv_heads, head_dim), the shape of its pages in the pool."""
        attention = self.model.model.layers[0].self_attn
        config = self.model.config
        return config.num_hidden_layers, config.num_key_value_heads, attention.head_dim


def lean_model(model, between_layers: Callable[[], object] | None = None) -> LeanModel | None:
    """Return a bf16 or quantized Qwen2-family model as the lean forward runs it, or None if it cannot."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if (type(model).__name__ not in ARCHITECTURES or model.dtype != torch.bfloat16
            or getattr(config, "use_sliding_window", False) or config.hidden_act != "silu"
            or head_dim not in HEAD_DIMS or not hasattr(torch.ops.corechat, "paged_attention")):
        return None
    fused = fused_layers(model)
    return LeanModel(model, fused, between_layers, RotaryTable(model.model.rotary_emb, model.dtype),
                     register_layers(model, fused) if fused is not None else None)


def register_layers(model, fused: list[FusedLayer]) -> int:
    """Hand a quantized model's layers to the kernels once; return the handle run_layers takes."""
    norms, epsilons, weights, scales, biases, outputs, formats = [], [], [], [], [], [], []
    # Either none or every layer has head norms (a model has one decoder class): two weights a layer.
    per_head, head_epsilons = [], []
    for layer in fused:
        if layer.head_norms is not None:
            per_head += layer.head_norms[:2]
            head_epsilons.append(layer.head_norms[2])
        for norm, eps, layer_weights, layer_scales, layer_biases, layer_outputs, layer_formats in (layer.attention,
                                                                                                  layer.mlp):
            norms.append(norm)
            epsilons.append(eps)
            weights += layer_weights
            scales += layer_scales
            biases += layer_biases
            outputs += layer_outputs
            formats += layer_formats
    attention = model.model.layers[0].self_attn
    return torch.ops.corechat.register_layers(norms, epsilons, weights, scales, biases, outputs, formats,
                                              attention.head_dim, attention.scaling, per_head, head_epsilons)


@dataclass(frozen=True)
class Rows:
    """Where a forward's rows go: each row's table (into `tables`) and position in its sequence."""

    tables: torch.Tensor  # [sequences, pages] int64
    sequences: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    # The largest of positions, where the caller knows it without reading the tensor.
    last: int | None = None


def lean_forward(lean: LeanModel, token_ids: torch.Tensor, rows: Rows, pool: torch.Tensor, keep_last: int) -> torch.Tensor:
    """Run Qwen2ForCausalLM's (or Qwen3's, Llama's) operations over rows of tokens; return the logits of the last `keep_last`
    rows (0: every row), float32 [kept, vocabulary]."""
    model = lean.model
    inner = model.model
    hidden = F.embedding(token_ids, inner.embed_tokens.weight)
    cos, sin = lean.rotary.rows(hidden, rows.positions, rows.last)
    if lean.fused is not None:
        if lean.between_layers is not None:
            lean.between_layers()
        hidden = torch.ops.corechat.run_layers(lean.registered, hidden, cos, sin, pool, rows.tables, rows.sequences,
                                               rows.positions)
        hidden = norm_rows(hidden, inner.norm)
    else:
        hidden = decoder(hidden, cos, sin, inner.layers[: model.config.num_hidden_layers], lean, rows, pool)
        hidden = rms_norm(hidden, inner.norm)
    kept = hidden[-keep_last:] if keep_last else hidden
    logits = product(model.lm_head, kept)
    return logits if logits.dtype == torch.float32 else logits.float()


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, layer: int, rows: Rows,
           head_dim: int, scaling: float) -> torch.Tensor:
    """Store the rows' keys and values in the pool and attend: [rows, heads * head_dim] in, [rows, heads * head_dim] out."""
    count = query.shape[0]
    attended = torch.ops.corechat.paged_attention(
        query.view(count, -1, head_dim), key.view(count, -1, head_dim), value.view(count, -1, head_dim), pool, layer,
        rows.tables, rows.sequences, rows.positions, scaling)
    return attended.view(count, -1)


def decoder(hidden, cos, sin, layers, lean: LeanModel, rows: Rows, pool: torch.Tensor) -> torch.Tensor:
    """Run the decoder layers with transformers' operations, one by one."""
    count = hidden.shape[0]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head_dim = layers[0].self_attn.head_dim
    for index, layer in enumerate(layers):
        if lean.between_layers is not None:
            lean.between_layers()
        attention = layer.self_attn
        residual = hidden
        states = rms_norm(hidden, layer.input_layernorm)
        query = product(attention.q_proj, states).view(count, -1, head_dim)
        key = product(attention.k_proj, states).view(count, -1, head_dim)
        value = product(attention.v_proj, states)
        if getattr(attention, "q_norm", None) is not None:
            query, key = rms_norm(query, attention.q_norm), rms_norm(key, attention.k_norm)
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        attended = attend(query, key, value, pool, index, rows, head_dim, attention.scaling)
        hidden = residual + product(attention.o_proj, attended)
        residual = hidden
        states = rms_norm(hidden, layer.post_attention_layernorm)
        mlp = layer.mlp
        hidden = residual + product(mlp.down_proj, F.silu(product(mlp.gate_proj, states)) * product(mlp.up_proj, states))
    return hidden


def norm_rows(hidden: torch.Tensor, norm) -> torch.Tensor:
    """The fused path's RMSNorm (kernels/csrc/layer.cpp) over the last dimension."""
    return torch.ops.corechat.rms_norm(hidden, norm.weight, norm.variance_epsilon)
