"""Time the working tree's products against another revision's, in one process, taking turns.

`python bench/probes/kernel_ab.py --against REV [--rows 1 2 8] [--formats int8 int4] [--path best]
[--threads 2] [--rounds 20]` builds the kernel sources of git revision REV with their operators
renamed (torch.ops.corechat_b), loads them beside the working tree's (torch.ops.corechat), and
runs one decode step's products of the 0.5B dev model's shapes (bench/probes/kernel_probe.py: 24
layers and the output layer, random weights, each its own memory) with each library in turn, the
order alternating round by round. A change to a kernel is then judged by the ratio of the two
step times taken moments apart on the same weights, which a shared machine's drift moves far less
than two runs' absolute figures. Where REV's service/engine/quantized.py is the working tree's, both
libraries multiply the very same weights (two copies in different memory differ by a few percent
between themselves); otherwise each multiplies weights converted by its own revision's, so a
revision that stores a format otherwise is timed on its own format (int6, the 4-bit formats' output
layer, runs as every product's format, against revisions that have it). Before each round it sums
1 GB on the same threads: a shared host's memory runs at one pace for tens of seconds, then another
(30 to 60 GB/s), and a change to how the weights are read may win at one pace only, so the table
gives the ratio over the rounds at or above the median read rate and below it too. It first checks
that both give the same bits (every path must; not compared where the two read different layouts),
prints a table and writes bench/results/<machine>/<name>.json and .md (--name, default kernel-ab)
with the CPU, date and both revisions.
"""

import argparse
import importlib.util
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import CACHE_DIR, git, save_results  # noqa: E402
from bench.probes.kernel_probe import HIDDEN, INTERMEDIATE, random_weight, step_shapes  # noqa: E402
from service.engine import kernels, quantized  # noqa: E402
from service.settings import Settings  # noqa: E402

SOURCES = "service/engine/kernels/csrc"
CONVERTER = "service/engine/quantized.py"
RENAMED = "corechat_b"


def renamed_source(text: str) -> str:
    """Return kernel source with its C++ namespace and torch operator library named RENAMED instead of corechat."""
    text = re.sub(r"\bnamespace corechat\b", f"namespace {RENAMED}", text)
    text = re.sub(r"\bcorechat::", f"{RENAMED}::", text)
    return re.sub(r"\b(TORCH_LIBRARY(?:_FRAGMENT|_IMPL)?)\(corechat\b", rf"\1({RENAMED}", text)


def build_revision(revision: str) -> tuple[str, Path]:
    """Build a revision's kernels renamed (once per commit); return its commit and the library."""
    commit = git("rev-parse", "--short", f"{revision}^{{commit}}").strip()
    folder = CACHE_DIR / "kernel-ab" / commit
    library = folder / "build" / kernels.LIBRARY_NAME
    if not library.is_file():
        source_dir = folder / "src"
        source_dir.mkdir(parents=True, exist_ok=True)
        for path in git("ls-tree", "--name-only", f"{commit}:{SOURCES}").split():
            (source_dir / path).write_text(renamed_source(git("show", f"{commit}:{SOURCES}/{path}")))
        # This CPU's paths that the revision has sources for (a revision before the AMX path has no amx.cpp).
        sets = [isa for isa in kernels.instruction_sets(kernels.cpu_flags()) if (source_dir / isa.source).is_file()]
        kernels.build(folder / "build", sets, source_dir=source_dir)
    return commit, library


