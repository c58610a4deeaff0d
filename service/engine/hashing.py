"""A file's SHA-256, kept between starts in a small sidecar keyed by what identifies the file's bytes:
the model's fingerprint (loading.py) and a GGUF file's converted folder (gguf.py) are named by it."""

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

# A weight file's SHA-256 is kept in a small file of this suffix, beside it (or in the hashes folder
# where the model's folder is read-only), with what identifies the file's bytes: a restart reads
# it instead of hashing the whole file again.
HASH_SIDECAR_SUFFIX = ".corechat-sha256.json"


def file_identity(path: Path) -> dict[str, int]:
    """Return what changes whenever a file's bytes may have: its size, its inode and device, its
    mtime, and its ctime (which a write in place that restores the mtime still moves)."""
    stat = path.stat()
    return {"size": stat.st_size, "inode": stat.st_ino, "device": stat.st_dev, "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns}


def hash_sidecar(path: Path, hashes_dir: Path) -> Path:
    """Return where a file's hash is kept: beside it, or in hashes_dir (named by its real path) where
    its folder is read-only."""
    if os.access(path.parent, os.W_OK):
        return path.with_name(f".{path.name}{HASH_SIDECAR_SUFFIX}")
    real_path = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return hashes_dir / f"{real_path}-{path.name}{HASH_SIDECAR_SUFFIX}"


def file_sha256(path: Path, hashes_dir: Path) -> str:
    """Return the SHA-256 of a file's bytes, hashing them only where the kept hash is of another identity."""
    sidecar = hash_sidecar(path, hashes_dir)
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        lock = open(sidecar.with_name(f"{sidecar.name}.lock"), "w")  # noqa: SIM115 (held by the with below)
    except OSError as exc:
        log.warning("cannot keep the hash of %s in %s (%s); hashing it at every start", path, sidecar.parent, exc)
        return _hash_file(path)
    # Workers start together: one hashes while the others wait, then read what it kept.
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        identity = file_identity(path)
        try:
            kept = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            kept = {}
        if isinstance(kept, dict) and kept.get("identity") == identity and isinstance(kept.get("sha256"), str):
            return kept["sha256"]
        digest = _hash_file(path)
        # A file that changed while it was read has no hash of its own yet: keep nothing.
        if file_identity(path) == identity:
            temporary = sidecar.with_name(f"{sidecar.name}.{os.getpid()}.tmp")
            try:
                temporary.write_text(json.dumps({"identity": identity, "sha256": digest}))
                os.replace(temporary, sidecar)
            except OSError as exc:
                log.warning("cannot keep the hash of %s in %s (%s)", path, sidecar, exc)
                temporary.unlink(missing_ok=True)
    return digest


def _hash_file(path: Path) -> str:
    """Return the SHA-256 of a file's bytes, logging how long reading them took."""
    began = time.monotonic()
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    log.info("hashed %s (%d MB) in %.1f s", path, path.stat().st_size >> 20, time.monotonic() - began)
    return digest
