"""Measure every weight product a decode step can use, in GB/s of weights read, against one core's read bandwidth.

`python bench/probes/kernel_probe.py [--threads 1] [--rounds 5]` times one decode step's products of the
0.5B dev model's shapes (24 layers of q, k, v, o, gate, up, down and the output layer, random
weights, each tensor its own memory so nothing stays in cache) for 1 to 8 rows:
torch's `_weight_int8pack_mm` (bf16 x int8 per row), `_weight_int4pack_mm_for_cpu` (groups of
32), `_int_mm` with activations rounded per row (the only int8 x int8 product torch ships; per
block would be a call per block), fbgemm's `linear_dynamic` (a private packed copy per worker), and
corechat's kernels (int8 and int4, the best path this CPU runs). Kernels take turns round by round
and each keeps its best round; time is the thread's CPU time, so other processes on the machine
shift the figures less. The bound is the best of summing a 1 GB float32 tensor on the same thread.
It prints a table and writes bench/results/<machine>/kernels.json and .md.
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import save_results  # noqa: E402
from service.engine import kernels  # noqa: E402
from service.engine.quantized import INT4, INT8, quantize_int4, quantize_int8  # noqa: E402
from service.settings import Settings  # noqa: E402

LAYERS = 24
HIDDEN, INTERMEDIATE, KV, VOCAB = 896, 4864, 128, 151936
# (outputs, inputs) of one layer's products, then the output layer.
LAYER_SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
ROWS = [1, 2, 4, 8]


def step_shapes() -> list[tuple[int, int]]:
    """Return the (outputs, inputs) of every product of one decode step."""
    return LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]


def random_weight(outputs: int, inputs: int, generator: torch.Generator) -> torch.Tensor:
    """Return a random float32 weight of a trained model's scale."""
    return torch.randn(outputs, inputs, generator=generator) * 0.02


class Product:
    """One kernel's weights for a whole step, and how to run the step."""

    def __init__(self, name: str, prepare, multiply, rounds: int | None = None):
        self.name, self.multiply, self.rounds = name, multiply, rounds
        generator = torch.Generator().manual_seed(0)
        self.weights = [prepare(random_weight(outputs, inputs, generator)) for outputs, inputs in step_shapes()]
        self.bytes = sum(sum(t.numel() * t.element_size() for t in weight if isinstance(t, torch.Tensor))
                         for weight in self.weights)

    def run(self, activations: dict[int, torch.Tensor]) -> None:
        """Multiply each weight by the activations of its input width."""
        for weight, (_, inputs) in zip(self.weights, step_shapes(), strict=True):
            self.multiply(activations[inputs], weight)


def torch_int8(weight):
    scales = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scales[:, None]).to(torch.int8), scales.to(torch.bfloat16)


def torch_int4(weight):
    scale = (weight.abs().reshape(weight.shape[0], -1, 32).amax(dim=2) / 7).clamp(min=1e-8)
    levels = (torch.round(weight.reshape(weight.shape[0], -1, 32) / scale[:, :, None]).clamp(-8, 7) + 8)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.reshape(weight.shape).to(torch.int32), 2)
    scale_and_zero = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=2).to(torch.bfloat16).contiguous()
    return packed, scale_and_zero


def int_mm(x, weight):
    values = x.float()
    scale = values.abs().amax(dim=1, keepdim=True) / 127
    rows = torch.round(values / scale).to(torch.int8)
    # _int_mm wants more than 16 rows on some builds: pad (the padding is not counted as weights).
    padded = torch.cat([rows, rows.new_zeros(17 - rows.shape[0], rows.shape[1])]) if rows.shape[0] <= 16 else rows
    torch._int_mm(padded, weight[0].t())[: rows.shape[0]].float().mul_(scale).mul_(weight[1].float())


