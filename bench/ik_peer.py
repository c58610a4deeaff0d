"""ik_llama.cpp (the CPU-tuned llama.cpp fork) as the benchmark's peer: built from a clone, fed the
same model folder as llama.cpp.

    python -m bench.peers build --peer ik_llama.cpp --source CLONE    # a work tree or a git dir (~8 min, cached)
    python -m bench.peers convert MODEL_DIR --peer ik_llama.cpp      # q8_0 and q4_0 with ik's llama-quantize

The build is of the clone's HEAD commit, unpacked with `git archive` (uncommitted changes are not
built), with one patch, PATCH, and is cached under ~/.cache/corechat/peer/ by the commit, the patch
and the CPU's flags. The patch only keeps the fork's chat endpoint alive on the dev model's replies:
they hold malformed UTF-8, which the fork's chat parser fails on and its server aborts at (the patch
says more); llama.cpp steps over such bytes, and with the patch the fork does too. The GGUF files
come from llama.cpp's own bf16 conversion of the folder (bench/peer.py), quantized by the fork's
llama-quantize, as a user of the fork would. Its server renders the model's own chat template
(--jinja, llama.cpp's default and not the fork's) and repacks the weights into its interleaved
layouts at load time (-rtr), the fork's advice for CPU inference.
"""

import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from bench.peer import (
    PEER_DIR,
    QUANTIZATIONS,
    Toolchain,
    build_once,
    cpu_flags_key,
    exclusive,
    progress,
    run_tool,
)

NAME = "ik_llama.cpp"
# llama-server and llama-quantize live under examples/ in the fork, so the examples are configured
# (only the two targets are built); the flash-attention kernels for quantized KV caches are left
# out, as the benchmark's cache is f16 and they only add build time.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_SERVER_SSL=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_IQK_FA_ALL_QUANTS=OFF",
)
# No web UI; the model's own chat template, as llama.cpp and corechat render it (the fork's built-in
# ChatML leaves out Qwen's default system message); -rtr repacks q8_0 and q4_0 into the interleaved
# rows the fork's CPU kernels read.
SERVER_OPTIONS = ("--webui", "none", "--jinja", "-rtr")
PATCH = Path(__file__).resolve().parent / "patches" / "ik_llama.cpp-malformed-utf8.patch"


def patch_key() -> str:
    """Return a short key for PATCH's text, so an edited patch builds again."""
    return hashlib.sha256(PATCH.read_bytes()).hexdigest()[:8]


def is_git_dir(source: Path) -> bool:
    """Tell whether `source` is a git directory itself (a bare clone or a mirror), not a work tree."""
    return (source / "HEAD").is_file() and (source / "objects").is_dir()


def git_command(source: Path) -> list[str]:
    """Return the git command line that reads `source`, a git directory or a work tree."""
    return ["git", f"--git-dir={source}"] if is_git_dir(source) else ["git", "-C", str(source)]


def source_commit(source: Path) -> str:
    """Return the commit a clone's HEAD names."""
    return subprocess.run([*git_command(source), "rev-parse", "--verify", "HEAD^{commit}"], capture_output=True,
                          text=True, check=True).stdout.strip()


def toolchain_for(commit: str, root: Path = PEER_DIR, flags_key: str | None = None) -> Toolchain:
    """Return where the fork's commit is (or will be) unpacked, patched and built on this CPU."""
    key = flags_key or cpu_flags_key(Path("/proc/cpuinfo").read_text())
    tree = f"{commit[:12]}-{patch_key()}"
    return Toolchain(source=root / f"{NAME}-{tree}", build=root / f"build-{NAME}-{tree}-{key}",
                     server_options=SERVER_OPTIONS)


def commit_of(toolchain: Toolchain) -> str:
    """Return the (short) commit a toolchain was built from, as its folder names it."""
    return toolchain.build.name.removeprefix(f"build-{NAME}-").split("-")[0]


def version_of(toolchain: Toolchain) -> str:
    """Return what a toolchain runs, for the results: the commit and the patch."""
    return f"{commit_of(toolchain)} with bench/patches/{PATCH.name}"


