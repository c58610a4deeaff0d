"""What each part of int4m's rounding buys on SmolLM2 moved off its grid, on the float32 forward.

`python bench/probes/grid_probe.py` rounds SmolLM2-135M-Instruct, its weights moved off their GGUF grid
(bench/off_grid.py), as `DTYPE=int4m` converts its decoder layers (service/engine/quantized.py and gptq.py:
value products in int8, the rest by GPTQ on the calibration text, each group's grid searched by the error
weighted by its inputs' mean square; the output layer held at int8 here, where the format's is int6, which
bench/probes/rounding.py measures alone), and with one part changed at a time: the plain q4_1 grid
instead of the search, each weight to its nearest level instead of GPTQ, and GPTQ's damping at 0.1,
0.3 and 3 instead of 1. Each variant's weights are dequantized into transformers' float32 forward and
scored as bench/probes/rounding.py scores its roundings (KL divergence from float32 over bench/quality.py's
windows). Results: bench/results/<machine>/grid.json and .md.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.off_grid import off_grid_model  # noqa: E402
from bench.probes.rounding import run_variant, save_variants, scored_model, stored  # noqa: E402
from service.engine import gptq, quantized  # noqa: E402
from service.engine.calibration import calibration_windows  # noqa: E402
from service.engine.converted import format_of  # noqa: E402
from service.engine.quantized import INT4M, INT8, PACKED, QUANTIZE, dequantize, quantize_int8  # noqa: E402


def converted_weights(model, tokenizer, calibrated: bool = True) -> dict[str, torch.Tensor]:
    """Return each decoder Linear's weight as DTYPE=int4m stores it, dequantized (by the nearest rounding
    where not `calibrated`)."""
    rounded = {}
    weights = dict(model.named_parameters())

    def quantize_layer(moments: dict[str, torch.Tensor]) -> None:
        for name, layer_moments in moments.items():
            fmt, weight = format_of(INT4M, name), weights[name].detach()
            stored_tensors = QUANTIZE[fmt.name](weight, layer_moments if calibrated else None) if fmt in PACKED \
                else QUANTIZE[fmt.name](weight)
            rounded[name] = dequantize(fmt, *stored_tensors, weight.shape[0])

    gptq.layer_moments(model, calibration_windows(tokenizer), quantize_layer)
    return rounded


def with_attribute(owner, name: str, value, build):
    """Return build() with owner.name set to value for its duration."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        return build()
    finally:
        setattr(owner, name, saved)


def main() -> None:
    """Score each variant and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from devtools.smollm2 import gguf_path
    from service.engine.gguf import converted_folder
    from service.settings import Settings

    root = Path(Settings().converted_weights_dir)
    folder = off_grid_model(converted_folder(gguf_path(), root), root)
    model, tokenizer, windows, reference, originals = scored_model(folder)
    searched = quantized.int4m_grid
    builds = {
        "as converted (grid searched, act order, damping 1)": lambda: converted_weights(model, tokenizer),
        "plain q4_1 grid instead of the search": lambda: with_attribute(
            quantized, "int4m_grid", lambda groups, importance: searched(groups, None),
            lambda: converted_weights(model, tokenizer)),
        "nearest rounding instead of GPTQ (plain grid)": lambda: converted_weights(model, tokenizer, calibrated=False),
        **{f"damping {damping}": (lambda damping=damping: with_attribute(
            gptq, "DAMPING", damping, lambda: converted_weights(model, tokenizer))) for damping in (0.1, 0.3, 3.0)},
    }
    output = stored(INT8, quantize_int8)
    variants = {name: run_variant(model, reference, windows, build(), output, None, False, originals)
                for name, build in builds.items()}
    save_variants("grid", "int4m's rounding, one part changed at a time, on the float32 forward of SmolLM2-135M-Instruct "
                  "moved off its grid", folder.name, windows, variants)


if __name__ == "__main__":
    main()
