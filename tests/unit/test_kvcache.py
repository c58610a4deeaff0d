"""The KV cache of sequences on transformers' forward appends into room in place and holds what
transformers' DynamicCache holds.

transformers' DynamicLayer concatenates on every append (a copy of the layer's whole cache per
decode step); kvcache.py's GrowingLayer writes into room it allocated ahead. These tests hold it to
the same contents and the same logits as transformers' cache, to writing in place until its room is
full, and to never writing a tensor it was handed. kvcache.py builds layers from tensors it already
holds through DynamicLayer's `keys`/`values` and `lazy_initialization`; those internals change
between transformers releases, and the tests below fail on an upgrade that moves them first.
"""

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer

from service.engine.kvcache import ROOM_TOKENS, GrowingLayer, build_cache, cache_layers, new_cache, reserve
from service.engine.loading import load_model

HEADS, DIM = 2, 16
# A Qwen2.5 chat prompt's first tokens, then one more for the step after it.
PROMPT = [151644, 872, 198, 9707, 151645, 198]
NEXT = [9707]


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


def test_transformers_still_gives_qwen2_one_plain_dynamic_layer_per_layer(config):
    """build_cache hands tensors over without a copy only to DynamicLayer; any other layer type would
    silently take the copying path."""
    cache = DynamicCache(config=config)
    assert len(cache.layers) == config.num_hidden_layers
    assert all(type(layer) is DynamicLayer for layer in cache.layers), (
        "transformers changed DynamicCache's layers: review service/engine/kvcache.py"
    )
    layer = cache.layers[0]
    keys, values = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    assert layer.is_initialized and layer.get_seq_length() == 3
    assert cache_layers(cache)[0] == (keys, values)


def test_a_rebuilt_cache_holds_the_same_tensors_and_the_model_continues_it_as_the_original(tiny_model_dir):
    """A round trip through cache_layers and build_cache keeps the very tensors, and the next forward
    over the rebuilt cache gives exactly the logits of the one over the model's own cache."""
    model = load_model(tiny_model_dir, torch.float32)
    with torch.inference_mode():
        original = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([PROMPT]), cache=original, use_cache=True)
        layers = cache_layers(original)
        rebuilt = build_cache(model.config, layers)
        assert all(keys is rebuilt_keys and values is rebuilt_values
                   for (keys, values), (rebuilt_keys, rebuilt_values) in zip(layers, cache_layers(rebuilt)))
        assert rebuilt.get_seq_length() == original.get_seq_length() == len(PROMPT)
        expected = model(input_ids=torch.tensor([NEXT]), cache=original, use_cache=True).logits
        got = model(input_ids=torch.tensor([NEXT]), cache=rebuilt, use_cache=True).logits
    assert torch.equal(got, expected)
    assert rebuilt.get_seq_length() == original.get_seq_length() == len(PROMPT) + 1


def test_a_built_cache_holds_the_given_tensors_and_appending_leaves_them_unchanged(config):
    """Batch joins and prefix lookups hand their tensors over without another copy, and never see them written."""
    layers = [(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)) for _ in range(config.num_hidden_layers)]
    copies = [(keys.clone(), values.clone()) for keys, values in layers]
    cache = build_cache(config, layers)
    assert cache.get_seq_length() == 5
    assert all(layer.keys is keys and layer.values is values for layer, (keys, values) in zip(cache.layers, layers))
    cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    assert cache.layers[0].keys.shape[-2] == 6
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(layers, copies))