def latest_build(root: Path = PEER_DIR) -> Toolchain:
    """Return the fork's most recent finished build (with today's PATCH) on this CPU, or say how to make one."""
    key = cpu_flags_key(Path("/proc/cpuinfo").read_text())
    built = [toolchain_for(commit_of(Toolchain(source=root, build=folder)), root, key)
             for folder in root.glob(f"build-{NAME}-*-{patch_key()}-{key}")]
    built = [toolchain for toolchain in built if toolchain.built]
    if not built:
        raise RuntimeError(f"no {NAME} build on this CPU: python -m bench.peers build --peer {NAME} --source CLONE "
                           "(a clone of https://github.com/ikawrakow/ik_llama.cpp)")
    return max(built, key=lambda toolchain: toolchain.server.stat().st_mtime)


def absent_files(source: Path, commit: str) -> list[str]:
    """Return the commit's files whose contents the clone lacks (a mirror or a partial clone may leave out
    its largest files: web UI sources and tokenizer test files, which the two targets do not read)."""
    listing = subprocess.run([*git_command(source), "ls-tree", "-r", "-z", commit], capture_output=True,
                             check=True).stdout
    blobs = [(meta.split()[2], path) for meta, _, path in (entry.partition(b"\t") for entry in listing.split(b"\0")
                                                            if entry) if meta.split()[1] == b"blob"]
    checked = subprocess.run([*git_command(source), "cat-file", "--batch-check"],
                             input=b"".join(sha + b"\n" for sha, _ in blobs), capture_output=True,
                             check=True).stdout.splitlines()
    return [path.decode() for (_, path), line in zip(blobs, checked, strict=True) if line.endswith(b" missing")]


def unpack(source: Path, commit: str, destination: Path) -> None:
    """Write the commit's files (not the work tree's) into `destination`, leaving out those the clone lacks,
    and apply PATCH."""
    absent = absent_files(source, commit)
    if absent:
        progress(f"leaving out {len(absent)} files absent from {source}: {', '.join(absent)}")
    partial = destination.with_name(destination.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    archive = subprocess.Popen([*git_command(source), "archive", "--format=tar", commit, "--",
                                *(f":(exclude,literal){path}" for path in absent)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tree:
        tree.extractall(partial, filter="data")
    errors = archive.stderr.read().decode(errors="replace")
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} in {source} exited with {archive.returncode}:\n{errors}")
    # The ceiling keeps git from taking a repository above the folder for the one to patch.
    patched = subprocess.run(["git", "apply", str(PATCH)], cwd=partial, capture_output=True, text=True,
                             env={**os.environ, "GIT_CEILING_DIRECTORIES": str(partial.parent)})
    if patched.returncode != 0:
        raise RuntimeError(f"{PATCH.name} does not apply to {NAME} {commit[:12]}: check whether the commit's "
                           f"common/peg-parser.cpp steps over malformed UTF-8 itself, then drop or redo the "
                           f"patch\n{patched.stderr}")
    partial.rename(destination)


def build(source: Path | None = None, root: Path = PEER_DIR) -> Toolchain:
    """Build BUILD_TARGETS of the clone's HEAD, once per commit and CPU; without a
    clone, return the latest build."""
    if source is None:
        return latest_build(root)
    commit = source_commit(source)
    toolchain = toolchain_for(commit, root)

    def fetch() -> None:
        progress(f"unpacking {NAME} {commit[:12]} from {source}")
        unpack(source, commit, toolchain.source)

    return build_once(toolchain, root, fetch, CMAKE_OPTIONS, f"{NAME} {commit[:12]} (about 8 minutes on two cores)")


def quantize(toolchain: Toolchain, bf16: Path, root: Path = PEER_DIR) -> dict[str, Path]:
    """Quantize llama.cpp's bf16 GGUF of a model folder with the fork's llama-quantize (cached beside it)."""
    out_dir = root / "gguf" / f"{bf16.parent.name}-{NAME}-{commit_of(toolchain)}"
    files = {name: out_dir / f"model-{name}.gguf" for name in QUANTIZATIONS}
    with exclusive(root / "convert.lock"):
        for name, path in files.items():
            if not path.is_file():
                progress(f"quantizing to {name} with {NAME}'s llama-quantize")
                out_dir.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(".partial")
                run_tool([str(toolchain.quantize), str(bf16), str(partial), name.upper()])
                partial.rename(path)
    return {"bf16": bf16, **files}
