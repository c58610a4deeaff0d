"""Benchmark corechat against plain transformers and against this machine's memory bandwidth.

    python bench/run.py            # the full run on the Qwen2.5-0.5B-shaped dev model (minutes)
    python bench/run.py --peer     # then beside llama.cpp's llama-server in alternating rounds (bench/versus.py:
                                   # decode, throughput, long prompts, conversations; builds llama.cpp once)
    python bench/run.py --quick    # every scenario on the tiny model, for CI (asserts nothing)

corechat runs as users run it: real Gunicorn from gunicorn.conf.py configured by the environment,
real HTTP, SSE parsed by the client (harness/client.py), and Redis on; llama-server (bench/peer.py)
gets the same model folder, threads, parallel sequences and client. Results go to
bench/results/<machine>/<name>.json and .md with the CPU, its kernel paths, the date and the commit.
"""

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import CACHE_DIR, progress, save_results, start_corechat  # noqa: E402
from bench.probes import run_probe  # noqa: E402
from bench.weights import converted_weights_path, served_weight_bytes, weight_bytes_per_token  # noqa: E402
from harness import (  # noqa: E402
    RedisServer,
    StreamResult,
    concurrent_streams,
    memory_of,
    processes_of,
    ready_facts,
    short_chat,
    stream_chat,
)
from harness.client import SHORT_PROMPT  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.topology import physical_cores  # noqa: E402

# Scenario 8 sends its long prompt this long after the short streams, once they decode.
LONG_PROMPT_DELAY_SECONDS = 0.5
SYSTEM_PROMPT_SENTENCE = "You are a careful assistant for the corechat benchmark; answer briefly and precisely. "


@dataclass(frozen=True)
class Plan:
    """How big the run is: the full benchmark or the quick CI pass."""

    model_dir: Path
    preset: str
    max_tokens: int
    repetitions: int
    stream_counts: tuple[int, ...]
    system_prompt_tokens: int
    bandwidth_megabytes: int
    matrix_repetitions: int
    # Shapes scenario 7 starts a server for, the most threads first (None: every shape).
    matrix_shapes: int | None = None


FULL = dict(preset="qwen2.5-0.5b", max_tokens=64, repetitions=7, stream_counts=(1, 2, 4, 5, 8),
            system_prompt_tokens=512, bandwidth_megabytes=1024, matrix_repetitions=3)
QUICK = dict(preset="tiny", max_tokens=8, repetitions=2, stream_counts=(1, 2, 4, 5, 8),
             system_prompt_tokens=512, bandwidth_megabytes=64, matrix_repetitions=1, matrix_shapes=1)


