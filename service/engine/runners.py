"""How the scheduler runs a model over sequences: their KV state, prompt chunks and decode steps.

Two runners share one face (SequenceModel). PagedModel serves Qwen2-family models in bfloat16,
int8, int4 and int4m with the lean forward (qwen2.py): every sequence's KV state lives in the worker's
page pool (kvpool.py), a decode step runs every running sequence as one batch of rows, and a
sequence joining or leaving that batch copies nothing. TransformersModel serves the rest (other
architectures, float32) with transformers' own forward: each sequence keeps its own cache, room
for its prompt plus max_tokens allocated once, and a decode step runs the sequences one by one,
so nothing is padded or copied there either; their decoding shares no weight reads, which is the
price of running any architecture.

Both count a sequence's room in pages of the same KV budget, so admission and memory bounds are
the same whichever runs.
"""

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from transformers import DynamicCache

from .kvcache import build_cache, cache_layers, new_cache, reserve
from .kvpool import PagePool, SequencePages
from .memory import PAGE_TOKENS, KVBudget
from .qwen2 import LeanModel, Rows, lean_forward


class SequenceModel(Protocol):
    """A model as the scheduler runs it: sequences' KV room, prompt chunks, decode steps."""

    pool: PagePool
    # Names how read() lays KV state out, so stored sequences of another layout are never loaded.
    kv_layout: str
    # Whether a row's logits are the same bits whatever else its forward runs (corechat's quantized
    # kernels): only then are a step's draft rows what single steps would give (speculation.py).
    exact_rows: bool

    def reserve(self, tokens: int) -> object:
        """Take room for a sequence of at most `tokens` tokens (the pool must have it free)."""

    def release(self, kv) -> None:
        """Give a sequence's room back."""

    def length(self, kv) -> int:
        """Return the tokens a sequence's KV state holds."""

    def stored_shape(self, length: int) -> tuple[int, ...]:
        """Return the shape in which one layer of `length` tokens of KV state is stored (read, load)."""

    def load(self, kv, layers: list[torch.Tensor], length: int) -> None:
        """Start a sequence's KV state with `length` stored tokens (each layer's, as read() gave it)."""

    def read(self, kv, length: int) -> Iterator[Iterable[torch.Tensor]]:
        """Yield a sequence's first `length` tokens of KV state, each layer as pieces of its stored shape."""

    def copy(self, source, target) -> None:
        """Make one sequence's KV state another's (a request's choices after their shared prompt)."""

    def prefill(self, kv, token_ids: list[int], keep_last: int) -> torch.Tensor:
        """Pass the next prompt tokens of a sequence; return the last `keep_last` rows' logits (0: all)."""

    def decode(self, kvs: list, token_ids: list[int]) -> torch.Tensor:
        """Feed one token to each sequence; return the next-token logits, [sequences, vocabulary]."""


