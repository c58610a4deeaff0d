"""What chat frontends send, beside llama.cpp's server: conversations resent whole every turn, and a
short question behind a long pasted document.

    python bench/conversations.py              # 3 alternating rounds on the Qwen2.5-0.5B-shaped model
    python bench/conversations.py --quick      # the tiny model, one round: checks that it all runs

Each round runs every server in turn (corechat in its default shape, llama-server, corechat with one
worker), so a ratio compares runs minutes apart, not a morning with an afternoon; the tables give
medians over the rounds with the spread. llama-server is bench/peer.py's build (q8_0, 4 slots,
corechat's threads); corechat runs DTYPE=int8 through real Gunicorn. Results go to
bench/results/<machine>/<name>.json and .md with the CPU, its kernel paths, the date and the commit.
"""

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import CACHE_DIR, progress, save_results, start_corechat  # noqa: E402
from harness import StreamResult, free_port, stream_chat  # noqa: E402
from service.topology import physical_cores  # noqa: E402

# One sentence of a user's message: 16 Qwen2 tokens.
SENTENCE = "Please keep the following notes in mind while you answer the question below. "
CONTEXT_TOKENS = 8192
PEER_SLOTS = 4


class Sizes:
    """How big a run is."""

    def __init__(self, quick: bool):
        self.preset = "tiny" if quick else "qwen2.5-0.5b"
        self.rounds = 1 if quick else 3
        self.sessions, self.turns = (2, 3) if quick else (4, 6)
        self.user_sentences = 5  # about 80 tokens
        self.reply_tokens = 8 if quick else 48
        self.document_sentences = 30 if quick else 315  # about 5,050 tokens
        self.short_delay_seconds = 0.5


# Scenarios -----------------------------------------------------------------------------------


def conversation(url: str, sizes: Sizes, tag: str) -> list[StreamResult]:
    """Run one chat session: every turn resends the system prompt, all earlier turns and a new message."""
    messages = [{"role": "system", "content": f"You are a helpful assistant (session {tag})."}]
    turns = []
    for turn in range(sizes.turns):
        messages.append({"role": "user", "content": f"Turn {turn}. " + SENTENCE * sizes.user_sentences})
        result = stream_chat(url, messages, sizes.reply_tokens)
        turns.append(result)
        messages.append({"role": "assistant", "content": result.text})
    return turns


