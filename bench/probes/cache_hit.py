"""Time to first byte and to first content of a cache miss and a hit, under real Gunicorn and Redis.

    python bench/probes/cache_hit.py [--model DIR] [--repetitions 5] [--max-tokens 32]

Each repetition sends a fresh request (a new seed, so a miss), then the same request again (a hit),
and times both from the client. Prints a table and writes bench/results/<machine>/cache_hit.json and .md.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import save_results  # noqa: E402
from harness import TINY_MODEL_DIR, GunicornServer, RedisServer, sse_payload  # noqa: E402


def timed_stream(url: str, body: dict) -> dict:
    """Stream one reply and return its X-Cache and client-side timings in milliseconds."""
    began = time.perf_counter()
    first_byte = first_content = None
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=600) as response:
        for line in response.iter_lines(decode_unicode=True):
            now = time.perf_counter()
            first_byte = first_byte or now
            payload = sse_payload(line)
            if first_content is None and isinstance(payload, dict) and any(
                    choice["delta"].get("content") for choice in payload.get("choices", [])):
                first_content = now
        ended = time.perf_counter()
        status = response.headers["X-Cache"]
    return {
        "x_cache": status,
        "first_byte_ms": (first_byte - began) * 1000,
        "first_content_ms": (first_content - began) * 1000,
        "total_ms": (ended - began) * 1000,
    }


def measure(url: str, repetitions: int, max_tokens: int) -> list[dict]:
    """Run miss-then-hit pairs and return every timing."""
    runs = []
    for repetition in range(repetitions):
        body = {"messages": [{"role": "user", "content": "Tell me about caches."}], "max_tokens": max_tokens,
                "seed": 1000 + repetition, "temperature": 0.7, "stream": True}
        miss, hit = timed_stream(url, body), timed_stream(url, body)
        assert (miss["x_cache"], hit["x_cache"]) == ("miss", "hit"), (miss, hit)
        runs += [miss, hit]
    return runs


def summarize(runs: list[dict]) -> dict:
    """Return the median of each timing for misses and hits, and the hit/miss ratios."""
    summary = {}
    for status in ("miss", "hit"):
        chosen = [run for run in runs if run["x_cache"] == status]
        summary[status] = {key: round(statistics.median(run[key] for run in chosen), 2)
                           for key in ("first_byte_ms", "first_content_ms", "total_ms")}
    summary["hit_to_miss_ratio"] = {
        key: round(summary["hit"][key] / summary["miss"][key], 4) for key in summary["hit"]
    }
    return summary


def table(summary: dict) -> str:
    """Render the summary as a Markdown table."""
    lines = ["| median (ms) | miss | hit | hit / miss |", "|---|---:|---:|---:|"]
    for key in ("first_byte_ms", "first_content_ms", "total_ms"):
        lines.append(f"| {key} | {summary['miss'][key]} | {summary['hit'][key]} | "
                     f"{summary['hit_to_miss_ratio'][key]} |")
    return "\n".join(lines)


def main() -> None:
    """Start Redis and Gunicorn, measure, print and save the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: the tiny test model)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.model is None:
        from devtools.devmodel import build_dev_model

        args.model = str(build_dev_model(TINY_MODEL_DIR, preset="tiny"))
    with tempfile.TemporaryDirectory() as work:
        redis = RedisServer(Path(work)).start()
        server = GunicornServer(Path(work), workers=1, model=args.model, redis_url=redis.url)
        try:
            server.start(timeout=600)
            runs = measure(server.url, args.repetitions, args.max_tokens)
        finally:
            server.stop()
            redis.stop()
    summary = summarize(runs)
    config = {"model": args.model, "repetitions": args.repetitions, "max_tokens": args.max_tokens, "workers": 1}
    markdown = f"# Cache hit vs miss\n\n{json.dumps(config)}\n\n{table(summary)}\n"
    save_results("cache_hit", {**config, "summary": summary, "runs": runs}, markdown)


if __name__ == "__main__":
    main()
