"""corechat's C++ kernels (quantized products, decode attention), built from source for this CPU.

The sources in csrc/ compile with the system's g++ against the installed torch into one shared
library that registers torch.ops.corechat. A build is keyed by the sources, torch's version, the
compiler's and the instruction sets this CPU has, so a virtualenv copied to another CPU builds
again instead of dying on an illegal instruction. `make setup` and deploy/install.sh build into the virtualenv
(`python -m service.engine.kernels`); a worker that finds no build for its CPU there builds one,
into the virtualenv if it may write there, else into the fallback folder it is given.
"""

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIBRARY_NAME = "libcorechat_kernels.so"
COMPILER = "g++"
COMMON_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-Wall")
BASELINE_SOURCES = ("reference.cpp",)
# The torch operators (ATen and torch's headers).
OPERATOR_SOURCES = ("ops.cpp", "layer.cpp", "sampling.cpp")
# at::parallel_for is a header template: built without OpenMP it runs every range on one thread.
# The library links the libgomp torch ships (found through torch's lib folder), never a second one.
OPS_FLAGS = ("-fopenmp",)
LINK_LIBRARIES = ("-lc10", "-ltorch_cpu", "-l:libgomp.so.1")


@dataclass(frozen=True)
class InstructionSet:
    """A SIMD path: the /proc/cpuinfo flags it needs, how to compile for it, and its source."""

    name: str
    cpu_flags: tuple[str, ...]
    compiler_flags: tuple[str, ...]
    source: str
    # Attention's kernels alone: no product path of its own, never the flags the rest is built with.
    attention_only: bool = False


AVX2 = InstructionSet("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "avx2.cpp")
AVX512_VNNI = InstructionSet(
    "avx512_vnni",
    AVX2.cpu_flags + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    AVX2.compiler_flags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx512_vnni.cpp",
)
# AVX-512 VNNI's kernels with the prompt products' integer sums on the tile unit (amx.cpp).
AMX = InstructionSet(
    "amx",
    AVX512_VNNI.cpu_flags + ("amx_tile", "amx_int8"),
    AVX512_VNNI.compiler_flags + ("-mamx-tile", "-mamx-int8"),
    "amx.cpp",
)
# AVX-512's attention with the bfloat16 dot product (avx512_bf16.cpp): no product path of its own.
AVX512_BF16 = InstructionSet(
    "avx512_bf16",
    AVX512_VNNI.cpu_flags + ("avx512_bf16",),
    AVX512_VNNI.compiler_flags + ("-mavx512bf16",),
    "avx512_bf16.cpp",
    attention_only=True,
)
INSTRUCTION_SETS = (AVX2, AVX512_VNNI, AMX, AVX512_BF16)
# Numbers of the kernels' `path` arguments; avx512_bf16 is paged_attention's only.
PATHS = {"best": 0, "reference": 1, "avx2": 2, "avx512_vnni": 3, "amx": 4, "avx512_bf16": 5}
# A build runs while every worker of the host waits for it: a g++ that hangs must fail the build,
# not the whole service, and a builder that hangs where no timeout reaches must not hold the others
# forever. The bounds are far above a build's time on a small machine.
BUILD_TIMEOUT_SECONDS = 900
LOCK_WAIT_SECONDS = BUILD_TIMEOUT_SECONDS + 120

class KernelBuildFailed(RuntimeError):
    """The kernels could not be compiled or loaded on this machine."""


def cpu_flags() -> set[str]:
    """Return the instruction-set flags of this CPU (empty where /proc/cpuinfo has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def instruction_sets(flags: set[str]) -> list[InstructionSet]:
    """Return the SIMD paths this CPU runs (none off x86-64: the reference path serves alone)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return [isa for isa in INSTRUCTION_SETS if set(isa.cpu_flags) <= flags]


@functools.cache
def compiler_version(compiler: str) -> str:
    """Return what `compiler --version` prints (its release: another g++ may compile the same sources
    to other code)."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildFailed(f"`{compiler} --version` failed ({exc}); corechat's kernels are built and "
                                "looked up with g++ (Debian: apt-get install g++)") from exc


def build_key(sets: list[InstructionSet]) -> str:
    """Hash what decides the library: its sources, torch, the compiler, the paths compiled and their flags."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{torch.__version__}|{platform.machine()}|{COMMON_FLAGS}|{OPS_FLAGS}|{LINK_LIBRARIES}".encode())
    digest.update(compiler_version(COMPILER).encode())
    for isa in sets:
        digest.update(f"|{isa.name}:{isa.compiler_flags}".encode())
    return digest.hexdigest()[:16]


def virtualenv_dir() -> Path:
    """Return where `make setup` and deploy/install.sh put builds: inside the virtualenv."""
    return Path(sys.prefix) / "lib" / "corechat-kernels"


def _compile_commands(build_dir: Path, sets: list[InstructionSet],
                      source_dir: Path = SOURCE_DIR) -> tuple[list[list[str]], list[str]]:
    """Return the compile command of each object file and the link command."""
    torch_dir = Path(torch.__file__).resolve().parent
    # A build is this CPU's (build_key): the reference and the operators' element-wise loops (norms,
    # rotary, rounding activations) are compiled for its best instruction set, which vectorizes
    # them; without -ffast-math and with -ffp-contract=off their bits are the plain C++'s.
    products = [isa for isa in sets if not isa.attention_only]
    best = products[-1].compiler_flags if products else ()
    units = [(name, best) for name in BASELINE_SOURCES]
    units += [(isa.source, isa.compiler_flags) for isa in sets]
    defines = [f"-DCORECHAT_WITH_{isa.name.upper()}" for isa in sets]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    units += [(source, (*best, *OPS_FLAGS, abi, *defines, *includes)) for source in OPERATOR_SOURCES]
    compiles, objects = [], []
    for source, flags in units:
        target = build_dir / (Path(source).stem + ".o")
        compiles.append([COMPILER, *COMMON_FLAGS, *flags, "-c", str(source_dir / source), "-o", str(target)])
        objects.append(str(target))
    library_dir = torch_dir / "lib"
    link = [COMPILER, "-shared", *objects, "-o", str(build_dir / LIBRARY_NAME), f"-L{library_dir}", *LINK_LIBRARIES,
            f"-Wl,-rpath,{library_dir}"]
    return compiles, link


