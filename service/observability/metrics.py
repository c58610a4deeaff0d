"""Prometheus metrics: the catalogue, the `/metrics` route, and the hooks that count requests.

Under Gunicorn, `gunicorn.conf.py` sets PROMETHEUS_MULTIPROC_DIR before anything imports
prometheus_client, so every worker writes its values to files in that folder and any worker's
`/metrics` merges all of them. Without it (the Flask test client, `flask run`) the values live in
this process and `/metrics` serves them directly.

This module never imports torch: Gunicorn's master imports it for its hooks, with or without
PRELOAD_LIBRARIES.
"""

import logging
import time
from typing import TYPE_CHECKING

from flask import Blueprint, Flask, Response, current_app, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from ..settings import Settings
from .request_record import current_record

if TYPE_CHECKING:
    from ..engine.facts import EngineFacts

log = logging.getLogger(__name__)

bp = Blueprint("metrics", __name__)
# Where the app keeps PROMETHEUS_MULTIPROC_DIR for `/metrics` to read.
MULTIPROC_DIR_CONFIG = "CORECHAT_PROMETHEUS_MULTIPROC_DIR"

# Chat, legacy completions and responses count in the same series: one engine serves them all.
GENERATION_ENDPOINTS = ("api.create_chat_completion", "api.create_completion", "api.create_response")

# From a cache hit (milliseconds) to a long reply on a busy CPU (minutes).
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0
)
# One decode step of a small model on a few cores takes milliseconds; a big one, a second or so.
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5
)
# Outcomes created up front, so their series exist (at zero) before the first such request and
# rate() over them works from the first scrape.
KNOWN_OUTCOMES = ("stop", "length", "cancelled", "internal_error", "overloaded")
CACHE_RESULTS = ("hit", "miss", "bypass", "error")
DRAFT_OUTCOMES = ("accepted", "rejected")

time_to_first_token_seconds = Histogram(
    "corechat_time_to_first_token_seconds",
    "Time from a request's arrival to its first generated text.",
    buckets=LATENCY_BUCKETS,
)
inter_token_latency_seconds = Histogram(
    "corechat_inter_token_latency_seconds",
    "Mean time between two generated tokens of a request, one observation per request.",
    buckets=TOKEN_LATENCY_BUCKETS,
)
request_duration_seconds = Histogram(
    "corechat_request_duration_seconds",
    "Time from a request's arrival to its last event (end to end).",
    buckets=LATENCY_BUCKETS,
)
queue_wait_seconds = Histogram(
    "corechat_queue_wait_seconds",
    "Time a request waited in its worker's queue before the engine started it.",
    buckets=LATENCY_BUCKETS,
)
prompt_processing_seconds = Histogram(
    "corechat_prompt_processing_seconds",
    "Time the engine spent on a request's prompt (prefill) up to its first token.",
    buckets=LATENCY_BUCKETS,
)
requests_total = Counter(
    "corechat_requests",
    "Chat and legacy completion requests by outcome: finish reason, cancelled, or error code.",
    ["outcome"],
)
# The engine's work, as vLLM's token counters: every generation once, however many requests read it.
prompt_tokens_total = Counter(
    "corechat_prompt_tokens", "Prompt tokens the engines processed (a continued reply's earlier tokens included)."
)
generation_tokens_total = Counter("corechat_generation_tokens", "Tokens the engines generated.")
speculative_tokens_total = Counter(
    "corechat_speculative_tokens",
    "Draft tokens speculative decode steps checked (SPECULATIVE_TOKENS), by outcome: accepted (taken into the "
    "reply, a step saved each) or rejected (a row computed for nothing).",
    ["outcome"],
)
# What clients got without the engine working for them: the usage of replayed replies.
replayed_prompt_tokens_total = Counter(
    "corechat_replayed_prompt_tokens",
    "Prompt tokens of replies replayed from the response cache or an identical request's generation.",
)
replayed_generation_tokens_total = Counter(
    "corechat_replayed_generation_tokens",
    "Completion tokens of replies replayed from the response cache or an identical request's generation.",
)
send_timeouts_total = Counter(
    "corechat_send_timeouts",
    "Responses cut because their client read none of them for SEND_TIMEOUT_SECONDS (a generation is cancelled).",
)
cache_lookups_total = Counter(
    "corechat_cache_lookups", "Response cache lookups by result: hit, miss, bypass or error.", ["result"]
)
singleflight_followers_total = Counter(
    "corechat_singleflight_followers",
    "Requests that waited for an identical in-flight request instead of generating.",
)
# livesum: the sum over live workers, and a killed worker's share vanishes with mark_process_dead.
requests_running = Gauge(
    "corechat_requests_running", "Requests the engines are generating now.", multiprocess_mode="livesum"
)
requests_waiting = Gauge(
    "corechat_requests_waiting", "Requests queued for an engine and not started.", multiprocess_mode="livesum"
)
workers_ready = Gauge(
    "corechat_workers_ready", "Workers whose model is loaded and warmed up.", multiprocess_mode="livesum"
)
# liveall: one series per live worker (a `pid` label), because each worker loads its own copy.
model_load_seconds = Gauge(
    "corechat_model_load_seconds", "Seconds this worker took to map its model.", multiprocess_mode="liveall"
)
warmup_seconds = Gauge(
    "corechat_warmup_seconds", "Seconds this worker's warm-up generation took.", multiprocess_mode="liveall"
)
# livemax: every worker reports the same labels, and one series is what an info metric should be.
model_info = Gauge(
    "corechat_model_info",
    "Always 1; the labels describe the served model and how the workers run it.",
    ["model", "dtype", "quantization", "threads_per_worker", "workers"],
    multiprocess_mode="livemax",
)

