"""What each rounding of a weight format costs on the real model, one at a time.

`python bench/probes/rounding.py` runs SmolLM2-135M-Instruct's float32 forward (transformers') over
bench/quality.py's windows with one rounding applied at a time, and gives each variant's KL
divergence from the plain float32 forward and its top-1 agreement:
- weights only, stored as each format stores them (service/engine/quantized.py's own converters,
  dequantized), and as the alternatives the formats were chosen over: int8 without the rotation of
  its groups (q8_0's rounding) and with one scale per row, int4 with q4_0's rule (each group's
  largest weight at -8), with its output layer in int4 too and with its groups rotated as int8's;
- int8 weights plus the activations rounded to int8 per block of 32, as the kernels round every
  product's input, unrotated (as q8_0) and rotated (as the kernels do for int8), and int4's;
- those plus bfloat16 where the served forward keeps bfloat16 (the embedding, each layer's output,
  and the query, key, value, attention-output and down products' outputs);
- the output layer alone, at int8 and at int6 (the 4-bit formats'), nearest and by GPTQ, and at the
  widths beside int6 (5 and 7 bits).
It splits bench/quality.py's end-to-end figure into its causes, so a format idea can be judged
before a kernel is written. Results: bench/results/<machine>/rounding.json and .md.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench import save_results  # noqa: E402
from bench.quality import TEXT, WINDOW, Tally, read_text, scored_positions, text_tokens, windows_of  # noqa: E402
from service.engine.converted import OUTPUT_LAYER  # noqa: E402
from service.engine.quantized import (  # noqa: E402
    INT4,
    INT6,
    INT8,
    dequantize,
    quantize_int4,
    quantize_int6,
    quantize_int8,
    rotate_groups,
    rotated_levels,
)

GROUP = 32


def stored(fmt, quantize) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the rounding of a format's converter: the weights it stores, dequantized."""
    return lambda weight: dequantize(fmt, *quantize(weight), weight.shape[0])


def int8_unrotated(weight: torch.Tensor) -> torch.Tensor:
    """int8 as stored, but without the rotation (q8_0's rounding): the converter rotates the groups of
    what it is given, so it is given them rotated, and its result rotated back once more."""
    return rotate_groups(stored(INT8, quantize_int8)(rotate_groups(weight)))


def int8_per_row(weight: torch.Tensor) -> torch.Tensor:
    """int8 with one float32 scale per row (the format int8 replaced)."""
    scales = weight.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(weight / torch.where(scales > 0, scales, 1.0)).clamp(-127, 127) * scales


def int4_q4_0_rule(weight: torch.Tensor) -> torch.Tensor:
    """int4 with llama.cpp's q4_0 rule alone: each group's largest weight at -8 steps."""
    groups = weight.reshape(weight.shape[0], -1, GROUP)
    scales = (groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)) / -8).half().float()
    levels = torch.round(groups / torch.where(scales != 0, scales, 1.0)).clamp(-8, 7)
    return (levels * scales).reshape(weight.shape)


