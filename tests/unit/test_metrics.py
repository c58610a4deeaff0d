"""Metrics of a cache replay: replayed tokens and a fast first token, but none of the engine's work."""

import time

from prometheus_client import REGISTRY

from service.cache import Flight
from service.cache.entries import CachedReply
from service.engine import Finished
from service.observability import metrics
from service.observability.observed import ObservedGeneration


def local_value(name: str, **labels) -> float:
    """Return a sample of this process's own registry (0 when the series does not exist)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_cache_replay_counts_as_replayed_tokens_and_fast_first_token_but_no_engine_work():
    """A cache hit is a request with usage and a first token, but neither its tokens nor its zero
    timings are the engine's."""
    fast_bucket = {"le": str(metrics.LATENCY_BUCKETS[0])}
    engine_only = ("queue_wait", "prompt_processing", "inter_token_latency")
    before = {
        "fast": local_value("corechat_time_to_first_token_seconds_bucket", **fast_bucket),
        "stop": local_value("corechat_requests_total", outcome="stop"),
        "prompt": local_value("corechat_prompt_tokens_total"),
        "generated": local_value("corechat_generation_tokens_total"),
        "replayed_prompt": local_value("corechat_replayed_prompt_tokens_total"),
        "replayed_generated": local_value("corechat_replayed_generation_tokens_total"),
        **{name: local_value(f"corechat_{name}_seconds_count") for name in engine_only},
    }
    replay = ObservedGeneration(
        Flight.replayed(CachedReply(("Hello", " there"), "stop", 9, 2)).join(), arrived_at=time.monotonic()
    )
    assert isinstance(list(replay.events())[-1], Finished)
    replay.cancel()
    assert local_value("corechat_time_to_first_token_seconds_bucket", **fast_bucket) == before["fast"] + 1
    assert local_value("corechat_requests_total", outcome="stop") == before["stop"] + 1
    assert local_value("corechat_replayed_prompt_tokens_total") == before["replayed_prompt"] + 9
    assert local_value("corechat_replayed_generation_tokens_total") == before["replayed_generated"] + 2
    assert local_value("corechat_prompt_tokens_total") == before["prompt"]
    assert local_value("corechat_generation_tokens_total") == before["generated"]
    for name in engine_only:
        assert local_value(f"corechat_{name}_seconds_count") == before[name], name
    assert local_value("corechat_requests_waiting") == 0
    assert local_value("corechat_requests_running") == 0
