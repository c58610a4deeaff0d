"""Ready a loaded model for its DTYPE: quantized weights, corechat's kernels, the lean forward."""

from pathlib import Path

from . import kernels, qwen2
from .quantized import ACTIVATIONS, FORMAT_VERSION, FORMATS, apply_quantized


def prepare_model(model, dtype: str, model_dir: Path, converted_dir: Path, kernels_dir: Path, fingerprint: str) -> dict:
    """Ready a loaded model for its DTYPE; return the facts to report, `weight_format` among them.

    int8 and int4 swap in QuantizedLinear layers; they and bfloat16 attend with corechat's kernel
    and, for Qwen2-family models, run the lean forward (qwen2.py), so the kernels are loaded for
    all three. float32 runs transformers' own code only. weight_format names what decides the
    replies' bits, so hosts that differ in it never share cached replies.
    """
    if dtype == "float32":
        return {"weight_format": dtype, "forward": "transformers"}
    kernels.load(kernels_dir)
    facts = {"weight_format": f"{dtype}:v{FORMAT_VERSION}", "kernel_paths": ",".join(kernels.available_paths())}
    fmt = FORMATS.get(dtype)
    if fmt is not None:
        converted = apply_quantized(model, fmt, model_dir, converted_dir, fingerprint)
        facts.update(quantization=f"{fmt.description}, {ACTIVATIONS}", converted_weights=str(converted))
    facts["forward"] = "lean" if qwen2.install(model) else "transformers"
    return facts
