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

# Pages a copy in or out of the pool moves at a time: its temporary is never larger.
COPY_PAGES = 16


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

    # Moving KV state in and out: the prefix store keeps a layer as its pages, [pages, 2, kv_heads,
    # PAGE_TOKENS * head_dim], copied COPY_PAGES at a time so no copy is ever larger.

    def stored_shape(self, length: int) -> tuple[int, int, int, int]:
        """Return the shape one layer of `length` tokens is stored in: its pages."""
        _, kv_heads, head_dim = self.shape
        return pages_for(length), 2, kv_heads, PAGE_TOKENS * head_dim

    def read(self, pages: SequencePages, length: int) -> Iterator[Iterator[torch.Tensor]]:
        """Yield each layer of a sequence's first `length` tokens as pieces of its pages; the last page's
        columns past `length` are zeros (they may hold what an earlier sequence left)."""
        for layer in range(self.shape[0]):
            yield self._read_layer(pages, layer, length)

    def _read_layer(self, pages: SequencePages, layer: int, length: int) -> Iterator[torch.Tensor]:
        """Yield one layer's pages of a sequence's first `length` tokens, a few at a time."""
        _, kv_heads, head_dim = self.shape
        count = pages_for(length)
        for first in range(0, count, COPY_PAGES):
            last = min(count, first + COPY_PAGES)
            piece = self.storage[pages.table[first:last], layer]
            if last == count and length % PAGE_TOKENS:
                used = length % PAGE_TOKENS
                piece[-1, 0].view(kv_heads, head_dim // 2, PAGE_TOKENS, 2)[:, :, used:] = 0
                values = piece[-1, 1].view(kv_heads, PAGE_TOKENS // 2, head_dim, 2)
                values[:, -(-used // 2):] = 0
                if used % 2:
                    values[:, used // 2, :, 1] = 0
            yield piece

    def write(self, pages: SequencePages, layers: list[torch.Tensor], length: int) -> None:
        """Put `length` stored tokens of KV state (each layer's pages, read() or the prefix store's) at a
        sequence's start."""
        count = pages_for(length)
        for layer, stored in enumerate(layers):
            for first in range(0, count, COPY_PAGES):
                last = min(count, first + COPY_PAGES)
                self.storage[pages.table[first:last], layer] = stored[first:last]
        pages.length = length

    def copy(self, source: SequencePages, target: SequencePages) -> None:
        """Make `target` hold what `source` holds (a request's other choices, after their shared prompt pass)."""
        count = pages_for(source.length)
        for first in range(0, count, COPY_PAGES):
            last = min(count, first + COPY_PAGES)
            self.storage[target.table[first:last]] = self.storage[source.table[first:last]]
        target.length = source.length
