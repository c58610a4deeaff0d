"""The prefix store and the cache building it shares with batching, pinned against transformers' cache.

kvcache.py builds DynamicCache layers from tensors it already holds, through DynamicLayer's
`keys`/`values` and `lazy_initialization` (the public `DynamicCache(ddp_cache_data)` fills layers
through `update`, which copies every tensor once more). Those internals change between transformers
releases: these tests fail on an upgrade that moves them, before the engine does.
"""

import pytest
import torch
from transformers import AutoConfig, DynamicCache
from transformers.cache_utils import DynamicLayer

from service.engine.kvcache import build_cache, cache_layers
from service.engine.loading import load_model
from service.engine.prefixes import PrefixStore

# A Qwen2.5 chat prompt's first tokens, then one more for the step after it.
PROMPT = [151644, 872, 198, 9707, 151645, 198]
NEXT = [9707]


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    """Return the tiny model's config."""
    return AutoConfig.from_pretrained(tiny_model_dir)


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


def cache_of(config, tokens: int):
    """Return a one-row cache of random keys and values holding `tokens` tokens."""
    return build_cache(config, [(torch.randn(1, 2, tokens, 16), torch.randn(1, 2, tokens, 16))
                                for _ in range(config.num_hidden_layers)])


def test_prefix_store_drops_a_stored_prompt_that_a_new_one_extends(config, tmp_path):
    """A conversation's earlier turn can never be the longest match again: its file goes."""
    store = PrefixStore(config, 1 << 30, tmp_path, "model")
    store.store_cache([1, 2, 3], cache_of(config, 3))
    store.store_cache([7, 8], cache_of(config, 2))
    store.store_cache([1, 2, 3, 4, 5], cache_of(config, 5))
    assert len(list((tmp_path / "model").iterdir())) == 2
    assert store.lookup([1, 2, 3, 9])[1] == 3
    assert store.lookup([1, 2, 3, 4, 5, 6])[1] == 5
    assert store.lookup([7, 8, 9])[1] == 2


def test_a_sequence_stored_by_one_worker_is_found_whole_by_another(config, tmp_path):
    """Two stores on one folder (two workers): what one keeps, the other reads back bit for bit."""
    writer, reader = PrefixStore(config, 1 << 30, tmp_path, "model"), PrefixStore(config, 1 << 30, tmp_path, "model")
    stored = cache_of(config, 6)
    writer.store_cache([5, 6, 7, 8, 9, 10], stored)
    found, length = reader.lookup([5, 6, 7, 8, 9, 10, 11])
    assert length == 6
    assert all(torch.equal(a, b) and torch.equal(c, d)
               for (a, c), (b, d) in zip(cache_layers(found), cache_layers(stored), strict=True))
    assert PrefixStore(config, 1 << 30, tmp_path, "other model").lookup([5, 6, 7, 8, 9, 10, 11]) == (None, 0)


def test_the_folder_keeps_the_most_recently_used_sequences_within_its_capacity(config, tmp_path):
    """Eviction goes least recently used first, over every model's files, and a hit counts as a use."""
    one = PrefixStore(config, 1 << 30, tmp_path, "model")
    one.store_cache([1, 1], cache_of(config, 2))
    size = one.bytes
    store = PrefixStore(config, 3 * size, tmp_path, "model")
    store.store_cache([2, 2], cache_of(config, 2))
    store.store_cache([3, 3], cache_of(config, 2))
    assert store.lookup([1, 1, 5])[1] == 2  # [1, 1] is the most recently used now
    PrefixStore(config, 3 * size, tmp_path, "other model").store_cache([4, 4], cache_of(config, 2))
    kept = {tuple(store.lookup([first, first, 5])[1] for first in (1, 2, 3))}
    assert kept == {(2, 0, 2)}


def test_a_folder_others_can_write_is_never_read(config, tmp_path):
    """A folder another user could fill with forged keys and values turns prefix reuse off."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    store = PrefixStore(config, 1 << 30, shared, "model")
    store.store_cache([1, 2, 3], cache_of(config, 3))
    assert not store.enabled and store.lookup([1, 2, 3, 4]) == (None, 0)
    assert not (shared / "model").exists()


def test_no_capacity_keeps_nothing(config, tmp_path):
    """PREFIX_CACHE_MB=0 stores no file at all."""
    store = PrefixStore(config, 0, tmp_path / "store", "model")
    store.store_cache([1, 2, 3], cache_of(config, 3))
    assert store.lookup([1, 2, 3, 4]) == (None, 0) and not (tmp_path / "store").exists()
