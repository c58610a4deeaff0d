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

Beyond the host (SHARED_KV_TTL_SECONDS), a finished turn's file is also sent, from a background
thread, to a store every host reaches (service/cache/kvshare.py: Redis). A prompt whose longest
local prefix is shorter than one a finished turn could have left asks that store for it: a turn
ends just before its end-of-turn token (or one token earlier, cut by max_tokens), so the
candidates are the prompt's prefixes that stop there; the longest found is written into this
host's folder and used from there.
"""

import hashlib
import json
import logging
import mmap
import os
import queue
import stat
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
# Turns waiting to be sent beyond the host; more are dropped (sharing only saves recomputing).
SHARE_QUEUE = 8


class SharedPrefixes(Protocol):
    """Stored sequences' files shared beyond the host, by name; failures fail open (nothing found, nothing sent)."""

    def publish(self, name: str, data: memoryview) -> None:
        """Keep a stored sequence's file under a name for the other hosts."""

    def fetch(self, names: list[str]) -> tuple[str, bytes] | None:
        """Return the first of the names that is kept, and its file."""


def sequence_name(ids) -> str:
    """Return the file name a sequence of token ids is stored under."""
    key = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int32)
    return hashlib.sha256(key.numpy().tobytes()).hexdigest()[:32] + SUFFIX


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


