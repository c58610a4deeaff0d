"""How faithful each weight format is on a real model: the perplexity of a text and the KL divergence of
every scored position's next-token distribution from float32's, corechat's DTYPEs beside llama.cpp's
formats of the same width.

    python bench/quality.py                        # SmolLM2-135M-Instruct (devtools/smollm2.py), minutes on 2 cores
    python bench/quality.py --dtypes int8 --peer-formats q8_0
    python bench/quality.py --no-peer              # corechat alone, without building llama.cpp
    python bench/quality.py --model MODEL          # a GGUF file or a model folder
    python bench/quality.py --off-grid --name quality-off-grid   # the model moved off its GGUF grid (bench/off_grid.py)

The text (the GPL-3, as Debian ships it) is cut as `llama-perplexity -c 512` cuts it: tokenized whole,
a BOS first where the vocabulary adds one, then as many whole windows of 512 tokens as fit, each
window's first token replaced by the BOS where the vocabulary adds one; in each window positions
256..510 are scored, each predicting the token after it. corechat loads the model folder at each
DTYPE as a worker does and runs each window as one prompt pass of the runner the worker's engine
drives; float32 is the reference. llama.cpp converts the same folder to an f32 GGUF, its reference,
quantizes it with llama-quantize, and scores the f32 file and then each quantization against it with
llama-perplexity (bench/perplexity.py). Both sides score the same token ids: corechat's tokenizer's
are checked against those llama-perplexity scored, and where they differ both sides score llama.cpp's
and the table says so first. corechat's float32 is also scored against llama.cpp's f32 as
llama-perplexity scores a quantization, so the two references are compared too. Results go to
bench/results/<machine>/quality.json and .md.
"""

import argparse
import gc
import math
import re
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import progress, save_results  # noqa: E402
from bench.off_grid import off_grid_model  # noqa: E402
from bench.perplexity import (  # noqa: E402
    BaseFile,
    Scores,
    base_perplexity,
    bits_per_weight,
    first_difference,
    run_against_base,
    run_base,
)
from bench.probes.dev_model import load_runner  # noqa: E402
from bench.weights import element_counts_of, served_weight_bytes  # noqa: E402
from devtools.smollm2 import gguf_path  # noqa: E402
from service.engine.loading import load_tokenizer, resolve_model_dir  # noqa: E402
from service.settings import Settings  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")
# llama-perplexity's default context, which the figures llama.cpp's users quote are measured with.
WINDOW = 512
REFERENCE = "float32"
DTYPES = (REFERENCE, "bfloat16", "int8", "int4", "int4m")
PEER_REFERENCE = "f32"
PEER_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_K_M")
# The table groups formats by width, so that each of corechat's stands beside llama.cpp's of its width.
WIDTHS = {"float32": 32, "f32": 32, "bfloat16": 16, "bf16": 16, "f16": 16, "int8": 8, "int4": 4, "int4m": 4}
# llama-perplexity leaves a reference token out of the KL divergence below this log-probability (its
# base file stores log-probabilities only down to it); the cross-check of the references does the same.
PEER_LOG_PROB_FLOOR = -16.0
# Room for one window's KV state, whatever the model.
KV_CACHE_MB = 256


def read_text(path: Path) -> str:
    """Read the text as llama-perplexity's -f reads it: the file less one final newline."""
    text = path.read_text(encoding="utf-8")
    return text.removesuffix("\n")


def text_tokens(tokenizer, text: str) -> tuple[list[int], int | None]:
    """Tokenize the whole text with the special tokens the tokenizer adds, as llama-perplexity does; return
    the ids and the BOS id where the tokenizer put one first (each window then starts with it), else None."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if ids == plain:
        return ids, None
    if tokenizer.bos_token_id is not None and ids == [tokenizer.bos_token_id, *plain]:
        return ids, tokenizer.bos_token_id
    raise ValueError("the tokenizer adds tokens other than a first BOS, which llama-perplexity does not score")


def windows_of(ids: list[int], window: int, bos: int | None) -> list[list[int]]:
    """Cut token ids into llama-perplexity's windows: every whole window, its first id the BOS where there is one."""
    if len(ids) < 2 * window:
        raise ValueError(f"the text has {len(ids)} tokens; llama-perplexity scores windows of {window} in at least "
                         f"{2 * window}")
    windows = [ids[start:start + window] for start in range(0, len(ids) - window + 1, window)]
    return [[bos, *chunk[1:]] for chunk in windows] if bos is not None else windows


