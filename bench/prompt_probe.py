"""Time corechat's quantized products at prompt-pass row counts, every SIMD path this CPU runs.

`python bench/prompt_probe.py [--threads 1] [--rounds 5]` multiplies one decoder layer's product
shapes of the 0.5B dev model (q, k, v, o, gate, up, down; random weights) by 1, 2, 128 and 512
rows of activations on each path (`avx2`, and `avx512_vnni` where the CPU has it), keeps each
path's best round and reports multiply-adds per second. A prompt pass is these products at 128
rows (PREFILL_CHUNK_TOKENS) plus attention. It prints a table and writes
bench/results/<name>.json and .md, with the CPU, date and commit.
"""

import argparse
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from bench.kernel_probe import LAYER_SHAPES, random_weight  # noqa: E402
from service.engine import kernels  # noqa: E402
from service.engine.quantized import INT8, quantize_int8  # noqa: E402

ROWS = [1, 2, 128, 512]


def cpu_model() -> str:
    """Return the CPU's model name."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def measure(path: str, rows: int, weights, rounds: int) -> float:
    """Return the best round's seconds for one layer's products on one path."""
    generator = torch.Generator().manual_seed(rows)
    inputs = [torch.randn(rows, shape[1], generator=generator).to(torch.bfloat16) for shape in LAYER_SHAPES]
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for (outputs, _), (weight, scales), x in zip(LAYER_SHAPES, weights, inputs, strict=True):
            torch.ops.corechat.quantized_linear(x, weight, scales, None, INT8.code, outputs, False, kernels.PATHS[path])
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    """Measure, print the table and write the results files."""
    parser = argparse.ArgumentParser(prog="python bench/prompt_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="prompt-products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load()
    generator = torch.Generator().manual_seed(0)
    weights = [quantize_int8(random_weight(outputs, inputs, generator)) for outputs, inputs in LAYER_SHAPES]
    paths = [path for path in ("avx2", "avx512_vnni") if path in kernels.available_paths()]
    multiply_adds = sum(outputs * inputs for outputs, inputs in LAYER_SHAPES)
    figures = {path: {rows: multiply_adds * rows / measure(path, rows, weights, args.rounds) for rows in ROWS}
               for path in paths}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = {"cpu": cpu_model(), "threads": args.threads,
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit}
    table = "\n".join([
        f"# {args.name}", "",
        f"{machine['cpu']}, {args.threads} thread(s), {machine['date']}, commit {commit}; int8 products of one "
        "0.5B decoder layer, best of {args.rounds} rounds, G multiply-adds per second.".replace("{args.rounds}", str(args.rounds)),
        "", "| path | " + " | ".join(f"{rows} rows" for rows in ROWS) + " |", "|---|" + "---|" * len(ROWS),
        *(f"| {path} | " + " | ".join(f"{figures[path][rows] / 1e9:.1f}" for rows in ROWS) + " |" for path in paths), ""])
    save_results(args.name, {"machine": machine, "gmacs": {path: {str(rows): value / 1e9 for rows, value in by_rows.items()}
                                                             for path, by_rows in figures.items()}}, table)


if __name__ == "__main__":
    main()
