"""Time corechat's quantized products at prompt-pass row counts, every SIMD path this CPU runs,
against the path's peak multiply-add rate.

`python bench/probes/prompt_probe.py [--threads 1] [--rounds 5] [--formats int8 int4]` multiplies one
decoder layer's product shapes of the 0.5B dev model (q, k, v, o, gate, up, down; random weights)
by 1, 2, 128 and 512 rows of activations on each path (`avx2`, and `avx512_vnni` and `amx` where
the CPU has them), keeps each path's best round and reports multiply-adds per second, and that as a
fraction of the path's peak: torch.ops.corechat.peak_multiply_adds, the path's multiply-add
instructions alone on independent registers (512-bit vpdpbusd on avx512_vnni; the product's
maddubs, madd and add on avx2; on amx, tdpbssd of the product's shape, 16 rows x 16 outputs x 32
inputs, into four tiles), on as many threads. A prompt pass is these products at 128 rows
(PREFILL_CHUNK_TOKENS) plus attention. It prints a table and writes bench/results/<machine>/<name>.json and
.md, with the CPU, date and commit.
"""

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes.kernel_probe import LAYER_SHAPES, random_weight  # noqa: E402
from service.engine import kernels  # noqa: E402
from service.engine.quantized import FORMATS, QUANTIZE  # noqa: E402

ROWS = [1, 2, 128, 512]
PEAK_ITERATIONS = 2_000_000


def peak(path: str, threads: int, rounds: int) -> float:
    """Return a path's peak multiply-adds per second on `threads` threads, the best of `rounds`."""
    best = 0.0
    for _ in range(rounds):
        began = time.perf_counter()
        done = torch.ops.corechat.peak_multiply_adds(kernels.PATHS[path], PEAK_ITERATIONS, threads)
        best = max(best, done / (time.perf_counter() - began))
    return best


def measure(fmt, path: str, rows: int, weights, rounds: int) -> float:
    """Return the best round's seconds for one layer's products on one path."""
    generator = torch.Generator().manual_seed(rows)
    inputs = [torch.randn(rows, shape[1], generator=generator).to(torch.bfloat16) for shape in LAYER_SHAPES]
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for (outputs, _), (weight, scales), x in zip(LAYER_SHAPES, weights, inputs, strict=True):
            torch.ops.corechat.quantized_linear(x, weight, scales, None, fmt.code, outputs, False, kernels.PATHS[path])
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    """Measure, print the table and write the results files."""
    parser = argparse.ArgumentParser(prog="python bench/probes/prompt_probe.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=sorted(FORMATS))
    parser.add_argument("--name", default="prompt-products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load()
    generator = torch.Generator().manual_seed(0)
    paths = [path for path in ("avx2", "avx512_vnni", "amx") if path in kernels.available_paths()]
    peaks = {path: peak(path, args.threads, args.rounds) for path in paths}
    multiply_adds = sum(outputs * inputs for outputs, inputs in LAYER_SHAPES)
    figures = {}
    for name in args.formats:
        fmt = FORMATS[name]
        weights = [QUANTIZE[name](random_weight(outputs, inputs, generator)) for outputs, inputs in LAYER_SHAPES]
        for path in paths:
            figures[f"{name} {path}"] = {rows: multiply_adds * rows / measure(fmt, path, rows, weights, args.rounds)
                                         for rows in ROWS}
    lines = ["| format, path | peak | " + " | ".join(f"{rows} rows" for rows in ROWS) + " |",
             "|---|---|" + "---|" * len(ROWS)]
    for key, by_rows in figures.items():
        path_peak = peaks[key.split()[1]]
        lines.append(f"| {key} | {path_peak / 1e9:.0f} | " + " | ".join(
            f"{value / 1e9:.1f} ({value / path_peak:.2f})" for value in by_rows.values()) + " |")
    table = "\n".join([
        f"# {args.name}", "",
        f"{args.threads} thread(s); products of one 0.5B decoder layer, best of {args.rounds} rounds: G multiply-adds "
        "per second (fraction of the path's peak).", "", *lines, ""])
    save_results(args.name, {"threads": args.threads, "peak_gmacs": {path: value / 1e9 for path, value in peaks.items()},
                             "gmacs": {key: {str(rows): value / 1e9 for rows, value in by_rows.items()}
                                       for key, by_rows in figures.items()}}, table)


if __name__ == "__main__":
    main()
