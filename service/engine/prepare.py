"""Ready a loaded model for its DTYPE: quantized weights, corechat's kernels, the lean forward."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import kernels, qwen2
from .converted import apply_quantized
from .quantized import ACTIVATIONS, FORMAT_VERSION, FORMATS
from .qwen2 import LeanModel


@dataclass(frozen=True)
class PreparedModel:
    """What preparing a model decided: the format that fixes the replies' bits and the facts to report."""

    weight_format: str
    forward: str
    # What the lean forward runs, for the models it serves (runners.PagedModel); None runs transformers'.
    lean: LeanModel | None = None
    kernel_paths: str | None = None
    quantization: str | None = None
    converted_weights: str | None = None
    # The converted weights' digest (converted.py), which the engine's fingerprint includes.
    weights_digest: str = ""


def prepare_model(model, tokenizer, dtype: str, model_dir: Path, converted_dir: Path, kernels_dir: Path, fingerprint: str,
                  between_layers: Callable[[], object] | None = None, kernel_path: str = "best") -> PreparedModel:
    """Ready a loaded model for its DTYPE; return what was decided, `weight_format` among it.

    int8, int4 and int4m swap in QuantizedLinear layers; they and bfloat16 run the lean forward (qwen2.py)
    with corechat's attention kernel for Qwen2-family models, so the kernels are loaded for all
    three; float32 loads them too, for the sampler's kernels. float32, and models the lean forward
    does not serve, run transformers' own forward. weight_format names what decides the replies'
    bits, so hosts that differ in it never share cached replies. between_layers runs before every
    decoder layer of every forward (the engine's core sharing, cores.py). kernel_path names the
    kernels' instruction-set path (KERNEL_PATH; every path gives the same bits).
    """
    kernels.load(kernels_dir)  # the sampler's greedy and draw kernels run on them at every DTYPE
    if dtype == "float32":
        call_between_layers(model, between_layers)
        return PreparedModel(weight_format=dtype, forward="transformers")
    kernel_paths = ",".join(kernels.use_path(kernel_path))
    quantization = converted_weights = None
    weights_digest = ""
    fmt = FORMATS.get(dtype)
    if fmt is not None:
        converted, weights_digest = apply_quantized(model, tokenizer, fmt, model_dir, converted_dir, fingerprint)
        converted_weights = str(converted)
        quantization = f"{fmt.description}, {ACTIVATIONS}"
    lean = qwen2.lean_model(model, between_layers)
    if lean is None:
        call_between_layers(model, between_layers)
    return PreparedModel(weight_format=f"{dtype}:v{FORMAT_VERSION}", forward="lean" if lean else "transformers",
                         lean=lean, kernel_paths=kernel_paths, quantization=quantization,
                         converted_weights=converted_weights, weights_digest=weights_digest)


def call_between_layers(model, between_layers: Callable[[], object] | None) -> None:
    """Run between_layers before each decoder layer of transformers' forward."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if between_layers is None or layers is None:
        return

    def before_layer(module, args) -> None:
        """Run between_layers; a pre-hook's return value would replace the layer's inputs."""
        between_layers()

    for layer in layers:
        layer.register_forward_pre_hook(before_layer)
