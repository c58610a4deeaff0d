"""corechat beside llama.cpp's llama-server (or ik_llama.cpp's), servers alternating over rounds: decode,
throughput, long prompts, conversations.

    python bench/versus.py                 # 3 rounds on the Qwen2.5-0.5B-shaped dev model (about 15 min a round)
    python bench/versus.py --rounds 5 --formats int8
    python bench/versus.py --quick         # the tiny model, one round, short scenarios: checks that it all runs
    python bench/versus.py --isa avx2 --no-conversations   # both servers on AVX2 at most (an AVX2-only CPU's work)
    python bench/versus.py --peer ik_llama.cpp   # beside the CPU-tuned fork (built first: bench/ik_peer.py)

`python bench/run.py --peer` runs it after its own scenarios. Each round starts every server in turn
(corechat DTYPE=int8 in its default shape, llama-server q8_0, corechat int4, llama-server q4_0; the
order reversed every other round), so a ratio compares runs minutes apart; one pass on a shared
machine moves a ratio by up to a quarter, so the tables give the median over the rounds and the
range, and each round's ratio. Both servers get the same threads (corechat's default shape: a
worker per core), the same client (harness/client.py's streaming client) and the same model folder
(llama-server: bench/peer.py's build and GGUF conversion, MAX_RUNNING slots). Scenarios:
- decode: one stream of a short chat, REPLY_TOKENS greedy tokens: decode tokens/s (median of 3);
- aggregate: 4 and 8 such streams at once: all their tokens over the wall time;
- long prompts: the first token of a unique ~850- and ~5,000-token prompt;
- (int8 only) multi-turn: 4 sessions x 6 turns, each turn resending the whole conversation;
  and a one-line question 0.5 s behind a ~5,000-token document (corechat WORKERS=1 then, one
  process as llama-server is: bench/conversations.py's scenarios).
--no-conversations leaves out the two conversation scenarios. --isa avx2 runs corechat with
KERNEL_PATH=avx2 and a llama.cpp built for AVX2 at most (bench/peer.py), so an AVX-512 CPU compares
what an AVX2-only CPU runs. --peer ik_llama.cpp runs the fork's latest build on this CPU (or builds
--peer-source, a clone) with its own q8_0 and q4_0 files, repacked at load (-rtr); the tables
and the results name the peer and its commit. The machine is probed first, in the same command: its read bandwidth (a decode step's bound) and
each kernel path's peak multiply-add rate. Results go to bench/results/<machine>/<name>.json and
.md with the CPU, its kernel paths, the date and the commit.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import CACHE_DIR, progress, save_results, start_corechat  # noqa: E402
from bench.conversations import SENTENCE, Sizes, multi_turn, short_behind_long  # noqa: E402
from bench.peer import LlamaServer, Toolchain, shown_command  # noqa: E402
from bench.peers import PEERS, prepare  # noqa: E402
from bench.probes import run_probe  # noqa: E402
from bench.weights import weight_bytes_per_token  # noqa: E402
from harness import concurrent_streams, free_port, memory_of, processes_of, stream_chat  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.topology import physical_cores  # noqa: E402

# Each format beside llama.cpp's of the same width; int4m (5 bits a weight, as q4_1) also beside q4_0, the
# 4-bit format users pick for speed, where a run holds int4 too.
PEER_QUANTIZATION = {"int8": "q8_0", "int4": "q4_0", "int4m": "q4_1"}
DEFAULT_FORMATS = ("int8", "int4")
CONTEXT_TOKENS = 8192
REPLY_TOKENS = 128
STREAM_COUNTS = (4, 8)
# User sentences (15 tokens each) of the long prompts: about 850 and 5,000 tokens with the template.
LONG_PROMPTS = {"850": 57, "5000": 334}


def formats_for(dtype: str) -> list[str]:
    """Return the formats a run compares: the default ones, the served one first."""
    return [dtype, *(fmt for fmt in DEFAULT_FORMATS if fmt != dtype)] if dtype in PEER_QUANTIZATION else list(DEFAULT_FORMATS)


def chat(sentences: int, tag: str) -> list[dict]:
    """Return a one-message chat of `sentences` sentences, unique from its first token."""
    return [{"role": "user", "content": f"({tag}) " + SENTENCE * sentences + "Summarise the notes."}]


def short(tag: str) -> list[dict]:
    """Return a short chat, unique from its first token."""
    return [{"role": "user", "content": f"({tag}) Explain in two sentences why the sky is blue."}]


def default_sampling(model_dir: Path) -> dict:
    """Return the sampling a corechat client gets by default, the model's generation_config.json, as the
    body fields llama-server takes (with its own min_p off, which corechat does not apply)."""
    defaults = json.loads((model_dir / "generation_config.json").read_text())
    if not defaults.get("do_sample"):
        return {"temperature": 0}
    return {"temperature": defaults.get("temperature", 1.0), "top_p": defaults.get("top_p", 1.0),
            "top_k": defaults.get("top_k", 0), "repeat_penalty": defaults.get("repetition_penalty", 1.0), "min_p": 0}


def measure(url: str, pids: list[int], reply_tokens: int, sizes: Sizes | None, long_prompts: dict[str, int],
            sampling: dict | None) -> dict:
    """Run the scenarios against one server (its processes `pids`); `sampling`: the body fields that make it
    sample as corechat's defaults (None: corechat itself, which samples so when the request names nothing)."""
    tag = uuid.uuid4().hex[:8]
    warm = stream_chat(url, short("template check"), 8)
    singles = [stream_chat(url, short(f"{tag} {index}"), reply_tokens) for index in range(3)]
    # What a client that names no sampling gets (Qwen2.5's generation_config samples), seeded alike.
    sampled = [stream_chat(url, short(f"{tag} sampled {index}"), reply_tokens, extra={"seed": index, **(sampling or {})},
                           greedy=False) for index in range(3)]
    figures = {"decode_tokens_per_second": statistics.median(run.decode_tokens_per_second for run in singles),
               "sampled_decode_tokens_per_second": statistics.median(run.decode_tokens_per_second for run in sampled),
               "short_first_token_seconds": statistics.median(run.first_token_seconds for run in singles),
               # The same chat template and tokenizer make as many tokens of the same chat (a fixed one).
               "short_prompt_tokens": warm.prompt_tokens,
               "errors": [run.error for run in (warm, *singles, *sampled) if run.error]}
    for streams in STREAM_COUNTS:
        results, wall = concurrent_streams(url, [short(f"{tag} x{streams} {index}") for index in range(streams)],
                                           reply_tokens)
        figures[f"aggregate_{streams}_tokens_per_second"] = sum(run.completion_tokens for run in results) / wall
        figures["errors"] += [run.error for run in results if run.error]
    for name, sentences in long_prompts.items():
        result = stream_chat(url, chat(sentences, f"{tag} long {name}"), 4)
        figures[f"prompt_{name}_first_token_seconds"] = result.first_token_seconds
        figures[f"prompt_{name}_tokens"] = result.prompt_tokens
        figures["errors"] += [result.error] if result.error else []
    if sizes is not None:
        figures["multi_turn"] = multi_turn(url, sizes)
        figures["errors"] += figures["multi_turn"]["errors"]
    figures["pss_bytes"] = memory_of(pids)["pss"]
    return figures


