"""Streams gathered on one worker (GATHER_STREAMS) against the same shape without, alternating over rounds.

    python bench/gathering.py [--rounds 3] [--formats int8 int4]

Each round starts corechat in its default shape (a worker per core) with GATHER_STREAMS on, then off
(the order reversed every other round), and starts 1, 4 and 8 of bench/versus.py's short chats at
once against each: all their tokens over the wall time, first tokens included.
The tables give medians over the rounds with their range, and each round's ratio; results go to
bench/results/<machine>/<name>.json and .md with the CPU, the date and the commit.
"""

import argparse
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import CACHE_DIR, progress, save_results  # noqa: E402
from bench.versus import PEER_QUANTIZATION, REPLY_TOKENS, short, spread, with_corechat  # noqa: E402
from harness import concurrent_streams  # noqa: E402

STREAM_COUNTS = (1, 4, 8)
SHAPES = {"gathering": {}, "not gathering": {"gather_streams": False}}


def measure(url: str, _pids) -> dict:
    """Return the aggregate tokens per second of each stream count."""
    tag = uuid.uuid4().hex[:8]
    concurrent_streams(url, [short(f"{tag} warm")], 8)
    figures = {}
    for streams in STREAM_COUNTS:
        results, wall = concurrent_streams(url, [short(f"{tag} x{streams} {index}") for index in range(streams)],
                                           REPLY_TOKENS)
        errors = [run.error for run in results if run.error]
        if errors:
            raise RuntimeError(f"{streams} streams: {errors[:3]}")
        figures[streams] = sum(run.completion_tokens for run in results) / wall
    return figures


def render(name: str, results: dict) -> str:
    """Return the markdown table of a run."""
    lines = [f"# {name}", "", f"corechat's default shape, {REPLY_TOKENS}-token greedy replies to short chats, "
             f"{len(results['rounds'])} alternating rounds: aggregate tokens/s, median (range), and each round's "
             "ratio of gathering to not.", ""]
    for fmt in results["formats"]:
        lines += [f"| {fmt}: streams at once | gathering | not gathering | ratio, per round |", "|---|---|---|---|"]
        for streams in STREAM_COUNTS:
            on = [one[f"gathering {fmt}"][streams] for one in results["rounds"]]
            off = [one[f"not gathering {fmt}"][streams] for one in results["rounds"]]
            ratios = ", ".join(f"{a / b:.2f}x" for a, b in zip(on, off, strict=True))
            lines.append(f"| {streams} | {spread(on, 1)} | {spread(off, 1)} | {ratios} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    """Run the rounds, print the tables and write the results files."""
    parser = argparse.ArgumentParser(prog="python bench/gathering.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", nargs="+", default=["int8"], choices=sorted(PEER_QUANTIZATION))
    parser.add_argument("--name", default="gathering")
    args = parser.parse_args()
    from devtools.devmodel import build_dev_model

    model_dir = CACHE_DIR / "bench-qwen2.5-0.5b"
    build_dev_model(model_dir, "qwen2.5-0.5b")
    results = {"formats": args.formats, "rounds": [], "reply_tokens": REPLY_TOKENS}
    with tempfile.TemporaryDirectory(prefix="corechat-gathering-") as scratch:
        for number in range(args.rounds):
            figures = {}
            for fmt in args.formats:
                shapes = list(SHAPES.items())
                for shape, settings in shapes if number % 2 == 0 else reversed(shapes):
                    progress(f"round {number + 1} of {args.rounds}: {shape} {fmt}")
                    figures[f"{shape} {fmt}"] = with_corechat(Path(scratch), model_dir, measure, dtype=fmt, **settings)
            results["rounds"].append(figures)
    table = render(args.name, results)
    save_results(args.name, results, table)


if __name__ == "__main__":
    main()
