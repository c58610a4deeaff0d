"""The benchmark's peer llama.cpp: its llama-server, llama-quantize and llama-perplexity built from source, the model
folder converted to GGUF, and the server run; ik_llama.cpp (bench/ik_peer.py) builds on these helpers,
and bench/peers.py prepares either.

    python -m bench.peers build [--isa avx2]     # build llama-server, llama-quantize and llama-perplexity (~10 min, cached)
    python -m bench.peers convert MODEL_DIR      # MODEL_DIR as bf16, q8_0 and q4_0 GGUF files (cached)
    python -m bench.peers build --peer ik_llama.cpp --source CLONE   # the fork's HEAD commit (~8 min, cached)
    python -m bench.peers convert MODEL_DIR --peer ik_llama.cpp      # llama.cpp's bf16, quantized by the fork

`bench/run.py --peer` calls both for llama.cpp, then starts llama-server beside corechat;
`bench/versus.py --peer ik_llama.cpp` runs the fork's latest build instead. Nothing of either is part of
the repository: llama.cpp's sources come from the llama-cpp-python sdist on PyPI (which vendors
llama.cpp), the fork's from a clone of https://github.com/ikawrakow/ik_llama.cpp, and the binaries and
GGUF files live under ~/.cache/corechat/peer/.
"""

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# The sdist whose vendored llama.cpp is the peer; bump it to compare with a newer llama.cpp.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
PEER_DIR = Path.home() / ".cache" / "corechat" / "peer"
# llama-perplexity scores the peer's formats for the quality benchmark (bench/quality.py).
BUILD_TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
# What a user picking llama.cpp for a CPU serves: 8 and 4 bits per weight, and q4_1 (a scale and a minimum
# per 32 weights) beside corechat's int4m.
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1")
# Only what the two targets need: no tests, examples, web UI download, HTTPS or shared libraries.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# llama-server's own flags beyond the shared ones (a fork whose server takes other flags names its own).
SERVER_OPTIONS = ("--no-webui",)
# The instruction sets a build may use: all this CPU has, or AVX2 at most (what an AVX2-only CPU
# runs, to compare corechat's AVX2 path on a CPU that also has AVX-512).
ISA_OPTIONS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"),
}
# On a CPU with AMX-INT8 this llama.cpp's AMX products (ggml-cpu/amx) crash llama-server at its
# warm-up (a segfault in ggml_backend_amx_mul_mat, seen on an Intel Xeon here; llama.cpp issue
# #20824, closed without a fix): a native build there is compiled without AMX, keeping every other
# path, its repacked q4_0 and q8_0 among them, and its folder says so.
WITHOUT_AMX = tuple(f"-DCMAKE_{language}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for language in ("C", "CXX"))


def progress(message: str) -> None:
    """Tell the person waiting what the peer's preparation is doing now."""
    print(f"[peer {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_flags_key(cpuinfo: str) -> str:
    """Return a short key for the CPU's instruction-set flags, which a native build depends on."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:12]
    return "unknown"


@contextmanager
def exclusive(lock_path: Path):
    """Hold a file lock, so two benchmarks started together build or convert once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class Toolchain:
    """A built llama.cpp or fork: its source tree (for the converter), its two binaries and how its server runs."""

    source: Path
    build: Path
    server_options: tuple[str, ...] = SERVER_OPTIONS

    @property
    def server(self) -> Path:
        """Return the llama-server binary."""
        return self.build / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        """Return the llama-quantize binary."""
        return self.build / "bin" / "llama-quantize"

    @property
    def perplexity(self) -> Path:
        """Return the llama-perplexity binary."""
        return self.build / "bin" / "llama-perplexity"

    @property
    def built(self) -> bool:
        """Tell whether every binary of BUILD_TARGETS exists."""
        return all((self.build / "bin" / target).is_file() for target in BUILD_TARGETS)


def leaves_out_amx(isa: str, cpuinfo: str) -> bool:
    """Tell whether a build for ISA_OPTIONS[isa] on this CPU is compiled WITHOUT_AMX."""
    return isa == "native" and "amx_int8" in cpuinfo.split()


def cmake_isa_options(isa: str, cpuinfo: str) -> tuple[str, ...]:
    """Return the instruction-set options of a build for ISA_OPTIONS[isa] on this CPU."""
    return (*ISA_OPTIONS[isa], *(WITHOUT_AMX if leaves_out_amx(isa, cpuinfo) else ()))


def toolchain_for(version: str = LLAMA_CPP_PYTHON_VERSION, root: Path = PEER_DIR, isa: str = "native",
                  cpuinfo: str | None = None) -> Toolchain:
    """Return where the given sdist's llama.cpp is (or will be) unpacked and built on this CPU (with ISA_OPTIONS[isa])."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    suffix = ("" if isa == "native" else f"-{isa}") + ("-no-amx" if leaves_out_amx(isa, cpuinfo) else "")
    return Toolchain(source=root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp",
                     build=root / f"build-{version}-{cpu_flags_key(cpuinfo)}{suffix}")


def build(version: str = LLAMA_CPP_PYTHON_VERSION, root: Path = PEER_DIR, isa: str = "native") -> Toolchain:
    """Download the sdist, unpack it and build BUILD_TARGETS, once per version, CPU and ISA_OPTIONS key."""

    def download() -> None:
        progress(f"downloading the llama-cpp-python {version} sdist from PyPI")
        downloads = root / "downloads"
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                        "--dest", str(downloads), f"llama-cpp-python=={version}"], check=True)
        with tarfile.open(downloads / f"llama_cpp_python-{version}.tar.gz") as sdist:
            sdist.extractall(root, filter="data")

    cpuinfo = Path("/proc/cpuinfo").read_text()
    return build_once(toolchain_for(version, root, isa, cpuinfo), root, download,
                      (*CMAKE_OPTIONS, *cmake_isa_options(isa, cpuinfo)),
                      f"{', '.join(BUILD_TARGETS)} (about 10 minutes on two cores)")


def build_once(toolchain: Toolchain, root: Path, fetch_source: Callable[[], None], cmake_options: tuple[str, ...],
               what: str) -> Toolchain:
    """Build BUILD_TARGETS of a toolchain's source once, under the peers' build lock: check the compilers
    before anything is fetched, fetch the source unless it is unpacked, configure, build on every core."""
    with exclusive(root / "build.lock"):
        if toolchain.built:
            return toolchain
        missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"building llama.cpp needs {' and '.join(missing)}: apt-get install cmake g++")
        if not toolchain.source.is_dir():
            fetch_source()
        progress(f"building {what} in {toolchain.build}")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(toolchain.source), "-B", str(toolchain.build), *generator, *cmake_options],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(toolchain.build), "--parallel", str(os.cpu_count() or 1),
                        "--target", *BUILD_TARGETS], check=True, stdout=subprocess.DEVNULL)
    return toolchain


def run_tool(command: list[str], **options) -> str:
    """Run one of llama.cpp's tools and return its output, raising with the end of it when the tool fails."""
    finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **options)
    if finished.returncode != 0:
        raise RuntimeError(f"{shown_command(command)} exited with {finished.returncode}:\n{finished.stdout[-4000:]}")
    return finished.stdout


def model_key(model_dir: Path) -> str:
    """Return a short key for a model folder's files, so a rebuilt model is converted again."""
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        path = model_dir / name
        stat = path.stat()
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update((model_dir / "config.json").read_bytes())
    return digest.hexdigest()[:12]


def converter_site(version: str, root: Path) -> Path:
    """Install what the converter imports and the bench's interpreter lacks into a folder of the peer's own.

    convert_hf_to_gguf.py imports sentencepiece before it looks for a sentencepiece vocabulary; it
    goes here rather than into corechat's requirements, as nothing of corechat needs it.
    """
    site = root / f"converter-site-{version}"
    if not (site / "sentencepiece").is_dir():
        progress("installing sentencepiece for llama.cpp's converter into " + str(site))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                        "sentencepiece==0.2.3"], check=True)
    return site