def with_corechat(scratch: Path, model_dir: Path, measure_server, **settings) -> dict:
    """Start corechat (Gunicorn from gunicorn.conf.py, the default shape unless told), measure, stop."""
    server, _ = start_corechat(scratch, model_dir, "", max_model_len=CONTEXT_TOKENS, **settings)
    try:
        return measure_server(server.url, processes_of(server))
    finally:
        server.stop()


def with_peer(scratch: Path, toolchain: Toolchain, peer_model: Path, measure_server, slots: int) -> dict:
    """Start the peer's llama-server (the same threads, `slots` sequences of CONTEXT_TOKENS), measure, stop."""
    server = LlamaServer(toolchain, peer_model, scratch, port=free_port(), threads=physical_cores(), slots=slots,
                         context_per_slot=CONTEXT_TOKENS)
    server.start()
    try:
        return measure_server(server.url, server.pids())
    finally:
        server.stop()


def probe_machine(quick: bool) -> dict:
    """Measure the read bandwidth and each kernel path's peak multiply-add rate, in child processes."""
    threads = physical_cores()
    bandwidth = run_probe("bandwidth", "--threads", str(threads), "--megabytes", "64" if quick else "1024")
    code = ("import json, sys, torch; sys.path.insert(0, sys.argv[1]); from bench.probes.prompt_probe import peak; "
            "from service.engine import kernels; kernels.load(); torch.set_num_threads(int(sys.argv[2])); "
            "print(json.dumps({path: peak(path, int(sys.argv[2]), 3) for path in kernels.available_paths() "
            "if path != 'reference'}))")
    peaks = subprocess.run([sys.executable, "-c", code, str(REPO), str(threads)], capture_output=True, text=True,
                           check=True).stdout
    import json

    return {"read_bytes_per_second": bandwidth["bytes_per_second"], "threads": threads,
            "peak_multiply_adds_per_second": json.loads(peaks.strip().splitlines()[-1])}