def fbgemm(weight):
    rows, scales = torch_int8(weight)
    scales = scales.float()
    quantized = torch._make_per_channel_quantized_tensor(rows, scales.double(), torch.zeros(rows.shape[0], dtype=torch.long), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The rows stay only to count the bytes the packed copy holds (the same int8 values).
        return (torch.ops.quantized.linear_prepack(quantized, None), rows)


def products() -> list[Product]:
    """Return every kernel measured, with its weights."""
    best = kernels.PATHS["best"]
    return [
        Product("torch `_weight_int8pack_mm` (int8, bf16 activations)", torch_int8,
                lambda x, w: torch._weight_int8pack_mm(x, w[0], w[1])),
        Product("torch `_weight_int4pack_mm_for_cpu` (int4, groups of 32)", torch_int4,
                lambda x, w: torch._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])),
        # Without VNNI this runs a reference loop (seconds per step): one round is enough.
        Product("torch `_int_mm` (int8 x int8, activations per row)", torch_int8, int_mm, rounds=1),
        Product("fbgemm `linear_dynamic` (int8, private packed copy)", fbgemm,
                lambda x, w: torch.ops.quantized.linear_dynamic(x.float(), w[0], False)),
        Product("corechat int8 (groups of 32)", lambda weight: (*quantize_int8(weight), weight.shape[0]),
                lambda x, w: torch.ops.corechat.quantized_linear(x, w[0], w[1], None, INT8.code, w[2], False, best)),
        Product("corechat int4 (groups of 32)", lambda weight: (*quantize_int4(weight), weight.shape[0]),
                lambda x, w: torch.ops.corechat.quantized_linear(x, w[0], w[1], None, INT4.code, w[2], False, best)),
    ]


def read_bandwidth(rounds: int) -> float:
    """Return the best bytes per second of summing 1 GB of float32 on this thread."""
    data = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(rounds):
        began = time.thread_time()
        data.sum()
        best = min(best, time.thread_time() - began)
    return data.numel() * 4 / best


def main() -> None:
    """Time every kernel for every row count, round-robin, and report GB/s against the bound."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default worker has 1 here)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels.load(Path(Settings().kernels_dir))
    bound = read_bandwidth(args.rounds)
    measured = products()
    best = {(product.name, rows): float("inf") for product in measured for rows in ROWS}
    generator = torch.Generator().manual_seed(1)
    for round_number in range(args.rounds):
        for rows in ROWS:
            activations = {width: torch.randn(rows, width, generator=generator).to(torch.bfloat16)
                           for width in (HIDDEN, INTERMEDIATE)}
            for product in measured:
                if product.rounds is not None and round_number >= product.rounds:
                    continue
                began = time.thread_time()
                product.run(activations)
                best[product.name, rows] = min(best[product.name, rows], time.thread_time() - began)
    results = {"threads": args.threads, "read_bytes_per_second": bound, "paths": kernels.available_paths(),
               "kernels": {product.name: {"weight_bytes": product.bytes,
                                          "step_seconds": {rows: best[product.name, rows] for rows in ROWS}}
                           for product in measured}}
    header = "| kernel | weights | " + " | ".join(f"{rows} row{'s' if rows > 1 else ''}" for rows in ROWS) + " |"
    lines = [header, "|---|---|" + "---|" * len(ROWS)]
    for product in measured:
        cells = []
        for rows in ROWS:
            rate = product.bytes / best[product.name, rows]
            cells.append(f"{rate / 1e9:.1f} GB/s ({rate / bound:.2f}x), {best[product.name, rows] * 1e3:.0f} ms")
        lines.append(f"| {product.name} | {product.bytes / 1e6:.0f} MB | " + " | ".join(cells) + " |")
    table = (f"## Decode-step products of the 0.5B shapes, {args.threads} thread(s): weights read per second "
             f"(x one thread's read bandwidth, {bound / 1e9:.1f} GB/s), step time; corechat path "
             f"{kernels.available_paths()[-1]}\n\n" + "\n".join(lines) + "\n")
    save_results("kernels", results, table)


if __name__ == "__main__":
    main()
