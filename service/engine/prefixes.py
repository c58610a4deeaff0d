"""Keep the KV state of recent prompts and replies where every worker of the host finds it.

A chat frontend resends the whole conversation every turn, and the kernel hands each turn to any
worker. So each stored sequence (a prompt at the end of its pass; prompt and reply at the end of a
generation) is a safetensors file (sequence_files.py) in a folder on tmpfs that all workers read.
A reader keeps only the files' token ids in memory, and maps a file only to copy its layers into a
sequence's pages, so a file deleted by eviction frees its memory at once. A writer writes a
temporary file and renames it into place, so a reader sees a whole file or none and never waits.
Eviction is least recently used over the whole folder, across models: a hit touches its file's time
(prefix_folder.py keeps the folder private and within its capacity and the filesystem's room).

Stored state is private to a scope (KvScope), as the response cache's replies are: each scope has
its own subfolder, named by a hash of the scope, of the model's: weights, weight format, runner
layout and the code that computes KV state. A prompt reuses only what its own scope stored, so how
many tokens one API key finds cached tells nothing of what another key sent. A request that asks
for no storage (Cache-Control: no-store) reads its scope's state and leaves none.

Beyond the host (SHARED_KV_TTL_SECONDS), a finished turn's file is also sent, from a background
thread, to a store every host reaches (service/cache/kvshare.py: Redis), under its folder's name.
Before a prompt is queued, its request's thread asks that store for the longest finished turn the
prompt continues that this host lacks: a turn ends just before its end-of-turn token (or one token
earlier, cut by max_tokens), so the candidates are the prompt's prefixes that stop there. What is
found is checked as a local file is and written into the host's folder; the engine's thread never
waits for the network.
"""

import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from .events import KvScope
from .prefix_folder import PrivateFolder, make_room, own_file, partial_name
from .sequence_files import SUFFIX, NotASequence, SequenceFormat, sequence_name, shape_bytes, write_sequence

log = logging.getLogger(__name__)

# Turns waiting to be sent beyond the host; more are dropped (sharing only saves recomputing).
SHARE_QUEUE = 8


class SharedPrefixes(Protocol):
    """Stored sequences' files shared beyond the host, by name; failures fail open (nothing found, nothing sent)."""

    def publish(self, name: str, data: memoryview) -> None:
        """Keep a stored sequence's file under a name for the other hosts."""

    def fetch(self, names: list[str]) -> tuple[str, bytes] | None:
        """Return the first of the names that is kept, and its file."""


def common_prefix_length(stored: torch.Tensor, prompt: torch.Tensor) -> int:
    """Return how many leading token ids two 1-D id tensors share."""
    length = min(stored.numel(), prompt.numel())
    differ = (stored[:length] != prompt[:length]).nonzero()
    return int(differ[0]) if differ.numel() else length


def touch(path: Path) -> None:
    """Mark a stored sequence used now (eviction goes least recently used first).

    The time is set to the nanosecond: the kernel's own file times are as coarse as its clock tick,
    and sequences stored within one tick would tie.
    """
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except FileNotFoundError:
        pass  # evicted meanwhile


@dataclass
class _ScopeFolder:
    """One scope's subfolder, and the token ids of its files as this worker last read them."""

    folder: PrivateFolder
    identity: tuple[int, int] | None = None
    ids: dict[str, torch.Tensor] = field(default_factory=dict)