def percentile(values: list[float], fraction: float) -> float:
    """Return the nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def long_system_prompt(tokens: int, tag: str) -> str:
    """Return a system prompt of about `tokens` tokens, unique from its first token on."""
    sentence_tokens = 16  # the sentence above is 16 Qwen2 tokens
    return f"Session {tag}. " + SYSTEM_PROMPT_SENTENCE * max(1, tokens // sentence_tokens)


# The scenarios --------------------------------------------------------------------------------


def scenario_short_prompt(url: str, plan: Plan) -> dict:
    """Scenario 1: one short chat, one stream, several times."""
    runs = [stream_chat(url, short_chat(f"s1-{uuid.uuid4().hex[:8]}"), plan.max_tokens) for _ in range(plan.repetitions)]
    return summarize_streams(runs)


def summarize_streams(runs: list[StreamResult]) -> dict:
    """Reduce single-stream runs to first-token percentiles and decode speed."""
    good = [run for run in runs if not run.error and run.first_token_seconds]
    first = [run.first_token_seconds for run in good] or [0.0]
    return {
        "runs": len(runs),
        "errors": [run.error for run in runs if run.error],
        "first_token_p50_seconds": statistics.median(first),
        "first_token_p95_seconds": percentile(first, 0.95),
        "decode_tokens_per_second": statistics.median([run.decode_tokens_per_second for run in good] or [0.0]),
        "completion_tokens": statistics.median([run.completion_tokens for run in good] or [0]),
    }


def scenario_system_prompt(url: str, plan: Plan, workers: int) -> dict:
    """Scenario 2: a long system prompt seen for the first time, then again with new user turns."""
    cold, repeated = [], []
    for round_index in range(max(1, plan.repetitions // 3)):
        system = long_system_prompt(plan.system_prompt_tokens, uuid.uuid4().hex[:8])
        cold.append(stream_chat(url, [{"role": "system", "content": system},
                                      {"role": "user", "content": f"Turn 0 of round {round_index}: hello."}], plan.max_tokens))
        # A few repeats per worker: each finds the prefix whichever worker stored it (the store is the host's).
        for turn in range(1, 2 * workers + 2):
            repeated.append(stream_chat(url, [{"role": "system", "content": system},
                                              {"role": "user", "content": f"Turn {turn}: what next?"}], plan.max_tokens))
    cold_first = statistics.median([run.first_token_seconds for run in cold])
    repeated_first = statistics.median([run.first_token_seconds for run in repeated])
    return {
        "system_prompt_tokens_about": plan.system_prompt_tokens,
        "errors": [run.error for run in cold + repeated if run.error],
        "cold_first_token_p50_seconds": cold_first,
        "repeated_first_token_p50_seconds": repeated_first,
        "repeated_first_token_min_seconds": min(run.first_token_seconds for run in repeated),
        "repeated_to_cold": repeated_first / cold_first if cold_first else 0.0,
    }


def scenario_concurrency(url: str, plan: Plan) -> dict:
    """Scenario 3: 1, 2, 4, ... streams at once: aggregate speed and latency."""
    rows = {}
    for streams in plan.stream_counts:
        progress(f"scenario 3: {streams} concurrent streams")
        results, wall = concurrent_streams(url, [short_chat(f"s3-{uuid.uuid4().hex[:8]}") for _ in range(streams)],
                                           plan.max_tokens)
        good = [result for result in results if not result.error]
        first = [result.first_token_seconds for result in good] or [0.0]
        gaps = [gap for result in good for gap in result.gaps] or [0.0]
        rows[str(streams)] = {
            "aggregate_tokens_per_second": sum(result.completion_tokens for result in good) / wall,
            "first_token_p50_seconds": statistics.median(first),
            "first_token_p95_seconds": percentile(first, 0.95),
            "inter_token_p95_seconds": percentile(gaps, 0.95),
            "errors": [result.error for result in results if result.error],
        }
    return rows


def scenario_long_prompt_arrives(url: str, plan: Plan, workers: int) -> dict:
    """Scenario 8: a cold long prompt arrives while short streams decode; how long do they stall?"""
    rounds = [long_prompt_round(url, plan, workers) for _ in range(max(1, plan.repetitions // 2))]
    return {
        "rounds": rounds,
        "streams": rounds[0]["streams"],
        "long_prompt_first_token_seconds": statistics.median(r["long_prompt_first_token_seconds"] for r in rounds),
        "inter_token_p50_seconds": statistics.median(r["inter_token_p50_seconds"] for r in rounds),
        "inter_token_max_seconds": statistics.median(r["inter_token_max_seconds"] for r in rounds),
        "errors": [error for r in rounds for error in r["errors"]],
    }


def long_prompt_round(url: str, plan: Plan, workers: int) -> dict:
    """Start two short streams per worker, send a cold long prompt while they decode, and time both."""
    messages = [short_chat(f"s8-{uuid.uuid4().hex[:8]}") for _ in range(2 * workers)]
    streams: list[StreamResult] = []
    threads = [threading.Thread(target=lambda m=m: streams.append(stream_chat(url, m, 2 * plan.max_tokens)))
               for m in messages]
    for thread in threads:
        thread.start()
    time.sleep(LONG_PROMPT_DELAY_SECONDS)
    system = long_system_prompt(plan.system_prompt_tokens, uuid.uuid4().hex[:8])
    long = stream_chat(url, [{"role": "system", "content": system}, {"role": "user", "content": "hello"}], 1)
    for thread in threads:
        thread.join()
    gaps = [gap for stream in streams for gap in stream.gaps] or [0.0]
    return {
        "streams": len(streams),
        "long_prompt_first_token_seconds": long.first_token_seconds,
        "inter_token_p50_seconds": statistics.median(gaps),
        "inter_token_max_seconds": max(gaps),
        "errors": [run.error for run in [*streams, long] if run.error],
    }


def scenario_cache_hit(url: str, plan: Plan) -> dict:
    """Scenario 4: the same greedy request twice; the second may come from the response cache."""
    messages = short_chat(f"s4-{uuid.uuid4().hex[:8]}")
    miss = stream_chat(url, messages, plan.max_tokens)
    hits = [stream_chat(url, messages, plan.max_tokens) for _ in range(max(2, plan.repetitions // 2))]
    hit_first_byte = statistics.median([hit.first_byte_seconds for hit in hits])
    return {
        "miss_x_cache": miss.x_cache or "(no header)",
        "repeat_x_cache": sorted({hit.x_cache or "(no header)" for hit in hits}),
        "miss_first_byte_seconds": miss.first_byte_seconds,
        "miss_total_seconds": miss.total_seconds,
        "repeat_first_byte_p50_seconds": hit_first_byte,
        "repeat_total_p50_seconds": statistics.median([hit.total_seconds for hit in hits]),
        "repeat_to_miss_total": statistics.median([hit.total_seconds for hit in hits]) / miss.total_seconds
        if miss.total_seconds else 0.0,
        "errors": [run.error for run in [miss, *hits] if run.error],
    }


def scenario_matrix(log_dir: Path, model_dir: Path, redis_url: str, plan: Plan, dtype: str) -> dict:
    """Scenario 7: workers x threads per worker, each started cold and measured briefly."""
    cores = physical_cores()
    shapes = sorted({(workers, cores // workers) for workers in range(1, cores + 1) if cores % workers == 0} | {(1, 1)},
                    key=lambda shape: (-shape[0] * shape[1], shape))[: plan.matrix_shapes]
    rows = {}
    for workers, threads in shapes:
        label = f"{workers}x{threads}"
        progress(f"scenario 7: {workers} worker(s) x {threads} thread(s)")
        server, cold_start = start_corechat(log_dir, model_dir, redis_url, workers=workers, torch_threads=threads,
                                            dtype=dtype)
        try:
            single = summarize_streams([stream_chat(server.url, short_chat(f"s7-{uuid.uuid4().hex[:8]}"), plan.max_tokens)
                                        for _ in range(plan.matrix_repetitions)])
            results, wall = concurrent_streams(server.url, [short_chat(f"s7-{uuid.uuid4().hex[:8]}") for _ in range(4)],
                                               plan.max_tokens)
            rows[label] = {
                "cold_start_seconds": cold_start,
                "first_token_p50_seconds": single["first_token_p50_seconds"],
                "decode_tokens_per_second": single["decode_tokens_per_second"],
                "four_streams_aggregate_tokens_per_second": sum(r.completion_tokens for r in results if not r.error) / wall,
                "errors": single["errors"] + [r.error for r in results if r.error],
            }
        finally:
            server.stop()
    return rows


def prompt_tokens_of(url: str) -> int:
    """Return how many tokens a server makes of the short chat, as its usage reports: the chat template check."""
    return stream_chat(url, short_chat("template check"), 1).prompt_tokens


# The run --------------------------------------------------------------------------------------


def vector_extensions() -> list[str]:
    """Return the CPU's AVX, AMX and VNNI flags, which decide which kernels torch and llama.cpp run."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return sorted(flag for flag in flags if flag.startswith(("avx", "amx")) or "vnni" in flag)


