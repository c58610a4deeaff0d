"""The prefix store: sequences' KV state kept as files every worker of a host maps."""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from service.engine.prefixes import PrefixStore
from service.engine.sequence_files import SequenceFormat


def shape_of(tokens: int) -> tuple[int, ...]:
    """Return the shape a layer of `tokens` tokens is stored in (transformers' runner's: keys and values)."""
    return 2, 2, tokens, 16


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    """Return the tiny model's config."""
    return AutoConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def fmt(config):
    """Return how the tiny model's sequences are stored: every layer, bf16, in shape_of's shape."""
    return SequenceFormat(config.num_hidden_layers, torch.bfloat16, shape_of)


def layers_of(config, tokens: int) -> list[torch.Tensor]:
    """Return random KV state of `tokens` tokens for every layer."""
    return [torch.randn(*shape_of(tokens)).to(torch.bfloat16) for _ in range(config.num_hidden_layers)]


def keep(store: PrefixStore, ids: list[int], layers: list[torch.Tensor]) -> None:
    """Store a sequence whose layers are each one piece."""
    store.store(ids, shape_of(len(ids)), ([layer] for layer in layers))


def test_prefix_store_drops_a_stored_prompt_that_a_new_one_extends(config, fmt, tmp_path):
    """A conversation's earlier turn can never be the longest match again: its file goes."""
    store = PrefixStore(fmt, 1 << 30, tmp_path, "model")
    keep(store, [1, 2, 3], layers_of(config, 3))
    keep(store, [7, 8], layers_of(config, 2))
    keep(store, [1, 2, 3, 4, 5], layers_of(config, 5))
    assert len(list((tmp_path / "model").iterdir())) == 2
    assert store.lookup([1, 2, 3, 9])[1] == 3
    assert store.lookup([1, 2, 3, 4, 5, 6])[1] == 5
    assert store.lookup([7, 8, 9])[1] == 2


def test_a_sequence_stored_by_one_worker_is_found_whole_by_another(config, fmt, tmp_path):
    """Two stores on one folder (two workers): what one keeps, the other reads back bit for bit."""
    writer, reader = PrefixStore(fmt, 1 << 30, tmp_path, "model"), PrefixStore(fmt, 1 << 30, tmp_path, "model")
    stored = layers_of(config, 6)
    keep(writer, [5, 6, 7, 8, 9, 10], stored)
    found, length = reader.lookup([5, 6, 7, 8, 9, 10, 11])
    assert length == 6
    assert all(torch.equal(a, b) for a, b in zip(found, stored, strict=True))
    assert PrefixStore(fmt, 1 << 30, tmp_path, "other model").lookup([5, 6, 7, 8, 9, 10, 11]) == ([], 0)


def test_the_folder_keeps_the_most_recently_used_sequences_within_its_capacity(config, fmt, tmp_path):
    """Eviction goes least recently used first, over every model's files, and a hit counts as a use."""
    one = PrefixStore(fmt, 1 << 30, tmp_path, "model")
    keep(one, [1, 1], layers_of(config, 2))
    size = one.bytes
    store = PrefixStore(fmt, 3 * size, tmp_path, "model")
    keep(store, [2, 2], layers_of(config, 2))
    keep(store, [3, 3], layers_of(config, 2))
    assert store.lookup([1, 1, 5])[1] == 2  # [1, 1] is the most recently used now
    keep(PrefixStore(fmt, 3 * size, tmp_path, "other model"), [4, 4], layers_of(config, 2))
    kept = {tuple(store.lookup([first, first, 5])[1] for first in (1, 2, 3))}
    assert kept == {(2, 0, 2)}


def test_a_folder_others_can_write_is_never_read(config, fmt, tmp_path):
    """A folder another user could fill with forged keys and values turns prefix reuse off."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    store = PrefixStore(fmt, 1 << 30, shared, "model")
    keep(store, [1, 2, 3], layers_of(config, 3))
    assert not store.enabled and store.lookup([1, 2, 3, 4]) == ([], 0)
    assert not (shared / "model").exists()


def test_no_capacity_keeps_nothing(config, fmt, tmp_path):
    """PREFIX_CACHE_MB=0 stores no file at all."""
    store = PrefixStore(fmt, 0, tmp_path / "store", "model")
    keep(store, [1, 2, 3], layers_of(config, 3))
    assert store.lookup([1, 2, 3, 4]) == ([], 0) and not (tmp_path / "store").exists()


def test_a_stored_sequence_is_a_safetensors_file_of_its_ids_and_every_layers_state(config, fmt, tmp_path):
    """The file is written piece by piece by hand; safetensors itself reads it back whole."""
    store = PrefixStore(fmt, 1 << 30, tmp_path, "model")
    stored = layers_of(config, 5)
    keep(store, [3, 1, 4, 1, 5], stored)
    [path] = list((tmp_path / "model").iterdir())
    with safe_open(str(path), framework="pt") as file:
        assert file.get_tensor("ids").tolist() == [3, 1, 4, 1, 5]
        for index, layer in enumerate(stored):
            assert torch.equal(file.get_tensor(f"layer.{index}"), layer)


@pytest.mark.parametrize("bad", ["short", "wrong dtype", "missing layer"])
def test_a_sequence_whose_state_does_not_match_its_ids_is_not_kept_and_leaves_no_file(config, fmt, tmp_path, bad):
    """A layer of the wrong shape or dtype, or too few layers, writes nothing a reader could map."""
    store = PrefixStore(fmt, 1 << 30, tmp_path, "model")
    layers = layers_of(config, 4)
    if bad == "short":
        layers[1] = layers_of(config, 3)[1]
    elif bad == "wrong dtype":
        layers[0] = layers[0].float()
    else:
        layers = layers[:-1]
    keep(store, [1, 2, 3, 4], layers)
    assert list((tmp_path / "model").iterdir()) == []
    assert store.lookup([1, 2, 3, 4, 5]) == ([], 0)