# safetensors' names of the dtypes a KV state is kept in.
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Return the bytes of a tensor of a shape and dtype."""
    count = dtype.itemsize
    for size in shape:
        count *= size
    return count


def write_sequence(path: Path, ids: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   layers: Iterable[Iterable[torch.Tensor]], layer_count: int) -> None:
    """Write a sequence as a safetensors file: its ids, then each layer's KV state (`layer.N` of `shape`),
    each layer given as pieces whose bytes follow each other, written as they come.

    safetensors' own writers take every tensor at once, which would hold a second copy of the
    sequence's whole KV state; the format is a little-endian header length, a JSON header and the
    tensors' bytes in its order, so it is written here piece by piece.
    """
    layer_bytes = shape_bytes(shape, dtype)
    header = {"ids": {"dtype": "I32", "shape": list(ids.shape), "data_offsets": [0, ids.nbytes]}}
    for index in range(layer_count):
        start = ids.nbytes + index * layer_bytes
        header[f"layer.{index}"] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                                    "data_offsets": [start, start + layer_bytes]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    written = 0
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.write(ids.numpy().data)
        for pieces in layers:
            size = 0
            for piece in pieces:
                if piece.dtype != dtype:
                    raise ValueError(f"a layer's KV state is {piece.dtype}, not {dtype}")
                size += piece.nbytes
                file.write(piece.contiguous().view(torch.uint8).numpy().data)
            if size != layer_bytes:
                raise ValueError(f"a layer's KV state is {size} bytes, not {layer_bytes} ({shape})")
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

    def __init__(self, config, capacity_bytes: int, root: Path, model_key: str, dtype: torch.dtype = torch.bfloat16,
                 shared: SharedPrefixes | None = None, turn_end_ids: Iterable[int] = ()):
        """`shared` keeps finished turns beyond the host; `turn_end_ids` are the tokens a finished turn stops before."""
        self.config = config
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.root = root
        self.model_key = model_key
        self.folder = root / model_key
        self.enabled = capacity_bytes > 0 and private_folder(root) and private_folder(self.folder)
        self.shared = shared if self.enabled else None
        self.turn_end_ids = frozenset(turn_end_ids)
        # Bytes of the stored files as this worker last counted them (all models' files).
        self.bytes = 0
        # Prompts that found their prefix beyond the host.
        self.shared_hits = 0
        self._entries: dict[str, _Entry] = {}
        self._sharing: queue.Queue[Path] = queue.Queue(maxsize=SHARE_QUEUE)
        self._sharer: threading.Thread | None = None

    def lookup(self, prompt_ids: list[int]) -> tuple[list[torch.Tensor], int]:
        """Return every layer's stored KV state of the longest stored prefix of the prompt, and its length.

        The tensors are views of a read-only mapping, in the layout their runner stored (at least the
        prefix's tokens); the caller copies what it needs. At least the prompt's last token is left
        out, since its logits are what the prompt pass is for.
        """
        if not self.enabled or len(prompt_ids) < 2:
            return [], 0
        self._refresh()
        prompt = torch.tensor(prompt_ids, dtype=torch.int32)
        best, best_length = self._longest(prompt)
        if self.shared is not None and self._fetch_longer(prompt, best_length):
            best, best_length = self._longest(prompt)
        best_length = min(best_length, len(prompt_ids) - 1)
        if best is None or best_length <= 0:
            return [], 0
        touch(best.path)
        layers = [best.file.get_tensor(f"layer.{index}") for index in range(self.config.num_hidden_layers)]
        return layers, best_length

    def _longest(self, prompt: torch.Tensor) -> tuple["_Entry | None", int]:
        """Return the mapped entry sharing the longest prefix with a prompt, and that length."""
        best, best_length = None, 0
        for entry in self._entries.values():
            length = common_prefix_length(entry.ids, prompt)
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    def _fetch_longer(self, prompt: torch.Tensor, local_length: int) -> bool:
        """Ask the shared store for the longest finished turn the prompt continues, longer than the local
        match; keep what it holds in this host's folder. Return whether something was kept."""
        # A turn that stopped at its end-of-turn token holds the tokens before it; one cut by max_tokens all
        # but its last (never fed).
        at_ends = torch.isin(prompt, torch.tensor(sorted(self.turn_end_ids), dtype=prompt.dtype)).nonzero().flatten()
        ends = sorted({end - back for end in at_ends.tolist() for back in (0, 1)}, reverse=True)
        ends = [length for length in ends if length > max(local_length, 1)]
        if not ends:
            return False
        names = {f"{self.model_key}/{sequence_name(prompt[:length])}": length for length in ends}
        found = self.shared.fetch(list(names))
        if found is None:
            return False
        name, data = found
        path = self.folder / name.rpartition("/")[2]
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            partial.write_bytes(data)
            with safe_open(str(partial), framework="pt") as file:
                if not torch.equal(file.get_tensor("ids"), prompt[:names[name]]):
                    raise ValueError("its token ids are not the prompt's")
            os.replace(partial, path)
        except Exception as exc:  # a full folder, a file that is not a stored sequence
            log.warning("a shared sequence's KV state could not be kept: %s", exc)
            partial.unlink(missing_ok=True)
            return False
        touch(path)
        self.shared_hits += 1
        self._refresh()
        self._evict()
        return True

    def share(self, ids: list[int]) -> None:
        """Send a stored sequence (a finished turn) beyond the host, from a background thread."""
        if self.shared is None:
            return
        path = self.folder / sequence_name(ids)
        if self._sharer is None:
            self._sharer = threading.Thread(target=self._send_shared, name="corechat-kv-share", daemon=True)
            self._sharer.start()
        try:
            self._sharing.put_nowait(path)
        except queue.Full:
            log.debug("sharing queue full: %s stays on this host", path.name)

    def _send_shared(self) -> None:
        """Send queued stored sequences' files, each mapped (never copied), until the process ends."""
        while True:
            path = self._sharing.get()
            try:
                with (open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping,
                      memoryview(mapping) as view):
                    self.shared.publish(f"{self.model_key}/{path.name}", view)
            except (FileNotFoundError, ValueError):
                pass  # evicted before it was sent, or empty
            except Exception:
                log.exception("a stored sequence could not be shared")

    def store(self, ids: list[int], shape: tuple[int, ...], layers: Iterable[Iterable[torch.Tensor]]) -> None:
        """Keep the KV state of a sequence for every worker: each layer's, of `shape`, given as pieces
        taken one at a time (so no more than a piece is ever copied)."""
        if not self.enabled or len(ids) < 2:
            return
        key = torch.tensor(ids, dtype=torch.int32)
        name = sequence_name(key)
        path = self.folder / name
        if path.exists():
            touch(path)
            return
        size = key.nbytes + self.config.num_hidden_layers * shape_bytes(shape, self.dtype)
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
