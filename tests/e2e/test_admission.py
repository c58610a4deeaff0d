"""Admission at three times capacity, with the settings `make serve` uses: every request runs, waits
in the engine's counted queue, or is refused at once, and probes never wait behind generations.

Real Gunicorn with its default 2 workers and default limits (MAX_RUNNING 8, MAX_QUEUE 16) on the
tiny model, driven by one selector loop (harness/loadgen.py) so the client adds no latency of its own.
"""

import statistics

import pytest

from harness import COUNTING, chat, send_until_every_worker_served, value, wait_for_samples
from harness.loadgen import chat_exchange, probe_exchanges, run_exchanges
from service.settings import Settings

pytestmark = pytest.mark.serial

DEFAULTS = Settings.model_construct()
CAPACITY_PER_WORKER = DEFAULTS.max_running + DEFAULTS.max_queue
WORKERS = 2
STREAMS = 3 * WORKERS * CAPACITY_PER_WORKER
# Long enough that the admitted streams keep both engines busy for seconds while the probes run.
MAX_TOKENS = 64
PROBES = ("/healthz", "/readyz", "/metrics")
PROBE_EVERY = 0.05
PROBE_SECONDS = 4.0
# The figures: refusals and probes answer within 100 ms (medians, on a shared CPU).
FAST_SECONDS = 0.1
# A hang, not a slow answer: the client gives up on anything still open after this.
RUN_TIMEOUT = 120


def test_three_times_capacity_is_served_or_refused_at_once_and_probes_stay_fast(default_server):
    # Warm, as a serving worker is: its first requests compile the chat template and fill caches.
    send_until_every_worker_served(default_server, lambda: chat(default_server, max_tokens=2), most_rounds=20)
    streams = [
        chat_exchange({"messages": COUNTING, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
        for _ in range(STREAMS)
    ]
    probes = probe_exchanges(PROBES, every=PROBE_EVERY, during=PROBE_SECONDS, start_after=0.2)
    run_exchanges(default_server.port, streams + probes, timeout=RUN_TIMEOUT)

    failed = [(exchange.status, exchange.error) for exchange in streams + probes if exchange.error]
    assert not failed, failed
    served = [exchange for exchange in streams if exchange.status == 200]
    refused = [exchange for exchange in streams if exchange.status == 503]
    assert len(served) + len(refused) == STREAMS, sorted({exchange.status for exchange in streams})
    assert CAPACITY_PER_WORKER <= len(served) <= WORKERS * CAPACITY_PER_WORKER
    for exchange in served:
        payloads = exchange.sse_payloads()
        assert payloads[-1] == "[DONE]"
        assert payloads[-2]["choices"][0]["finish_reason"] == "length", payloads[-2]
    for exchange in refused:
        assert exchange.response_headers["retry-after"] == "1"
        assert exchange.json()["error"]["code"] == "overloaded"

    refusal_seconds = [exchange.seconds_to_status for exchange in refused]
    assert statistics.median(refusal_seconds) < FAST_SECONDS, sorted(refusal_seconds)
    assert all(exchange.status == 200 for exchange in probes), sorted({exchange.status for exchange in probes})
    # And fast while the streams ran: judged on the probes sent after the first stream was and
    # answered before the last served stream ended, however many that is on a given CPU.
    load_began = min(exchange.sent_at for exchange in streams)
    load_ended = max(exchange.ended_at for exchange in served)
    for target in PROBES:
        answered = [exchange for exchange in probes if exchange.target == target]
        seconds = [exchange.seconds_to_status for exchange in answered]
        assert statistics.median(seconds) < FAST_SECONDS, (target, sorted(seconds))
        under_load = [exchange.seconds_to_status for exchange in answered
                      if exchange.sent_at >= load_began and exchange.status_at <= load_ended]
        assert under_load, (target, "no probe was answered while streams ran")
        assert statistics.median(under_load) < FAST_SECONDS, (target, sorted(under_load))

    wait_for_samples(
        default_server,
        lambda samples: value(samples, "corechat_requests_running") == 0
        and value(samples, "corechat_requests_waiting") == 0,
        timeout=10,
    )