def run(rounds: int, formats: list[str], quick: bool, isa: str = "native", conversations: bool = True,
        peer_name: str = "llama.cpp", peer_source: Path | None = None) -> dict:
    """Probe the machine, then run the rounds beside the named peer (both servers on `isa`: native or avx2;
    ik_llama.cpp built from `peer_source` or its latest build); return every round's figures."""
    from devtools.devmodel import build_dev_model

    preset = "tiny" if quick else "qwen2.5-0.5b"
    model_dir = CACHE_DIR / ("test-tiny" if quick else f"bench-{preset}")
    build_dev_model(model_dir, preset)
    peer = prepare(peer_name, model_dir, isa=isa, source=peer_source)
    kernel = {} if isa == "native" else {"kernel_path": isa}
    sizes = Sizes(quick)
    reply_tokens = 8 if quick else REPLY_TOKENS
    long_prompts = {name: max(2, sentences // 10) for name, sentences in LONG_PROMPTS.items()} if quick else LONG_PROMPTS
    slots = Settings.model_fields["max_running"].default
    sampling = default_sampling(model_dir)
    progress("machine: read bandwidth and peak multiply-add rates")
    results = {"machine_probes": probe_machine(quick), "rounds": [], "formats": formats, "isa": isa,
               "peer": {"name": peer.name, "version": peer.version,
                        "options": shown_command(list(peer.toolchain.server_options))},
               "weight_bytes_per_token": {fmt: weight_bytes_per_token(model_dir, fmt)["bytes_per_token"] for fmt in formats},
               "default_sampling": sampling,
               "sizes": {"reply_tokens": reply_tokens, "stream_counts": list(STREAM_COUNTS), "slots": slots,
                         "conversations": vars(sizes)}}
    with tempfile.TemporaryDirectory(prefix="corechat-versus-") as scratch:
        scratch = Path(scratch)
        for number in range(rounds):
            figures = {}
            for fmt in formats:
                talks = sizes if fmt == "int8" and conversations else None
                servers = [("corechat", lambda: with_corechat(
                               scratch, model_dir,
                               lambda url, pids: measure(url, pids, reply_tokens, talks, long_prompts, None),
                               dtype=fmt, **kernel)),
                           (peer.name, lambda: with_peer(
                               scratch, peer.toolchain, peer.files[PEER_QUANTIZATION[fmt]],
                               lambda url, pids: measure(url, pids, reply_tokens, talks, long_prompts, sampling),
                               slots))]
                for name, start in servers if number % 2 == 0 else reversed(servers):
                    progress(f"round {number + 1} of {rounds}: {name} {fmt}")
                    figures[f"{name} {fmt}"] = start()
            if "int8" in formats and conversations:
                progress(f"round {number + 1} of {rounds}: a question behind a document, one process each")
                behind = [("corechat one worker", lambda: with_corechat(
                              scratch, model_dir, lambda url, _: short_behind_long(url, sizes), dtype="int8", workers=1,
                              **kernel)),
                          (f"{peer.name} one process", lambda: with_peer(
                              scratch, peer.toolchain, peer.files["q8_0"], lambda url, _: short_behind_long(url, sizes),
                              slots))]
                for name, start in behind if number % 2 == 0 else reversed(behind):
                    figures[name] = {"short_behind_long": start()}
            results["rounds"].append(figures)
    return results


# Tables --------------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 2) -> str:
    """Return the median of values with their range."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


METRICS = [  # name, key, unit, digits, higher is better
    ("decode, one stream", "decode_tokens_per_second", "tok/s", 1, True),
    ("decode, one stream, default sampling", "sampled_decode_tokens_per_second", "tok/s", 1, True),
    ("aggregate, 4 streams", "aggregate_4_tokens_per_second", "tok/s", 1, True),
    ("aggregate, 8 streams", "aggregate_8_tokens_per_second", "tok/s", 1, True),
    ("first token, short chat", "short_first_token_seconds", "s", 3, False),
    ("first token, ~850-token prompt", "prompt_850_first_token_seconds", "s", 2, False),
    ("first token, ~5,000-token prompt", "prompt_5000_first_token_seconds", "s", 2, False),
    ("PSS of all processes", "pss_gigabytes", "GB", 2, False),
]


def value_of(figures: dict, key: str) -> float:
    """Return one server's figure of a metric (PSS in GB from its bytes)."""
    return figures["pss_bytes"] / 1e9 if key == "pss_gigabytes" else figures[key]


def cross_ratios(rounds: list[dict], peer: str, fmt: str, peer_fmt: str) -> list[str]:
    """Return the lines of corechat `fmt` beside the peer's format for corechat `peer_fmt`, per round (the
    same run, so the same machine minutes apart)."""
    lines = [f"## corechat {fmt} vs {peer} {PEER_QUANTIZATION[peer_fmt]}", "",
             f"| measurement | corechat {fmt} / {peer} {PEER_QUANTIZATION[peer_fmt]}, per round |", "|---|---|"]
    for label, key, unit, _, _ in METRICS[:4]:
        ratios = [figures[f"corechat {fmt}"][key] / figures[f"{peer} {peer_fmt}"][key] for figures in rounds]
        lines.append(f"| {label} ({unit}) | " + ", ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")
    return [*lines, ""]


def render(name: str, results: dict) -> str:
    """Return the markdown tables of a run."""
    rounds, probes = results["rounds"], results["machine_probes"]
    # Results written before a second peer existed name none: theirs was llama.cpp.
    peer = results.get("peer", {}).get("name", "llama.cpp")
    peaks = ", ".join(f"{path} {value / 1e9:.0f} G/s" for path, value in probes["peak_multiply_adds_per_second"].items())
    lines = [f"# {name}", "",
             f"{len(rounds)} rounds, servers alternating; medians (range over rounds); corechat / {peer} per round. "
             f"Read bandwidth {probes['read_bytes_per_second'] / 1e9:.1f} GB/s on {probes['threads']} threads; "
             f"peak multiply-adds per path on as many threads: {peaks}."
             + (f" Both servers on {results['isa']} at most (corechat KERNEL_PATH={results['isa']})."
                if results.get("isa", "native") != "native" else "")
             + (f" {peer}: {results['peer']['version']}, served with {results['peer']['options']}."
                if "peer" in results else ""), ""]
    for fmt in results["formats"]:
        quantization = PEER_QUANTIZATION[fmt]
        lines += [f"## corechat {fmt} vs {peer} {quantization}", "",
                  f"| measurement | corechat {fmt} | {peer} {quantization} | corechat / {peer}, per round |",
                  "|---|---|---|---|"]
        for label, key, unit, digits, _ in METRICS:
            if key not in rounds[0][f"corechat {fmt}"] and key != "pss_gigabytes":
                continue  # a results file written before the metric existed
            mine = [value_of(figures[f"corechat {fmt}"], key) for figures in rounds]
            theirs = [value_of(figures[f"{peer} {fmt}"], key) for figures in rounds]
            ratios = ", ".join(f"{a / b:.2f}x" if b else "-" for a, b in zip(mine, theirs, strict=True))
            lines.append(f"| {label} ({unit}) | {spread(mine, digits)} | {spread(theirs, digits)} | {ratios} |")
        bound = probes["read_bytes_per_second"] / results["weight_bytes_per_token"][fmt]
        decode = [figures[f"corechat {fmt}"]["decode_tokens_per_second"] for figures in rounds]
        lines += ["", f"corechat {fmt}'s one-stream decode reads {statistics.median(decode) / bound:.2f} of the read "
                  f"bandwidth (median; a step reads {results['weight_bytes_per_token'][fmt] / 1e9:.3f} GB of weights: "
                  f"{bound:.0f} tokens/s at the bandwidth)."]
        if "sampled_decode_tokens_per_second" in rounds[0][f"corechat {fmt}"]:
            costs = {server: statistics.median(figures[f"{server} {fmt}"]["decode_tokens_per_second"]
                                               / figures[f"{server} {fmt}"]["sampled_decode_tokens_per_second"]
                                               for figures in rounds) for server in ("corechat", peer)}
            lines += ["", "Default sampling (" + ", ".join(f"{key} {value}" for key, value in
                                                           results["default_sampling"].items())
                      + ") against greedy, one stream's decode time (median over rounds): "
                      + "; ".join(f"{server} {cost:.3f}x" for server, cost in costs.items()) + "."]
        tokens = {figures[f"{server} {fmt}"]["short_prompt_tokens"] for figures in rounds for server in ("corechat", peer)}
        lines += ["", f"Both made {tokens.pop()} prompt tokens of the short chat: the same template and tokenizer."
                  if len(tokens) == 1 else f"**The prompts differ** ({sorted(tokens)} tokens of the short chat): the "
                  "servers did not run the same work.", ""]
    if {"int4", "int4m"} <= set(results["formats"]):
        lines += cross_ratios(rounds, peer, "int4m", "int4")
    if "multi_turn" in rounds[0].get("corechat int8", {}):
        turns = results["sizes"]["conversations"]["turns"]
        lines += ["## Multi-turn: "
                  f"{results['sizes']['conversations']['sessions']} sessions x {turns} turns, int8 vs q8_0 (seconds)", "",
                  "| server | " + " | ".join(f"turn {turn + 1}" for turn in range(turns)) + " | wall | reuse |",
                  "|---|" + "---|" * (turns + 2)]
        for server in ("corechat int8", f"{peer} int8"):
            runs = [figures[server]["multi_turn"] for figures in rounds]
            cells = [spread([run["first_token_seconds_by_turn"][turn] for run in runs]) for turn in range(turns)]
            reuse = statistics.median(run["reuse_of_previous_turn"] for run in runs)
            lines.append(f"| {server} | " + " | ".join(cells) + f" | {spread([run['wall_seconds'] for run in runs])} | "
                         f"{reuse:.0%} |")
        later, wall = [], []
        for figures in rounds:
            mine, theirs = figures["corechat int8"]["multi_turn"], figures[f"{peer} int8"]["multi_turn"]
            later.append(statistics.median(mine["first_token_seconds_by_turn"][1:])
                         / statistics.median(theirs["first_token_seconds_by_turn"][1:]))
            wall.append(mine["wall_seconds"] / theirs["wall_seconds"])
        lines += ["", f"corechat / {peer} per round: turns 2+ median first token "
                  + ", ".join(f"{value:.2f}x" for value in later) + "; wall " + ", ".join(f"{value:.2f}x" for value in wall)]
    if "corechat one worker" in rounds[0]:
        lines += ["", "## A one-line question 0.5 s behind a long document, one process each (first token, seconds)", "",
                  "| server | document alone | question behind it | document behind itself |", "|---|---|---|---|"]
        for server in ("corechat one worker", f"{peer} one process"):
            runs = [figures[server]["short_behind_long"] for figures in rounds]
            lines.append(f"| {server} ({runs[0]['long_prompt_tokens']} tokens) | "
                         f"{spread([run['long_alone_first_token_seconds'] for run in runs])} | "
                         f"{spread([run['short_first_token_seconds'] for run in runs])} | "
                         f"{spread([run['long_first_token_seconds'] for run in runs])} |")
    errors = [error for figures in rounds for server in figures.values()
              for error in server.get("errors", []) + server.get("short_behind_long", {}).get("errors", [])]
    lines += ["", f"Errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""), ""]
    return "\n".join(lines)


def main() -> None:
    """Run the rounds, print the tables and write the results files."""
    parser = argparse.ArgumentParser(prog="python bench/versus.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 1)")
    parser.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), choices=sorted(PEER_QUANTIZATION))
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round: checks that it all runs")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: both servers on AVX2 at most, as on an AVX2-only CPU")
    parser.add_argument("--no-conversations", action="store_true", help="leave out the conversation scenarios")
    parser.add_argument("--peer", choices=PEERS, default=PEERS[0], help="the server beside corechat (default llama.cpp)")
    parser.add_argument("--peer-source", type=Path,
                        help="ik_llama.cpp: a clone (work tree or git dir) to build; default: its latest build here")
    parser.add_argument("--name", help="results file name (default: versus[-PEER][-quick], PEER unless llama.cpp)")
    parser.add_argument("--results-dir", type=Path, help="default: bench/results/<this machine>/")
    args = parser.parse_args()
    if args.peer != "llama.cpp" and args.isa != "native":
        parser.error(f"--isa {args.isa} runs llama.cpp only")
    # A run beside another peer does not overwrite llama.cpp's results of the same name.
    name = args.name or "-".join(["versus", *([args.peer] if args.peer != "llama.cpp" else []),
                                  *(["quick"] if args.quick else [])])
    results = run(args.rounds or (1 if args.quick else 3), args.formats, args.quick, args.isa, not args.no_conversations,
                  args.peer, args.peer_source)
    written = save_results(name, results, render(name, results), args.results_dir)
    progress(f"wrote {written}.json and .md")


if __name__ == "__main__":
    main()
