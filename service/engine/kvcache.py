"""The KV cache: transformers' DynamicCache, whose plain layers append into room instead of concatenating.

DynamicLayer.update concatenates, so every decode step copied each layer's whole cache: at 4,096
tokens of context and 4 rows, about 40 ms of a 0.5B int8 step of 290 ms (bench/kv_append_probe.py). A GrowingLayer keeps its keys and values as views of the first
columns of larger tensors it allocated (its room) and writes each step's column into the room; a full
room is replaced by one ROOM_TOKENS columns longer than needed, copied once. Attention reads the
views in place (the kernel takes a cache's strides).

A layer writes only into room it allocated or was handed as room (build_cache's `length`): tensors
handed over as they are (a stored prefix's slices) are copied into new room at the first append, so
what was handed in is never written.

Caches are read and built through DynamicLayer's `keys`, `values` and `lazy_initialization`:
transformers has no public call that builds a cache from tensors without copying them (its
`DynamicCache(ddp_cache_data)` goes through `update`). Those internals change between releases;
tests/test_prefixes.py pins them, so an upgrade that moves them fails there first.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Columns a layer allocates beyond what it holds: a full room is copied once every ROOM_TOKENS
# appended tokens at most, and a running sequence holds at most this many unused columns in each
# layer (3 MiB in all for Qwen2.5-0.5B).
ROOM_TOKENS = 256


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into columns it allocated ahead instead of concatenating."""

    def __init__(self):
        super().__init__()
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handed: tuple[torch.Tensor, torch.Tensor] | None = None
        # Columns the first room holds at least: a prompt's length, so its pass allocates once.
        self.reserved_tokens = 0

    def adopt(self, keys_room: torch.Tensor, values_room: torch.Tensor, length: int) -> None:
        """Hold the first `length` columns of tensors the layer may write into from column `length` on."""
        self.lazy_initialization(keys_room, values_room)
        self._room = (keys_room, values_room)
        self.keys, self.values = keys_room.narrow(2, 0, length), values_room.narrow(2, 0, length)
        self._handed = (self.keys, self.values)

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


def build_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int | None = None) -> DynamicCache:
    """Build a cache that holds the given per-layer keys and values, without copying them.

    DynamicCache.update would copy each tensor once more (it concatenates onto an empty one), and
    a batch join or leave already made fresh tensors while every running stream waits. Given
    `length`, the tensors are room the cache owns from then on: it holds their first `length`
    columns and appends after them. Without it they are never written: the first append copies
    them into room of the cache's own.
    """
    cache = new_cache(config)
    for index, (keys, values) in enumerate(layers):
        layer = cache.layers[index] if index < len(cache.layers) else None
        if type(layer) is GrowingLayer:
            if length is None:
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            else:
                layer.adopt(keys, values, length)
        else:  # sliding-window and other layers trim what they keep: let them
            cache.update(keys if length is None else keys[:, :, :length],
                         values if length is None else values[:, :, :length], index)
    return cache