def revision_converter(commit: str):
    """Return a revision's service/engine/quantized.py as a module (its relative imports the working tree's)."""
    source = CACHE_DIR / "kernel-ab" / commit / "quantized.py"
    source.write_text(git("show", f"{commit}:{CONVERTER}"))
    spec = importlib.util.spec_from_file_location(f"service.engine.quantized_{commit}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_weights(converter, fmt: str) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Return one decode step's weights quantized by a converter (weight, scales, outputs, inputs), each its own memory."""
    generator = torch.Generator().manual_seed(0)
    return [(*getattr(converter, f"quantize_{fmt}")(random_weight(outputs, inputs, generator)), outputs, inputs)
            for outputs, inputs in step_shapes()]


def run_step(operator, fmt: str, weights, activations: dict[int, torch.Tensor], path: int) -> list[torch.Tensor]:
    """Multiply every weight of a step by the activations of its width with one library's operator."""
    code = quantized.STORED_FORMATS[fmt].code
    return [operator(activations[inputs], weight, scales, None, code, outputs, False, path)
            for weight, scales, outputs, inputs in weights]


def read_rate(data: torch.Tensor) -> float:
    """Return the bytes a second one sum over `data` read (the memory's pace at this moment)."""
    began = time.perf_counter()
    data.sum()
    return data.numel() * data.element_size() / (time.perf_counter() - began)


def compare(fmt: str, rows: int, rounds: int, path: int, converters: dict, pace_data: torch.Tensor) -> dict:
    """Time a step's products with both libraries in turns, each on its revision's weights (one set for
    both where the converters are the same), reading the memory's pace before each round; return their
    median times and the ratios, over all rounds and split at the median pace (summing `pace_data`)."""
    shared = converters["against"] is None
    if shared:
        weights = dict.fromkeys(converters, step_weights(converters["tree"], fmt))
    else:
        weights = {name: step_weights(converter, fmt) for name, converter in converters.items()}
    generator = torch.Generator().manual_seed(rows)
    activations = {width: torch.randn(rows, width, generator=generator).to(torch.bfloat16)
                   for width in (HIDDEN, INTERMEDIATE)}
    libraries = {"tree": torch.ops.corechat, "against": getattr(torch.ops, RENAMED)}
    operators = {name: library.quantized_linear for name, library in libraries.items()}
    outputs = {name: run_step(operator, fmt, weights[name], activations, path) for name, operator in operators.items()}
    same_bits = None
    if libraries["tree"].layout() == libraries["against"].layout():
        same_bits = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                        for a, b in zip(outputs["tree"], outputs["against"], strict=True))
    seconds = {name: [] for name in operators}
    paces = []
    for round_number in range(rounds):
        paces.append(read_rate(pace_data))
        for name in (list(operators) if round_number % 2 == 0 else list(operators)[::-1]):
            began = time.perf_counter()
            run_step(operators[name], fmt, weights[name], activations, path)
            seconds[name].append(time.perf_counter() - began)
    ratios = [tree / against for tree, against in zip(seconds["tree"], seconds["against"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    middle = statistics.median(paces)
    by_pace = {half: statistics.median(ratio for ratio, pace in zip(ratios, paces, strict=True) if keep(pace))
               for half, keep in (("faster", lambda pace: pace >= middle), ("slower", lambda pace: pace < middle))
               if any(keep(pace) for pace in paces)}
    return {"format": fmt, "rows": rows, "same_bits": same_bits,
            "weight_bytes": {name: sum(w.numel() * w.element_size() + s.numel() * s.element_size()
                                       for w, s, _, _ in step) for name, step in weights.items()},
            "median_seconds": {name: statistics.median(values) for name, values in seconds.items()},
            "ratio_median": statistics.median(ratios), "ratio_quartiles": [quartiles[0], quartiles[2]],
            "shared_weights": shared, "read_bytes_per_second": paces, "ratio_median_by_pace": by_pace,
            "median_read_bytes_per_second": middle}


def main() -> None:
    """Build the other revision's kernels, time both round by round, and report the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the git revision to compare the working tree with")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--formats", nargs="+", choices=sorted(quantized.STORED_FORMATS), default=["int8", "int4"])
    parser.add_argument("--path", choices=sorted(kernels.PATHS), default="best", help="the kernel path both run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--name", default="kernel-ab", help="the results files' name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load(Path(Settings().kernels_dir))
    commit, library = build_revision(args.against)
    torch.ops.load_library(str(library))
    path = kernels.PATHS[args.path]
    # None: the revision converts as the working tree does, and both multiply the same weights.
    same_converter = git("show", f"{commit}:{CONVERTER}") == (REPO / CONVERTER).read_text()
    converters = {"tree": quantized, "against": None if same_converter else revision_converter(commit)}
    # 1 GB, summed before each round to read the memory's pace.
    pace_data = torch.rand(256 * 1024 * 1024)
    results = [compare(fmt, rows, args.rounds, path, converters, pace_data) for fmt in args.formats for rows in args.rows]
    lines = ["| format | rows | working tree | " + commit + " | tree / " + commit + " (median, quartiles) | "
             "at the faster memory / the slower | same bits |", "|---|---|---|---|---|---|---|"]
    for result in results:
        cells = []
        for name in ("tree", "against"):
            seconds = result["median_seconds"][name]
            cells.append(f"{seconds * 1e3:.2f} ms, {result['weight_bytes'][name] / seconds / 1e9:.1f} GB/s")
        low, high = result["ratio_quartiles"]
        same = {None: "other layout", True: "yes", False: "NO"}[result["same_bits"]]
        halves = result["ratio_median_by_pace"]
        paced = " / ".join(f"{halves[half]:.3f}" if half in halves else "-" for half in ("faster", "slower"))
        lines.append(f"| {result['format']} | {result['rows']} | {cells[0]} | {cells[1]} | "
                     f"{result['ratio_median']:.3f} ({low:.3f}-{high:.3f}) | {paced} "
                     f"(split at {result['median_read_bytes_per_second'] / 1e9:.0f} GB/s) | {same} |")
    weights_note = "both on the same weights" if converters["against"] is None else "each on its own revision's weights"
    table = (f"## One decode step's products, working tree against {commit}: path {args.path}, {args.threads} "
             f"thread(s), {args.rounds} alternating rounds (a ratio below 1: the working tree is faster); "
             f"{weights_note}; "
             f"the ratio also over the rounds whose 1 GB sum before them read at or above the median rate, and "
             f"below it\n\n"
             + "\n".join(lines) + "\n")
    save_results(args.name, {"against": commit, "path": args.path, "threads": args.threads, "rounds": args.rounds,
                               "comparisons": results}, table)


if __name__ == "__main__":
    main()