def multi_turn(url: str, sizes: Sizes) -> dict:
    """Run the sessions at once; return each turn's first-token times, reuse, and the wall time."""
    sessions: list[list[StreamResult]] = [[] for _ in range(sizes.sessions)]

    def run(index: int) -> None:
        sessions[index] = conversation(url, sizes, f"{index}-{uuid.uuid4().hex[:8]}")

    threads = [threading.Thread(target=run, args=(index,)) for index in range(sizes.sessions)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    by_turn = list(zip(*sessions, strict=True))
    # Of what a turn could reuse (the previous turn's prompt and reply, less the reply's last token),
    # the share the server did reuse; it falls short where a reply's text tokenises otherwise.
    reuse = [session[turn].cached_tokens / max(1, session[turn - 1].prompt_tokens + session[turn - 1].completion_tokens - 1)
             for session in sessions for turn in range(1, sizes.turns)]
    return {
        "first_token_seconds_by_turn": [statistics.median(result.first_token_seconds for result in turn) for turn in by_turn],
        "wall_seconds": wall,
        "reuse_of_previous_turn": statistics.median(reuse) if reuse else 0.0,
        "errors": [result.error for session in sessions for result in session if result.error],
    }


def document(sizes: Sizes) -> list[dict]:
    """Return a chat whose one message is a long pasted document, unique from its first token."""
    return [{"role": "user", "content": f"Document {uuid.uuid4().hex[:8]}. " + SENTENCE * sizes.document_sentences}]


def short_behind_long(url: str, sizes: Sizes) -> dict:
    """Time a long document alone, then the same length with a one-line question sent just after it."""
    alone = stream_chat(url, document(sizes), 4)
    results: dict[str, StreamResult] = {}
    long = threading.Thread(target=lambda: results.setdefault("long", stream_chat(url, document(sizes), 4)))
    long.start()
    time.sleep(sizes.short_delay_seconds)
    results["short"] = stream_chat(url, [{"role": "user", "content": f"({uuid.uuid4().hex[:8]}) What is 2 + 2?"}], 4)
    long.join()
    return {
        "long_prompt_tokens": alone.prompt_tokens,
        "long_alone_first_token_seconds": alone.first_token_seconds,
        # From the short request's own send, as its client sees it.
        "short_first_token_seconds": results["short"].first_token_seconds,
        "long_first_token_seconds": results["long"].first_token_seconds,
        "errors": [result.error for result in (alone, *results.values()) if result.error],
    }


# Servers -------------------------------------------------------------------------------------


def with_corechat(scratch: Path, model_dir: Path, measure, **settings) -> dict:
    """Start corechat (int8, Gunicorn from gunicorn.conf.py), measure, stop."""
    server, _ = start_corechat(scratch, model_dir, "", dtype="int8", **settings)
    try:
        return measure(server.url)
    finally:
        server.stop()


def with_peer(scratch: Path, peer_model: Path, measure) -> dict:
    """Start llama-server (q8_0, PEER_SLOTS slots, corechat's threads), measure, stop."""
    from bench.peer import LlamaServer, toolchain_for

    server = LlamaServer(toolchain_for(), peer_model, scratch, port=free_port(), threads=physical_cores(),
                         slots=PEER_SLOTS, context_per_slot=CONTEXT_TOKENS)
    server.start()
    try:
        return measure(server.url)
    finally:
        server.stop()


def run(sizes: Sizes, peer: bool, settings: dict | None = None) -> dict:
    """Run the rounds (`settings` for the multi-turn corechat server); return every round's figures."""
    from devtools.devmodel import build_dev_model

    model_dir = CACHE_DIR / ("test-tiny" if sizes.preset == "tiny" else f"bench-{sizes.preset}")
    build_dev_model(model_dir, sizes.preset)
    peer_model = None
    if peer:
        from bench.peer import build, convert

        peer_model = convert(build(), model_dir)["q8_0"]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="corechat-conversations-") as scratch:
        scratch = Path(scratch)
        for number in range(sizes.rounds):
            progress(f"round {number + 1} of {sizes.rounds}")
            figures = {}
            progress("corechat, default shape: multi-turn")
            figures["corechat"] = with_corechat(scratch, model_dir, lambda url: {"multi_turn": multi_turn(url, sizes)},
                                                **{"max_model_len": CONTEXT_TOKENS, **(settings or {})})
            if peer_model is not None:
                progress("llama-server: multi-turn, short behind long")
                figures["llama.cpp"] = with_peer(scratch, peer_model, lambda url: {
                    "multi_turn": multi_turn(url, sizes), "short_behind_long": short_behind_long(url, sizes)})
            progress("corechat, WORKERS=1: short behind long")
            figures["corechat_one_worker"] = with_corechat(
                scratch, model_dir, lambda url: {"short_behind_long": short_behind_long(url, sizes)},
                workers=1, max_model_len=CONTEXT_TOKENS)
            rounds.append(figures)
    return {"machine": {"physical_cores": physical_cores()}, "sizes": vars(sizes), "settings": settings or {}, "rounds": rounds}


# Tables --------------------------------------------------------------------------------------


