"""A lean forward for Qwen2-family models: transformers' operations, without its module machinery.

A decode step of the 0.5B model spent about a quarter of its time in Python outside any operator
(transformers' module calls, decorators, keyword plumbing, mask building; bench/step_probe.py).
This forward calls the products and the attention kernel directly, and serves the engine's two
kinds of call: a prompt chunk of one sequence, and a decode step of one token per row with
`row_starts`; anything else (a batch of padded prompts) goes to transformers' forward. It keeps
transformers' DynamicCache (with kvcache.py's layers, which append in place), so the prefix store
and the batch joins work unchanged.

Quantized models (int8, int4) run each decoder layer as three fused operators (kernels/csrc/
layer.cpp: the norm, products and rotary before attention; the rest after it), the same arithmetic
as transformers' except RMSNorm's mean, which the kernel sums in its own fixed order. bfloat16
models run transformers' operations one by one, so their logits are transformers' bits.
"""

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attention import attention_by_rows, kernel_cache, row_spans
from .quantized import QuantizedLinear

ARCHITECTURES = ("Qwen2ForCausalLM",)


def install(model, between_layers: Callable[[], object] | None = None) -> bool:
    """Give a bf16 Qwen2-family model the lean forward, calling between_layers before each decoder
    layer; return whether it got it."""
    config = model.config
    if (type(model).__name__ not in ARCHITECTURES or model.dtype != torch.bfloat16
            or getattr(config, "use_sliding_window", False) or config.hidden_act != "silu"
            or not hasattr(torch.ops.corechat, "attention")):
        return False
    model.forward = types.MethodType(
        functools.partial(lean_forward, between_layers=between_layers, fused=fused_layers(model)), model)
    return True


@dataclass(frozen=True)
class FusedLayer:
    """A quantized decoder layer's arguments to the fused operators, gathered once."""

    attention: tuple
    mlp: tuple


def product_arguments(linears: list[QuantizedLinear]) -> tuple:
    """Return the weights, scales, biases, output counts and format of products, as the operators take them."""
    return ([linear.qweight for linear in linears], [linear.qscale for linear in linears],
            [linear.bias for linear in linears], [linear.out_features for linear in linears], linears[0].format.code)


def fused_layers(model) -> list[FusedLayer] | None:
    """Return the fused operators' arguments for every decoder layer, or None unless every product
    of every layer is quantized, in one format, and the output layer too."""
    layers = []
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        attention, mlp = layer.self_attn, layer.mlp
        before = [attention.q_proj, attention.k_proj, attention.v_proj]
        after = [attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        linears = before + after + [model.lm_head]
        if not all(isinstance(linear, QuantizedLinear) and linear.format is linears[0].format for linear in linears):
            return None
        layers.append(FusedLayer(
            (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, *product_arguments(before)),
            (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
             *product_arguments(after)),
        ))
    return layers


def rms_norm(hidden: torch.Tensor, norm) -> torch.Tensor:
    """Qwen2RMSNorm's operations."""
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


def lean_forward(model, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                 logits_to_keep=0, row_starts=None, between_layers=None, fused=None, **kwargs):
    """Run Qwen2ForCausalLM.forward's operations for one prompt chunk or one decode step of a batch."""
    batch, length = input_ids.shape
    # The attention kernel's calls (attention.kernel_applies): one sequence, or single tokens with starts.
    by_rows = batch == 1 or (length == 1 and row_starts is not None)
    if cache is None or not use_cache or kwargs or not by_rows:
        return type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                   row_starts=row_starts, **kwargs)
    inner = model.model
    if position_ids is None:
        past = cache.get_seq_length()
        position_ids = torch.arange(past, past + length).unsqueeze(0)
    hidden = F.embedding(input_ids, inner.embed_tokens.weight)
    cos, sin = inner.rotary_emb(hidden, position_ids)
    layers = inner.layers[: model.config.num_hidden_layers]
    if fused is not None:
        hidden = fused_decoder(hidden, cos, sin, layers, fused, cache, row_starts, between_layers)
    else:
        hidden = decoder(hidden, cos, sin, layers, cache, row_starts, between_layers)
    hidden = rms_norm(hidden, inner.norm) if fused is None else norm_rows(hidden, inner.norm)
    kept = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
    return CausalLMOutputWithPast(logits=product(model.lm_head, kept), cache=cache)


def decoder(hidden, cos, sin, layers, cache, row_starts, between_layers) -> torch.Tensor:
    """Run the decoder layers with transformers' operations, one by one."""
    batch, length, _ = hidden.shape
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head_dim = layers[0].self_attn.head_dim
    for index, layer in enumerate(layers):
        if between_layers is not None:
            between_layers()
        attention = layer.self_attn
        residual = hidden
        states = rms_norm(hidden, layer.input_layernorm)
        shape = (batch, length, -1, head_dim)
        query = product(attention.q_proj, states).view(shape).transpose(1, 2)
        key = product(attention.k_proj, states).view(shape).transpose(1, 2)
        value = product(attention.v_proj, states).view(shape).transpose(1, 2)
        query = (query * cos) + (rotate_half(query) * sin)
        key = (key * cos) + (rotate_half(key) * sin)
        keys, values = cache.update(key, value, index)
        attended = attention_by_rows(query, keys, values, attention.scaling, row_starts)
        hidden = residual + product(attention.o_proj, attended.reshape(batch, length, -1).contiguous())
        residual = hidden
        states = rms_norm(hidden, layer.post_attention_layernorm)
        mlp = layer.mlp
        hidden = residual + product(mlp.down_proj, F.silu(product(mlp.gate_proj, states)) * product(mlp.up_proj, states))
    return hidden


def fused_decoder(hidden, cos, sin, layers, fused: list[FusedLayer], cache, row_starts, between_layers) -> torch.Tensor:
    """Run quantized decoder layers as the fused operators: three calls and a cache append per layer."""
    batch, length, width = hidden.shape
    tokens = batch * length
    head_dim = layers[0].self_attn.head_dim
    scaling = layers[0].self_attn.scaling
    hidden = hidden.view(tokens, width)
    cos, sin = cos.reshape(tokens, head_dim).contiguous(), sin.reshape(tokens, head_dim).contiguous()
    spans = None
    for index, arguments in enumerate(fused):
        if between_layers is not None:
            between_layers()
        query, key, value = torch.ops.corechat.attention_inputs(hidden, *arguments.attention, cos, sin, head_dim)
        keys, values = cache.update(key.view(batch, length, -1, head_dim).transpose(1, 2),
                                    value.view(batch, length, -1, head_dim).transpose(1, 2), index)
        if spans is None:
            spans = row_spans(batch, length, keys.shape[2], row_starts)
        attended = torch.ops.corechat.attention(query.view(tokens, -1, head_dim), *kernel_cache(keys, values),
                                                *spans, scaling)
        hidden = torch.ops.corechat.mlp(hidden, attended.view(tokens, -1), *arguments.mlp)
    return hidden.view(batch, length, width)


def norm_rows(hidden: torch.Tensor, norm) -> torch.Tensor:
    """The fused path's RMSNorm (kernels/csrc/layer.cpp) over the last dimension."""
    width = hidden.shape[-1]
    return torch.ops.corechat.rms_norm(hidden.reshape(-1, width), norm.weight, norm.variance_epsilon).view(hidden.shape)