def rotated(rounding: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return `rounding` applied to the groups rotated (the Hadamard matrix, quantized.py), then rotated
    back: what the product sees when weights and input blocks are both rounded rotated."""
    return lambda values: rotate_groups(rounding(rotate_groups(values)))


def round_activations(states: torch.Tensor) -> torch.Tensor:
    """Round to int8 per block of 32, as the kernels do (largest magnitude / 127)."""
    blocks = states.reshape(*states.shape[:-1], -1, GROUP)
    scales = blocks.abs().amax(dim=-1, keepdim=True) / 127
    levels = torch.round(blocks / torch.where(scales > 0, scales, 1.0)).clamp(-127, 127)
    return (levels * scales).reshape(states.shape)


def bfloat16_output(module: nn.Module, inputs: tuple, output):
    """Round a module's output (or a decoder layer's hidden states) to bfloat16."""
    if isinstance(output, tuple):
        return (output[0].bfloat16().float(), *output[1:])
    return output.bfloat16().float()


# Variant name -> (the decoder's Linear weights' rounding, the output layer's, activations, bfloat16 states).
VARIANTS = {
    "none (float32)": (torch.clone, torch.clone, None, False),
    "int8 weights (groups rotated, as stored)": (stored(INT8, quantize_int8), stored(INT8, quantize_int8), None, False),
    "int8 weights (groups unrotated, as q8_0)": (int8_unrotated, int8_unrotated, None, False),
    "int8 weights (a float32 scale per row)": (int8_per_row, int8_per_row, None, False),
    "int8 unrotated: weights + activations per 32 (q8_0's rounding)": (int8_unrotated, int8_unrotated,
                                                                       round_activations, False),
    "int8 unrotated: weights + activations + bfloat16 states": (int8_unrotated, int8_unrotated, round_activations, True),
    "int8 rotated: weights + activations per 32 (the format)": (stored(INT8, quantize_int8), stored(INT8, quantize_int8),
                                                                rotated(round_activations), False),
    "int8 rotated: weights + activations + bfloat16 states": (stored(INT8, quantize_int8), stored(INT8, quantize_int8),
                                                              rotated(round_activations), True),
    "int4 weights (output layer int8)": (stored(INT4, quantize_int4), stored(INT8, quantize_int8), None, False),
    "int4 weights (output layer int4)": (stored(INT4, quantize_int4), stored(INT4, quantize_int4), None, False),
    "int4 weights (q4_0's rule, output layer int8)": (int4_q4_0_rule, stored(INT8, quantize_int8), None, False),
    "int4 weights, groups rotated (output layer int8)": (rotated(stored(INT4, quantize_int4)),
                                                         stored(INT8, quantize_int8), None, False),
    "int4 weights + activations (output layer int8)": (stored(INT4, quantize_int4), stored(INT8, quantize_int8),
                                                       round_activations, False),
}


def run_variant(model, reference: list[torch.Tensor], windows: list[list[int]], weights, output_weights,
                activations: Callable[[torch.Tensor], torch.Tensor] | None, bfloat16_states: bool, originals: dict[str, torch.Tensor]) -> dict:
    """Score one variant's forward against the float32 one; the model is restored after. `weights` rounds a
    decoder Linear's weight, or is a mapping of their names to the rounded weights."""
    hooks = []
    linears = {name: module for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.startswith("model.layers.")}
    with torch.no_grad():
        for name, module in linears.items():
            weight_name = f"{name}.weight"
            module.weight.copy_(weights[weight_name] if isinstance(weights, dict) else weights(originals[weight_name]))
        output = output_weights(originals[OUTPUT_LAYER])
    if activations is not None:
        hooks += [module.register_forward_pre_hook(lambda module, inputs: (activations(inputs[0]),))
                  for module in linears.values()]
    if bfloat16_states:
        hooks.append(model.model.embed_tokens.register_forward_hook(bfloat16_output))
        for layer in model.model.layers:
            hooks.append(layer.register_forward_hook(bfloat16_output))
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.down_proj):
                hooks.append(module.register_forward_hook(bfloat16_output))
    tally = Tally()
    scored = scored_positions(WINDOW)
    try:
        with torch.inference_mode():
            for window, expected in zip(windows, reference, strict=True):
                hidden = model.model(input_ids=torch.tensor([window])).last_hidden_state[0, scored.start:scored.stop]
                if activations is not None:
                    hidden = activations(hidden)
                tally.add(expected, (hidden @ output.T).log_softmax(-1), torch.tensor(window[scored.start + 1:]))
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for name, module in linears.items():
                module.weight.copy_(originals[f"{name}.weight"])
    scores = tally.scores(0, 1.0)
    return {"kld_mean": scores.kld_mean, "kld_99": scores.kld_99, "top1_same": scores.top1_same,
            "perplexity": scores.perplexity}


