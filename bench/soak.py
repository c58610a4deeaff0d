"""A bounded soak: a fixed mixed workload against real Gunicorn (2 workers) on loopback, then a verdict.

The mix: streams, whole replies, identical greedy requests (cache hits once a cache is on), clients
that hang up mid-stream, invalid requests, and long prompts that are all distinct (up to
--long-prompt-tokens, so neither the response cache nor the prefix store can share them). It passes
with zero 5xx, zero hung requests, worker memory flat over the second half, and nothing running or
queued at the end. Memory is judged as a worker's anonymous memory, its RSS less the files it maps
(the weights, and the prefix store, which fills up to PREFIX_CACHE_MB by design): what must not grow
is everything else.

    python bench/soak.py            # 800 requests on the tiny test model
    python bench/soak.py --quick    # 60 requests, prompts up to 2,000 tokens, as the test suite runs it
    python bench/soak.py --model ~/.cache/corechat/bench-qwen2.5-0.5b --requests 200 --long-prompt-tokens 8000 --timeout 300
"""

import argparse
import json
import random
import socket
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import save_results  # noqa: E402
from devtools.devmodel import build_dev_model  # noqa: E402
from harness import TINY_MODEL_DIR, GunicornServer  # noqa: E402

VERDICTS = {True: "pass", False: "FAIL", None: "not judged (run too short)"}
MIN_REQUESTS_FOR_RSS = 200
ROUNDS = 4  # RSS is sampled after the warm-up and after each quarter of the measured requests
KINDS = {"stream": 3, "whole": 3, "repeat": 2, "hang_up": 1, "invalid": 1, "long": 2}
# Words of one token each, drawn at random: long prompts differ from their first words on.
LONG_PROMPT_WORDS = "alpha bravo charlie delta echo golf hotel india kilo lima mike oscar papa romeo sierra tango".split()
GREEDY = {"messages": [{"role": "user", "content": "The same question, again."}], "temperature": 0}
INVALID_BODIES = [
    (b'{"messages": [', "application/json"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "application/json"),
    (b'{"messages": "hi"}', "application/json"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "application/json"),
    (b"messages=hi", "application/x-www-form-urlencoded"),
]


def chat_body(rng: random.Random, max_tokens: int) -> dict:
    """Return a sampled chat request body."""
    words = " ".join(rng.choice(["cpu", "cache", "token", "stream", "worker", "queue"]) for _ in range(rng.randint(1, 30)))
    return {"messages": [{"role": "user", "content": words}], "max_tokens": max_tokens, "seed": rng.randint(0, 10**6)}


