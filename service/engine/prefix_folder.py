"""The prefix store's folder on tmpfs: private to the service, checked before every use, kept within
its capacity and the filesystem's free space.

A folder another local user can write could hand workers forged keys and values. The folder is
made mode 0700 and checked (a directory of this user's that nobody else can write, not a link)
before each read or write, not only at start: a tmpfs cleaned while serving (logind's RemoveIPC,
tmpfiles) frees its path, and another user could make a folder there. Its files are checked too
(regular files of this user's).

Eviction is least recently used over every subfolder, and also makes room on the filesystem: /run
or /dev/shm is a share of RAM that other programs use, so the store never takes it below
MIN_FREE_FRACTION free. Half-written files (`.NAME.PID.partial`) count towards the capacity while
their writer lives and are deleted once it is gone.
"""

import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .sequence_files import SUFFIX

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
# The share of the filesystem the store leaves free for everything else on it.
MIN_FREE_FRACTION = 0.10
# A partial file untouched this long is a dead writer's even if its pid runs again (reused).
PARTIAL_MAX_AGE_SECONDS = 600


def private(status: os.stat_result) -> bool:
    """Tell whether a status is of a directory (not a link) of this user's that no one else can write."""
    return (stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid()
            and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def own_file(status: os.stat_result) -> bool:
    """Tell whether a status is of a regular file of this user's."""
    return stat.S_ISREG(status.st_mode) and status.st_uid == os.getuid()


def partial_name(name: str) -> str:
    """Return the name a file is written under before it is renamed into place (hidden, with the writer's pid)."""
    return f".{name}.{os.getpid()}{PARTIAL_SUFFIX}"


def writer_alive(name: str) -> bool:
    """Tell whether the process that is writing a partial file still runs."""
    try:
        os.kill(int(name[: -len(PARTIAL_SUFFIX)].rpartition(".")[2]), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # someone's process, not ours: the pid was reused; the file is swept by age below
    return True


class PrivateFolder:
    """A folder made mode 0700 if missing, used only while it is this user's private folder."""

    def __init__(self, path: Path, parents: bool = False):
        self.path = path
        self.parents = parents
        self._refused = False

    def identity(self) -> tuple[int, int] | None:
        """Make the folder if it is missing; return its (device, inode) if it is private, else None.

        A folder replaced since the last call has another identity: whoever holds what it read from
        the old one must forget it.
        """
        try:
            self.path.mkdir(mode=0o700, parents=self.parents, exist_ok=True)
            status = self.path.lstat()
        except OSError as exc:
            self._refuse(f"cannot be made: {exc}")
            return None
        if not private(status):
            self._refuse("is not this user's private folder")
            return None
        if self._refused:
            log.info("prefix store folder %s is usable again", self.path)
        self._refused = False
        return status.st_dev, status.st_ino

    def _refuse(self, why: str) -> None:
        """Log, once until it is usable again, why the folder is not used."""
        if not self._refused:
            log.warning("prefix store folder %s %s; prefix reuse is off while it is", self.path, why)
        self._refused = True


@dataclass
class FolderUse:
    """What the store's files take: their bytes (stored and being written) and the filesystem's free bytes."""

    stored_bytes: int
    free_bytes: int
    reserve_bytes: int


def sweep_and_list(root: Path) -> tuple[list[tuple[int, int, str]], int]:
    """Delete dead writers' partial files under root's subfolders; return the stored files as (time, size,
    path), and the bytes of the partial files still being written."""
    stored, writing = [], 0
    now = time.time()
    for folder in os.scandir(root):
        if not folder.is_dir(follow_symlinks=False):
            continue
        for item in os.scandir(folder.path):
            try:
                status = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not own_file(status):
                continue
            if item.name.endswith(SUFFIX):
                stored.append((status.st_mtime_ns, status.st_size, item.path))
            elif item.name.endswith(PARTIAL_SUFFIX):
                if writer_alive(item.name) and now - status.st_mtime < PARTIAL_MAX_AGE_SECONDS:
                    writing += status.st_size
                else:
                    Path(item.path).unlink(missing_ok=True)
    return stored, writing


def folder_use(root: Path, stored_bytes: int) -> FolderUse:
    """Return the bytes stored and the filesystem's free bytes and reserve under root."""
    fs = os.statvfs(root)
    return FolderUse(stored_bytes, fs.f_bavail * fs.f_frsize, int(fs.f_blocks * fs.f_frsize * MIN_FREE_FRACTION))


def make_room(root: Path, capacity_bytes: int, room: int) -> tuple[bool, int]:
    """Delete the least recently used stored files under root until `room` more bytes fit both the capacity
    and the filesystem's free space above its reserve; return whether they fit, and the bytes left stored.

    Called with room 0 it only evicts down to the capacity (and sweeps dead writers' partial files).
    """
    try:
        files, writing = sweep_and_list(root)
        files.sort()
        total = writing + sum(size for _, size, _ in files)
        use = folder_use(root, total)
        for _, size, path in files:
            if total + room <= capacity_bytes and use.free_bytes - room >= use.reserve_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
            use = folder_use(root, total)
        return total + room <= capacity_bytes and use.free_bytes - room >= use.reserve_bytes, total
    except OSError as exc:
        log.warning("prefix store folder %s could not be evicted: %s", root, exc)
        return False, 0