def scored_model(folder: Path):
    """Load a model folder's float32 forward over bench/quality.py's windows; return the model, its
    tokenizer, the windows, the float32 log-probabilities of their scored positions and a copy of the
    weights (the output layer's under OUTPUT_LAYER where it is tied to the embedding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids, bos = text_tokens(tokenizer, read_text(TEXT))
    windows = windows_of(ids, WINDOW, bos)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    originals = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    originals.setdefault(OUTPUT_LAYER, originals["model.embed_tokens.weight"])
    scored = scored_positions(WINDOW)
    with torch.inference_mode():
        reference = [model(input_ids=torch.tensor([window])).logits[0, scored.start:scored.stop].log_softmax(-1)
                     for window in windows]
    return model, tokenizer, windows, reference, originals


def save_variants(name: str, title: str, model_name: str, windows: list[list[int]], variants: dict[str, dict]) -> None:
    """Write the variants' figures as a table to bench/results/<machine>/<name>.md and .json."""
    scored_tokens = len(windows) * len(scored_positions(WINDOW))
    rows = ["| rounding | mean KLD | 99% KLD | top-1 same as float32 | perplexity |", "|---|---|---|---|---|"]
    for variant, figures in variants.items():
        rows.append(f"| {variant} | {figures['kld_mean']:.5f} | {figures['kld_99']:.4f} | {figures['top1_same']:.2%} | "
                    f"{figures['perplexity']:.3f} |")
    results = {"model": model_name, "windows": len(windows), "scored_tokens": scored_tokens, "variants": variants}
    save_results(name, results, f"## {title} ({len(windows)} windows of {WINDOW} tokens of {TEXT.name}, "
                 f"{scored_tokens} scored)\n\n" + "\n".join(rows) + "\n")


def rotated_symmetric(largest: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the nearest rounding of int8's and int6's rule at another width: rotated groups of 32 at
    -largest..largest steps of a float16 scale (5 bits: 15, 7 bits: 63)."""
    def rounding(weight: torch.Tensor) -> torch.Tensor:
        scales, levels = rotated_levels(weight, largest)
        steps = levels.reshape(weight.shape[0], -1, GROUP) * scales.float()[:, :, None]
        return rotate_groups(steps.reshape(weight.shape))
    return rounding


def output_variants(model, tokenizer) -> dict:
    """Return the variants that round the output layer alone: int8 and int6 as the nearest rounding, and
    int6 by GPTQ on the decoder's output over the converter's calibration text (the 4-bit formats' output
    layer, converted.py); and the widths beside int6, 5 and 7 bits, as the nearest rounding."""
    from service.engine.calibration import calibration_windows

    with torch.inference_mode():
        states = model.model(input_ids=calibration_windows(tokenizer)).last_hidden_state
    flat = states.reshape(-1, states.shape[-1]).float()
    moments = flat.T @ flat

    def int6_gptq(weight: torch.Tensor) -> torch.Tensor:
        return dequantize(INT6, *quantize_int6(weight, moments), weight.shape[0])

    return {"output layer alone: int8": (torch.clone, stored(INT8, quantize_int8), None, False),
            "output layer alone: int6, nearest": (torch.clone, stored(INT6, quantize_int6), None, False),
            "output layer alone: int6, GPTQ on the calibration text": (torch.clone, int6_gptq, None, False),
            "output layer alone: 5 bits (-15..15), nearest": (torch.clone, rotated_symmetric(15), None, False),
            "output layer alone: 7 bits (-63..63), nearest": (torch.clone, rotated_symmetric(63), None, False)}


def main() -> None:
    """Score every variant and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="rounding", help="the results file's name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from devtools.smollm2 import gguf_path
    from service.engine.gguf import converted_folder
    from service.settings import Settings

    folder = converted_folder(gguf_path(), Path(Settings().converted_weights_dir))
    model, tokenizer, windows, reference, originals = scored_model(folder)
    chosen = {**VARIANTS, **output_variants(model, tokenizer)}
    variants = {name: run_variant(model, reference, windows, *variant, originals) for name, variant in chosen.items()}
    save_variants(args.name, "Each rounding alone on SmolLM2-135M-Instruct's float32 forward", folder.name, windows,
                  variants)


if __name__ == "__main__":
    main()
