"""Overload and slow clients against `make serve`'s defaults (2 workers, tiny model): the figures of
docs/reliability.md, measured as tests/e2e/test_admission.py and tests/e2e/test_worker.py check them.

    python bench/overload.py              # 5 rounds of each scenario
    python bench/overload.py --rounds 1

Round of "3x capacity": 3 x 2 workers x (MAX_RUNNING + MAX_QUEUE) streams at once, with /healthz,
/readyz and /metrics every 50 ms meanwhile. Round of "stalled clients": 20 connections of each way
to stall a request (headers never ended, part of a body, Expect: 100-continue and no body, a chunked
body without its last chunk), with the same probes for 3 s. Latencies run from the request's last
byte sent to the response's status line, measured by one selector loop (harness/loadgen.py).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import save_results  # noqa: E402
from harness import COUNTING, GunicornServer, chat, send_until_every_worker_served  # noqa: E402
from harness.loadgen import STALLED_PER_KIND, STALLS, chat_exchange, probe_exchanges, raw_exchange, run_exchanges  # noqa: E402
from service.settings import Settings  # noqa: E402

DEFAULTS = Settings.model_construct()
WORKERS = 2
PROBES = ("/healthz", "/readyz", "/metrics")


def milliseconds(values: list[float]) -> dict:
    """Summarize latencies in milliseconds: median, 90th percentile and maximum."""
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered) * 1000, 1),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1),
        "max": round(ordered[-1] * 1000, 1),
    }


def probe_latencies(probes) -> dict:
    """Summarize each probe route's latencies."""
    return {target: milliseconds([probe.seconds_to_status for probe in probes if probe.target == target]) for target in PROBES}


def overload_round(server) -> dict:
    """Send three times capacity at once; return outcomes and latencies."""
    streams = [
        chat_exchange({"messages": COUNTING, "max_tokens": 64, "temperature": 0, "stream": True})
        for _ in range(3 * WORKERS * DEFAULTS.request_places)
    ]
    probes = probe_exchanges(PROBES, every=0.05, during=4.0, start_after=0.2)
    run_exchanges(server.port, streams + probes, timeout=120)
    refused = [stream for stream in streams if stream.status == 503]
    return {
        "served": sum(stream.status == 200 and stream.error is None for stream in streams),
        "refused": len(refused),
        "other": sum(stream.status not in (200, 503) or stream.error is not None for stream in streams),
        "refusal_ms": milliseconds([stream.seconds_to_status for stream in refused]),
        "probe_ms": probe_latencies(probes),
    }


def stalled_round(server) -> dict:
    """Hold stalled connections open while probing; return probe latencies and the stalled ones' answers."""
    stalled = [raw_exchange(raw) for raw in STALLS.values() for _ in range(STALLED_PER_KIND)]
    probes = probe_exchanges(PROBES, every=0.05, during=3.0, start_after=0.5)
    began = time.monotonic()
    run_exchanges(server.port, stalled + probes, timeout=DEFAULTS.request_arrival_seconds + 10)
    return {
        "stalled": len(stalled),
        "answered_408": sum(exchange.status == 408 for exchange in stalled),
        "seconds_to_408": milliseconds([exchange.status_at - began for exchange in stalled if exchange.status_at]),
        "probe_ms": probe_latencies(probes),
    }


def render(results: dict) -> str:
    """Render the rounds as a markdown table."""
    lines = [
        "| scenario | round | outcome | refusal ms (median / p90 / max) | /healthz | /readyz | /metrics |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rounds in results["scenarios"].items():
        for number, result in enumerate(rounds, 1):
            if name == "3x capacity":
                outcome = f"{result['served']} served, {result['refused']} refused, {result['other']} other"
                refusal = "{median} / {p90} / {max}".format(**result["refusal_ms"])
            else:
                outcome = f"{result['answered_408']} of {result['stalled']} got 408 at {result['seconds_to_408']['median'] / 1000:.1f} s"
                refusal = "-"
            probes = [f"{result['probe_ms'][target]['median']} / {result['probe_ms'][target]['p90']}" for target in PROBES]
            lines.append(f"| {name} | {number} | {outcome} | {refusal} | " + " | ".join(probes) + " |")
    lines.append("")
    lines.append(f"Probe columns: median / p90 in ms. Load average at the end (1 / 5 / 15 min): {results['load_average']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run the rounds and save the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="the results folder (default: bench/results/<this machine>/)")
    args = parser.parse_args()
    with GunicornServer(Path(tempfile.mkdtemp(prefix="corechat-overload-")), workers=WORKERS) as server:
        send_until_every_worker_served(server, lambda: chat(server, max_tokens=2), most_rounds=20)
        scenarios = {
            "3x capacity": [overload_round(server) for _ in range(args.rounds)],
            "stalled clients": [stalled_round(server) for _ in range(args.rounds)],
        }
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg())
    results = {"scenarios": scenarios, "load_average": load}
    save_results("overload", results, render(results), args.out)


if __name__ == "__main__":
    main()
