"""Keep the KV state of recent prompts so a shared system prompt or a conversation's earlier turns
are not processed again (one store per worker, owned by its engine thread).
"""

from collections import OrderedDict

import torch
from transformers import DynamicCache

from .kvcache import build_cache, cache_layers


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
        # Slices are views, and build_cache keeps them as they are; the sequence's first append
        # copies them into room of its own (kvcache.py), so the stored entry is never written.
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
