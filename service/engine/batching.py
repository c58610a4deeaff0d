"""Decode every running sequence of a worker in one forward pass per token (continuous batching).

Sequences join after their own prompt pass and leave when they finish; the batch's KV cache is
their caches left-padded to one length, so one step appends one column for every row, and an
attention mask hides the padding. A join or leave copies the rows into new tensors with room for
the next steps' columns (kvcache.py).
"""

import torch

from .kvcache import ROOM_TOKENS, build_cache, cache_layers


def new_room(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Return zeros for `rows` rows of `width` columns and ROOM_TOKENS more, shaped like a layer's keys.

    Zeros: the padding left of a row's keys is skipped or masked, but must be finite.
    """
    return like.new_zeros((rows, like.shape[1], width + ROOM_TOKENS, like.shape[3]))


class DecodeBatch:
    """The running sequences' joint KV cache, padding and positions."""

    def __init__(self, config):
        self.config = config
        self.cache = None
        self.lengths: list[int] = []  # real tokens in each row's cache
        self.width = 0  # columns in the joint cache, padding included

    def __len__(self) -> int:
        """Return the number of rows."""
        return len(self.lengths)

    def join(self, caches: list) -> None:
        """Append rows for sequences whose prompt pass is done (each cache holds one row)."""
        rows = ([cache_layers(self.cache)] if self.cache is not None else []) + [cache_layers(c) for c in caches]
        lengths = self.lengths + [cache.get_seq_length() for cache in caches]
        width = max(lengths)
        layers = []
        for layer in range(len(caches[0].layers)):
            rooms = []
            for held in zip(*(part[layer] for part in rows)):  # every part's keys, then every part's values
                room = new_room(held[0], sum(tensor.shape[0] for tensor in held), width)
                row = 0
                for tensor in held:
                    room[row:row + tensor.shape[0], :, width - tensor.shape[-2]:width].copy_(tensor)
                    row += tensor.shape[0]
                rooms.append(room)
            layers.append((rooms[0], rooms[1]))
        self.cache = build_cache(self.config, layers, length=width)
        self.lengths, self.width = lengths, width

    def leave(self, rows: list[int]) -> None:
        """Drop finished rows, and the padding columns no remaining row needs."""
        keep = [row for row in range(len(self.lengths)) if row not in set(rows)]
        if not keep:
            self.cache, self.lengths, self.width = None, [], 0
            return
        lengths = [self.lengths[row] for row in keep]
        width = max(lengths)
        index = torch.tensor(keep)
        layers = []
        for held in cache_layers(self.cache):
            rooms = []
            for tensor in held:
                room = new_room(tensor, len(keep), width)
                room[:, :, :width].copy_(tensor[:, :, self.width - width:].index_select(0, index))
                rooms.append(room)
            layers.append((rooms[0], rooms[1]))
        self.cache = build_cache(self.config, layers, length=width)
        self.lengths, self.width = lengths, width

    def row_layers(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Return one row's keys and values, every layer, without its padding (views of the batch's cache)."""
        start = self.width - self.lengths[row]
        return [(keys[row:row + 1, :, start:self.width], values[row:row + 1, :, start:self.width])
                for keys, values in cache_layers(self.cache)]

    def step(self, model, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row; return the next-token logits, one row per sequence.

        Each row's first real column goes to the attention as `row_starts`, so the decode
        attention kernel sums over that row's own keys only (attention.py); the mask stays for
        the paths that fall back to SDPA.
        """
        positions = torch.tensor(self.lengths).unsqueeze(1)
        starts = torch.tensor([self.width - length for length in self.lengths])
        padded = len(self.lengths) > 1 and min(self.lengths) < self.width
        mask = None
        if padded:
            columns = torch.arange(self.width + 1)
            mask = (columns >= (self.width - positions)).long()
        output = model(
            input_ids=torch.tensor(token_ids).unsqueeze(1),
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
            row_starts=starts,
        )
        self.lengths = [length + 1 for length in self.lengths]
        self.width += 1
        return output.logits[:, -1]
