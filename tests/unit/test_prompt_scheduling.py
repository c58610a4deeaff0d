"""How one step's prompt budget is shared: the oldest prompt takes its least, the rest goes to the shortest."""

import pytest

from service.engine.prompts import MIN_CHUNK_TOKENS, prompt_shares


@pytest.mark.parametrize(("budget", "remaining", "expected"), [
    (128, [], []),
    (128, [1], [1]),
    (128, [24_000], [128]),
    (128, [24_000, 40], [88, 40]),
    (128, [24_000, 500, 40], [MIN_CHUNK_TOKENS, 72, 40]),
    (128, [5, 200, 100], [5, 23, 100]),
    (16, [24_000, 40], [16, 0]),
    (17, [24_000, 40], [16, 1]),
    (1, [24_000, 40], [1, 0]),
    (128, [40, 40, 40, 40], [40, 40, 40, 8]),
])
def test_a_steps_budget_goes_to_the_shortest_prompts_after_the_oldest_takes_its_least(budget, remaining, expected):
    """The oldest prompt always advances; then the fewest remaining tokens come first, ties oldest first."""
    shares = prompt_shares(budget, remaining)
    assert shares == expected
    assert sum(shares) <= budget and all(0 <= share <= left for share, left in zip(shares, remaining, strict=True))