def convert(toolchain: Toolchain, model_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION,
            root: Path = PEER_DIR, *, outtype: str = "bf16",
            quantizations: tuple[str, ...] = QUANTIZATIONS) -> dict[str, Path]:
    """Convert a Hugging Face model folder with llama.cpp's own tools: an `outtype` GGUF (convert_hf_to_gguf.py's
    --outtype), then each quantization of it; return the files by name, the outtype's among them."""
    out_dir = root / "gguf" / f"{model_dir.name}-{model_key(model_dir)}-{version}"
    # Quantized from another outtype than bf16, a file is named by its source too, so neither replaces the other.
    source = "" if outtype == "bf16" else f"-from-{outtype}"
    files = {outtype: out_dir / f"model-{outtype}.gguf",
             **{name: out_dir / f"model-{name}{source}.gguf" for name in quantizations}}
    with exclusive(root / "convert.lock"):
        if not files[outtype].is_file():
            progress(f"converting {model_dir} to {outtype} GGUF with llama.cpp's convert_hf_to_gguf.py")
            out_dir.mkdir(parents=True, exist_ok=True)
            # The gguf package of the same vendored tree, so converter and format always agree.
            path = os.pathsep.join([str(toolchain.source / "gguf-py"), str(converter_site(version, root))])
            partial = files[outtype].with_suffix(".partial")
            run_tool([sys.executable, str(toolchain.source / "convert_hf_to_gguf.py"), str(model_dir),
                      "--outtype", outtype, "--outfile", str(partial)], env={**os.environ, "PYTHONPATH": path})
            partial.rename(files[outtype])
        for name in quantizations:
            if not files[name].is_file():
                progress(f"quantizing to {name} with llama-quantize")
                partial = files[name].with_suffix(".partial")
                run_tool([str(toolchain.quantize), str(files[outtype]), str(partial), name.upper()])
                partial.rename(files[name])
    return files


