"""The KV page pool: a sequence's room reserved once, given back whole, its state read back as written and
never another's."""

import pytest
import torch

from service.engine.kvpool import PagePool, PoolExhausted
from service.engine.memory import PAGE_TOKENS, KVBudget

SHAPE = (3, 2, 16)  # layers, kv heads, head dim


def pool_of(pages: int) -> PagePool:
    """Return a storing pool of `pages` pages of SHAPE."""
    layers, kv_heads, head_dim = SHAPE
    return PagePool(KVBudget(pages, PAGE_TOKENS * 2 * layers * kv_heads * head_dim * 2), SHAPE)


def stored(pool: PagePool, tokens: int, seed: int) -> list[torch.Tensor]:
    """Return random KV state of `tokens` tokens for every layer, in the pages the prefix store keeps."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*pool.stored_shape(tokens), generator=generator).bfloat16() for _ in range(SHAPE[0])]


def read_back(pool: PagePool, pages, tokens: int) -> list[torch.Tensor]:
    """Return each layer of a sequence as the prefix store would write it: its pieces, joined."""
    return [torch.cat(list(pieces)) for pieces in pool.read(pages, tokens)]


def without_tail(layer: torch.Tensor, tokens: int) -> torch.Tensor:
    """Return a stored layer with its last page's columns past `tokens` zeroed."""
    _, kv_heads, head_dim = SHAPE
    layer = layer.clone()
    used = tokens % PAGE_TOKENS
    if used:
        layer[-1, 0].view(kv_heads, head_dim // 2, PAGE_TOKENS, 2)[:, :, used:] = 0
        values = layer[-1, 1].view(kv_heads, PAGE_TOKENS // 2, head_dim, 2)
        values[:, -(-used // 2):] = 0
        if used % 2:
            values[:, used // 2, :, 1] = 0
    return layer


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


@pytest.mark.parametrize("tokens", [1, PAGE_TOKENS - 1, PAGE_TOKENS, PAGE_TOKENS + 1, 20 * PAGE_TOKENS + 17])
def test_stored_state_written_into_pages_reads_back_the_same(tokens):
    """Pages in and out, a few at a time: the same bytes, the last page's unused columns zeros."""
    pool = pool_of(24)
    pages = pool.reserve(tokens + 5)
    state = stored(pool, tokens, seed=tokens)
    pool.write(pages, state, tokens)
    assert pages.length == tokens
    read = read_back(pool, pages, tokens)
    assert len(read) == SHAPE[0]
    assert all(torch.equal(got, without_tail(want, tokens)) for got, want in zip(read, state, strict=True))


def test_what_an_earlier_sequence_left_in_a_page_is_never_read_out():
    """A page handed on keeps the old bytes past the new sequence's tokens; they are never stored."""
    pool = pool_of(4)
    earlier = pool.reserve(2 * PAGE_TOKENS)
    pool.write(earlier, stored(pool, 2 * PAGE_TOKENS, seed=1), 2 * PAGE_TOKENS)
    pool.release(earlier)
    later = pool.reserve(PAGE_TOKENS + 3)
    pool.write(later, stored(pool, 3, seed=2), 3)
    for layer in read_back(pool, later, 3):
        assert layer.shape[0] == 1
        keys = layer[0, 0].view(SHAPE[1], SHAPE[2] // 2, PAGE_TOKENS, 2)
        assert not keys[:, :, 3:].any() and keys[:, :, :3].any()


def test_a_copied_sequence_holds_the_same_state_in_pages_of_its_own():
    pool = pool_of(8)
    source, target = pool.reserve(100), pool.reserve(100)
    pool.write(source, stored(pool, 70, seed=1), 70)
    pool.copy(source, target)
    assert target.length == 70 and not set(source.table.tolist()) & set(target.table.tolist())
    assert all(torch.equal(a, b) for a, b in zip(read_back(pool, source, 70), read_back(pool, target, 70), strict=True))
