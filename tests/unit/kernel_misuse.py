"""Calls of torch.ops.corechat's operators with shapes, dtypes or devices they cannot take.

Some of these once killed the process (a division by a zero width, a read past the end of a
tensor, a null pointer of a meta tensor), so tests/unit/test_kernels.py runs them here, in a child
process: `python tests/unit/kernel_misuse.py [CASE ...]` prints one JSON line as each case starts and one with what
it raised, so a crash is pinned on the case that caused it instead of killing pytest.
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from service.engine import kernels  # noqa: E402
from service.engine.quantized import INT8, quantize_int8  # noqa: E402
from service.settings import Settings  # noqa: E402

WIDTH = 128
INTERMEDIATE = 256
HEAD_DIM = 64
EPS = 1e-6


def linear(inputs=None, weight=None, scales=None, bias=None, outputs=8):
    """Call quantized_linear on a valid int8 product of 8 outputs of WIDTH, with some arguments replaced."""
    stored, stored_scales = quantize_int8(torch.randn(8, WIDTH))
    inputs = torch.randn(2, WIDTH) if inputs is None else inputs
    return torch.ops.corechat.quantized_linear(inputs, stored if weight is None else weight,
                                               stored_scales if scales is None else scales, bias, INT8.code, outputs,
                                               True)


def products(shapes: list[tuple[int, int]]) -> tuple[list, list, list, list]:
    """Return int8 products of the given (outputs, inputs) as the fused operators take them."""
    quantized = [quantize_int8(torch.randn(outputs, inputs) * 0.05) for outputs, inputs in shapes]
    return ([weight for weight, _ in quantized], [scales for _, scales in quantized], [None] * len(shapes),
            [outputs for outputs, _ in shapes])


def hidden(rows: int = 2, width: int = WIDTH) -> torch.Tensor:
    """Return bfloat16 rows of hidden states."""
    return torch.randn(rows, width).bfloat16()


def norm(width: int = WIDTH) -> torch.Tensor:
    """Return a bfloat16 norm weight."""
    return torch.ones(width).bfloat16()


def attention_inputs(hidden_states=None, cos=None, sin=None, shapes=None):
    """Call attention_inputs on a valid layer (4 query heads, 2 key/value heads), with some arguments replaced."""
    weights, scales, biases, outputs = products(shapes or [(4 * HEAD_DIM, WIDTH), (2 * HEAD_DIM, WIDTH),
                                                           (2 * HEAD_DIM, WIDTH)])
    rotary = torch.randn(2, HEAD_DIM).bfloat16()
    return torch.ops.corechat.attention_inputs(hidden() if hidden_states is None else hidden_states, norm(), EPS,
                                               weights, scales, biases, outputs, [INT8.code] * 3,
                                               rotary if cos is None else cos, rotary if sin is None else sin, HEAD_DIM)


def mlp(hidden_states=None, attended=None, shapes=None):
    """Call mlp on a valid layer, with some arguments replaced; products are [o, gate, up, down]."""
    weights, scales, biases, outputs = products(shapes or [(WIDTH, WIDTH), (INTERMEDIATE, WIDTH),
                                                           (INTERMEDIATE, WIDTH), (WIDTH, INTERMEDIATE)])
    return torch.ops.corechat.mlp(hidden() if hidden_states is None else hidden_states,
                                  hidden() if attended is None else attended, norm(), EPS, weights, scales, biases,
                                  outputs, [INT8.code] * 4)


META = torch.device("meta")

# Each case: the call, and what its error message must say.
CASES: dict[str, tuple[Callable[[], object], str]] = {
    "linear-input-width-0": (lambda: linear(inputs=torch.randn(2, 0), weight=torch.zeros(8, 0, dtype=torch.int8)),
                             "positive multiple of 32"),
    "linear-input-on-meta": (lambda: linear(inputs=torch.randn(2, WIDTH, device=META)), "CPU"),
    "linear-weight-on-meta": (lambda: linear(weight=torch.zeros(8, WIDTH, dtype=torch.int8, device=META)), "CPU"),
    "linear-scales-on-meta": (lambda: linear(scales=torch.zeros(8, device=META)), "CPU"),
    "linear-bias-on-meta": (lambda: linear(bias=torch.zeros(8, device=META)), "CPU"),
    "rms-norm-width-0": (lambda: torch.ops.corechat.rms_norm(hidden(2, 0), norm(0), EPS), "width"),
    "rms-norm-input-on-meta": (lambda: torch.ops.corechat.rms_norm(hidden().to(META), norm(), EPS), "CPU"),
    "rms-norm-weight-on-meta": (lambda: torch.ops.corechat.rms_norm(hidden(), norm().to(META), EPS), "CPU"),
    "attention-inputs-hidden-a-scalar": (lambda: attention_inputs(hidden_states=torch.tensor(1.0).bfloat16()),
                                         "hidden must be"),
    "attention-inputs-hidden-on-meta": (lambda: attention_inputs(hidden_states=hidden().to(META)), "CPU"),
    "attention-inputs-cos-on-meta": (lambda: attention_inputs(cos=torch.randn(2, HEAD_DIM, device=META).bfloat16()),
                                     "CPU"),
    "attention-inputs-partial-heads": (lambda: attention_inputs(shapes=[(4 * HEAD_DIM + 32, WIDTH),
                                                                        (2 * HEAD_DIM, WIDTH), (2 * HEAD_DIM, WIDTH)]),
                                       "whole heads"),
    "mlp-down-narrower-than-hidden": (lambda: mlp(shapes=[(WIDTH, WIDTH), (INTERMEDIATE, WIDTH), (INTERMEDIATE, WIDTH),
                                                          (WIDTH // 2, INTERMEDIATE)]), "down"),
    "mlp-gate-and-up-differ": (lambda: mlp(shapes=[(WIDTH, WIDTH), (INTERMEDIATE, WIDTH), (INTERMEDIATE // 2, WIDTH),
                                                   (WIDTH, INTERMEDIATE)]), "gate and up"),
    "mlp-attended-rows-differ": (lambda: mlp(attended=hidden(rows=3)), "attended"),
    "mlp-hidden-on-meta": (lambda: mlp(hidden_states=hidden().to(META)), "CPU"),
    "mlp-attended-on-meta": (lambda: mlp(attended=hidden().to(META)), "CPU"),
    "greedy-width-0": (lambda: torch.ops.corechat.greedy_tokens(torch.zeros(2, 0)), "width"),
    "greedy-a-vector": (lambda: torch.ops.corechat.greedy_tokens(torch.zeros(8)), "matrix"),
    "greedy-bfloat16": (lambda: torch.ops.corechat.greedy_tokens(torch.zeros(2, 8).bfloat16()), "float32"),
    "greedy-not-contiguous": (lambda: torch.ops.corechat.greedy_tokens(torch.zeros(8, 2).t()), "contiguous"),
    "greedy-on-meta": (lambda: torch.ops.corechat.greedy_tokens(torch.zeros(2, 8, device=META)), "CPU"),
}


def main(names: list[str]) -> None:
    """Run the named cases (all by default), printing a JSON line as each starts and one with the
    exception it raised (or none)."""
    kernels.load(Path(Settings().kernels_dir))
    for name in names or CASES:
        call, _ = CASES[name]
        print(json.dumps({"case": name, "started": True}), flush=True)
        try:
            call()
        except Exception as exc:  # noqa: BLE001 (the parent judges what was raised)
            print(json.dumps({"case": name, "raised": type(exc).__name__, "message": str(exc)}), flush=True)
        else:
            print(json.dumps({"case": name, "raised": None}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
