"""The prefix store under its faults: a tmpfs that fills, evicted files an idle worker mapped, a folder
removed and made again by someone else, half-written files of a killed worker, forged entries from
the shared store; and its scopes, which keep each caller's state apart.

The small filesystems are real tmpfs mounts (root, as CI runs); the shared store is a real Redis.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from service.cache.kvshare import RedisPrefixes
from service.engine import KvScope
from service.engine.prefix_folder import MIN_FREE_FRACTION
from service.engine.prefixes import PrefixStore
from service.engine.sequence_files import (
    ENGINE_DIR,
    SequenceFormat,
    forward_code_version,
    sequence_name,
    write_sequence,
)

LAYERS = 2
END_OF_TURN = 9


def shape_of(tokens: int) -> tuple[int, ...]:
    """Return the shape one layer of `tokens` tokens is stored in (keys and values of 2 heads of 16)."""
    return 2, 2, tokens, 16


FORMAT = SequenceFormat(LAYERS, torch.bfloat16, shape_of)


def layers_of(tokens: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """Return random KV state of `tokens` tokens for every layer."""
    return [torch.randn(*shape_of(tokens)).to(dtype) for _ in range(LAYERS)]


def keep(store: PrefixStore, ids: list[int], scope: KvScope = KvScope()) -> None:
    """Store a sequence of random state, each layer one piece."""
    store.store(ids, shape_of(len(ids)), ([layer] for layer in layers_of(len(ids))), scope)


def sequence(first: int, tokens: int = 1000) -> list[int]:
    """Return a sequence of token ids of its own, starting with `first`."""
    return [first, *range(100, 100 + tokens - 1)]


@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a 4 MiB tmpfs, as a /run of little memory is."""
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def free_fraction(path: Path) -> float:
    """Return the share of a filesystem that is free."""
    fs = os.statvfs(path)
    return fs.f_bavail / fs.f_blocks


def test_a_tmpfs_smaller_than_the_capacity_keeps_storing_the_newest_and_leaves_room(small_tmpfs, caplog):
    """With PREFIX_CACHE_MB far above the filesystem, the store evicts to keep a tenth of it free, and
    every new sequence is still kept and found: it never fills the filesystem and stops."""
    store = PrefixStore(FORMAT, 1 << 30, small_tmpfs / "prefixes", "model")
    for first in range(1, 41):  # 40 sequences of ~260 KB each: 2.5 times the filesystem
        keep(store, sequence(first))
        assert store.lookup([*sequence(first), 0])[1] == 1000, first
        assert free_fraction(small_tmpfs) >= MIN_FREE_FRACTION - 0.01
    assert "could not be stored" not in caplog.text


def test_a_tmpfs_others_filled_stores_nothing_and_recovers_when_room_returns(small_tmpfs, caplog):
    store = PrefixStore(FORMAT, 1 << 30, small_tmpfs / "prefixes", "model")
    filler = small_tmpfs / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k", "count=58"], check=True, capture_output=True)
    keep(store, sequence(1))
    assert store.lookup([*sequence(1), 0]) == ([], 0)
    filler.unlink()
    keep(store, sequence(2))
    assert store.lookup([*sequence(2), 0])[1] == 1000


def mapped_paths() -> str:
    """Return this process's memory map."""
    return Path("/proc/self/maps").read_text()


