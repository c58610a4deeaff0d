"""Measure fbgemm's packed int8 kernels against the shared int8 file's, in the model, memory included.

`python bench/packed_probe.py [--threads 1]` loads the 0.5B dev model as a default worker does
(int8, weights mapped from the shared file), times decode steps for one sequence and a batch of
four, then repacks every int8 Linear for fbgemm (`quantized::linear_prepack` from the same int8 rows
and scales, so no fp32 detour) and times them again, reporting the private memory the packed copy
takes. Prompt passes keep the engine's int8 products in both. It prints a table and writes
bench/results/packed-int8.json and .md.
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench import save_results  # noqa: E402
from bench.compile_probe import load  # noqa: E402
from service.engine.int8 import Int8Linear, prompt_pass  # noqa: E402


class PackedInt8Linear(nn.Module):
    """An Int8Linear whose decode products use fbgemm's packed weights (a private copy)."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        zero_points = torch.zeros(layer.out_features, dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(layer.weight_int8, layer.scales.double(), zero_points, 0)
        bias = layer.bias.float() if layer.bias is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.ops.quantized.linear_prepack(weight, bias)
        self.layer = layer

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Decode rows through fbgemm (activations rounded to uint8 per call); prompts as the engine does."""
        if self.layer.mode.in_prompt_pass:
            return self.layer(inputs)
        flat = inputs.reshape(-1, inputs.shape[-1])
        output = torch.ops.quantized.linear_dynamic(flat.float(), self.packed, False)
        return output.to(inputs.dtype).reshape(*inputs.shape[:-1], -1)


def anonymous_bytes() -> int:
    """Return this process's anonymous memory in bytes."""
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line in smaps_rollup")


def step_seconds(model, prompt_ids: list[int], rows: int, steps: int) -> float:
    """Run a prompt pass for `rows` copies of the prompt, then return the median decode step seconds."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        with prompt_pass(model):
            model(input_ids=torch.tensor([prompt_ids] * rows), cache=cache, use_cache=True, logits_to_keep=1)
        times = []
        for token in range(steps):
            began = time.perf_counter()
            model(input_ids=torch.tensor([[token + 100]] * rows), cache=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(model, prompt_ids: list[int], steps: int) -> dict:
    """Time one sequence and a batch of four."""
    step_seconds(model, prompt_ids, 1, 4)  # warm up
    one, four = step_seconds(model, prompt_ids, 1, steps), step_seconds(model, prompt_ids, 4, steps)
    return {"step_seconds": one, "tokens_per_second": 1 / one, "batch4_step_seconds": four, "batch4_tokens_per_second": 4 / four}


def main() -> None:
    """Time the shared kernels, repack, time the packed ones, and report both with the memory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default worker has 1 here)")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, prompt_ids = load("int8")
    results = {"threads": args.threads, "shared": measure(model, prompt_ids, args.steps)}
    before = anonymous_bytes()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Int8Linear):
                setattr(module, name, PackedInt8Linear(child))
    results["packed_private_bytes"] = anonymous_bytes() - before
    results["packed"] = measure(model, prompt_ids, args.steps)
    shared, packed = results["shared"], results["packed"]
    rows = [
        "| kernel | one sequence | batch of 4 | private memory per worker |",
        "|---|---|---|---|",
        f"| `_weight_int8pack_mm` on the shared int8 file (the default) | {shared['tokens_per_second']:.1f} tok/s | "
        f"{shared['batch4_tokens_per_second']:.1f} tok/s | 0 |",
        f"| fbgemm `linear_dynamic`, packed copy | {packed['tokens_per_second']:.1f} tok/s | "
        f"{packed['batch4_tokens_per_second']:.1f} tok/s | {results['packed_private_bytes'] / 1e6:.0f} MB |",
    ]
    table = f"## Packed int8 probe: decode, {args.threads} thread(s)\n\n" + "\n".join(rows) + "\n"
    save_results("packed-int8", results, table)


if __name__ == "__main__":
    main()
