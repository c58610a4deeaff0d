"""A sequence's own KV cache on transformers' forward (runners.TransformersModel): transformers'
DynamicCache, whose plain layers append into room allocated once instead of concatenating.

DynamicLayer.update concatenates, so every decode step would copy each layer's whole cache. A
GrowingLayer keeps its keys and values as views of the first columns of a larger tensor it
allocated (its room), sized for the sequence's prompt plus max_tokens when the runner reserves it,
and writes each step's columns into it.

A layer writes only into room it allocated: tensors handed over as they are (a stored prefix's
slices, views of a read-only mapping) are copied into new room at the first append, so what was
handed in is never written.

Caches are read and built through DynamicLayer's `keys`, `values` and `lazy_initialization`:
transformers has no public call that builds a cache from tensors without copying them (its
`DynamicCache(ddp_cache_data)` goes through `update`). Those internals change between releases;
tests/unit/test_kvcache.py pins them, so an upgrade that moves them fails there first.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Columns a layer allocates beyond what it holds when it outgrows its room (which a reserved
# sequence never does): room is copied once every ROOM_TOKENS appended tokens at most.
ROOM_TOKENS = 256


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into columns it allocated ahead instead of concatenating."""

    def __init__(self):
        super().__init__()
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handed: tuple[torch.Tensor, torch.Tensor] | None = None
        # Columns the first room holds at least: the sequence's prompt plus max_tokens (its reservation).
        self.reserved_tokens = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new columns in place (allocating new room when there is none or it is full)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        new = key_states.shape[2]
        # Room is written only while keys and values are still the views this layer made of it
        # (anything that replaced them, such as build_cache or crop, made them someone else's).
        if (self._room is None or self._handed[0] is not self.keys or self._handed[1] is not self.values
                or length + new > self._room[0].shape[2] or self._room[0].shape[:2] != key_states.shape[:2]):
            self._grow(length, max(length + new + ROOM_TOKENS, self.reserved_tokens), key_states, value_states)
        keys_room, values_room = self._room
        keys_room.narrow(2, length, new).copy_(key_states)
        values_room.narrow(2, length, new).copy_(value_states)
        self.keys, self.values = keys_room.narrow(2, 0, length + new), values_room.narrow(2, 0, length + new)
        self._handed = (self.keys, self.values)
        return self.keys, self.values

    def _grow(self, length: int, columns: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate room for `columns` columns and copy the held ones into it."""
        rooms = []
        for held, new in ((self.keys, key_states), (self.values, value_states)):
            batch, heads, _, dim = new.shape
            room = new.new_empty((batch, heads, columns, dim))
            if length:
                room[:, :, :length].copy_(held)
            rooms.append(room)
        self._room = (rooms[0], rooms[1])


def new_cache(config) -> DynamicCache:
    """Return an empty cache for a model: transformers' layers, its plain ones GrowingLayers."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def reserve(cache: DynamicCache, tokens: int) -> DynamicCache:
    """Make the cache's first room hold `tokens` columns, so appending up to them never copies."""
    for layer in cache.layers:
        if type(layer) is GrowingLayer:
            layer.reserved_tokens = tokens
    return cache


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return the (keys, values) tensors of every layer of a cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def build_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """Build a cache that holds the given per-layer keys and values without copying them; its first
    append copies them into room of its own, so they are never written."""
    cache = new_cache(config)
    for index, (keys, values) in enumerate(layers):
        layer = cache.layers[index] if index < len(cache.layers) else None
        if type(layer) is GrowingLayer:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        else:  # sliding-window and other layers trim what they keep: let them
            cache.update(keys, values, index)
    return cache
