"""ik_llama.cpp as the benchmark's peer, without building it: its command line, its cache keys, and the
clone it builds from (a real git repository in a temporary folder)."""

import os
import subprocess
from pathlib import Path

import pytest

from bench import ik_peer
from bench.peer import Toolchain, server_command, shown_command
from bench.peers import prepare


def git(*args: str, cwd: Path) -> str:
    """Run git in a folder as a user with a name, returning its output."""
    return subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout.strip()


def hunk_side(marker: str) -> str:
    """Return PATCH's lines on one side of its hunk: "-" before it applies, "+" after."""
    hunk = ik_peer.PATCH.read_text().split("\n@@")[1].split("\n", 1)[1]
    return "".join(line[1:] + "\n" for line in hunk.splitlines() if line[:1] in (" ", marker))


@pytest.fixture()
def clone(tmp_path) -> Path:
    """Return a work tree with one commit (the patched file as the fork has it, and two more) and loose
    objects (no pack), as a test clone."""
    tree = tmp_path / "ik_llama.cpp"
    (tree / "examples" / "server").mkdir(parents=True)
    (tree / "common").mkdir()
    (tree / "CMakeLists.txt").write_text("project(ik)\n")
    (tree / "examples" / "server" / "index.html").write_text("<html>a web UI source</html>\n")
    (tree / "common" / "peg-parser.cpp").write_text(hunk_side("-"))
    git("init", "--quiet", cwd=tree)
    git("add", ".", cwd=tree)
    git("commit", "--quiet", "-m", "one", cwd=tree)
    return tree


def test_ik_server_repacks_at_load_and_gets_corechats_threads_slots_and_context(tmp_path):
    """The fork's server runs with -rtr and without a web UI, with the same threads, slots and context as llama.cpp."""
    command = server_command(tmp_path / "llama-server", tmp_path / "model-q4_0.gguf", port=8123, threads=2, slots=8,
                             context_per_slot=8192, options=ik_peer.SERVER_OPTIONS)
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--threads"] == options["--threads-batch"] == "2"
    assert options["--parallel"] == "8" and options["--ctx-size"] == str(8 * 8192)
    assert shown_command(command).endswith(" --webui none --jinja -rtr")
    assert "--no-webui" not in command  # llama.cpp's flag; the fork's server takes --webui none


def test_ik_build_is_keyed_by_commit_patch_and_cpu(tmp_path):
    """Another commit, another patch or another CPU builds again; the results name the commit and the patch."""
    commit = "8337e4cd3861406fc04e0854b1409cd1b027fbc9"
    toolchain = ik_peer.toolchain_for(commit, tmp_path, flags_key="cpukey")
    patch = ik_peer.patch_key()
    assert toolchain.build == tmp_path / f"build-ik_llama.cpp-8337e4cd3861-{patch}-cpukey"
    assert toolchain.source == tmp_path / f"ik_llama.cpp-8337e4cd3861-{patch}"
    assert toolchain.server_options == ik_peer.SERVER_OPTIONS
    assert ik_peer.commit_of(toolchain) == "8337e4cd3861"
    assert ik_peer.version_of(toolchain) == "8337e4cd3861 with bench/patches/ik_llama.cpp-malformed-utf8.patch"
    assert ik_peer.toolchain_for("0" * 40, tmp_path, flags_key="cpukey").build != toolchain.build
    assert ik_peer.toolchain_for(commit, tmp_path, flags_key="other").build != toolchain.build


def test_without_a_clone_the_latest_ik_build_on_this_cpu_serves(tmp_path):
    """No build says how to make one; of two finished builds the newer is taken, an unfinished one never."""
    with pytest.raises(RuntimeError, match="python -m bench.peers build --peer ik_llama.cpp --source CLONE"):
        ik_peer.latest_build(tmp_path)
    older, newer, unfinished = (ik_peer.toolchain_for(commit * 40, tmp_path) for commit in "abc")
    for toolchain in (older, newer):
        for binary in (toolchain.server, toolchain.quantize, toolchain.perplexity):
            binary.parent.mkdir(parents=True, exist_ok=True)
            binary.touch()
    unfinished.server.parent.mkdir(parents=True)
    unfinished.server.touch()
    os.utime(older.server, (1, 1))
    assert ik_peer.latest_build(tmp_path) == newer


def test_the_build_takes_the_commit_from_a_work_tree_or_a_git_dir(clone):
    """Both kinds of clone name the same HEAD commit."""
    head = git("rev-parse", "HEAD", cwd=clone)
    assert ik_peer.source_commit(clone) == ik_peer.source_commit(clone / ".git") == head
    assert ik_peer.is_git_dir(clone / ".git") and not ik_peer.is_git_dir(clone)


def test_unpacking_writes_the_commit_not_the_work_tree_and_applies_the_patch(clone, tmp_path):
    """Uncommitted edits are not built: the build is of the commit it records, with the patch it records."""
    (clone / "CMakeLists.txt").write_text("project(edited)\n")
    destination = tmp_path / "unpacked"
    ik_peer.unpack(clone, ik_peer.source_commit(clone), destination)
    assert (destination / "CMakeLists.txt").read_text() == "project(ik)\n"
    assert (destination / "examples" / "server" / "index.html").is_file()
    assert (destination / "common" / "peg-parser.cpp").read_text() == hunk_side("+")
    assert "step over it" in hunk_side("+") and "step over it" not in hunk_side("-")


def test_a_commit_the_patch_does_not_fit_is_not_built(clone, tmp_path):
    """A fork whose parser changed stops the build with what to check, rather than building unpatched."""
    (clone / "common" / "peg-parser.cpp").write_text("// rewritten upstream\n")
    git("commit", "--quiet", "-am", "rewrite", cwd=clone)
    with pytest.raises(RuntimeError, match="does not apply to ik_llama.cpp .*steps over malformed UTF-8"):
        ik_peer.unpack(clone, ik_peer.source_commit(clone), tmp_path / "unpacked")
    assert not (tmp_path / "unpacked").exists()


def test_files_a_clone_lacks_are_named_and_left_out(clone, tmp_path):
    """A mirror without some of its largest blobs still unpacks, leaving out (and naming) those files alone."""
    blob = git("rev-parse", "HEAD:examples/server/index.html", cwd=clone)
    (clone / ".git" / "objects" / blob[:2] / blob[2:]).unlink()
    commit = ik_peer.source_commit(clone / ".git")
    assert ik_peer.absent_files(clone / ".git", commit) == ["examples/server/index.html"]
    destination = tmp_path / "unpacked"
    ik_peer.unpack(clone / ".git", commit, destination)
    assert (destination / "CMakeLists.txt").is_file()
    assert not (destination / "examples" / "server" / "index.html").exists()


def test_ik_is_built_for_this_cpu_only(tmp_path):
    """An AVX2-at-most ik build is refused before anything is built, rather than run as a native one."""
    with pytest.raises(ValueError, match="this CPU's own instruction sets"):
        prepare("ik_llama.cpp", isa="avx2")
    assert Toolchain(tmp_path, tmp_path).server_options == ("--no-webui",)  # llama.cpp's stay its own