def long_body(rng: random.Random, most_tokens: int, max_tokens: int) -> dict:
    """Return a request with a distinct prompt of up to most_tokens tokens."""
    words = " ".join(rng.choice(LONG_PROMPT_WORDS) for _ in range(rng.randint(most_tokens // 10, most_tokens - 50)))
    return {"messages": [{"role": "user", "content": words}], "max_tokens": max_tokens, "seed": rng.randint(0, 10**6)}


def run_one(url: str, port: int, kind: str, rng: random.Random, args) -> dict:
    """Send one request of a kind; return its outcome: status, seconds, whether it hung."""
    began = time.monotonic()
    endpoint = f"{url}/v1/chat/completions"
    max_tokens, timeout = args.max_tokens, args.timeout
    try:
        if kind == "stream":
            with requests.post(endpoint, json={**chat_body(rng, max_tokens), "stream": True}, stream=True, timeout=timeout) as response:
                body = b"".join(response.iter_content(None))
                status = response.status_code if response.status_code != 200 or body.endswith(b"data: [DONE]\n\n") else 0
        elif kind == "whole":
            status = requests.post(endpoint, json=chat_body(rng, max_tokens), timeout=timeout).status_code
        elif kind == "repeat":
            status = requests.post(endpoint, json={**GREEDY, "max_tokens": max_tokens}, timeout=timeout).status_code
        elif kind == "long":
            status = requests.post(endpoint, json=long_body(rng, args.long_prompt_tokens, max_tokens), timeout=timeout).status_code
        elif kind == "hang_up":
            status = hang_up_mid_stream(port, chat_body(rng, 4000), timeout)
        else:
            data, content_type = rng.choice(INVALID_BODIES)
            status = requests.post(endpoint, data=data, headers={"Content-Type": content_type}, timeout=timeout).status_code
        hung = False
    except (requests.Timeout, socket.timeout):
        status, hung = None, True
    return {"kind": kind, "status": status, "seconds": time.monotonic() - began, "hung": hung}


def hang_up_mid_stream(port: int, body: dict, timeout: float) -> int:
    """Start a stream, read until its first generated token, then close the connection."""
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        received = b""
        while b'"delta":{"content":"' not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    return int(received[9:12]) if received.startswith(b"HTTP/1.1 ") else 0


def worker_status_mb(server: GunicornServer, field: str) -> dict[int, float]:
    """Return one /proc/<pid>/status size of each worker (VmRSS, RssShmem, ...) in MiB."""
    sizes = {}
    for pid in server.worker_pids():
        status = Path(f"/proc/{pid}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith(f"{field}:"))
        sizes[pid] = kib / 1024
    return sizes


def worker_memory_mb(server: GunicornServer) -> dict[int, dict[str, float]]:
    """Return each worker's RSS, the mapped files in it, and the rest (its anonymous memory), in MiB.

    Mapped files are the weights and the prefix store, whose files (on tmpfs in production, in the
    test's folder here) the workers map: they fill up to PREFIX_CACHE_MB for the whole host by
    design, and the kernel can take their pages back. What a leak grows is the anonymous rest.
    """
    rss, anonymous = worker_status_mb(server, "VmRSS"), worker_status_mb(server, "RssAnon")
    return {pid: {"rss": size, "prefix_store": size - anonymous.get(pid, size), "rest": anonymous.get(pid, size)}
            for pid, size in rss.items()}


def queues_drained(server: GunicornServer, timeout: float = 30) -> dict[int, dict]:
    """Wait until every worker runs and queues nothing; return each worker's running and waiting."""
    deadline = time.monotonic() + timeout
    while True:
        facts = {}
        for _ in range(40):
            body = requests.get(f"{server.url}/readyz", headers={"Connection": "close"}, timeout=10).json()
            facts[body["worker_pid"]] = {"running": body["running"], "waiting": body["waiting"]}
            if len(facts) == server.workers:
                break
        idle = all(fact["running"] + fact["waiting"] == 0 for fact in facts.values())
        if idle or time.monotonic() > deadline:
            return facts
        time.sleep(0.2)


def run_phase(server, kinds: list[str], rng: random.Random, args) -> list[dict]:
    """Run a list of requests with bounded concurrency and return their outcomes."""
    seeds = [rng.randint(0, 2**32) for _ in kinds]
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [
            pool.submit(run_one, server.url, server.port, kind, random.Random(seed), args)
            for kind, seed in zip(kinds, seeds)
        ]
        return [future.result() for future in futures]


def soak(args) -> dict:
    """Run the warm-up and the soak and return the report."""
    rng = random.Random(args.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
    warmup_count = max(len(KINDS), args.requests // 5)
    model_dir = args.model or build_dev_model(TINY_MODEL_DIR, preset="tiny")
    work_dir = args.out / "soak-logs.tmp"
    work_dir.mkdir(parents=True, exist_ok=True)
    server = GunicornServer(work_dir, workers=2, model=model_dir, model_name="soak", sse_ping_seconds=0.5)
    server.start(timeout=600)
    try:
        began = time.monotonic()
        warmup = run_phase(server, kinds[:warmup_count], rng, args)
        queues_drained(server)
        memory_series = [worker_memory_mb(server)]
        outcomes = []
        measured = kinds[warmup_count:]
        for start in range(0, len(measured), -(-len(measured) // ROUNDS)):
            outcomes += run_phase(server, measured[start : start + -(-len(measured) // ROUNDS)], rng, args)
            memory_series.append(worker_memory_mb(server))
        final_queues = queues_drained(server)
        memory_at_end = worker_memory_mb(server)
        elapsed = time.monotonic() - began
    finally:
        server.stop()
    everything = warmup + outcomes
    statuses = Counter(str(outcome["status"]) for outcome in everything)
    # The first half still grows the allocator's pools (new prompt lengths, new threads) towards a
    # plateau; a leak keeps growing, so flatness is judged over the second half.
    settled = memory_series[ROUNDS // 2]
    growth = {pid: memory_at_end[pid]["rest"] - memory["rest"] for pid, memory in settled.items() if pid in memory_at_end}
    checks = {
        "no_5xx": sum(count for status, count in statuses.items() if status.startswith("5")) == 0,
        "no_hung_requests": not any(outcome["hung"] for outcome in everything),
        "every_stream_complete": statuses.get("0", 0) == 0,
        "queues_back_to_zero": all(fact["running"] + fact["waiting"] == 0 for fact in final_queues.values()),
        "same_workers_throughout": set(memory_series[0]) == set(memory_at_end),
        # A run too short for the allocator to settle cannot tell a leak from warm-up: not judged.
        "rss_flat": max(growth.values()) <= args.rss_growth_limit_mb if args.requests >= MIN_REQUESTS_FOR_RSS else None,
    }

    def rounded(sample: dict, key: str) -> dict:
        """Return one figure of a memory sample per worker, rounded."""
        return {str(pid): round(memory[key], 1) for pid, memory in sample.items()}

    return {
        "requests": len(everything),
        "warmup_requests": warmup_count,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "model": str(model_dir),
        "long_prompt_tokens": args.long_prompt_tokens,
        "seconds": round(elapsed, 1),
        "by_kind": {kind: sum(1 for outcome in everything if outcome["kind"] == kind) for kind in KINDS},
        "statuses": dict(sorted(statuses.items())),
        "slowest_seconds": round(max(outcome["seconds"] for outcome in everything), 2),
        "rss_after_warmup_mb": rounded(memory_series[0], "rss"),
        "rss_at_end_mb": rounded(memory_at_end, "rss"),
        "prefix_store_at_end_mb": rounded(memory_at_end, "prefix_store"),
        "rss_less_prefix_store_growth_mb": {str(pid): round(delta, 1) for pid, delta in growth.items()},
        "rss_growth_limit_mb": args.rss_growth_limit_mb,
        "rss_series_mb": [rounded(sample, "rss") for sample in memory_series],
        "rss_less_prefix_store_series_mb": [rounded(sample, "rest") for sample in memory_series],
        "final_queues": {str(pid): fact for pid, fact in final_queues.items()},
        "checks": checks,
        "passed": all(passed is not False for passed in checks.values()),
    }


def render_table(report: dict) -> str:
    """Render the report as a Markdown table."""
    rows = [
        ("requests (warm-up)", f"{report['requests']} ({report['warmup_requests']})"),
        ("by kind", ", ".join(f"{kind} {count}" for kind, count in report["by_kind"].items())),
        ("statuses (0 = stream cut short)", ", ".join(f"{status}: {count}" for status, count in report["statuses"].items())),
        ("seconds / slowest request", f"{report['seconds']} / {report['slowest_seconds']}"),
        ("model (longest prompt, tokens)", f"{Path(report['model']).name} ({report['long_prompt_tokens']})"),
        ("worker RSS after warm-up, MiB", ", ".join(map(str, report["rss_after_warmup_mb"].values()))),
        ("worker RSS at end (mapped files), MiB", ", ".join(
            f"{rss} ({store})" for rss, store in zip(report["rss_at_end_mb"].values(), report["prefix_store_at_end_mb"].values()))),
        ("RSS per quarter, MiB", " → ".join("/".join(map(str, sample.values())) for sample in report["rss_series_mb"])),
        ("RSS less mapped files per quarter, MiB", " → ".join(
            "/".join(map(str, sample.values())) for sample in report["rss_less_prefix_store_series_mb"])),
        ("its growth over the second half, MiB (limit)",
         f"{', '.join(map(str, report['rss_less_prefix_store_growth_mb'].values()))} ({report['rss_growth_limit_mb']})"),
        *((check, VERDICTS[passed]) for check, passed in report["checks"].items()),
    ]
    return "\n".join(["| soak | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])


def main() -> int:
    """Parse arguments, soak, print and write the report; exit 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--quick", action="store_true", help="60 requests, prompts up to 2,000 tokens, for the test suite")
    parser.add_argument("--model", type=Path, help="model folder (default: the tiny test model)")
    parser.add_argument("--long-prompt-tokens", type=int, default=28_000, help="the longest distinct prompt")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds after which a request counts as hung")
    # Long distinct prompts leave tens of MiB more or less in the allocator from one idle sample to
    # the next; a leak (or no trim at idle: about 80 MiB over the second half) grows past this.
    parser.add_argument("--rss-growth-limit-mb", type=float, default=32.0)
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument("--out", type=Path, help="the results folder (default: bench/results/<this machine>/)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.long_prompt_tokens = 60, 4, 2_000
    report = soak(args)
    save_results("soak", report, render_table(report) + "\n", args.out)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
