"""The kernels' own exponentials (kernels.h), compiled alone with g++'s undefined-behaviour sanitizer:
the sampler's exp_nonpositive_lane and attention's pow2_weight_lane. Every input they can be given
(0, a little above 0, negatives down to the clamp and below, subnormals, -inf, NaN from a key holding
inf) is defined behaviour and NaN stays NaN; exp_nonpositive_lane is within 2 ulp of e^x in float32,
pow2_weight_lane within 2^-17 of 2^t (its results are rounded to bfloat16, steps of 2^-8)."""

import math
import struct
import subprocess

import numpy
import pytest

from service.engine.kernels import COMPILER, SOURCE_DIR

PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include "kernels.h"
int main(int argc, char** argv) {
    const bool pow2 = argv[1][0] == 'p';
    for (int i = 2; i < argc; ++i) {
        const uint32_t in = static_cast<uint32_t>(std::strtoul(argv[i], nullptr, 16));
        float x;
        std::memcpy(&x, &in, sizeof x);
        const float y = pow2 ? corechat::pow2_weight_lane(x) : corechat::exp_nonpositive_lane(x);
        uint32_t out;
        std::memcpy(&out, &y, sizeof out);
        std::printf("%08x\n", out);
    }
}
"""


def bits(value: float) -> str:
    """Return a float32's bits as hex."""
    return struct.pack(">f", value).hex()


def from_bits(text: str) -> float:
    """Return the float32 of hex bits."""
    return struct.unpack(">f", bytes.fromhex(text))[0]


SUBNORMAL = struct.unpack(">f", bytes.fromhex("00000001"))[0]
INPUTS = [0.0, -0.0, -SUBNORMAL, -1e-30, -1e-7, -0.5, -1.0, -10.0, -86.9, -87.0, -87.0001, -100.0, -1e30,
          -math.inf, math.nan, -math.nan]


@pytest.fixture(scope="module")
def sanitized_exp(tmp_path_factory):
    """Build the exp alone with -fsanitize=undefined, aborting at the first undefined operation."""
    folder = tmp_path_factory.mktemp("kernel-exp")
    (folder / "exp.cpp").write_text(PROGRAM)
    binary = folder / "exp"
    subprocess.run([COMPILER, "-std=c++17", "-O1", "-fsanitize=undefined", "-fsanitize=float-cast-overflow",
                    "-fno-sanitize-recover=all", f"-I{SOURCE_DIR}", str(folder / "exp.cpp"), "-o", str(binary)],
                   check=True, capture_output=True, timeout=300)
    return binary


def test_the_samplers_exp_is_defined_and_close_to_expf_on_every_input(sanitized_exp):
    run = subprocess.run([str(sanitized_exp), "exp", *(bits(value) for value in INPUTS)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    results = [from_bits(line) for line in run.stdout.split()]
    for value, result in zip(INPUTS, results, strict=True):
        if math.isnan(value):
            assert math.isnan(result), (value, result)
            continue
        expected = numpy.float32(math.exp(max(float(numpy.float32(value)), -87.0)))
        assert abs(numpy.float32(result) - expected) <= 2 * numpy.spacing(expected), (value, result, expected)


# Every exponent of 2 attention's weights pass through, each at whole and half steps and beside them,
# the largest score's t a little above 0, and a dense sweep of [-1, 0] (where most weights that matter lie).
POW2_INPUTS = [*INPUTS, 1e-6, 2e-7, -124.5, -125.0, -125.0001, -126.0,
               *(float(numpy.float32(whole + offset)) for whole in range(-124, 1)
                 for offset in (0.0, -0.25, -0.5, -0.5000001, -0.4999999, 0.4999999)),
               *(float(value) for value in numpy.linspace(-1.0, 0.0, 2001, dtype=numpy.float32))]


def test_attention_weights_pow2_is_defined_and_within_its_bound(sanitized_exp):
    run = subprocess.run([str(sanitized_exp), "pow2", *(bits(value) for value in POW2_INPUTS)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    results = [from_bits(line) for line in run.stdout.split()]
    assert len(results) == len(POW2_INPUTS)
    for value, result in zip(POW2_INPUTS, results, strict=True):
        if math.isnan(value):
            assert math.isnan(result), (value, result)
            continue
        expected = 2.0 ** max(float(numpy.float32(value)), -125.0)
        assert abs(result - expected) <= 2.0 ** -17 * expected, (value, result, expected)