class PrefixStore:
    """Stored sequences' KV state, shared by the workers of a host, capped in bytes for the folder."""

    def __init__(self, sequence_format: SequenceFormat, capacity_bytes: int, root: Path, model_key: str,
                 shared: SharedPrefixes | None = None, turn_end_ids: Iterable[int] = ()):
        """`shared` keeps finished turns beyond the host; `turn_end_ids` are the tokens a finished turn stops before."""
        self.format = sequence_format
        self.capacity_bytes = capacity_bytes
        self.root = PrivateFolder(root, parents=True)
        self.model_key = model_key
        self.enabled = capacity_bytes > 0 and self.root.identity() is not None
        self.shared = shared if self.enabled else None
        self.turn_end_ids = torch.tensor(sorted(set(turn_end_ids)), dtype=torch.int32)
        # Bytes of the stored files as this process last counted them (all models' files).
        self.bytes = 0
        # Prompts that found their prefix beyond the host.
        self.shared_hits = 0
        self._scopes: dict[str, _ScopeFolder] = {}
        self._lock = threading.Lock()  # the engine's thread and the request threads' fetches share these
        self._sharing: queue.Queue[tuple[Path, str]] = queue.Queue(maxsize=SHARE_QUEUE)
        self._sharer: threading.Thread | None = None

    def folder_name(self, scope: KvScope) -> str:
        """Return the name of a scope's subfolder, which is also its files' prefix in the shared store."""
        return f"{self.model_key}.{scope.tag}" if scope.tag else self.model_key

    def _folder(self, scope: KvScope) -> _ScopeFolder | None:
        """Return a scope's subfolder once the root and it are checked private (made if missing), else None.

        A subfolder that is not the one last seen (removed and made again) forgets the ids read from it.
        """
        if not self.enabled or self.root.identity() is None:
            return None
        name = self.folder_name(scope)
        with self._lock:
            entry = self._scopes.get(name)
            if entry is None:
                entry = self._scopes[name] = _ScopeFolder(PrivateFolder(self.root.path / name))
        identity = entry.folder.identity()
        if identity != entry.identity:
            with self._lock:
                entry.identity, entry.ids = identity, {}
        return entry if identity is not None else None

    def lookup(self, prompt_ids: list[int], scope: KvScope = KvScope()) -> tuple[list[torch.Tensor], int]:
        """Return every layer's stored KV state of the longest prefix of the prompt its scope stored, and its length.

        The tensors are views of a read-only mapping, in the layout their runner stored (at least the
        prefix's tokens); the caller copies what it needs and drops them. At least the prompt's last
        token is left out, since its logits are what the prompt pass is for.
        """
        entry = self._folder(scope) if len(prompt_ids) >= 2 else None
        if entry is None:
            return [], 0
        self._refresh(entry)
        prompt = torch.tensor(prompt_ids, dtype=torch.int32)
        matches = sorted(((common_prefix_length(ids, prompt), name) for name, ids in entry.ids.items()), reverse=True)
        for length, name in matches:
            if length < 1:
                break
            path = entry.folder.path / name
            try:
                layers = self.format.open_layers(path, entry.ids[name])
            except (OSError, NotASequence) as exc:  # evicted meanwhile, or not a file this store wrote
                log.debug("stored sequence %s skipped: %s", name, exc)
                entry.ids.pop(name, None)
                continue
            touch(path)
            return layers, min(length, len(prompt_ids) - 1)
        return [], 0

    def _refresh(self, entry: _ScopeFolder) -> None:
        """Read the ids of the files other workers stored in a scope's folder since the last look; forget
        the ones evicted."""
        names = set()
        try:
            for item in os.scandir(entry.folder.path):
                try:
                    if item.name.endswith(SUFFIX) and own_file(item.stat(follow_symlinks=False)):
                        names.add(item.name)
                except FileNotFoundError:
                    continue  # evicted since the folder was listed
        except FileNotFoundError:
            pass  # the folder itself is gone: nothing is stored
        for gone in entry.ids.keys() - names:
            del entry.ids[gone]
        for name in names - entry.ids.keys():
            try:
                entry.ids[name] = self.format.read_ids(entry.folder.path / name)
            except (OSError, NotASequence) as exc:
                log.debug("stored sequence %s skipped: %s", name, exc)

    def prefetch(self, prompt_ids: list[int], scope: KvScope = KvScope()) -> bool:
        """Ask the shared store for the longest finished turn of the scope that the prompt continues and this
        host lacks, and keep it in the host's folder; return whether one was kept. Called by the request's
        thread before the prompt is queued; fails open."""
        entry = self._folder(scope) if self.shared is not None and len(self.turn_end_ids) else None
        if entry is None:
            return False
        prompt = torch.tensor(prompt_ids, dtype=torch.int32)
        # A turn that stopped at its end-of-turn token holds the tokens before it; one cut by max_tokens all
        # but its last (never fed).
        at_ends = torch.isin(prompt, self.turn_end_ids).nonzero().flatten().tolist()
        ends = sorted({end - back for end in at_ends for back in (0, 1) if end - back > 1}, reverse=True)
        wanted = {}
        for length in ends:
            name = sequence_name(prompt[:length])
            if (entry.folder.path / name).exists():
                break  # this host has it, and every shorter candidate would be a shorter match
            wanted[f"{self.folder_name(scope)}/{name}"] = length
        if not wanted:
            return False
        found = self.shared.fetch(list(wanted))
        if found is None:
            return False
        shared_name, data = found
        return self._keep_fetched(entry, shared_name.rpartition("/")[2], data, prompt[:wanted[shared_name]])

    def _keep_fetched(self, entry: _ScopeFolder, name: str, data: bytes, ids: torch.Tensor) -> bool:
        """Write a file fetched from the shared store into a scope's folder if it is the sequence of `ids`."""
        fits, self.bytes = make_room(self.root.path, self.capacity_bytes, len(data))
        if not fits:
            return False
        path = entry.folder.path / name
        partial = path.with_name(partial_name(name))
        try:
            partial.write_bytes(data)
            if not torch.equal(self.format.read_ids(partial), ids):
                raise NotASequence("its token ids are not the prompt's")
            os.replace(partial, path)
        except (OSError, NotASequence) as exc:  # a full folder, a file that is not a stored sequence
            log.warning("a shared sequence's KV state could not be kept: %s", exc)
            partial.unlink(missing_ok=True)
            return False
        touch(path)
        with self._lock:
            self.shared_hits += 1
        return True

    def share(self, ids: list[int], scope: KvScope = KvScope()) -> None:
        """Send a stored sequence (a finished turn) beyond the host, from a background thread."""
        if self.shared is None or not scope.keep:
            return
        folder = self.folder_name(scope)
        path = self.root.path / folder / sequence_name(ids)
        if self._sharer is None:
            self._sharer = threading.Thread(target=self._send_shared, name="corechat-kv-share", daemon=True)
            self._sharer.start()
        try:
            self._sharing.put_nowait((path, f"{folder}/{path.name}"))
        except queue.Full:
            log.debug("sharing queue full: %s stays on this host", path.name)

    def _send_shared(self) -> None:
        """Send queued stored sequences' files, each mapped (never copied), until the process ends."""
        while True:
            path, name = self._sharing.get()
            try:
                with (open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping,
                      memoryview(mapping) as view):
                    self.shared.publish(name, view)
            except (FileNotFoundError, ValueError):
                pass  # evicted before it was sent, or empty
            except Exception:
                log.exception("a stored sequence could not be shared")

    def store(self, ids: list[int], shape: tuple[int, ...], layers: Iterable[Iterable[torch.Tensor]],
              scope: KvScope = KvScope()) -> None:
        """Keep the KV state of a sequence for its scope on every worker: each layer's, of `shape`, given as
        pieces taken one at a time (so no more than a piece is ever copied). A scope that keeps nothing
        stores nothing."""
        entry = self._folder(scope) if scope.keep and len(ids) >= 2 else None
        if entry is None:
            return
        key = torch.tensor(ids, dtype=torch.int32)
        name = sequence_name(key)
        path = entry.folder.path / name
        if path.exists():
            touch(path)
            return
        size = key.nbytes + self.format.layer_count * shape_bytes(shape, self.format.dtype)
        fits, self.bytes = make_room(self.root.path, self.capacity_bytes, size)
        if not fits:
            return
        partial = path.with_name(partial_name(name))
        try:
            write_sequence(partial, key, shape, self.format.dtype, layers, self.format.layer_count)
            os.replace(partial, path)
            touch(path)
            self._drop_extended(entry, key)
        except (OSError, ValueError) as exc:  # a full tmpfs: this sequence is not kept, serving goes on
            log.warning("a sequence's KV state could not be stored: %s", exc)
            partial.unlink(missing_ok=True)
        finally:
            _, self.bytes = make_room(self.root.path, self.capacity_bytes, 0)

    def _drop_extended(self, entry: _ScopeFolder, key: torch.Tensor) -> None:
        """Delete a scope's stored sequences the new one extends: they can never be the longest match again."""
        self._refresh(entry)
        for name, ids in list(entry.ids.items()):
            if ids.numel() < key.numel() and torch.equal(ids, key[: ids.numel()]):
                (entry.folder.path / name).unlink(missing_ok=True)
                del entry.ids[name]
