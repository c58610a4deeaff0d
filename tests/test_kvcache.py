"""The engine's KV cache appends into room in place and holds what transformers' DynamicCache holds.

transformers' DynamicLayer concatenates on every append (a copy of the layer's whole cache per
decode step); kvcache.py's GrowingLayer writes into room it allocated ahead. These tests hold it to
the same contents and the same logits as transformers' cache, to writing in place until its room is
full, and to never writing a tensor it was handed.
"""

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from service.engine import Engine
from service.engine.batching import DecodeBatch
from service.engine.kvcache import ROOM_TOKENS, GrowingLayer, build_cache, cache_layers, new_cache, reserve

HEADS, DIM = 2, 16


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    """Return the tiny model's config."""
    return AutoConfig.from_pretrained(tiny_model_dir)


def states(columns: int, rows: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Return random keys and values of `columns` tokens."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, HEADS, columns, DIM, generator=generator).bfloat16() for _ in range(2))


def test_a_new_cache_has_a_growing_layer_per_plain_layer(config):
    """new_cache keeps transformers' layer list, its plain DynamicLayers replaced."""
    cache = new_cache(config)
    assert len(cache.layers) == config.num_hidden_layers
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    assert cache.get_seq_length() == 0


def test_appends_hold_what_concatenation_holds_and_write_in_place_until_the_room_is_full(config):
    """Column by column and in chunks, past a full room twice: the same tensors as DynamicCache's,
    and a new allocation only when the room is full."""
    cache, reference = new_cache(config), DynamicCache(config=config)
    widths = [5] + [1] * ROOM_TOKENS + [1, 300, 1, 1]
    pointers = []
    for step, width in enumerate(widths):
        keys, values = states(width, seed=step)
        got, want = cache.update(keys, values, 0), reference.update(keys, values, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pointers.append(got[0].data_ptr())
    assert cache.get_seq_length() == sum(widths)
    # The first room holds 5 + ROOM_TOKENS columns: every append until then writes in place.
    assert len(set(pointers[: 1 + ROOM_TOKENS])) == 1
    assert pointers[1 + ROOM_TOKENS] != pointers[0]  # full: new room, contents copied
    assert pointers[-1] == pointers[-2] == pointers[-3]  # the 300-column chunk's room has space for more
    layer = cache.layers[0]
    assert layer._room[0].shape[2] <= layer.get_seq_length() + ROOM_TOKENS + 300


def test_a_prompt_reserved_whole_is_passed_in_chunks_into_one_room(config):
    """A cache reserved for a long prompt allocates once, however many chunks fill it, from empty or
    from a handed (stored) prefix."""
    for handed in (0, 700):
        cache = reserve(build_cache(config, [states(handed, seed=1)] * config.num_hidden_layers) if handed
                        else new_cache(config), 5_000)
        pointers = set()
        for step in range((5_000 - handed) // 128 + 1):
            width = min(128, 5_000 - handed - 128 * step)
            if width:
                pointers.add(cache.update(*states(width, seed=step), 0)[0].data_ptr())
        assert cache.get_seq_length() == 5_000 and len(pointers) == 1, handed


def test_a_cache_never_writes_tensors_it_was_handed(config):
    """A stored prefix's slices are copied into the cache's own room at the first append."""
    keys, values = states(7)
    stored = (keys.clone(), values.clone())
    cache = build_cache(config, [(keys[:, :, :5], values[:, :, :5])] * config.num_hidden_layers)
    for step in range(3):
        cache.update(*states(1, seed=10 + step), 0)
    assert torch.equal(keys, stored[0]) and torch.equal(values, stored[1])
    held = cache.layers[0].keys
    assert held.untyped_storage().data_ptr() != keys.untyped_storage().data_ptr()
    assert torch.equal(held[:, :, :5], keys[:, :, :5])


def test_a_batch_join_and_leave_leave_room_for_the_next_steps(engine):
    """DecodeBatch hands its new tensors over as room: the steps after a join or a leave copy nothing."""
    model = engine.model
    caches = []
    with torch.inference_mode():
        for length in (3, 9, 5):
            cache = new_cache(model.config)
            model(input_ids=torch.arange(100, 100 + length).unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=1)
            caches.append(cache)
        kept = cache_layers(caches[1])[0][0].clone()
        batch = DecodeBatch(model.config)
        batch.join(caches)
        for leaving in ([], [0]):
            if leaving:
                batch.leave(leaving)
            before = [keys.data_ptr() for keys, _ in cache_layers(batch.cache)]
            batch.step(model, [7] * len(batch))
            assert [keys.data_ptr() for keys, _ in cache_layers(batch.cache)] == before
    # The middle row, now first: its prompt's keys at the right end of the columns before the two steps.
    keys = cache_layers(batch.cache)[0][0]
    assert keys.shape[:3] == (2, kept.shape[1], 11) and torch.equal(keys[0, :, :9], kept[0])


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_a_model_gives_the_same_logits_over_both_caches(make_settings, dtype):
    """A chunked 500-token prompt (its room filled and grown) and decode steps: logits to the bit."""
    engine = Engine(make_settings(dtype=dtype, max_model_len=1024))
    engine.start()
    try:
        assert engine.wait_ready(300), engine.facts
        model = engine.model
        prompt = torch.randint(100, 5000, (500,), generator=torch.Generator().manual_seed(0)).tolist()
        seen = []
        with torch.inference_mode():
            for cache in (new_cache(model.config), DynamicCache(config=model.config)):
                logits = []
                for start in range(0, len(prompt), 200):
                    chunk = torch.tensor([prompt[start:start + 200]])
                    logits.append(model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1).logits)
                for _ in range(8):
                    token = logits[-1][0, -1].argmax().view(1, 1)
                    logits.append(model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits)
                seen.append(logits)
        assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))
    finally:
        engine.stop()