def scored_positions(window: int) -> range:
    """Return the positions llama-perplexity scores in a window: the second half's, less the last (no token follows it)."""
    return range(window // 2, window - 1)


class Tally:
    """Per scored position: the negative log-likelihood of the text's next token, the KL divergence of the
    format's distribution from the reference's, and whether both rank the same token first."""

    def __init__(self):
        self.nll: list[np.ndarray] = []
        self.kld: list[np.ndarray] = []
        self.same: list[np.ndarray] = []

    def add(self, reference: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor,
            floor: float | None = None) -> None:
        """Add a window's positions ([positions, vocabulary] log-probabilities; reference tokens at or below
        `floor` left out of the KL divergence, where given)."""
        reference, log_probs = reference.double(), log_probs.double()
        terms = reference.exp() * (reference - log_probs)
        if floor is not None:
            terms = torch.where(reference > floor, terms, 0.0)
        self.kld.append(terms.sum(dim=-1).numpy())
        self.nll.append(-log_probs.gather(1, targets[:, None])[:, 0].numpy())
        self.same.append((log_probs.argmax(dim=-1) == reference.argmax(dim=-1)).numpy())

    @property
    def perplexity(self) -> float:
        """Return the text's perplexity over the positions added."""
        return math.exp(float(np.concatenate(self.nll).mean()))

    def scores(self, bits: float, reference_perplexity: float) -> Scores:
        """Summarize the positions as llama-perplexity does (its percentiles interpolate linearly)."""
        kld = np.concatenate(self.kld)
        return Scores(bits_per_weight=bits, perplexity=self.perplexity,
                      perplexity_ratio=self.perplexity / reference_perplexity, kld_mean=float(kld.mean()),
                      kld_median=float(np.median(kld)), kld_99=float(np.quantile(kld, 0.99)),
                      kld_max=float(kld.max()), top1_same=float(np.concatenate(self.same).mean()))


def agreed_tokens(tokenizer, ids: list[int], bos: int | None, base: BaseFile) -> tuple[list[int], int | None, str]:
    """Return the ids both sides score, their BOS, and what comparing corechat's ids with llama-perplexity's
    found: corechat's where they agree, else llama.cpp's (the ids llama-perplexity scored)."""
    at = first_difference(ids, base)
    if at is None:
        return ids, bos, "identical on both sides (corechat's tokenizer and llama-perplexity's base file)"
    theirs, their_bos = base.scored_ids(tokenizer.bos_token_id)
    found = (f"**corechat's tokenizer differs from llama.cpp's** from token {at} on (corechat "
             f"{[tokenizer.decode([token]) for token in ids[at:at + 3]]}, llama.cpp "
             f"{[tokenizer.decode([token]) for token in theirs[at:at + 3]]}); both sides scored llama.cpp's ids")
    progress(found)
    return theirs, their_bos, found


def window_log_probs(runner, window_ids: list[int]) -> torch.Tensor:
    """Run a window as one prompt pass, as a worker passes a prompt; return the log-probabilities of the scored positions."""
    positions = scored_positions(len(window_ids))
    kv = runner.reserve(len(window_ids))
    try:
        with torch.inference_mode():
            logits = runner.prefill(kv, window_ids, keep_last=len(window_ids) - positions.start)
    finally:
        runner.release(kv)
    return torch.log_softmax(logits[:len(positions)].float(), dim=-1)


def corechat_side(model_dir: Path, dtypes: list[str], windows: list[list[int]],
                  base: BaseFile | None) -> tuple[dict[str, Scores], dict[str, str], Scores | None]:
    """Score each DTYPE against float32 (run first, as the reference); return the scores, how each DTYPE ran
    (its weight format and forward), and float32 scored against llama.cpp's f32 base where there is one."""
    first = scored_positions(len(windows[0])).start
    targets = [torch.tensor(window[first + 1:]) for window in windows]
    parameters = sum(element_counts_of(model_dir).values())
    reference: list[torch.Tensor] = []
    scores, runs, against_peer = {}, {}, None
    for dtype in [REFERENCE, *(dtype for dtype in dtypes if dtype != REFERENCE)]:
        progress(f"corechat {dtype}: loading {model_dir.name}")
        runner, _, prepared = load_runner(model_dir, dtype, KV_CACHE_MB)
        runs[dtype] = f"{prepared.weight_format}, {prepared.forward} forward"
        tally, peer_tally = Tally(), Tally()
        for index, (window, target) in enumerate(zip(windows, targets, strict=True)):
            log_probs = window_log_probs(runner, window)
            if dtype == REFERENCE:
                reference.append(log_probs)
                if base is not None:
                    peer_tally.add(torch.from_numpy(base.log_probs(index)), log_probs, target, PEER_LOG_PROB_FLOOR)
            tally.add(reference[index], log_probs, target)
        progress(f"corechat {dtype}: {len(windows)} windows scored ({prepared.forward} forward)")
        converted = Path(prepared.converted_weights) if prepared.converted_weights else None
        bits = 8 * served_weight_bytes(model_dir, dtype, converted) / parameters
        if dtype == REFERENCE:
            scores[dtype] = Scores(bits_per_weight=bits, perplexity=tally.perplexity, perplexity_ratio=1.0)
            if base is not None:
                against_peer = peer_tally.scores(bits, base.perplexity(targets))
        else:
            scores[dtype] = tally.scores(bits, scores[REFERENCE].perplexity)
        del runner, prepared
        gc.collect()
    return scores, runs, against_peer


def peer_side(model_dir: Path, formats: list[str], text: Path, base_path: Path, threads: int) -> dict[str, Scores]:
    """Convert the folder to llama.cpp's f32 and quantize it, then score the f32 file (writing the base file)
    and each quantization against it with llama-perplexity."""
    from bench.peer import build, convert

    toolchain = build()
    files = convert(toolchain, model_dir, outtype=PEER_REFERENCE, quantizations=tuple(formats))
    progress(f"llama.cpp {PEER_REFERENCE}: llama-perplexity over {text.name}")
    output = run_base(toolchain, files[PEER_REFERENCE], text, base_path, window=WINDOW, threads=threads)
    scores = {PEER_REFERENCE: Scores(bits_per_weight=bits_per_weight(files[PEER_REFERENCE]),
                                     perplexity=base_perplexity(output),
                                     perplexity_ratio=1.0)}
    for name in formats:
        progress(f"llama.cpp {name}: llama-perplexity --kl-divergence")
        scores[name] = run_against_base(toolchain, files[name], base_path, window=WINDOW, threads=threads)
    return scores


def width_of(name: str) -> int:
    """Return a format's nominal bits per weight: its width in WIDTHS, or the digit of a llama.cpp type (q5_K_M: 5)."""
    found = re.match(r"[a-z]+(\d+)", name.lower())
    return WIDTHS.get(name) or (int(found.group(1)) if found else 0)


def render(results: dict) -> str:
    """Return the table: every format of both sides, widest first, each beside its float32."""
    rows = [(f"corechat {name}", name, figures) for name, figures in results["corechat"].items()]
    rows += [(f"llama.cpp {name}", name, figures) for name, figures in results["llama.cpp"].items()]
    rows.sort(key=lambda row: -width_of(row[1]))

    def shown(value: float | None, pattern: str) -> str:
        return "—" if value is None else pattern.format(value)

    lines = ["| format | bits/weight | perplexity | PPL ratio to its float32 | mean KLD | 99% KLD | "
             "top-1 same as float32 |", "|---|---|---|---|---|---|---|"]
    for label, _, figures in rows:
        lines.append(f"| {label} | {figures['bits_per_weight']:.2f} | {figures['perplexity']:.4f} | "
                     f"{figures['perplexity_ratio']:.4f} | {shown(figures['kld_mean'], '{:.5f}')} | "
                     f"{shown(figures['kld_99'], '{:.4f}')} | {shown(figures['top1_same'], '{:.2%}')} |")
    text = results["text"]
    notes = [f"Text: {text['file']} ({text['tokens']} tokens by corechat's tokenizer), {text['windows']} windows of "
             f"{text['window']} tokens, {text['scored_tokens']} scored tokens (positions {text['scored_positions']} "
             f"of each window); {text['bos']}. Token ids: {results['token_ids']}.",
             "KLD: KL(P_float32 || P_format) per scored position, in nats; each side's float32 is its reference "
             "(llama.cpp's from its base file of 16-bit log-probabilities). bits/weight: the weights' bytes as "
             "loaded over the parameters, scales included; corechat's quantized formats keep the embedding in bfloat16 "
             "beside their quantized output layer, a second copy of it where the model ties the two.",
             "corechat ran: " + "; ".join(f"{name} as {run}" for name, run in results["runs"].items()) + "."]
    cross = results.get("corechat_float32_against_llama_cpp_f32")
    if cross:
        notes.append(f"The references compared: corechat float32 against llama.cpp f32 (as llama-perplexity "
                     f"scores a quantization): PPL ratio {cross['perplexity_ratio']:.4f}, mean KLD "
                     f"{cross['kld_mean']:.6f}, 99% KLD {cross['kld_99']:.5f}, top-1 same {cross['top1_same']:.2%} "
                     f"(its KLD resolved to the base file's 16-bit log-probabilities).")
    return (f"## Quality of each weight format: {results['model']}\n\n" + "\n".join(lines) + "\n\n"
            + "\n\n".join(notes) + "\n")


def main() -> None:
    """Score every format of both sides over the text and report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a GGUF file or a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                        help="corechat's DTYPEs (float32, the reference, always runs)")
    parser.add_argument("--peer-formats", nargs="+", default=list(PEER_FORMATS),
                        help="llama-quantize types scored against llama.cpp's f32")
    parser.add_argument("--no-peer", action="store_true", help="corechat alone")
    parser.add_argument("--off-grid", action="store_true",
                        help="score the model with its weights moved off the grid its GGUF file stored them on")
    parser.add_argument("--name", default="quality", help="the results file's name")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = args.model or gguf_path()
    converted = Path(Settings().converted_weights_dir)
    model_dir = resolve_model_dir(str(model), converted)
    if args.off_grid:
        model_dir = off_grid_model(model_dir, converted)
    tokenizer = load_tokenizer(model_dir)
    ids, bos = text_tokens(tokenizer, read_text(TEXT))
    results = {"model": model.name + (", its weights moved off their grid (bench/off_grid.py)" if args.off_grid else ""),
               "model_dir": model_dir.name, "threads": args.threads, "llama.cpp": {},
               "token_ids": "corechat's tokenizer's (not compared: no llama.cpp run)"}
    text = {"file": str(TEXT), "tokens": len(ids)}
    with tempfile.TemporaryDirectory(prefix="corechat-quality-") as scratch:
        base = None
        if not args.no_peer:
            base_path = Path(scratch) / "base.dat"
            results["llama.cpp"] = peer_side(model_dir, args.peer_formats, TEXT, base_path, args.threads)
            base = BaseFile.read(base_path)
            ids, bos, results["token_ids"] = agreed_tokens(tokenizer, ids, bos, base)
        windows = windows_of(ids, WINDOW, bos)
        corechat, results["runs"], against_peer = corechat_side(model_dir, args.dtypes, windows, base)
    positions = scored_positions(WINDOW)
    results["text"] = {**text, "window": WINDOW, "windows": len(windows),
                       "scored_positions": f"{positions.start}..{positions.stop - 1}",
                       "scored_tokens": len(windows) * len(positions),
                       "bos": f"each window starts with BOS {bos}" if bos is not None else "no BOS (the vocabulary adds none)"}
    results["corechat"] = corechat
    results["corechat_float32_against_llama_cpp_f32"] = against_peer
    record = {key: ({name: asdict(figures) for name, figures in value.items()} if key in ("corechat", "llama.cpp")
                    else asdict(value) if isinstance(value, Scores) else value) for key, value in results.items()}
    save_results(args.name, record, render(record))


if __name__ == "__main__":
    main()