def test_an_idle_reader_keeps_no_evicted_file_mapped(tmp_path):
    """A worker that read a sequence and then sat idle holds no mapping of it once another evicted it, so
    the folder's capacity bounds its memory."""
    probe = PrefixStore(FORMAT, 1 << 30, tmp_path / "probe", "model")
    keep(probe, sequence(1))
    size = probe.bytes
    writer = PrefixStore(FORMAT, 2 * size + size // 2, tmp_path / "prefixes", "model")
    reader = PrefixStore(FORMAT, 2 * size + size // 2, tmp_path / "prefixes", "model")
    keep(writer, sequence(1))
    layers, found = reader.lookup([*sequence(1), 0])
    assert found == 1000
    path = tmp_path / "prefixes" / "model" / sequence_name(sequence(1))
    assert str(path) in mapped_paths()  # mapped while its layers are held
    del layers
    keep(writer, sequence(2))
    keep(writer, sequence(3))
    assert not path.exists()
    assert str(path) not in mapped_paths()


def evicting_on_open(monkeypatch, path: Path) -> None:
    """Make the next opening of `path` lose the file between safetensors' reading of its header and
    torch's mapping of it by name (UntypedStorage.from_file), as when another worker evicts or replaces
    it in that moment."""
    real_from_file = torch.UntypedStorage.from_file

    def evict_then_map(filename, *args, **options):
        if Path(filename) == path and path.exists():
            path.unlink()
        return real_from_file(filename, *args, **options)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", evict_then_map)


@pytest.mark.parametrize("while_reading", ["ids", "layers"])
def test_a_file_evicted_while_a_worker_reads_it_is_skipped_not_a_failed_request(tmp_path, monkeypatch, while_reading):
    """Two workers under one prompt: one replaces a stored sequence (a longer one extends it) while the
    other opens it, to read its ids when it first sees the file or its layers when it takes them. The
    reader skips the file and computes the prompt, where torch's RuntimeError (the file gone when it
    mapped it by name) failed the request: a 500, seen under load in the supervisor and Sentinel tests."""
    writer = PrefixStore(FORMAT, 1 << 30, tmp_path / "prefixes", "model")
    reader = PrefixStore(FORMAT, 1 << 30, tmp_path / "prefixes", "model")
    keep(writer, sequence(1))
    path = tmp_path / "prefixes" / "model" / sequence_name(sequence(1))
    if while_reading == "layers":
        assert reader.lookup([*sequence(1), 0])[1] == 1000  # its ids read, the file known
    evicting_on_open(monkeypatch, path)
    assert reader.lookup([*sequence(1), 0]) == ([], 0)
    monkeypatch.undo()
    keep(writer, sequence(1))
    assert reader.lookup([*sequence(1), 0])[1] == 1000


def test_a_folder_removed_and_made_again_by_someone_else_is_never_read_or_written(tmp_path):
    """The prefix folder goes (a tmpfs cleaned while serving) and a folder others can write appears in its
    place, holding a planted sequence: the store neither reads it nor writes there, and uses its own
    folder again once that can be made."""
    root = tmp_path / "prefixes"
    store = PrefixStore(FORMAT, 1 << 30, root, "model")
    keep(store, sequence(1))
    assert store.lookup([*sequence(1), 0])[1] == 1000
    shutil.rmtree(root)
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    (root / "model").mkdir(mode=0o777)
    planted = sequence(2)
    write_sequence(root / "model" / sequence_name(planted), torch.tensor(planted, dtype=torch.int32),
                   shape_of(1000), torch.bfloat16, ([layer] for layer in layers_of(1000)), LAYERS)
    assert store.lookup([*planted, 0]) == ([], 0)
    keep(store, sequence(3))
    assert not (root / "model" / sequence_name(sequence(3))).exists()
    shutil.rmtree(root)
    keep(store, sequence(4))
    assert store.lookup([*sequence(4), 0])[1] == 1000
    assert oct(root.stat().st_mode & 0o777) == "0o700"


def test_a_folder_made_again_by_another_user_is_never_used(tmp_path):
    if os.getuid() != 0:
        pytest.skip("handing a folder to another user needs root (CI runs as root)")
    root = tmp_path / "prefixes"
    store = PrefixStore(FORMAT, 1 << 30, root, "model")
    keep(store, sequence(1))
    shutil.rmtree(root)
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    keep(store, sequence(2))
    assert store.lookup([*sequence(2), 0]) == ([], 0)
    assert list(root.iterdir()) == []


def test_a_killed_writers_half_written_file_is_swept_and_a_live_ones_counted(tmp_path):
    store = PrefixStore(FORMAT, 1 << 30, tmp_path, "model")
    keep(store, sequence(1))
    folder = tmp_path / "model"
    dead = folder / f".{sequence_name(sequence(5))}.4194999.partial"  # above any pid_max: no such process
    live = folder / f".{sequence_name(sequence(6))}.{os.getpid()}.partial"
    dead.write_bytes(b"\0" * 50_000)
    live.write_bytes(b"\0" * 70_000)
    stored = store.bytes
    keep(store, sequence(2))
    assert not dead.exists() and live.exists()
    assert store.bytes == 2 * stored + 70_000


def test_each_scope_finds_only_what_it_stored_and_a_scope_that_keeps_nothing_stores_nothing(tmp_path):
    store = PrefixStore(FORMAT, 1 << 30, tmp_path, "model")
    alice, bob = KvScope("key:alice"), KvScope("key:bob")
    keep(store, sequence(1), alice)
    assert store.lookup([*sequence(1), 0], alice)[1] == 1000
    assert store.lookup([*sequence(1), 0], bob) == ([], 0)
    assert store.lookup([*sequence(1), 0]) == ([], 0)
    before = sorted(tmp_path.rglob("*.safetensors"))
    keep(store, sequence(2), KvScope("key:alice", keep=False))
    assert sorted(tmp_path.rglob("*.safetensors")) == before
    assert store.lookup([*sequence(2), 0], alice) == ([], 0)


def forged_files(ids: list[int]) -> dict[str, bytes]:
    """Return files that name themselves the sequence of `ids` but are not a stored sequence of FORMAT."""
    key = torch.tensor(ids, dtype=torch.int32)
    tokens = len(ids)
    forged = {}
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"forged-{os.getpid()}.safetensors"
    cases = {
        "a layer missing": {"ids": key, "layer.0": layers_of(tokens)[0]},
        "a layer too many": {"ids": key, **{f"layer.{index}": layers_of(tokens)[0] for index in range(LAYERS + 1)}},
        "float32 layers": {"ids": key, **{f"layer.{index}": layer for index, layer in
                                          enumerate(layers_of(tokens, torch.float32))}},
        "a shorter shape": {"ids": key, **{f"layer.{index}": layer for index, layer in
                                           enumerate(layers_of(tokens - 1))}},
        "other ids": {"ids": key + 1, **{f"layer.{index}": layer for index, layer in enumerate(layers_of(tokens))}},
    }
    for name, tensors in cases.items():
        save_file({key: value.contiguous() for key, value in tensors.items()}, str(scratch))
        forged[name] = scratch.read_bytes()
    scratch.unlink()
    return forged


@pytest.mark.parametrize("case", ["a layer missing", "a layer too many", "float32 layers", "a shorter shape",
                                  "other ids"])
def test_a_forged_entry_in_the_shared_store_is_never_kept(tmp_path, redis_server, case):
    shared = RedisPrefixes(redis_server.url, ttl_seconds=60, max_bytes=1 << 30, connect_timeout=1.0,
                           socket_timeout=5.0)
    store = PrefixStore(FORMAT, 1 << 30, tmp_path, "model", shared=shared, turn_end_ids=[END_OF_TURN])
    turn = sequence(1, 200)
    shared.publish(f"{store.folder_name(KvScope())}/{sequence_name(turn)}", memoryview(forged_files(turn)[case]))
    assert not store.prefetch([*turn, END_OF_TURN, 5])
    assert list(tmp_path.rglob("*.safetensors")) == []
    assert store.lookup([*turn, END_OF_TURN, 5]) == ([], 0)


def test_a_turn_in_the_shared_store_is_fetched_before_queueing_and_only_in_its_scope(tmp_path, redis_server):
    shared = RedisPrefixes(redis_server.url, ttl_seconds=60, max_bytes=1 << 30, connect_timeout=1.0,
                           socket_timeout=5.0)
    home = PrefixStore(FORMAT, 1 << 30, tmp_path / "home", "model", shared=shared, turn_end_ids=[END_OF_TURN])
    away = PrefixStore(FORMAT, 1 << 30, tmp_path / "away", "model", shared=shared, turn_end_ids=[END_OF_TURN])
    alice, bob = KvScope("key:alice"), KvScope("key:bob")
    turn = sequence(1, 200)
    keep(home, turn, alice)
    stored = home.root.path / home.folder_name(alice) / sequence_name(turn)
    shared.publish(f"{home.folder_name(alice)}/{stored.name}", memoryview(stored.read_bytes()))
    prompt = [*turn, END_OF_TURN, 5]
    assert not away.prefetch(prompt, bob) and away.lookup(prompt, bob) == ([], 0)
    assert away.prefetch(prompt, alice)
    assert away.lookup(prompt, alice)[1] == 200
    assert not away.prefetch(prompt, alice)  # this host has it now: no second fetch



def test_stored_kv_state_is_named_by_the_code_that_computes_it(tmp_path):
    """A release whose forward code differs (a kernel's C++, the engine's Python) names its stored KV state
    otherwise, so it never continues from an older release's, on this host or through Redis."""
    engine = tmp_path / "engine"
    shutil.copytree(ENGINE_DIR, engine, ignore=shutil.ignore_patterns("__pycache__"))
    assert forward_code_version(engine) == forward_code_version()
    for changed in (engine / "kernels" / "csrc" / "kernels.h", engine / "qwen2.py"):
        before = forward_code_version(engine)
        changed.write_text(changed.read_text() + "\n// another release\n")
        assert forward_code_version(engine) != before, changed.name
