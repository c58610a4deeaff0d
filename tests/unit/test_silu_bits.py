"""The fused layer's SiLU (at::silu in layer.cpp) gives each bf16 value the same bits on torch's vector
path and on its scalar one.

Which path a value takes depends on the row count and the thread count (a chunk's tail goes
scalar), so "the same bits alone or in any batch, on any thread count" rests on the two agreeing:
the vector path's exp is Sleef's, the scalar one's the C library's. With this torch they agree on
every finite bf16 value; an upgrade that breaks it fails here.
"""

import torch
import torch.nn.functional as F

from tests.support import torch_threads


def every_finite_bfloat16() -> torch.Tensor:
    """Return each finite bf16 value once (65,280 of them)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[torch.isfinite(values)]


def test_silu_gives_every_finite_bfloat16_the_same_bits_on_the_vector_and_the_scalar_path():
    values = every_finite_bfloat16()
    assert values.numel() == 65_280
    with torch_threads(1), torch.inference_mode():
        vector = F.silu(values)  # contiguous and a multiple of every vector width: vector loops throughout
        scalar = torch.cat([F.silu(value.reshape(1)) for value in values])  # one element: the scalar loop
    differing = (vector.view(torch.int16) != scalar.view(torch.int16)).nonzero().flatten()
    assert differing.numel() == 0, [(float(values[index]), float(vector[index]), float(scalar[index]))
                                    for index in differing[:5]]
