"""Metrics: values after real traffic through real Gunicorn with 2 workers, read from /metrics."""

import os
import random
import signal
import statistics
import string
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from harness import (
    COUNTING,
    NO_END_OF_TURN,
    chat,
    ready_facts,
    scrape,
    send_until_every_worker_served,
    value,
    wait_for_samples,
)
from tests.support import wait_until

STREAMS = 4


def pids_labelled(samples: dict, name: str) -> set[str]:
    """Return the `pid` labels of a per-worker (liveall) gauge."""
    return {dict(labels)["pid"] for sample_name, labels in samples if sample_name == name}


class OpenStreams:
    """Long streams the test opens and leaves unread, then drops as a client that goes away does."""

    def __init__(self, server, count: int):
        self.responses = [
            requests.post(
                f"{server.url}/v1/chat/completions",
                # Longer than a test waits for them even on a loaded machine (4,000 tokens took under
                # 30 s), and never ended early by an end-of-turn token: such a stream left no live gauge.
                json={"messages": COUNTING, "max_tokens": 15_000, "temperature": 0, "stream": True,
                      "logit_bias": NO_END_OF_TURN},
                # Identical greedy streams would share one generation through the cache.
                headers={"Connection": "close", "Cache-Control": "no-cache"},
                stream=True,
                timeout=60,
            )
            for _ in range(count)
        ]
        assert all(response.status_code == 200 for response in self.responses)

    @classmethod
    def on_every_worker(cls, server, most: int = 12) -> "OpenStreams":
        """Open one stream on every worker, and no more.

        The kernel decides which worker accepts a connection, so streams are opened one at a time
        (up to `most`), and one that lands on a worker that has one already, where it waits, is
        closed before the next: a stream left waiting would start once the first one's generation
        ends, unread (the tiny model writes its 15,000 tokens within a test on a fast CPU), and count
        as a third running request.
        """
        streams = cls(server, 0)
        served: set[int] = set()
        for _ in range(most):
            opened = cls(server, 1).responses[0]
            deadline = time.monotonic() + 5
            while True:
                facts = ready_facts(server)
                landed = [pid for pid, worker in facts.items()
                          if pid not in served and worker["running"] + worker["waiting"] >= 1]
                if landed:
                    served.add(landed[0])
                    streams.responses.append(opened)
                    break
                if any(worker["waiting"] >= 1 for pid, worker in facts.items() if pid in served):
                    opened.close()
                    assert wait_until(lambda: all(worker["waiting"] == 0 for worker in ready_facts(server).values()),
                                      timeout=10), "a closed stream still waits"
                    break
                if time.monotonic() > deadline:
                    opened.close()
                    streams.close()
                    raise AssertionError(f"a stream reached no worker: {facts}")
                time.sleep(0.1)
            if len(served) == server.workers:
                return streams
        streams.close()
        raise AssertionError(f"{most} streams did not reach every worker: {facts}")

    def close(self) -> None:
        """Close every connection with its stream unread."""
        for response in self.responses:
            response.close()


STALE_PID = 999999999


def plant_stale_readiness(metrics_dir: Path) -> Path:
    """Leave the file a worker of an earlier run would have left: 5 ready workers."""
    stale = metrics_dir / f"gauge_livesum_{STALE_PID}.db"
    values = MmapedDict(str(stale))
    key = mmap_key("corechat_workers_ready", "corechat_workers_ready", [], [], "Workers ready.")
    values.write_value(key, 5.0, 0.0)
    values.close()
    return stale


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory) -> Path:
    """Return the metrics folder of the module's server, holding a stale file of an earlier run."""
    metrics_dir = tmp_path_factory.mktemp("multiproc")
    plant_stale_readiness(metrics_dir)
    return metrics_dir


@pytest.fixture(scope="module")
def server(metrics_dir, gunicorn):
    """Run 2 workers that generate one sequence at a time, so extra streams wait in the queue."""
    with gunicorn(
        workers=2,
        max_model_len=16_384,
        max_tokens_limit=15_000,
        max_running=1,
        sse_ping_seconds=0.2,
        # The tests leave streams unread while they scrape; on a loaded machine that outlasts the
        # default send deadline, which would cut them (tests/e2e/test_worker.py tests that deadline).
        send_timeout_seconds=600,
        prometheus_multiproc_dir=metrics_dir,
    ) as server:
        yield server


def test_master_empties_the_metrics_folder_of_an_earlier_run(server, metrics_dir):
    assert not (metrics_dir / f"gauge_livesum_{STALE_PID}.db").exists()
    worker_files = {path.name for path in metrics_dir.glob("gauge_livesum_*.db")}
    assert worker_files == {f"gauge_livesum_{pid}.db" for pid in server.worker_pids()}
    assert value(scrape(server), "corechat_workers_ready") == 2


