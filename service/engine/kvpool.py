"""Every running sequence's KV state in pages of one pool per worker, allocated once.

KV_CACHE_MB is cut into pages of PAGE_TOKENS tokens. A sequence reserves, when it starts, the
pages its prompt plus max_tokens can fill, and gives them back when it ends; a request whose pages
are not free waits in the queue. So the KV state never outgrows the budget, a running sequence
never grows its room (nothing is copied to make space), and a sequence joining or leaving the
decode batch touches no other sequence's pages.

On the paged path (the lean forward, runners.PagedModel) the pages hold the keys and values
themselves: one tensor of KV_CACHE_MB, [pages, layers, 2, kv_heads, PAGE_TOKENS * head_dim], laid
out as the attention kernel reads it (kernels.h: PagedAttention), whose memory the kernel gives
the process only as pages are first written. Freed pages are handed out again last in, first
out, so a worker reuses the memory it already holds before touching more. The other path
(transformers' forward, runners.TransformersModel) counts pages without storing into them.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .memory import PAGE_TOKENS, KVBudget, pages_for


class PoolExhausted(RuntimeError):
    """Not enough free pages for a sequence (admission checks first, so this is a bookkeeping fault)."""


@dataclass
class SequencePages:
    """A sequence's pages, in order, and how many tokens its KV state holds so far."""

    table: torch.Tensor  # int64 page numbers
    length: int = 0

    @property
    def capacity(self) -> int:
        """Return the tokens its pages hold."""
        return self.table.numel() * PAGE_TOKENS


class PagePool:
    """A worker's KV pages: the free list and, where `shape` is given, the storage."""

    def __init__(self, budget: KVBudget, shape: tuple[int, int, int] | None = None):
        """`shape` is (layers, kv_heads, head_dim) for a pool that stores; None counts pages only."""
        self.budget = budget
        self.shape = shape
        self._free = list(range(budget.pages - 1, -1, -1))
        self._storage: torch.Tensor | None = None

    @property
    def free_pages(self) -> int:
        """Return the pages no sequence holds."""
        return len(self._free)

    @property
    def storage(self) -> torch.Tensor:
        """Return the pool's tensor, made at first use: [pages, layers, 2, kv_heads, PAGE_TOKENS * head_dim]."""
        if self._storage is None:
            layers, kv_heads, head_dim = self.shape
            # A normal tensor, not an inference one, so it may be written in and out of inference mode.
            with torch.inference_mode(False):
                self._storage = torch.empty((self.budget.pages, layers, 2, kv_heads, PAGE_TOKENS * head_dim),
                                            dtype=torch.bfloat16)
        return self._storage

    def reserve(self, tokens: int) -> SequencePages:
        """Take the pages `tokens` tokens fill."""
        count = pages_for(tokens)
        if count > len(self._free):
            raise PoolExhausted(f"{count} pages asked, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(count)]
        return SequencePages(torch.tensor(taken, dtype=torch.long))

    def release(self, pages: SequencePages) -> None:
        """Give a sequence's pages back (once; its table is emptied)."""
        self._free.extend(reversed(pages.table.tolist()))
        pages.table = pages.table[:0]
        pages.length = 0

    # Moving KV state in and out (the prefix store keeps it as [1, kv_heads, tokens, head_dim]) ----

    def _layer(self, pages: SequencePages, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the first `count` pages' keys and values of one layer (copies: advanced indexing)."""
        _, kv_heads, head_dim = self.shape
        picked = self.storage[pages.table[:count], layer]  # [count, 2, kv_heads, PAGE_TOKENS * head_dim]
        keys = picked[:, 0].view(count, kv_heads, head_dim, PAGE_TOKENS)
        values = picked[:, 1].view(count, kv_heads, PAGE_TOKENS, head_dim)
        return keys, values

    def read(self, pages: SequencePages, length: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield each layer's keys and values of a sequence's first `length` tokens, one layer at a time."""
        layers, kv_heads, head_dim = self.shape
        count = pages_for(length)
        for layer in range(layers):
            keys, values = self._layer(pages, layer, count)
            keys = keys.permute(1, 0, 3, 2).reshape(kv_heads, count * PAGE_TOKENS, head_dim)[:, :length]
            values = values.permute(1, 0, 2, 3).reshape(kv_heads, count * PAGE_TOKENS, head_dim)[:, :length]
            yield keys.unsqueeze(0), values.unsqueeze(0)

    def write(self, pages: SequencePages, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Put `length` tokens of KV state (each layer's [1, kv_heads, >= length, head_dim]) at a sequence's start."""
        _, kv_heads, head_dim = self.shape
        count = pages_for(length)
        rows = pages.table[:count]
        padded = count * PAGE_TOKENS
        for layer, (keys, values) in enumerate(layers):
            for part, held in ((0, keys), (1, values)):
                tokens = torch.zeros((kv_heads, padded, head_dim), dtype=torch.bfloat16)
                tokens[:, :length] = held[0, :, :length]
                tokens = tokens.view(kv_heads, count, PAGE_TOKENS, head_dim).transpose(0, 1)
                if part == 0:
                    tokens = tokens.transpose(2, 3)
                self.storage[rows, layer, part] = tokens.reshape(count, kv_heads, PAGE_TOKENS * head_dim)
        pages.length = length

    def copy(self, source: SequencePages, target: SequencePages) -> None:
        """Make `target` hold what `source` holds (a request's other choices, after their shared prompt pass)."""
        count = pages_for(source.length)
        self.storage[target.table[:count]] = self.storage[source.table[:count]]
        target.length = source.length