for _outcome in KNOWN_OUTCOMES:
    requests_total.labels(_outcome)
for _result in CACHE_RESULTS:
    cache_lookups_total.labels(_result)
for _outcome in DRAFT_OUTCOMES:
    speculative_tokens_total.labels(_outcome)


def count_cache_lookup(result: str) -> None:
    """Count one response cache lookup; result is hit, miss, bypass or error."""
    cache_lookups_total.labels(result).inc()


def count_singleflight_follower() -> None:
    """Count one request served by waiting for an identical request already generating."""
    singleflight_followers_total.inc()


def report_ready(facts: "EngineFacts", settings: Settings) -> None:
    """Publish this worker's readiness and what its engine measured while loading."""
    model_load_seconds.set(facts.load_seconds or 0.0)
    warmup_seconds.set(facts.warmup_seconds or 0.0)
    model_info.labels(
        model=settings.served_model_name,
        dtype=str(facts.dtype or settings.dtype),
        quantization=str(facts.quantization or "none"),
        threads_per_worker=str(facts.torch_threads or settings.threads_per_worker),
        workers=str(settings.worker_count),
    ).set(1)
    workers_ready.set(1)


def report_not_ready() -> None:
    """Take this worker out of the ready count (its engine failed; it is about to exit)."""
    workers_ready.set(0)


def mark_arrival() -> None:
    """Remember when the request arrived, the start of its time to first token."""
    current_record().arrived_at = time.monotonic()


def count_refused_by_worker(code: str) -> None:
    """Count a chat request the worker refused before the app saw it (overloaded, too slow, too
    large or malformed)."""
    requests_total.labels(code).inc()


def count_refused_request(response):
    """Count a chat request answered with an error before any generation was observed."""
    if request.endpoint in GENERATION_ENDPOINTS and response.status_code >= 400 and not current_record().observed:
        error = (response.get_json(silent=True) or {}).get("error") or {}
        requests_total.labels(error.get("code") or error.get("type") or f"http_{response.status_code}").inc()
    return response


@bp.get("/metrics")
def scrape_metrics():
    """Return every worker's metrics in Prometheus's text format."""
    multiproc_dir = current_app.config[MULTIPROC_DIR_CONFIG]
    if multiproc_dir:
        # A fresh registry per scrape, as prometheus_client's multiprocess recipe asks: the
        # collector reads the files of every worker, live or dead, at collection time.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=multiproc_dir)
    else:
        registry = REGISTRY
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def init_app(app: Flask, settings: Settings) -> None:
    """Register `/metrics` and the hooks that time and count chat requests."""
    app.config[MULTIPROC_DIR_CONFIG] = settings.prometheus_multiproc_dir
    app.register_blueprint(bp)
    app.before_request(mark_arrival)
    app.after_request(count_refused_request)
