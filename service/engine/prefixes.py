"""Keep the KV state of recent prompts and replies where every worker of the host finds it.

A chat frontend resends the whole conversation every turn, and the kernel hands each turn to any
worker. So each stored sequence (a prompt at the end of its pass; prompt and reply at the end of a
generation) is a safetensors file in one folder on tmpfs that all workers read: its token ids and
every layer's keys and values. Readers map the files (safetensors hands out views of the mapping,
no copy); a writer writes a temporary file and renames it into place, so a reader sees a whole file
or none and never waits for a writer. A file deleted while a reader holds views of it stays mapped
until the reader drops them. Eviction is least recently used over the whole folder, across models:
a hit touches its file's time.

The folder has one subfolder per model fingerprint (weights, weight format, dtype), so workers of
another model never read these keys and values. It must be the service's own: a folder another
user can write could hand workers forged keys and values, so one that is not private is not used.
"""

import hashlib
import json
import logging
import os
import stat
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"


def common_prefix_length(stored: torch.Tensor, prompt: torch.Tensor) -> int:
    """Return how many leading token ids two 1-D id tensors share."""
    length = min(stored.numel(), prompt.numel())
    differ = (stored[:length] != prompt[:length]).nonzero()
    return int(differ[0]) if differ.numel() else length


def private_folder(path: Path) -> bool:
    """Make the folder (mode 0700) if it is missing; tell whether only this user can write it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = path.lstat()
    except OSError as exc:
        log.warning("prefix store folder %s cannot be made: %s; prefix reuse is off", path, exc)
        return False
    private = (stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid()
               and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    if not private:
        log.warning("prefix store folder %s is not this user's private folder; prefix reuse is off", path)
    return private


def touch(path: Path) -> None:
    """Mark a stored sequence used now (eviction goes least recently used first).

    The time is set to the nanosecond: the kernel's own file times are as coarse as its clock tick,
    and sequences stored within one tick would tie.
    """
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except FileNotFoundError:
        pass  # evicted meanwhile: a mapping a reader holds stays whole


def kv_shape(config, tokens: int) -> tuple[int, int, int, int]:
    """Return the shape of one layer's keys (and values) of `tokens` tokens: [1, kv_heads, tokens, head_dim]."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 1, getattr(config, "num_key_value_heads", None) or heads, tokens, head_dim


