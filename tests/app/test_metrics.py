"""Metrics in this process, where /metrics serves the process's own registry: the request wrapper, a
cancelled generation, and the debug line that splits a first token into its parts."""

import time

import pytest

from harness import COUNTING, parse_samples
from service.engine import SamplingParams, TextDelta
from service.observability import metrics
from service.observability.observed import EngineWork, ObservedGeneration
from tests.unit.test_metrics import local_value


def test_metrics_without_gunicorn_serve_this_process(client):
    """Outside Gunicorn (no multiprocess folder) /metrics serves this process's own values."""
    before = parse_samples(client.get("/metrics").get_data(as_text=True))
    metrics.count_cache_lookup("hit")
    metrics.count_singleflight_follower()
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"
    after = parse_samples(response.get_data(as_text=True))
    hits = ("corechat_cache_lookups_total", (("result", "hit"),))
    assert after[hits] == before[hits] + 1
    followers = ("corechat_singleflight_followers_total", ())
    assert after[followers] == before[followers] + 1


def test_cancel_mid_generation_returns_running_to_zero_and_counts_cancelled_and_the_engines_work(engine):
    """A client that leaves mid-stream never reads its generation's last event: the engine's counters
    still take the prompt and the tokens it was sent."""
    cancelled = local_value("corechat_requests_total", outcome="cancelled")
    prompt, generated = local_value("corechat_prompt_tokens_total"), local_value("corechat_generation_tokens_total")
    prompt_ids = engine.template.encode(engine.template.render(COUNTING))
    observed = ObservedGeneration(
        EngineWork(engine.submit(prompt_ids, SamplingParams(max_tokens=10_000, temperature=0.0))),
        arrived_at=time.monotonic(),
    )
    assert local_value("corechat_requests_waiting") == 1
    while not isinstance(event := observed.next_event(timeout=30), TextDelta):
        pass
    sent = len(event.token_ids)
    assert local_value("corechat_requests_running") == 1
    assert local_value("corechat_requests_waiting") == 0
    observed.cancel()
    observed.cancel()  # the serving class cancels in `finally`, after a client already went away
    assert local_value("corechat_requests_running") == 0
    assert local_value("corechat_requests_total", outcome="cancelled") == cancelled + 1
    assert local_value("corechat_prompt_tokens_total") == prompt + len(prompt_ids)
    assert local_value("corechat_generation_tokens_total") == generated + sent > generated


def test_debug_log_splits_a_streamed_first_token_into_its_parts(client, engine, caplog):
    """The `first token timings` line of a real streamed request: its parts, none negative, add up."""
    from harness import parse_first_token_timings

    with caplog.at_level("DEBUG", logger="service.observability.observed"):
        response = client.post("/v1/chat/completions", json={"messages": COUNTING, "max_tokens": 3, "stream": True},
                               headers={"Cache-Control": "no-cache"})
        assert response.status_code == 200
        assert response.get_data(as_text=True).endswith("data: [DONE]\n\n")
    (timings,) = parse_first_token_timings(caplog.text)
    parts = ("before_queue", "queue", "prompt_pass", "after_prompt_pass")
    assert all(timings[part] >= 0 for part in (*parts, "first_write")), timings
    assert sum(timings[part] for part in parts) == pytest.approx(timings["first_token"], abs=0.5)
    assert timings["prompt_pass"] > 0
    assert timings["prompt_tokens"] == len(engine.template.encode(engine.template.render(COUNTING)))
