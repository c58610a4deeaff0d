"""Either peer of the benchmark ready to serve, llama.cpp's llama-server (bench/peer.py) or ik_llama.cpp's
(bench/ik_peer.py), built and given a model's GGUF files; and the command line that builds or converts.

    python -m bench.peers build [--peer ik_llama.cpp --source CLONE] [--isa avx2]
    python -m bench.peers convert MODEL_DIR [--peer ik_llama.cpp]

It stands above both peer modules, which share llama.cpp's helpers, so neither imports the other.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from bench import ik_peer
from bench.peer import ISA_OPTIONS, LLAMA_CPP_PYTHON_VERSION, Toolchain, build, convert

# The servers the benchmark compares corechat with: llama.cpp, and the fork tuned for CPUs.
PEERS = ("llama.cpp", "ik_llama.cpp")


@dataclass(frozen=True)
class Peer:
    """A peer ready to serve: its name in the tables, what was built, its build and its GGUF files by quantization."""

    name: str
    version: str
    toolchain: Toolchain
    files: dict[str, Path]


def prepare(name: str = "llama.cpp", model_dir: Path | None = None, *, isa: str = "native",
            source: Path | None = None) -> Peer:
    """Build the named peer (cached) and, given a model folder, its GGUF files of it (cached).

    ik_llama.cpp builds from `source`, a clone, or else is its latest build on this CPU; its files
    are quantized from llama.cpp's bf16 conversion, so llama.cpp is built too.
    """
    if name == "ik_llama.cpp":
        if isa != "native":
            raise ValueError("ik_llama.cpp is built for this CPU's own instruction sets only")
        toolchain = ik_peer.build(source)
        files = ik_peer.quantize(toolchain, convert(build(), model_dir)["bf16"]) if model_dir else {}
        return Peer(name, ik_peer.version_of(toolchain), toolchain, files)
    toolchain = build(isa=isa)
    return Peer(name, f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}", toolchain,
                convert(toolchain, model_dir) if model_dir else {})



def main() -> None:
    """Build a peer's tools, or convert a model folder with them."""
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    building = commands.add_parser("build", help="build llama-server, llama-quantize and llama-perplexity (cached)")
    building.add_argument("--isa", choices=sorted(ISA_OPTIONS), default="native",
                          help="avx2: at most AVX2, as on an AVX2-only CPU (llama.cpp only)")
    building.add_argument("--source", type=Path,
                          help="ik_llama.cpp: a clone (work tree or git dir) whose HEAD to build")
    converting = commands.add_parser("convert", help="convert a model folder to GGUF (cached)")
    converting.add_argument("model_dir", type=Path)
    for command in (building, converting):
        command.add_argument("--peer", choices=PEERS, default=PEERS[0], help="which server (default llama.cpp)")
    args = parser.parse_args()
    peer = prepare(args.peer, getattr(args, "model_dir", None), isa=getattr(args, "isa", "native"),
                   source=getattr(args, "source", None))
    if args.command == "build":
        print(json.dumps({"version": peer.version, "server": str(peer.toolchain.server),
                          "quantize": str(peer.toolchain.quantize)}))
    else:
        print(json.dumps({name: str(path) for name, path in peer.files.items()}))


if __name__ == "__main__":
    main()