# safetensors' names of the dtypes a KV state is kept in.
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Return the bytes of a tensor of a shape and dtype."""
    count = dtype.itemsize
    for size in shape:
        count *= size
    return count


def write_sequence(path: Path, ids: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   layers: Iterable[tuple[torch.Tensor, torch.Tensor]], layer_count: int) -> None:
    """Write a sequence as a safetensors file (ids, then keys.N and values.N per layer), a layer at a time.

    safetensors' own writers take every tensor at once, which would hold a second copy of the
    sequence's whole KV state; the format is a little-endian header length, a JSON header and the
    tensors' bytes in its order, so it is written here as it comes.
    """
    header, offset = {}, 0
    for name, stored_dtype, size in [("ids", "I32", ids.nbytes)] + [
            (f"{part}.{index}", SAFETENSORS_DTYPES[dtype], shape_bytes(shape, dtype)) for index in range(layer_count)
            for part in ("keys", "values")]:
        header[name] = {"dtype": stored_dtype, "shape": list(ids.shape) if name == "ids" else list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    written = 0
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.write(ids.numpy().data)
        for keys, values in layers:
            for tensor in (keys, values):
                if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    raise ValueError(f"a layer's KV state is {tuple(tensor.shape)} {tensor.dtype}, not {shape} {dtype}")
                file.write(tensor.contiguous().view(torch.uint8).numpy().data)
            written += 1
    if written != layer_count:
        raise ValueError(f"{written} layers of KV state given, {layer_count} expected")


@dataclass
class _Entry:
    """One stored sequence as a reader maps it."""

    path: Path
    ids: torch.Tensor
    file: object  # safetensors' handle: get_tensor returns views of the mapped file


class PrefixStore:
    """Stored sequences' KV state, shared by the workers of a host, capped in bytes for the folder."""

    def __init__(self, config, capacity_bytes: int, root: Path, model_key: str, dtype: torch.dtype = torch.bfloat16):
        self.config = config
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.root = root
        self.folder = root / model_key
        self.enabled = capacity_bytes > 0 and private_folder(root) and private_folder(self.folder)
        # Bytes of the stored files as this worker last counted them (all models' files).
        self.bytes = 0
        self._entries: dict[str, _Entry] = {}

    def lookup(self, prompt_ids: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """Return every layer's keys and values of the longest stored prefix of the prompt, and its length.

        The tensors are views of a read-only mapping, [1, kv_heads, tokens, head_dim], at least as
        long as the prefix; the caller copies what it needs. At least the prompt's last token is
        left out, since its logits are what the prompt pass is for.
        """
        if not self.enabled or len(prompt_ids) < 2:
            return [], 0
        self._refresh()
        prompt = torch.tensor(prompt_ids, dtype=torch.int32)
        best, best_length = None, 0
        for entry in self._entries.values():
            length = common_prefix_length(entry.ids, prompt)
            if length > best_length:
                best, best_length = entry, length
        best_length = min(best_length, len(prompt_ids) - 1)
        if best is None or best_length <= 0:
            return [], 0
        touch(best.path)
        layers = [(best.file.get_tensor(f"keys.{index}"), best.file.get_tensor(f"values.{index}"))
                  for index in range(self.config.num_hidden_layers)]
        return layers, best_length

    def store(self, ids: list[int], layers: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV state of a sequence for every worker: each layer's keys and values, [1, kv_heads,
        len(ids), head_dim], taken from `layers` one at a time (so no more than one is ever copied)."""
        if not self.enabled or len(ids) < 2:
            return
        key = torch.tensor(ids, dtype=torch.int32)
        name = hashlib.sha256(key.numpy().tobytes()).hexdigest()[:32] + SUFFIX
        path = self.folder / name
        if path.exists():
            touch(path)
            return
        shape = kv_shape(self.config, len(ids))
        size = key.nbytes + 2 * self.config.num_hidden_layers * shape_bytes(shape, self.dtype)
        if size > self.capacity_bytes:
            return
        if not self.folder.is_dir() and not (private_folder(self.root) and private_folder(self.folder)):
            return  # the folder was removed (a tmpfs cleaned up) and cannot be made again
        partial = path.with_name(f".{name}.{os.getpid()}.partial")
        try:
            write_sequence(partial, key, shape, self.dtype, layers, self.config.num_hidden_layers)
            os.replace(partial, path)
            touch(path)
        except (OSError, ValueError) as exc:  # a full tmpfs: this sequence is not kept, serving goes on
            log.warning("a sequence's KV state could not be stored: %s", exc)
            partial.unlink(missing_ok=True)
            return
        self._drop_extended(key)
        self._evict()

    def _refresh(self) -> None:
        """Map the files other workers stored since the last look; forget the ones evicted."""
        try:
            names = {item.name for item in os.scandir(self.folder) if item.name.endswith(SUFFIX) and item.is_file()}
        except FileNotFoundError:
            names = set()
        for gone in self._entries.keys() - names:
            del self._entries[gone]
        for name in names - self._entries.keys():
            path = self.folder / name
            try:
                file = safe_open(str(path), framework="pt")
                self._entries[name] = _Entry(path, file.get_tensor("ids"), file)
            except Exception as exc:  # evicted before it was opened, or not a file this store wrote
                log.debug("stored sequence %s skipped: %s", name, exc)

    def _drop_extended(self, key: torch.Tensor) -> None:
        """Delete stored sequences the new one extends: they can never be the longest match again."""
        self._refresh()
        for name, entry in list(self._entries.items()):
            if entry.ids.numel() < key.numel() and torch.equal(entry.ids, key[: entry.ids.numel()]):
                entry.path.unlink(missing_ok=True)
                del self._entries[name]

    def _evict(self) -> None:
        """Delete the least recently used files of the whole folder until it fits its capacity."""
        files = []
        for folder in (item for item in os.scandir(self.root) if item.is_dir(follow_symlinks=False)):
            for item in os.scandir(folder.path):
                if item.name.endswith(SUFFIX):
                    try:
                        status = item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    files.append((status.st_mtime, status.st_size, item.path))
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= self.capacity_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
        self.bytes = total