def run(plan: Plan, dtype: str, settings: dict, peer: bool = False, rounds: int = 3) -> dict:
    """Measure everything and return the results."""
    from devtools.devmodel import build_dev_model

    cores = physical_cores()
    progress(f"dev model {plan.preset} in {plan.model_dir} (built once)")
    build_dev_model(plan.model_dir, plan.preset)
    if peer:
        from bench.peer import build

        # Before any measurement: building takes minutes and both cores.
        build()
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "physical_cores": cores,
                           "vector_extensions": vector_extensions(), "load_average_at_start": os.getloadavg()[0]},
               "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(plan).items()},
               "dtype": dtype, "settings": settings}

    progress("memory read bandwidth probe")
    bandwidth = run_probe("bandwidth", "--threads", str(cores), "--megabytes", str(plan.bandwidth_megabytes))
    weights = weight_bytes_per_token(plan.model_dir, dtype)
    results["bound"] = {**bandwidth, **weights,
                        "decode_tokens_per_second": bandwidth["bytes_per_second"] / weights["bytes_per_token"]}

    progress("baseline: plain transformers generate(), bf16, streamer")
    baseline = run_probe("baseline", str(plan.model_dir), "--threads", str(cores), "--max-tokens", str(plan.max_tokens),
                         "--repetitions", str(plan.repetitions), "--prompt", f"(baseline) {SHORT_PROMPT}")
    baseline_first = [run["first_token_seconds"] for run in baseline["runs"]]
    results["baseline"] = {**baseline,
                           "first_token_p50_seconds": statistics.median(baseline_first),
                           "decode_tokens_per_second": statistics.median(r["decode_tokens_per_second"] for r in baseline["runs"])}

    with tempfile.TemporaryDirectory(prefix="corechat-bench-") as scratch:
        scratch = Path(scratch)
        redis = RedisServer(scratch).start() if shutil.which("redis-server") else None
        redis_url = redis.url if redis else ""
        results["redis"] = bool(redis)
        try:
            progress("scenario 6: cold start of corechat with the default workers and threads")
            server, cold_start = start_corechat(scratch, plan.model_dir, redis_url, dtype=dtype, **settings)
            try:
                workers = server.workers
                results["scenario_6_cold_start"] = {"workers": workers, "seconds_until_all_ready": cold_start}
                progress("scenario 1: short prompt, one stream")
                results["scenario_1_short_prompt"] = scenario_short_prompt(server.url, plan)
                progress("scenario 2: long system prompt, cold then repeated")
                results["scenario_2_system_prompt"] = scenario_system_prompt(server.url, plan, workers)
                results["scenario_3_concurrency"] = scenario_concurrency(server.url, plan)
                progress("scenario 8: a long prompt arrives while streams decode")
                results["scenario_8_long_prompt_arrives"] = scenario_long_prompt_arrives(server.url, plan, workers)
                progress("scenario 4: response cache hit")
                results["scenario_4_cache_hit"] = scenario_cache_hit(server.url, plan)
                progress("scenario 5: memory of all processes")
                memory = memory_of(processes_of(server))
                workers_facts = list(ready_facts(server).values())
                converted = converted_weights_path(server.log_path.read_text(errors="replace"))  # the file the workers map
                served = served_weight_bytes(plan.model_dir, dtype, converted)
                # The prefix store is the host's: every worker reports the whole folder's bytes.
                kv_bytes = max((facts.get("prefix_cache_bytes", 0) for facts in workers_facts), default=0)
                results["scenario_5_memory"] = {**memory, "weight_bytes": served, "prefix_cache_bytes": kv_bytes,
                                                "pss_to_weights_and_kv": memory["pss"] / (served + kv_bytes)}
                results["prompt_tokens"] = prompt_tokens_of(server.url)
            finally:
                server.stop()
            results["scenario_7_matrix"] = scenario_matrix(scratch, plan.model_dir, redis_url, plan, dtype)
        finally:
            if redis:
                redis.stop()
    add_ratios(results)
    if peer:
        from bench import versus

        results["versus"] = versus.run(rounds, versus.formats_for(dtype), quick=plan.preset == "tiny")
    return results