def test_token_counters_equal_the_usage_of_responses_across_both_workers(server):
    before = scrape(server)
    usages = []

    def send_round() -> None:
        # Distinct seeds, so no reply comes from the response cache and skips the engine's histograms.
        first = len(usages)
        usages.extend([chat(server, max_tokens=random.randint(1, 12), seed=seed).json()["usage"]
                       for seed in range(first, first + 12)])

    served = send_until_every_worker_served(server, send_round, most_rounds=10)
    assert all(served.values()), f"one worker served all: {served}"
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # Every reply was generated: the engine's counters take its usage, the replayed ones nothing.
    assert delta("corechat_prompt_tokens_total") == sum(usage["prompt_tokens"] for usage in usages)
    assert delta("corechat_generation_tokens_total") == sum(usage["completion_tokens"] for usage in usages)
    assert delta("corechat_replayed_prompt_tokens_total") == delta("corechat_replayed_generation_tokens_total") == 0
    sent = len(usages)
    assert delta("corechat_requests_total", outcome="length") + delta("corechat_requests_total", outcome="stop") == sent
    for histogram in ("time_to_first_token", "request_duration", "queue_wait", "prompt_processing"):
        assert delta(f"corechat_{histogram}_seconds_count") == sent, histogram
        assert delta(f"corechat_{histogram}_seconds_sum") > 0, histogram
    assert value(after, "corechat_requests_running") == 0
    assert value(after, "corechat_requests_waiting") == 0


def test_requests_refused_before_generating_are_counted_by_error_code(server):
    before = scrape(server)
    assert chat(server, max_tokens="many").status_code == 400
    assert chat(server, model="no-such-model").status_code == 404
    after = scrape(server)
    for outcome in ("invalid_request_error", "model_not_found"):
        assert value(after, "corechat_requests_total", outcome=outcome) - value(
            before, "corechat_requests_total", outcome=outcome
        ) == 1, outcome


def test_running_and_waiting_rise_during_streams_and_return_to_zero_after_disconnect(server):
    before = scrape(server)
    streams = OpenStreams(server, STREAMS)
    try:
        during = wait_for_samples(
            server,
            lambda samples: value(samples, "corechat_requests_running")
            + value(samples, "corechat_requests_waiting") == STREAMS,
        )
        # One sequence at a time per worker: at most 2 run, the rest wait.
        assert 1 <= value(during, "corechat_requests_running") <= 2
        assert value(during, "corechat_requests_waiting") >= 2
    finally:
        streams.close()
    after = wait_for_samples(
        server,
        lambda samples: value(samples, "corechat_requests_running") == 0
        and value(samples, "corechat_requests_waiting") == 0,
    )
    cancelled = value(after, "corechat_requests_total", outcome="cancelled") - value(
        before, "corechat_requests_total", outcome="cancelled"
    )
    assert cancelled == STREAMS


def random_prompt() -> str:
    """Return a prompt of random words, different every call."""
    return " ".join("".join(random.choices(string.ascii_lowercase, k=random.randint(1, 9))) for _ in range(20))


def test_series_stay_the_same_under_random_prompts(server):
    assert chat(server, max_tokens=2).status_code == 200
    before = set(scrape(server))
    for _ in range(6):
        body = {"messages": [{"role": "user", "content": random_prompt()}], "max_tokens": random.randint(1, 8)}
        response = requests.post(
            f"{server.url}/v1/chat/completions", json={**body, "stream": random.random() < 0.5}, timeout=60
        )
        assert response.status_code == 200
    after = set(scrape(server))
    assert after == before, {"new": after - before, "gone": before - after}


def test_metrics_answer_while_every_worker_generates(server):
    streams = OpenStreams.on_every_worker(server)
    latencies = []
    try:
        wait_for_samples(server, lambda samples: value(samples, "corechat_requests_running") == 2)
        for _ in range(20):
            began = time.monotonic()
            scrape(server)
            latencies.append(time.monotonic() - began)
    finally:
        streams.close()
    # A liveness bound, not a speed claim: a scrape must not wait for generation to pause (the
    # streams never pause on their own). The median, as one scrape on a loaded machine can be slow.
    assert statistics.median(latencies) < 1.0, latencies


def test_workers_report_ready_load_and_model_info(server):
    samples = scrape(server)
    worker_pids = {str(pid) for pid in server.worker_pids()}
    assert value(samples, "corechat_workers_ready") == 2
    assert pids_labelled(samples, "corechat_model_load_seconds") == worker_pids
    assert pids_labelled(samples, "corechat_warmup_seconds") == worker_pids
    assert all(val > 0 for (name, _), val in samples.items() if name == "corechat_model_load_seconds")
    info = [dict(labels) for name, labels in samples if name == "corechat_model_info"]
    assert len(info) == 1
    assert info[0]["model"] == "tiny" and info[0]["workers"] == "2"
    assert info[0]["dtype"] == "int8" and info[0]["quantization"] == (
        "int8 weights with a float16 scale per Hadamard-rotated group of 32, activations rounded to int8 per block "
        "of 32 (rotated as the weights are)")


def test_killed_worker_leaves_no_live_gauges_after_respawn(server):
    """Runs after the other tests that use `server`: it replaces a worker."""
    streams = OpenStreams.on_every_worker(server)
    try:
        wait_for_samples(server, lambda samples: value(samples, "corechat_requests_running") == 2)
        # Each worker has one stream, generating or (its tokens all made) waiting to be read.
        victim = next(iter(ready_facts(server)))
        os.kill(victim, signal.SIGKILL)
        server.wait_ready()
    finally:
        streams.close()
    samples = wait_for_samples(
        server,
        lambda samples: value(samples, "corechat_workers_ready") == 2
        and value(samples, "corechat_requests_running") == 0
        and value(samples, "corechat_requests_waiting") == 0,
    )
    worker_pids = {str(pid) for pid in server.worker_pids()}
    assert str(victim) not in worker_pids
    assert pids_labelled(samples, "corechat_model_load_seconds") == worker_pids
