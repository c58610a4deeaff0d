"""What the 4-bit formats' conversion costs a decode step: GPTQ's rounding and the int8 value product.

`python bench/probes/conversion_probe.py --dtype int4` converts the 0.5B dev model three ways, each
into its own folder beside the dev model (the weights file linked, not copied): as corechat converts
it (GPTQ's rounding, the value product in int8), with the nearest rounding and the int8 value
product, and with the nearest rounding and every product in the format (as before GPTQ). It loads all
three in one process as a worker does and times one sequence's decode steps on each, alternating
(the order reversed every other round), so the ratios are measured side by side. The layout the kernels
read is the same in all three; only the values and the value product's format differ.
Results: bench/results/<machine>/conversion-<dtype>.json and .md.
"""

import argparse
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR, load_runner  # noqa: E402
from bench.probes.step_probe import lone_steps  # noqa: E402
from devtools.devmodel import build_dev_model  # noqa: E402
from service.engine import converted, gptq  # noqa: E402
from service.engine.quantized import INT8  # noqa: E402

VARIANTS = ("as converted (GPTQ, value product int8)", "nearest rounding, value product int8",
            "nearest rounding, every product in the format")
PROMPT = "Once upon a time there was a lighthouse keeper who"


def linked_copy(model_dir: Path, name: str) -> Path:
    """Return a folder beside the model holding its files (the weights linked) and no conversion."""
    copy = model_dir.with_name(f"{model_dir.name}-{name}")
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.startswith((".", "corechat-int")):
            if path.suffix == ".safetensors":
                (copy / path.name).symlink_to(path)
            else:
                shutil.copy2(path, copy / path.name)
    return copy


def load_variants(model_dir: Path, dtype: str) -> tuple[dict, object]:
    """Load the three conversions' runners (each converted fresh in its own folder) and the tokenizer."""
    format_of, layer_moments = converted.format_of, gptq.layer_moments
    runners = {}
    # Loaded last to first: in-session runs that loaded the shipped conversion first timed it 2-7%
    # slower than the others, and a second copy of it, loaded later, as fast as they were.
    try:
        gptq.layer_moments = lambda *arguments: False
        converted.format_of = lambda fmt, name: INT8 if name == converted.OUTPUT_LAYER else fmt
        runners[VARIANTS[2]], tokenizer, _ = load_runner(linked_copy(model_dir, "one-format"), dtype)
        converted.format_of = format_of
        runners[VARIANTS[1]], _, _ = load_runner(linked_copy(model_dir, "nearest"), dtype)
        gptq.layer_moments = layer_moments
        runners[VARIANTS[0]], _, _ = load_runner(linked_copy(model_dir, "gptq"), dtype)
    finally:
        converted.format_of, gptq.layer_moments = format_of, layer_moments
    return runners, tokenizer


def main() -> None:
    """Time each conversion's decode steps, alternating, and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("int4", "int4m"), default="int4")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=64, help="decode steps a round times on each")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runners, tokenizer = load_variants(build_dev_model(DEV_MODEL_DIR, preset="qwen2.5-0.5b"), args.dtype)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    times = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):
        for name in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            times[name].append(lone_steps(runners[name], prompt_ids, args.steps))
        print(f"round {round_index + 1}: " + ", ".join(f"{times[name][-1] * 1e3:.2f} ms" for name in VARIANTS),
              flush=True)
    base = times[VARIANTS[2]]
    rows = ["| conversion | decode step (ms), median (range) | time / every product in the format, median (range) |",
            "|---|---|---|"]
    for name in VARIANTS:
        ratios = [mine / theirs for mine, theirs in zip(times[name], base, strict=True)]
        rows.append(f"| {name} | {statistics.median(times[name]) * 1e3:.2f} ({min(times[name]) * 1e3:.2f}-"
                    f"{max(times[name]) * 1e3:.2f}) | {statistics.median(ratios):.3f} ({min(ratios):.3f}-"
                    f"{max(ratios):.3f}) |")
    results = {"dtype": args.dtype, "rounds": args.rounds, "steps": args.steps, "threads": args.threads,
               "seconds": times}
    save_results(f"conversion-{args.dtype}", results,
                 f"## One sequence's decode step, the 0.5B dev model at {args.dtype}, three conversions "
                 f"alternating ({args.rounds} rounds of {args.steps} steps, {args.threads} threads)\n\n"
                 + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