def add_ratios(results: dict) -> None:
    """Relate corechat's figures to the baseline and the bound, as the targets are stated."""
    single = results["scenario_1_short_prompt"]
    concurrency = results["scenario_3_concurrency"]
    one = concurrency.get("1", {}).get("aggregate_tokens_per_second") or 0.0
    results["ratios"] = {
        "first_token_to_baseline": single["first_token_p50_seconds"] / results["baseline"]["first_token_p50_seconds"],
        "decode_to_baseline": single["decode_tokens_per_second"] / results["baseline"]["decode_tokens_per_second"],
        "decode_to_bound": single["decode_tokens_per_second"] / results["bound"]["decode_tokens_per_second"],
        "baseline_decode_to_bound": results["baseline"]["decode_tokens_per_second"] / results["bound"]["decode_tokens_per_second"],
        "four_streams_to_one": (concurrency.get("4", {}).get("aggregate_tokens_per_second", 0.0) / one) if one else 0.0,
    }


def render_markdown(name: str, results: dict) -> str:
    """Render the results as the Markdown table docs/performance.md quotes."""
    base, bound, ratios = results["baseline"], results["bound"], results["ratios"]
    s1, s2, s4 = results["scenario_1_short_prompt"], results["scenario_2_system_prompt"], results["scenario_4_cache_hit"]
    s5, s6 = results["scenario_5_memory"], results["scenario_6_cold_start"]
    lines = [
        f"## Benchmark `{name}`: {results['plan']['preset']} dev model, {results['dtype']}, "
        f"{results['machine']['physical_cores']} physical cores ({' '.join(results['machine']['vector_extensions'])}), "
        f"load {results['machine']['load_average_at_start']:.2f} at start",
        "",
        "| measurement | value | ratio |",
        "|---|---|---|",
        f"| memory read bandwidth (best of sums, {bound['threads']} threads) | {bound['bytes_per_second'] / 1e9:.1f} GB/s | |",
        f"| weight bytes read per decoded token | {bound['bytes_per_token'] / 1e9:.3f} GB | |",
        f"| decode bound (bandwidth / bytes per token) | {bound['decode_tokens_per_second']:.1f} tok/s | |",
        f"| baseline first token (transformers generate, bf16, p50) | {base['first_token_p50_seconds']:.3f} s | |",
        f"| baseline decode | {base['decode_tokens_per_second']:.1f} tok/s | {ratios['baseline_decode_to_bound']:.2f}x bound |",
        f"| 1. first token p50 / p95 | {s1['first_token_p50_seconds']:.3f} / {s1['first_token_p95_seconds']:.3f} s | "
        f"{ratios['first_token_to_baseline']:.2f}x baseline |",
        f"| 1. decode | {s1['decode_tokens_per_second']:.1f} tok/s | {ratios['decode_to_baseline']:.2f}x baseline, "
        f"{ratios['decode_to_bound']:.2f}x bound |",
        f"| 2. {s2['system_prompt_tokens_about']}-token system prompt, first token cold / repeated (p50) | "
        f"{s2['cold_first_token_p50_seconds']:.3f} / {s2['repeated_first_token_p50_seconds']:.3f} s | "
        f"{s2['repeated_to_cold']:.2f}x |",
    ]
    for streams, row in results["scenario_3_concurrency"].items():
        lines.append(
            f"| 3. {streams} streams: aggregate, first token p50/p95, inter-token p95 | "
            f"{row['aggregate_tokens_per_second']:.1f} tok/s, {row['first_token_p50_seconds']:.2f}/"
            f"{row['first_token_p95_seconds']:.2f} s, {row['inter_token_p95_seconds'] * 1000:.0f} ms | "
            f"{len(row['errors'])} errors |"
        )
    s8 = results["scenario_8_long_prompt_arrives"]
    lines.append(
        f"| 8. cold {s2['system_prompt_tokens_about']}-token prompt arrives while {s8['streams']} streams decode "
        f"(median of {len(s8['rounds'])} rounds): its first token; the streams' inter-token p50 / max | {s8['long_prompt_first_token_seconds']:.3f} s; "
        f"{s8['inter_token_p50_seconds'] * 1000:.0f} / {s8['inter_token_max_seconds'] * 1000:.0f} ms | "
        f"{len(s8['errors'])} errors |"
    )
    lines += [
        f"| 4. repeat of a greedy request: X-Cache {', '.join(s4['repeat_x_cache'])}, first byte / total (p50) | "
        f"{s4['repeat_first_byte_p50_seconds'] * 1000:.1f} ms / {s4['repeat_total_p50_seconds']:.3f} s | "
        f"{s4['repeat_to_miss_total']:.2f}x miss total |",
        f"| 5. PSS of master + {s5['processes'] - 1} workers | {s5['pss'] / 1e9:.2f} GB | "
        f"{s5['pss_to_weights_and_kv']:.2f}x weights as served ({s5['weight_bytes'] / 1e9:.2f} GB) "
        f"+ stored prefix KV ({s5['prefix_cache_bytes'] / 1e9:.2f} GB) |",
        f"| 6. cold start until all {s6['workers']} workers ready | {s6['seconds_until_all_ready']:.1f} s | |",
    ]
    for label, row in results["scenario_7_matrix"].items():
        lines.append(
            f"| 7. {label} (workers x threads): cold start, first token, decode, 4-stream aggregate | "
            f"{row['cold_start_seconds']:.1f} s, {row['first_token_p50_seconds']:.3f} s, "
            f"{row['decode_tokens_per_second']:.1f} tok/s, {row['four_streams_aggregate_tokens_per_second']:.1f} tok/s | |"
        )
    table = "\n".join(lines) + "\n"
    if "versus" not in results:
        return table
    from bench import versus

    return table + "\n" + versus.render(f"{name}: beside llama.cpp", results["versus"])


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="python bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few repetitions: checks that it all runs")
    parser.add_argument("--peer", action="store_true",
                        help="then compare with llama.cpp's llama-server (q8_0, q4_0) on the same model in alternating "
                        "rounds (bench/versus.py); builds it once")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds beside llama.cpp (with --peer)")
    parser.add_argument("--name", help="results file name (default: full or quick, and the dtype)")
    parser.add_argument("--results-dir", type=Path, help="default: bench/results/<this machine>/")
    parser.add_argument("--model-dir", type=Path, help="dev model folder (default: under ~/.cache/corechat)")
    parser.add_argument(
        "--dtype", default=Settings.model_fields["dtype"].default, help="DTYPE setting of the served model"
    )
    parser.add_argument("--repetitions", type=int, help="runs per single-stream measurement")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="another corechat setting for the main server, e.g. --set PIN_WORKERS=1")
    return parser.parse_args()


def main() -> None:
    """Run the benchmark, print the table and write the results files."""
    args = parse_args()
    sizes = dict(QUICK if args.quick else FULL)
    if args.repetitions:
        sizes["repetitions"] = args.repetitions
    default_dir = CACHE_DIR / ("test-tiny" if args.quick else f"bench-{sizes['preset']}")
    plan = Plan(model_dir=args.model_dir or default_dir, **sizes)
    settings = dict(item.split("=", 1) for item in args.set)
    name = args.name or f"{'quick' if args.quick else 'full'}-{args.dtype}"
    results = run(plan, args.dtype, {key.lower(): value for key, value in settings.items()}, peer=args.peer,
                  rounds=1 if args.quick else args.rounds)
    written = save_results(name, results, render_markdown(name, results), args.results_dir)
    progress(f"wrote {written}.json and .md")


if __name__ == "__main__":
    main()
