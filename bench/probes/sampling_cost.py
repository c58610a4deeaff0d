"""What the model's default sampling costs a served stream against greedy decoding, taking turns.

`python bench/probes/sampling_cost.py [--dtype int8] [--rounds 8] [--tokens 300] [--set NAME=VALUE]`
starts the working tree as one Gunicorn server on the dev model (`make serve`'s settings, each
`--set` added: `--set SPECULATIVE_TOKENS=0` leaves speculation out) and sends it one streamed chat
completion of `--tokens` tokens greedily and one as a client that names no sampling sends it (the
model's generation_config: Qwen2.5's top-p/top-k draw with its repetition penalty), the order
alternating round by round. Beside each stream's decode rate it reads the draft tokens speculation
took (/metrics' corechat_speculative_tokens_total before and after): on the dev model's random weights a greedy
reply repeats itself, its drafts are taken and its steps yield more than a token, which a sampled
reply's seldom do, so the two rates differ by more than the sampler's cost. Prints a table and
writes bench/results/<machine>/<name>.json and .md (--name, default sampling-cost) with the CPU,
date and commit.
"""

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import progress, save_results  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from harness.client import stream_chat  # noqa: E402
from harness.observe import scrape, value  # noqa: E402
from harness.servers import GunicornServer  # noqa: E402
from service.topology import physical_cores  # noqa: E402

WAYS = ("greedy", "defaults")


def accepted_drafts(server) -> int:
    """Return the draft tokens every worker of the server has taken (/readyz tells the answering worker's)."""
    return round(value(scrape(server), "corechat_speculative_tokens_total", outcome="accepted"))


def main() -> None:
    """Alternate greedy and default-sampled streams on one server and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a corechat setting")
    parser.add_argument("--name", default="sampling-cost", help="the results files' name")
    args = parser.parse_args()
    settings = dict(item.split("=", 1) for item in args.set)
    from devtools.devmodel import build_dev_model

    model = build_dev_model(DEV_MODEL_DIR, preset="qwen2.5-0.5b")
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    drafts: dict[str, list[int]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as scratch:
        server = GunicornServer(Path(scratch), workers=physical_cores(), model=model, dtype=args.dtype,
                                **{name.lower(): value for name, value in settings.items()})
        progress(f"starting the server ({args.dtype}; a first start converts the weights)")
        server.start(timeout=900)
        try:
            tag = uuid.uuid4().hex[:8]
            for round_index in range(args.rounds):
                for way in WAYS if round_index % 2 == 0 else reversed(WAYS):
                    messages = [{"role": "user", "content": f"{tag} {round_index} {way}: tell me a long story."}]
                    before = accepted_drafts(server)
                    result = stream_chat(server.url, messages, args.tokens, greedy=way == "greedy")
                    if result.error:
                        raise RuntimeError(f"the {way} stream failed: {result.error}")
                    rates[way].append(result.decode_tokens_per_second)
                    drafts[way].append(accepted_drafts(server) - before)
                progress(f"round {round_index + 1}: greedy {rates['greedy'][-1]:.1f}, "
                         f"defaults {rates['defaults'][-1]:.1f} tok/s")
        finally:
            server.stop()
    # The defaults' decode time over greedy's: above 1, sampling costs.
    costs = [greedy / sampled for greedy, sampled in zip(rates["greedy"], rates["defaults"], strict=True)]
    results = {"dtype": args.dtype, "tokens": args.tokens, "rounds": args.rounds, "settings": settings,
               "tokens_per_second": rates, "accepted_draft_tokens": drafts, "decode_time_ratios": costs}
    shown = "".join(f", {name}={value}" for name, value in settings.items())
    table = (f"## Default sampling against greedy, one served stream of {args.tokens} tokens: {args.dtype}{shown}, "
             f"{args.rounds} alternating rounds (decode time with the defaults over greedy's: above 1, sampling "
             "costs)\n\n| | greedy | draft tokens taken | defaults | draft tokens taken | time ratio |\n"
             "|---|---|---|---|---|---|\n"
             + "".join(f"| round {index + 1} | {rates['greedy'][index]:.1f} tok/s | {drafts['greedy'][index]} | "
                       f"{rates['defaults'][index]:.1f} tok/s | {drafts['defaults'][index]} | {costs[index]:.3f} |\n"
                       for index in range(args.rounds))
             + f"| median | {statistics.median(rates['greedy']):.1f} tok/s | {statistics.median(drafts['greedy'])} | "
               f"{statistics.median(rates['defaults']):.1f} tok/s | {statistics.median(drafts['defaults'])} | "
               f"{statistics.median(costs):.3f} |\n")
    save_results(args.name, results, table)


if __name__ == "__main__":
    main()
