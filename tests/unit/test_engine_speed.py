"""How long a prompt chunk may be beside decoding streams: cut to about the stall, and a stall setting that
cannot bound one is refused."""

import pydantic
import pytest

from service.engine.scheduler import chunk_tokens


@pytest.mark.parametrize(("most", "stall", "seconds_per_token", "expected"), [
    (128, 0.25, 0.01, 25),  # about the stall's worth of tokens
    (128, 0.17, 0.01, 17),  # next to the least
    (128, 0.16, 0.01, 16),  # the least
    (128, 0.15, 0.01, 16),  # below it: the least still
    (128, 5e-324, 0.01, 16),  # a subnormal stall
    (128, 1.28, 0.01, 128),  # the most
    (128, 1.29, 0.01, 128),  # above it: the most still
    (128, 0.25, 5e-324, 128),  # a subnormal speed: the quotient is infinite
    (128, 1e308, 1e-308, 128),  # a quotient past the largest float
    (128, 0.0, 0.01, 128),  # no stall: whole chunks
    (128, 0.25, None, 128),  # no speed measured yet
    (128, 0.25, 0.0, 128),  # a chunk timed at zero
    (16, 5e-324, 1.0, 16),  # the settings' least chunk
    (20, 0.001, 1.0, 16),
])
def test_chunk_tokens_cut_to_about_the_stall_between_the_least_and_the_most(most, stall, seconds_per_token, expected):
    """The chunk a stall allows, at every extreme of its numbers."""
    assert chunk_tokens(most, stall, seconds_per_token) == expected


@pytest.mark.parametrize("stall", [-1e-9, float("inf"), float("nan")])
def test_prefill_stall_seconds_refuses_what_cannot_bound_a_stall(make_settings, stall):
    """A negative, infinite or NaN stall is a configuration error, not a silent default."""
    with pytest.raises(pydantic.ValidationError, match="prefill_stall_seconds"):
        make_settings(prefill_stall_seconds=stall)
