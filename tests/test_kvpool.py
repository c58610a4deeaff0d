"""The KV page pool: a sequence's room reserved once, given back whole, and nothing of one sequence
touched when others join or leave the decode batch."""

import pytest
import torch

from service.engine import Engine
from service.engine.kvpool import PagePool, PoolExhausted
from service.engine.memory import PAGE_TOKENS, KVBudget

SHAPE = (3, 2, 16)  # layers, kv heads, head dim


def pool_of(pages: int) -> PagePool:
    """Return a storing pool of `pages` pages of SHAPE."""
    layers, kv_heads, head_dim = SHAPE
    return PagePool(KVBudget(pages, PAGE_TOKENS * 2 * layers * kv_heads * head_dim * 2), SHAPE)


def natural(tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return random keys and values of `tokens` tokens for every layer, as the prefix store keeps them."""
    generator = torch.Generator().manual_seed(seed)
    layers, kv_heads, head_dim = SHAPE
    return [tuple(torch.randn(1, kv_heads, tokens, head_dim, generator=generator).bfloat16() for _ in range(2))
            for _ in range(layers)]


def test_a_sequence_reserves_whole_pages_and_gives_them_back_for_the_next_first():
    pool = pool_of(10)
    first = pool.reserve(PAGE_TOKENS + 1)
    assert first.table.numel() == 2 and first.capacity == 2 * PAGE_TOKENS and pool.free_pages == 8
    second = pool.reserve(1)
    assert pool.free_pages == 7 and not set(first.table.tolist()) & set(second.table.tolist())
    pool.release(first)
    assert pool.free_pages == 9 and first.table.numel() == 0
    # Pages freed last are handed out first: a worker reuses the memory it already touched.
    again = pool.reserve(2 * PAGE_TOKENS)
    assert set(again.table.tolist()) == {0, 1}


def test_a_reservation_beyond_the_free_pages_is_refused_and_takes_nothing():
    pool = pool_of(4)
    pool.reserve(3 * PAGE_TOKENS)
    with pytest.raises(PoolExhausted):
        pool.reserve(PAGE_TOKENS + 1)
    assert pool.free_pages == 1


@pytest.mark.parametrize("tokens", [1, PAGE_TOKENS - 1, PAGE_TOKENS, PAGE_TOKENS + 1, 3 * PAGE_TOKENS + 17])
def test_stored_state_written_into_pages_reads_back_the_same(tokens):
    """Keys go in transposed per page (as the kernel reads them), values as they are: both read back whole."""
    pool = pool_of(8)
    pages = pool.reserve(tokens + 5)
    stored = natural(tokens + 3, seed=tokens)  # longer than asked for: only `tokens` go in
    pool.write(pages, stored, tokens)
    assert pages.length == tokens
    read = list(pool.read(pages, tokens))
    assert len(read) == SHAPE[0]
    for (keys, values), (want_keys, want_values) in zip(read, stored, strict=True):
        assert torch.equal(keys, want_keys[:, :, :tokens]) and torch.equal(values, want_values[:, :, :tokens])


def test_a_copied_sequence_holds_the_same_state_in_pages_of_its_own():
    pool = pool_of(8)
    source, target = pool.reserve(100), pool.reserve(100)
    pool.write(source, natural(70, seed=1), 70)
    pool.copy(source, target)
    assert target.length == 70
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(pool.read(source, 70), pool.read(target, 70), strict=True))


@pytest.fixture(scope="module")
def runner(make_settings):
    """Return the paged runner of a started int8 engine on the tiny model (the engine idle)."""
    engine = Engine(make_settings(prefix_cache_mb=0))
    engine.start()
    assert engine.wait_ready(120), engine.facts
    yield engine._scheduler.runner
    engine.stop()


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
