"""Time one stream's decode through the working tree's server and another revision's, taking turns.

`python bench/probes/served_ab.py --against REV [--dtype int4m] [--rounds 8] [--tokens 300]` unpacks
git revision REV into a folder under ~/.cache/corechat/served-ab, starts it and the working tree as
two Gunicorn servers on the dev model (`make serve`'s settings otherwise: a worker per core), both
alive at once, and sends one streamed chat completion of `--tokens` tokens to each in turn, the
order alternating round by round, as a client that names no sampling sends it (the model's
generation_config: Qwen2.5's top-p/top-k draw with its repetition penalty). A change to the
engine's per-token path (its Python, the operators around the forward) is then judged by the ratio
of two decode rates taken moments apart on the same machine, which moves far less than two runs'
absolute figures. `--prompt-sentences N` times instead the first token of a unique prompt of N
sentences (bench/versus.py's long prompts: 334 make about 5,000 tokens), for a change to the prompt
pass; `--streams N` instead sends N streams at once to each server (greedy, as bench/versus.py's
aggregate scenarios do) and compares all their tokens over the wall time, for a change to batched
decode. Prints a table and writes bench/results/<machine>/<name>.json and .md (--name, default
served-ab) with the CPU, date and both revisions.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import CACHE_DIR, git, progress, save_results  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from bench.versus import chat  # noqa: E402
from harness.client import concurrent_streams, stream_chat  # noqa: E402
from harness.servers import GunicornServer  # noqa: E402
from service.engine.cores import LOAD_WINDOW_SECONDS  # noqa: E402
from service.topology import physical_cores  # noqa: E402

# The pause before each burst of --streams: two and a half of the workers' load windows, so the
# window they read before the burst holds none of the other server's.
QUIET_SECONDS = 2.5 * LOAD_WINDOW_SECONDS


def unpacked(revision: str) -> tuple[str, Path]:
    """Return a revision's commit and a folder holding its tree (unpacked once per commit)."""
    commit = git("rev-parse", "--short", f"{revision}^{{commit}}").strip()
    folder = CACHE_DIR / "served-ab" / commit
    if not (folder / "wsgi.py").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return commit, folder


def main() -> None:
    """Alternate the two servers' streams and save the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="HEAD", help="the git revision to compare the working tree with")
    parser.add_argument("--dtype", default="int4m")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--prompt-sentences", type=int, default=0,
                        help="time the first token of a prompt of this many sentences instead of decode")
    parser.add_argument("--streams", type=int, default=1,
                        help="send this many greedy streams at once and compare their aggregate tokens a second")
    parser.add_argument("--tree-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the working tree's server alone (with --against HEAD: an "
                             "A/B of that variable)")
    parser.add_argument("--name", default="served-ab", help="the results files' name")
    args = parser.parse_args()
    tree_env = dict(item.split("=", 1) for item in args.tree_env)
    from devtools.devmodel import build_dev_model

    model = build_dev_model(DEV_MODEL_DIR, preset="qwen2.5-0.5b")
    prompt = args.prompt_sentences > 0
    commit, folder = unpacked(args.against)
    rates: dict[str, list[float]] = {"tree": [], "against": []}
    with tempfile.TemporaryDirectory() as scratch:
        servers = {name: GunicornServer(Path(scratch), workers=physical_cores(), model=model, dtype=args.dtype,
                                        repo=repo, **env)
                   for name, repo, env in (("tree", REPO, tree_env), ("against", folder, {}))}
        try:
            for name, server in servers.items():
                progress(f"starting the {name}'s server ({args.dtype}; a first start converts the weights)")
                server.start(timeout=900)
            tag = uuid.uuid4().hex[:8]
            for round_index in range(args.rounds):
                order = ("tree", "against") if round_index % 2 == 0 else ("against", "tree")
                for name in order:
                    if args.streams > 1:
                        # A worker gathers a burst on one batch only while other processes left a core
                        # idle over the last load window (service/engine/cores.py): not the other
                        # server's burst that just ended.
                        time.sleep(QUIET_SECONDS)
                        runs, wall = concurrent_streams(
                            servers[name].url, [[{"role": "user", "content": f"{tag} {round_index} {index}: tell me a "
                                                  "long story about a lighthouse."}] for index in range(args.streams)],
                            args.tokens)
                        failed = [run.error for run in runs if run.error]
                        if failed:
                            raise RuntimeError(f"a stream of the {name}'s failed: {failed[0]}")
                        rates[name].append(sum(run.completion_tokens for run in runs) / wall)
                        continue
                    if prompt:
                        result = stream_chat(servers[name].url, chat(args.prompt_sentences, f"{tag}{round_index}{name}"),
                                             1, greedy=False)
                    else:
                        messages = [{"role": "user",
                                     "content": f"{tag} {round_index}: tell me a long story about a lighthouse."}]
                        result = stream_chat(servers[name].url, messages, args.tokens, greedy=False)
                    if result.error:
                        raise RuntimeError(f"the {name}'s stream failed: {result.error}")
                    # A rate either way: decode tokens a second, or prompt tokens a second to the first token.
                    rates[name].append(result.prompt_tokens / result.first_token_seconds if prompt
                                       else result.decode_tokens_per_second)
                progress(f"round {round_index + 1}: tree {rates['tree'][-1]:.1f}, {commit} {rates['against'][-1]:.1f} tok/s")
        finally:
            for server in servers.values():
                server.stop()
    ratios = [tree_rate / against_rate for tree_rate, against_rate in zip(rates["tree"], rates["against"])]
    # The working tree's commit (and whether it had changes) is the results' own, as save_results records it.
    results = {"dtype": args.dtype, "tokens": args.tokens, "prompt_sentences": args.prompt_sentences,
               "streams": args.streams, "rounds": args.rounds, "against": commit, "tree_env": tree_env,
               "tree_tokens_per_second": rates["tree"], "against_tokens_per_second": rates["against"], "ratios": ratios}
    if args.streams > 1:
        what = f"{args.streams} greedy streams at once (all their tokens over the wall time, {args.tokens} tokens a stream)"
    elif prompt:
        what = (f"a unique prompt's first token ({args.prompt_sentences} sentences; prompt tokens a second to the "
                "first token)")
    else:
        what = f"one stream's decode ({args.tokens} tokens a stream)"
    sampling = "greedy" if args.streams > 1 else "the model's default sampling"
    table = (f"## {what[0].upper() + what[1:]}, served, working tree against {commit}: {args.dtype}, {sampling}, "
             f"{args.rounds} alternating rounds (a ratio above 1: the working tree is faster)"
             + "".join(f"; the working tree's server with {name}={value}" for name, value in tree_env.items()) + "\n\n"
             "| | working tree | " + commit + " | tree / " + commit + " |\n|---|---|---|---|\n"
             + "".join(f"| round {index + 1} | {tree_rate:.1f} tok/s | {against_rate:.1f} tok/s | {ratio:.3f} |\n"
                       for index, (tree_rate, against_rate, ratio) in enumerate(zip(rates["tree"], rates["against"], ratios)))
             + f"| median | {statistics.median(rates['tree']):.1f} tok/s | {statistics.median(rates['against']):.1f} tok/s "
               f"| {statistics.median(ratios):.3f} |\n")
    save_results(args.name, results, table)


if __name__ == "__main__":
    main()