def build(target: Path, sets: list[InstructionSet], timeout_seconds: float = BUILD_TIMEOUT_SECONDS,
          source_dir: Path = SOURCE_DIR) -> None:
    """Compile the sources (in parallel) into target/LIBRARY_NAME, replacing it atomically; a build
    that takes longer than timeout_seconds is killed and fails. source_dir holds the sources (another
    revision's, renamed, for bench/probes/kernel_ab.py)."""
    target.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_seconds
    too_slow = KernelBuildFailed(f"building corechat's kernels took more than {timeout_seconds:g} s and was "
                                 f"stopped; is {COMPILER} hanging?")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as scratch:
        scratch_dir = Path(scratch)
        compiles, link = _compile_commands(scratch_dir, sets, source_dir)
        processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for command in compiles]
        failures = []
        try:
            for command, process in zip(compiles, processes, strict=True):
                output = process.communicate(timeout=max(0.0, deadline - time.monotonic()))[0].decode(errors="replace")
                if process.returncode != 0:
                    failures.append(f"{' '.join(command)}\n{output}")
        except subprocess.TimeoutExpired:
            raise too_slow from None
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        if failures:
            raise KernelBuildFailed("compiling corechat's kernels failed:\n" + "\n".join(failures))
        try:
            result = subprocess.run(link, capture_output=True, text=True, timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise too_slow from None
        if result.returncode != 0:
            raise KernelBuildFailed(f"linking corechat's kernels failed:\n{' '.join(link)}\n{result.stdout}{result.stderr}")
        os.replace(scratch_dir / LIBRARY_NAME, target / LIBRARY_NAME)


def wait_for_lock(lock, wait_seconds: float, holder: str) -> None:
    """Take an exclusive flock on an open file, waiting at most wait_seconds for `holder` to let it go."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise KernelBuildFailed(f"waited {wait_seconds:g} s for {holder} to finish; if nothing is building, "
                                        f"remove {lock.name}") from None
            time.sleep(0.2)


def build_once(directory: Path, sets: list[InstructionSet], *, build_timeout_seconds: float = BUILD_TIMEOUT_SECONDS,
               lock_wait_seconds: float = LOCK_WAIT_SECONDS) -> Path:
    """Build into `directory` unless it holds the library already, one process at a time; return the library."""
    directory.mkdir(parents=True, exist_ok=True)
    # Workers start together: one builds while the others wait for its library.
    with open(directory / ".lock", "w") as lock:
        wait_for_lock(lock, lock_wait_seconds, f"another process building corechat's kernels into {directory}")
        # build() makes its scratch folders under this lock: one found while holding it is a killed builder's.
        for leftover in directory.parent.glob(f".{directory.name}.*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if not (directory / LIBRARY_NAME).is_file():
            began = time.monotonic()
            log.info("building corechat's kernels for %s into %s", [isa.name for isa in sets] or ["reference"], directory)
            build(directory, sets, build_timeout_seconds)
            log.info("kernels built in %.1f s", time.monotonic() - began)
    return directory / LIBRARY_NAME


def _writable(directory: Path) -> bool:
    """Tell whether a folder exists writable or can be created."""
    while not directory.exists():
        directory = directory.parent
    return os.access(directory, os.W_OK)


def ensure_built(fallback_dir: Path | None = None) -> Path:
    """Return this CPU's library, building it first if no candidate folder holds it."""
    sets = instruction_sets(cpu_flags())
    key = build_key(sets)
    candidates = [virtualenv_dir() / key] + ([Path(fallback_dir).expanduser() / key] if fallback_dir else [])
    for directory in candidates:
        if (directory / LIBRARY_NAME).is_file():
            return directory / LIBRARY_NAME
    writable = [directory for directory in candidates if _writable(directory.parent)]
    if not writable:
        raise KernelBuildFailed(f"no build of corechat's kernels for this CPU in {candidates} and none of them "
                                "is writable; run `python -m service.engine.kernels` as their owner")
    return build_once(writable[0], sets)


@functools.cache
def load(fallback_dir: Path | None = None) -> Path:
    """Build if needed and load the kernels into torch.ops.corechat (once per process); return the library."""
    library = ensure_built(fallback_dir)
    torch.ops.load_library(str(library))
    return library


def available_paths() -> list[str]:
    """Return the kernel paths the loaded library runs on this CPU, best last."""
    return list(torch.ops.corechat.paths())


def attention_paths() -> list[str]:
    """Return the paths paged_attention runs on this CPU, best last (avx512_bf16 where it has the
    bfloat16 dot product)."""
    return list(torch.ops.corechat.attention_paths())


def use_path(name: str) -> list[str]:
    """Run `name`'s kernels wherever the best path would run ("best": the best this CPU runs); return
    the paths in use, the chosen one last. Raise ValueError for a path this library or CPU lacks."""
    paths = available_paths()
    if name != "best" and name not in paths:
        raise ValueError(f"kernel path {name} is not among this CPU's {', '.join(paths)}")
    in_use = torch.ops.corechat.use_path(PATHS[name])
    return paths[: paths.index(in_use) + 1]