def server_command(server: Path, model: Path, *, port: int, threads: int, slots: int, context_per_slot: int,
                   options: tuple[str, ...] = SERVER_OPTIONS) -> list[str]:
    """Return llama-server's command line: corechat's threads and parallel sequences, each with corechat's context."""
    return [
        str(server), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(slots), "--ctx-size", str(slots * context_per_slot),
        *options,
    ]


def shown_command(command: list[str]) -> str:
    """Return a command line for the results: files by name, not by this machine's paths."""
    return " ".join(Path(arg).name if arg.startswith("/") else arg for arg in command)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Block until llama-server answers /health with 200 (it answers 503 while it loads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server not healthy after {timeout} s")


class LlamaServer:
    """llama-server on a free loopback port, serving one GGUF file."""

    def __init__(self, toolchain: Toolchain, model: Path, log_dir: Path, *, port: int, threads: int, slots: int,
                 context_per_slot: int):
        self.command = server_command(toolchain.server, model, port=port, threads=threads, slots=slots,
                                      context_per_slot=context_per_slot, options=toolchain.server_options)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"llama-server-{port}.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> "LlamaServer":
        """Start llama-server and wait until it serves."""
        # In the log's folder, as ik_llama.cpp's server writes a llama.log of its own into its working folder.
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=self.log_path.parent)
        try:
            wait_healthy(self.url, self.process, timeout)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}; its log:\n{self.log_path.read_text(errors='replace')[-4000:]}") from None
        return self

    def pids(self) -> list[int]:
        """Return the server's process (it runs in one)."""
        return [self.process.pid]

    def stop(self, timeout: float = 30) -> None:
        """Stop the server."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
