"""One-row decode with no server around it: corechat's steps in process beside the peer's llama-bench.

`python bench/probes/step_beside_peer.py [--peer ik_llama.cpp] [--formats int8 int4] [--rounds 4] [--tokens 128] [--threads 2] [--name step-beside-peer]`

bench/versus.py compares two servers' one-stream decode; this compares what runs under them. Taking
turns round by round on the dev model and its GGUF files: corechat's decode steps in this process (one
sequence after a short chat's prompt, as the step probe's lone steps: no sampling, no delivery, no
HTTP), and the peer's own benchmark tool generating as many tokens from an empty context (llama-bench
-p 0 -n TOKENS, ik_llama.cpp with its server's -rtr). The two contexts differ by tens of tokens, which
a one-row step hardly feels. Beside versus.py's ratios it tells how much of a served gap is serving.
llama-bench is built into the peer's build folder the first time it is asked for.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import progress, save_results  # noqa: E402
from bench.peer import PEER_DIR, Toolchain, exclusive  # noqa: E402
from bench.peers import PEERS, prepare  # noqa: E402
from bench.probes import run_probe  # noqa: E402
from bench.probes.dev_model import built_dev_model, load_dev_runner  # noqa: E402
from bench.probes.step_probe import chat_prompt_ids, lone_steps  # noqa: E402
from bench.versus import PEER_QUANTIZATION  # noqa: E402


def llama_bench(toolchain: Toolchain) -> Path:
    """Return the peer's llama-bench, built in its configured build folder if it is not there yet."""
    binary = toolchain.build / "bin" / "llama-bench"
    # The lock every peer build takes (bench/peer.py: build_once).
    with exclusive(PEER_DIR / "build.lock"):
        if not binary.is_file():
            progress(f"building llama-bench in {toolchain.build}")
            subprocess.run(["cmake", "--build", str(toolchain.build), "--target", "llama-bench"], check=True,
                           stdout=subprocess.DEVNULL)
    return binary


def peer_tokens_per_second(binary: Path, gguf: Path, tokens: int, threads: int, repack: bool) -> float:
    """Return the tokens a second llama-bench generates from an empty context, one run."""
    command = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-r", "1", "-t", str(threads),
               "-o", "json", *(["-rtr", "1"] if repack else [])]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {finished.returncode}:\n{finished.stderr[-4000:]}")
    return float(json.loads(finished.stdout)[0]["avg_ts"])


def main() -> None:
    """Take the rounds for every format asked for and report each round's ratio."""
    parser = argparse.ArgumentParser(prog="python bench/probes/step_beside_peer.py", description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=PEERS, default="ik_llama.cpp")
    parser.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=sorted(PEER_QUANTIZATION))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="step-beside-peer", help="the results files' name")
    args = parser.parse_args()
    bandwidth = run_probe("bandwidth", "--threads", str(args.threads), "--megabytes", "1024")["bytes_per_second"]
    torch.set_num_threads(args.threads)
    peer = prepare(args.peer, built_dev_model())
    binary = llama_bench(peer.toolchain)
    repack = "-rtr" in peer.toolchain.server_options
    results = {"peer": args.peer, "peer_version": peer.version, "threads": args.threads, "tokens": args.tokens,
               "read_bytes_per_second": bandwidth, "formats": {}}
    lines = ["| corechat | peer | corechat, tok/s | peer, tok/s | corechat / peer, per round |", "|---|---|---|---|---|"]
    for fmt in args.formats:
        quantization = PEER_QUANTIZATION[fmt]
        runner, tokenizer = load_dev_runner(fmt)
        prompt_ids = chat_prompt_ids(tokenizer)
        lone_steps(runner, prompt_ids, 16)
        ours, theirs = [], []
        for number in range(args.rounds):
            ours.append(1 / lone_steps(runner, prompt_ids, args.tokens))
            theirs.append(peer_tokens_per_second(binary, peer.files[quantization], args.tokens, args.threads, repack))
            progress(f"{fmt} round {number + 1}: corechat {ours[-1]:.1f}, {args.peer} {theirs[-1]:.1f} tok/s")
        del runner
        results["formats"][fmt] = {"peer_quantization": quantization, "corechat": ours, "peer": theirs}
        ratios = ", ".join(f"{mine / other:.2f}x" for mine, other in zip(ours, theirs, strict=True))
        lines.append(f"| {fmt} | {quantization} | {statistics.median(ours):.1f} ({min(ours):.1f}-{max(ours):.1f}) | "
                     f"{statistics.median(theirs):.1f} ({min(theirs):.1f}-{max(theirs):.1f}) | {ratios} |")
    table = "\n".join([
        f"Qwen2.5-0.5B-shaped dev model, {args.threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(summing 1 GB on as many threads). {args.peer}: {peer.version}"
        f"{', repacked at load (-rtr)' if repack else ''}.", "",
        f"## One-row decode in process, {args.tokens} tokens a turn, {args.rounds} rounds taking turns", "",
        "corechat: the median of its decode steps in this process (one sequence, no sampling, no server); the "
        f"peer: llama-bench -p 0 -n {args.tokens} (tokens a second over the run). Medians (range over rounds).", "",
        *lines, ""])
    save_results(args.name, results, table)


if __name__ == "__main__":
    main()
