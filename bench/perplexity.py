"""llama.cpp's side of bench/quality.py: llama-perplexity over a text with its f32 GGUF of the model (the
base, whose log-probabilities it writes to a file), then with each quantization against that file; what
it prints, read into the Scores both sides report, and what it writes.

The base file holds the token ids llama-perplexity scored, against which bench/quality.py checks
corechat's, and the base's log-probabilities, against which it scores corechat's float32.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.peer import Toolchain, run_tool

# Where llama-perplexity's base file starts, before its window, vocabulary size and window count.
BASE_MAGIC = b"_logits_"


@dataclass(frozen=True)
class Scores:
    """How a format's next-token distributions over the scored positions compare with its side's float32
    (a reference's own row has no KL divergence or top-1 figures: None)."""

    bits_per_weight: float
    perplexity: float
    perplexity_ratio: float
    kld_mean: float | None = None
    kld_median: float | None = None
    kld_99: float | None = None
    kld_max: float | None = None
    # The share of positions whose most likely token is the reference's.
    top1_same: float | None = None


def figure(pattern: str, output: str) -> float:
    """Return the number a pattern's group finds in llama-perplexity's output, or fail naming the pattern."""
    found = re.search(pattern, output)
    if found is None:
        raise ValueError(f"llama-perplexity's output has no line matching {pattern!r}")
    return float(found.group(1))


def bits_per_weight(gguf_file: Path) -> float:
    """Return a GGUF file's tensor bytes over its weights, in bits, as llama.cpp's loader reports it."""
    from gguf import GGUFReader

    tensors = GGUFReader(gguf_file).tensors
    return 8 * sum(int(tensor.n_bytes) for tensor in tensors) / sum(int(tensor.n_elements) for tensor in tensors)


def base_perplexity(output: str) -> float:
    """Return the perplexity llama-perplexity printed for the text (its `Final estimate` line)."""
    return figure(r"Final estimate: PPL = ([\d.]+)", output)


def parse_kl_divergence(output: str, bits: float) -> Scores:
    """Read the statistics llama-perplexity --kl-divergence prints at its end, for a file of `bits` per weight."""
    number = r"(-?[\d.]+(?:e-?\d+)?)"
    return Scores(
        bits_per_weight=bits,
        perplexity=figure(rf"Mean PPL\(Q\)\s*:\s*{number}", output),
        perplexity_ratio=figure(rf"Mean PPL\(Q\)/PPL\(base\)\s*:\s*{number}", output),
        kld_mean=figure(rf"Mean\s+KLD:\s*{number}", output),
        kld_median=figure(rf"Median\s+KLD:\s*{number}", output),
        kld_99=figure(rf"\n99\.0%\s+KLD:\s*{number}", output),
        kld_max=figure(rf"Maximum KLD:\s*{number}", output),
        top1_same=figure(rf"Same top p:\s*{number}", output) / 100,
    )


def run_base(toolchain: Toolchain, f32: Path, text: Path, base: Path, *, window: int, threads: int) -> str:
    """Score the text with the f32 file, writing its log-probabilities to `base`; return the output."""
    return run_tool([str(toolchain.perplexity), "-m", str(f32), "-f", str(text), "-c", str(window),
                     "-t", str(threads), "--kl-divergence-base", str(base)])


def run_against_base(toolchain: Toolchain, quantized: Path, base: Path, *, window: int, threads: int) -> Scores:
    """Score a quantized file against the base's log-probabilities."""
    output = run_tool([str(toolchain.perplexity), "-m", str(quantized), "-c", str(window), "-t", str(threads),
                       "--kl-divergence-base", str(base), "--kl-divergence"])
    return parse_kl_divergence(output, bits_per_weight(quantized))


@dataclass(frozen=True)
class BaseFile:
    """llama-perplexity's base file: the windows' token ids as it scored them (before a BOS replaces each
    window's first) and, per window, the log-probabilities of every scored position."""

    window: int
    vocabulary: int
    tokens: np.ndarray
    # [windows, scored positions, row]: a row is a float32 scale and minimum as four uint16, then a
    # uint16 level per token (padded to an even count): log p = scale * level + minimum.
    rows: np.ndarray

    @classmethod
    def read(cls, path: Path) -> "BaseFile":
        """Map a base file."""
        with path.open("rb") as file:
            if file.read(len(BASE_MAGIC)) != BASE_MAGIC:
                raise ValueError(f"{path} is not a llama-perplexity base file")
            window, vocabulary, windows = (int(value) for value in np.frombuffer(file.read(12), dtype="<i4"))
        tokens_at = len(BASE_MAGIC) + 12
        tokens = np.memmap(path, dtype="<i4", mode="r", offset=tokens_at, shape=(windows * window,))
        row = 2 * ((vocabulary + 1) // 2) + 4
        rows = np.memmap(path, dtype="<u2", mode="r", offset=tokens_at + tokens.nbytes,
                         shape=(windows, window - 1 - window // 2, row))
        return cls(window, vocabulary, tokens, rows)

    def log_probs(self, index: int) -> np.ndarray:
        """Return one window's log-probabilities as llama.cpp stored them, [positions, vocabulary]."""
        rows = self.rows[index]
        scale_and_minimum = np.ascontiguousarray(rows[:, :4]).view("<f4")
        return rows[:, 4:4 + self.vocabulary].astype(np.float32) * scale_and_minimum[:, 0:1] + scale_and_minimum[:, 1:2]

    def scored_ids(self, bos_id: int | None) -> tuple[list[int], int | None]:
        """Return the ids llama-perplexity scored and the BOS its windows start with (its first id, where its
        vocabulary adds one), else None."""
        ids = self.tokens.tolist()
        return ids, bos_id if bos_id is not None and ids[0] == bos_id else None

    def perplexity(self, targets: list) -> float:
        """Return the perplexity of each window's targets (token tensors) by the file's log-probabilities:
        llama-perplexity's PPL(base)."""
        nll = [-self.log_probs(index)[np.arange(len(target)), np.asarray(target)] for index, target in enumerate(targets)]
        return math.exp(float(np.concatenate(nll).mean()))


def first_difference(ids: list[int], base: BaseFile) -> int | None:
    """Return where token ids first differ from those llama-perplexity scored (its base file's whole
    windows), or None where they are the same and make as many windows."""
    scored = np.asarray(base.tokens)
    ours = np.asarray(ids[:len(scored)])
    differing = np.flatnonzero(ours != scored[:len(ours)])
    if differing.size:
        return int(differing[0])
    if len(ours) < len(scored) or len(ids) // base.window != len(scored) // base.window:
        return len(ours)
    return None
