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
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from .kvcache import build_cache, cache_layers

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


@dataclass
class _Entry:
    """One stored sequence as a reader maps it."""

    path: Path
    ids: torch.Tensor
    file: object  # safetensors' handle: get_tensor returns views of the mapped file


class PrefixStore:
    """Stored sequences' KV state, shared by the workers of a host, capped in bytes for the folder."""

    def __init__(self, config, capacity_bytes: int, root: Path, model_key: str):
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.root = root
        self.folder = root / model_key
        self.enabled = capacity_bytes > 0 and private_folder(root) and private_folder(self.folder)
        # Bytes of the stored files as this worker last counted them (all models' files).
        self.bytes = 0
        self._entries: dict[str, _Entry] = {}

    def lookup(self, prompt_ids: list[int]) -> tuple[DynamicCache | None, int]:
        """Return a cache holding the longest stored prefix of the prompt, and its length.

        At least the prompt's last token is left out, since its logits are what the prompt pass is for.
        """
        if not self.enabled or len(prompt_ids) < 2:
            return None, 0
        self._refresh()
        prompt = torch.tensor(prompt_ids, dtype=torch.int32)
        best, best_length = None, 0
        for entry in self._entries.values():
            length = common_prefix_length(entry.ids, prompt)
            if length > best_length:
                best, best_length = entry, length
        best_length = min(best_length, len(prompt_ids) - 1)
        if best is None or best_length <= 0:
            return None, 0
        touch(best.path)
        layers = [(best.file.get_tensor(f"keys.{index}")[:, :, :best_length],
                   best.file.get_tensor(f"values.{index}")[:, :, :best_length])
                  for index in range(self.config.num_hidden_layers)]
        # Views of a read-only mapping, never written: the sequence's first append copies them
        # into room of its own (kvcache.py).
        return build_cache(self.config, layers), best_length

    def store(self, ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV state of a sequence for every worker (each layer's keys and values hold exactly `ids`)."""
        if not self.enabled or len(ids) < 2:
            return
        key = torch.tensor(ids, dtype=torch.int32)
        name = hashlib.sha256(key.numpy().tobytes()).hexdigest()[:32] + SUFFIX
        path = self.folder / name
        if path.exists():
            touch(path)
            return
        size = key.nbytes + sum(keys.nbytes + values.nbytes for keys, values in layers)
        if size > self.capacity_bytes:
            return
        if not self.folder.is_dir() and not (private_folder(self.root) and private_folder(self.folder)):
            return  # the folder was removed (a tmpfs cleaned up) and cannot be made again
        tensors = {"ids": key}
        for index, (keys, values) in enumerate(layers):
            tensors[f"keys.{index}"] = keys.contiguous()
            tensors[f"values.{index}"] = values.contiguous()
        partial = path.with_name(f".{name}.{os.getpid()}.partial")
        try:
            save_file(tensors, partial)
            os.replace(partial, path)
            touch(path)
        except OSError as exc:  # a full tmpfs: this sequence is not kept, serving goes on
            log.warning("a sequence's KV state could not be stored: %s", exc)
            partial.unlink(missing_ok=True)
            return
        self._drop_extended(key)
        self._evict()

    def store_cache(self, ids: list[int], cache: DynamicCache) -> None:
        """Keep the KV state a one-row cache holds (exactly `ids`)."""
        self.store(ids, cache_layers(cache))

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