def spread(values: list[float], unit: str = "s") -> str:
    """Return the median of values with their range."""
    if len(values) == 1:
        return f"{values[0]:.2f}{unit}"
    return f"{statistics.median(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def render(name: str, results: dict) -> str:
    """Return the markdown tables of a run."""
    rounds, sizes, machine_facts = results["rounds"], results["sizes"], results["machine"]
    lines = [f"# {name}", "",
             f"{machine_facts['physical_cores']} physical cores; {len(rounds)} rounds, medians (range)."
             + "".join(f" Multi-turn corechat with {key.upper()}={value}." for key, value in results.get("settings", {}).items()), "",
             f"## Multi-turn: {sizes['sessions']} sessions x {sizes['turns']} turns, {sizes['reply_tokens']}-token replies", "",
             "| server | " + " | ".join(f"turn {turn + 1}" for turn in range(sizes["turns"])) + " | wall | reuse |",
             "|---|" + "---|" * (sizes["turns"] + 2)]
    servers = [server for server in ("corechat", "llama.cpp") if server in rounds[0]]
    for server in servers:
        runs = [figures[server]["multi_turn"] for figures in rounds]
        cells = [spread([run["first_token_seconds_by_turn"][turn] for run in runs]) for turn in range(sizes["turns"])]
        reuse = statistics.median(run["reuse_of_previous_turn"] for run in runs)
        lines.append(f"| {server} | " + " | ".join(cells) + f" | {spread([run['wall_seconds'] for run in runs])} | {reuse:.0%} |")
    if "llama.cpp" in servers:
        ratios = [ratio_of_turns(figures) for figures in rounds]
        lines += ["", "corechat / llama.cpp, per round: turns 2+ median first token "
                  + ", ".join(f"{later:.2f}x" for later, _ in ratios) + "; wall " + ", ".join(f"{wall:.2f}x" for _, wall in ratios)]
    lines += ["", "## A one-line question 0.5 s behind a long document (first token, seconds)", "",
              "| server | document alone | question behind it | document behind itself |", "|---|---|---|---|"]
    for server, label in (("corechat_one_worker", "corechat WORKERS=1"), ("llama.cpp", "llama.cpp")):
        if server not in rounds[0]:
            continue
        runs = [figures[server]["short_behind_long"] for figures in rounds]
        lines.append(f"| {label} ({runs[0]['long_prompt_tokens']} tokens) | "
                     f"{spread([run['long_alone_first_token_seconds'] for run in runs])} | "
                     f"{spread([run['short_first_token_seconds'] for run in runs])} | "
                     f"{spread([run['long_first_token_seconds'] for run in runs])} |")
    errors = [error for figures in rounds for server in figures.values() for scenario in server.values()
              for error in scenario["errors"]]
    lines += ["", f"Errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""), ""]
    return "\n".join(lines)


def ratio_of_turns(figures: dict) -> tuple[float, float]:
    """Return one round's corechat / llama.cpp ratios: turns 2+ median first token, and wall time."""
    mine, theirs = figures["corechat"]["multi_turn"], figures["llama.cpp"]["multi_turn"]
    later = statistics.median(mine["first_token_seconds_by_turn"][1:]) / statistics.median(theirs["first_token_seconds_by_turn"][1:])
    return later, mine["wall_seconds"] / theirs["wall_seconds"]


def main() -> None:
    """Run the benchmark, print the tables and write the results files."""
    parser = argparse.ArgumentParser(prog="python bench/conversations.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model and one round: checks that it all runs")
    parser.add_argument("--no-peer", action="store_true", help="corechat only (no llama.cpp build needed)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 1)")
    parser.add_argument("--name", help="results file name (default: conversations or conversations-quick)")
    parser.add_argument("--results-dir", type=Path, help="default: bench/results/<this machine>/")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a corechat setting of the multi-turn server, e.g. --set WORKERS=4 --set TORCH_THREADS=1")
    args = parser.parse_args()
    sizes = Sizes(args.quick)
    if args.rounds:
        sizes.rounds = args.rounds
    name = args.name or ("conversations-quick" if args.quick else "conversations")
    settings = {name.lower(): value for name, value in (item.split("=", 1) for item in args.set)}
    results = run(sizes, peer=not args.no_peer, settings=settings)
    written = save_results(name, results, render(name, results), args.results_dir)
    progress(f"wrote {written}.json and .md")


if __name__ == "__main__":
    main()
