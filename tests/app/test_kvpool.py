"""The KV page pool under the engine: joining and leaving the decode batch touch no other sequence's pages."""

import pytest
import torch

from tests.support import started_engine


@pytest.fixture(scope="module")
def runner(make_settings):
    """Return the paged runner of a started int8 engine on the tiny model (the engine idle)."""
    with started_engine(make_settings(prefix_cache_mb=0)) as engine:
        yield engine._scheduler.runner


def prompt(length: int, seed: int) -> list[int]:
    """Return random prompt token ids."""
    return torch.randint(100, 5000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_joining_and_leaving_the_batch_touch_no_other_sequences_pages(runner):
    """A sequence's table and pages are the same bytes before and after others join and leave, and its
    next token's logits are the same bits as decoding it alone."""
    with torch.inference_mode():
        staying, leaving, joining, alone = (runner.reserve(200) for _ in range(4))
        for kv, seed in ((staying, 1), (leaving, 2), (alone, 1)):
            runner.prefill(kv, prompt(40, seed), 1)
        runner.decode([staying, leaving], [7, 8])
        runner.decode([alone], [7])
        table = staying.table.clone()
        pages = runner.pool.storage[staying.table].clone()
        runner.release(leaving)
        runner.prefill(joining, prompt(90, 3), 1)
        assert torch.equal(staying.table, table) and torch.equal(runner.pool.storage[staying.table], pages)
        in_batch = runner.decode([joining, staying], [9, 10])
        by_itself = runner.decode([alone], [10])
        assert torch.equal(in_batch[1], by_itself[0])
        for kv in (staying, joining, alone):
            runner.release(kv)
