"""Keep the KV state of recent prompts so a shared system prompt or a conversation's earlier turns
are not processed again (one store per worker, owned by its engine thread).

Caches are read and built through DynamicLayer's `keys`, `values` and `lazy_initialization`:
transformers has no public call that builds a cache from tensors without copying them (its
`DynamicCache(ddp_cache_data)` goes through `update`). Those internals change between releases;
tests/test_prefixes.py pins them, so an upgrade that moves them fails there first.
"""

from collections import OrderedDict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return the (keys, values) tensors of every layer of a cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def build_cache(config, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """Build a DynamicCache that holds the given per-layer keys and values, without copying them.

    DynamicCache.update would copy each tensor once more (it concatenates onto an empty one), and
    a batch join or leave already made fresh tensors while every running stream waits. The next
    update concatenates into new tensors, so what was handed in is never written.
    """
    cache = DynamicCache(config=config)
    for index, (keys, values) in enumerate(layers):
        layer = cache.layers[index] if index < len(cache.layers) else None
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        else:  # sliding-window and other layers trim what they keep: let them
            cache.update(keys, values, index)
    return cache


def common_prefix_length(stored: torch.Tensor, prompt: torch.Tensor) -> int:
    """Return how many leading token ids two 1-D id tensors share."""
    length = min(stored.numel(), prompt.numel())
    differ = (stored[:length] != prompt[:length]).nonzero()
    return int(differ[0]) if differ.numel() else length


class PrefixStore:
    """An LRU of prompt KV states keyed by token ids, capped in bytes."""

    def __init__(self, config, capacity_bytes: int):
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, list]] = OrderedDict()

    def lookup(self, prompt_ids: list[int]) -> tuple[DynamicCache | None, int]:
        """Return a fresh cache holding the longest stored prefix of the prompt, and its length.

        At least the prompt's last token is left out, since its logits are what the prompt pass is for.
        """
        if not self._entries:
            return None, 0
        prompt = torch.tensor(prompt_ids)
        best_key, best_length = None, 0
        for key, (ids, _) in self._entries.items():
            length = common_prefix_length(ids, prompt)
            if length > best_length:
                best_key, best_length = key, length
        best_length = min(best_length, len(prompt_ids) - 1)
        if best_key is None or best_length <= 0:
            return None, 0
        self._entries.move_to_end(best_key)
        _, layers = self._entries[best_key]
        # Slices are views, and build_cache keeps them as they are; the sequence's cache appends
        # with torch.cat (new tensors), so the stored entry is never written through them.
        return build_cache(self.config, [(k[:, :, :best_length], v[:, :, :best_length]) for k, v in layers]), best_length

    def store(self, prompt_ids: list[int], cache: DynamicCache) -> None:
        """Keep a copy of a prompt's KV state (the cache must hold exactly the prompt)."""
        if self.capacity_bytes <= 0:
            return
        key = tuple(prompt_ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        layers = [(keys.clone(), values.clone()) for keys, values in cache_layers(cache)]
        size = sum(keys.nbytes + values.nbytes for keys, values in layers)
        if size > self.capacity_bytes:
            return
        # A stored prompt that this one extends (a conversation's previous turn) can never be the
        # longest match again: drop it rather than keep a nested copy until the LRU gets to it.
        for shorter in [stored for stored in self._entries if len(stored) < len(key) and key[: len(stored)] == stored]:
            self._drop(shorter)
        while self._entries and self.bytes + size > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (torch.tensor(prompt_ids), layers)
        self.bytes += size

    def _drop(self, key: tuple[int, ...]) -> None:
        """Forget one stored prompt and its bytes."""
        _, layers = self._entries.pop(key)
        self.bytes -= sum(keys.nbytes + values.nbytes for keys, values in layers)