class PagedModel:
    """The lean forward over the worker's page pool."""

    kv_layout = f"pages{PAGE_TOKENS}"

    def __init__(self, lean: LeanModel, budget: KVBudget):
        page_tokens = int(torch.ops.corechat.page_layout()[0])
        if page_tokens != PAGE_TOKENS:
            raise RuntimeError(f"the kernels' pages hold {page_tokens} tokens, memory.PAGE_TOKENS {PAGE_TOKENS}")
        self.lean = lean
        # bfloat16 runs torch's products, which choose their kernels by the number of rows.
        self.exact_rows = lean.fused is not None
        self.pool = PagePool(budget, lean.shape)
        # The batch's tables, rebuilt only when its sequences change: [sequences, widest table], and
        # the tables they were built from (held, so that no other sequence's can take their place).
        self._batch: list[torch.Tensor] = []
        self._tables = torch.zeros((0, 0), dtype=torch.long)
        self._sequences = torch.arange(0)

    def reserve(self, tokens: int) -> SequencePages:
        """Take the pages a sequence of at most `tokens` tokens fills."""
        return self.pool.reserve(tokens)

    def release(self, kv: SequencePages) -> None:
        """Give a sequence's pages back."""
        self.pool.release(kv)

    def length(self, kv: SequencePages) -> int:
        """Return the tokens a sequence's pages hold."""
        return kv.length

    def stored_shape(self, length: int) -> tuple[int, ...]:
        """Return one layer's stored shape: its pages."""
        return self.pool.stored_shape(length)

    def load(self, kv: SequencePages, layers: list[torch.Tensor], length: int) -> None:
        """Copy stored pages into a sequence's first pages."""
        self.pool.write(kv, layers, length)

    def read(self, kv: SequencePages, length: int) -> Iterator[Iterable[torch.Tensor]]:
        """Yield a sequence's pages, a layer at a time, a few pages at a time."""
        return self.pool.read(kv, length)

    def copy(self, source: SequencePages, target: SequencePages) -> None:
        """Copy a sequence's pages into another's."""
        self.pool.copy(source, target)

    def prefill(self, kv: SequencePages, token_ids: list[int], keep_last: int) -> torch.Tensor:
        """Run a prompt chunk as rows of its sequence, each at its position."""
        count = len(token_ids)
        rows = Rows(kv.table.unsqueeze(0), torch.zeros(count, dtype=torch.long),
                    torch.arange(kv.length, kv.length + count), kv.length + count - 1)
        logits = lean_forward(self.lean, torch.tensor(token_ids), rows, self.pool.storage, keep_last)
        kv.length += count
        return logits

    def decode(self, kvs: list[SequencePages], token_ids: list[int]) -> torch.Tensor:
        """Run one token of each sequence as a row of one batch."""
        lengths = [kv.length for kv in kvs]
        rows = Rows(self._batch_tables(kvs), self._row_sequences(len(kvs)), torch.tensor(lengths), max(lengths))
        logits = lean_forward(self.lean, torch.tensor(token_ids), rows, self.pool.storage, 0)
        for kv in kvs:
            kv.length += 1
        return logits

    def decode_rows(self, kvs: list[SequencePages], inputs: list[list[int]]) -> torch.Tensor:
        """Run each sequence's tokens as rows at its next positions, a prompt chunk's way, all sequences in one
        batch; return every row's logits, a sequence's rows together in order."""
        counts = [len(ids) for ids in inputs]
        sequences = torch.repeat_interleave(torch.arange(len(kvs)), torch.tensor(counts))
        positions = torch.cat([torch.arange(kv.length, kv.length + count) for kv, count in zip(kvs, counts, strict=True)])
        rows = Rows(self._batch_tables(kvs), sequences, positions,
                    max(kv.length + count for kv, count in zip(kvs, counts, strict=True)) - 1)
        logits = lean_forward(self.lean, torch.tensor([token for ids in inputs for token in ids]), rows,
                              self.pool.storage, 0)
        for kv, count in zip(kvs, counts, strict=True):
            kv.length += count
        return logits

    def rewind(self, kv: SequencePages, length: int) -> None:
        """Forget a sequence's KV state past `length` tokens: the next row written there replaces it, and no row
        attends past its own position."""
        kv.length = length

    def _row_sequences(self, count: int) -> torch.Tensor:
        """Return [0, count): row i of a decode step is sequence i of its batch (kept while the batch's size holds)."""
        if self._sequences.shape[0] != count:
            self._sequences = torch.arange(count)
        return self._sequences

    def _batch_tables(self, kvs: list[SequencePages]) -> torch.Tensor:
        """Return the batch's page tables, [sequences, widest table], rebuilt only when its sequences changed."""
        if len(kvs) != len(self._batch) or any(kv.table is not held for kv, held in zip(kvs, self._batch)):
            widest = max(kv.table.numel() for kv in kvs)
            self._tables = torch.zeros((len(kvs), widest), dtype=torch.long)
            for row, kv in enumerate(kvs):
                self._tables[row, : kv.table.numel()] = kv.table
            self._batch = [kv.table for kv in kvs]
        return self._tables


class TransformersModel:
    """transformers' forward, a cache per sequence, decode steps a sequence at a time."""

    kv_layout = "tokens"
    # transformers' products choose their kernels by the number of rows.
    exact_rows = False

    def __init__(self, model, budget: KVBudget):
        self.model = model
        self.pool = PagePool(budget)

    def reserve(self, tokens: int) -> tuple[DynamicCache, SequencePages]:
        """Count a sequence's pages and give it a cache whose room holds `tokens` tokens, allocated once."""
        return reserve(new_cache(self.model.config), tokens), self.pool.reserve(tokens)

    def release(self, kv: tuple[DynamicCache, SequencePages]) -> None:
        """Drop a sequence's cache and give its pages back."""
        self.pool.release(kv[1])

    def length(self, kv: tuple[DynamicCache, SequencePages]) -> int:
        """Return the tokens a sequence's cache holds."""
        return kv[0].get_seq_length()

    def stored_shape(self, length: int) -> tuple[int, ...]:
        """Return one layer's stored shape: its keys and values, [2, kv_heads, length, head_dim]."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 2, config.num_key_value_heads, length, head_dim

    def load(self, kv, layers: list[torch.Tensor], length: int) -> None:
        """Start a sequence's cache from stored KV state (copied into its room at its first append)."""
        cache, pages = kv
        stored = build_cache(self.model.config, [(layer[0:1, :, :length], layer[1:2, :, :length]) for layer in layers])
        reserve(stored, pages.capacity)
        cache.layers = stored.layers

    def read(self, kv, length: int) -> Iterator[Iterable[torch.Tensor]]:
        """Yield a sequence's KV state, a layer at a time (a copy of the layer, on this rarely taken path)."""
        for keys, values in cache_layers(kv[0]):
            yield [torch.cat((keys[:, :, :length], values[:, :, :length]))]

    def copy(self, source, target) -> None:
        """Give `target` a copy of `source`'s cache in room of its own."""
        length = self.length(source)
        self.load(target, [torch.cat(list(pieces)) for pieces in self.read(source, length)], length)

    def prefill(self, kv, token_ids: list[int], keep_last: int) -> torch.Tensor:
        """Run a prompt chunk through transformers' forward."""
        output = self.model(input_ids=torch.tensor([token_ids]), cache=kv[0], use_cache=True, logits_to_keep=keep_last)
        return output.logits[0].float()

    def decode(self, kvs: list, token_ids: list[int]) -> torch.Tensor:
        """Run each sequence's next token alone."""
        logits = [self.model(input_ids=torch.tensor([[token_id]]), cache=kv[0], use_cache=True, logits_to_keep=1).logits[0, -1]
                  for kv, token_id in zip(kvs, token_ids, strict=True)]
        return torch.stack(logits).float()
