"""A slow Redis holding conversations' KV state (SHARED_KV_TTL_SECONDS) delays only the turn that asks
it, never the streams the engine is decoding: the fetch runs in the request's thread, before the
turn is queued. The Redis is real, behind a proxy that holds back its every reply."""

import threading
import time

from harness import DelayingProxy
from service.cache.kvshare import RedisPrefixes
from service.engine import Engine, SamplingParams, TextDelta

REDIS_DELAY_SECONDS = 3.0
# Far above a decode step of the tiny model, far below the delay: only a stream that waited for Redis passes it.
LONGEST_GAP_SECONDS = 1.5


def test_a_slow_redis_delays_the_turn_that_fetches_and_never_the_streams_decoding(make_settings, redis_server,
                                                                                tmp_path):
    with DelayingProxy(redis_server.port, REDIS_DELAY_SECONDS) as proxy:
        settings = make_settings(max_model_len=4096, redis_url=f"redis://127.0.0.1:{proxy.port}/0",
                                 shared_kv_ttl_seconds=600, shared_kv_socket_timeout_seconds=10,
                                 prefix_cache_dir=str(tmp_path / "prefixes"))
        engine = Engine(settings, shared_prefixes=RedisPrefixes.from_settings(settings))
        engine.start()
        try:
            assert engine.wait_ready(300), engine.facts
            template = engine.template
            decoding = engine.submit(template.encode_chat([{"role": "user", "content": "Count to a million."}]),
                                     SamplingParams(max_tokens=100_000, temperature=0.0))
            arrivals: list[float] = []

            def read() -> None:
                for event in decoding.events():
                    if isinstance(event, TextDelta):
                        arrivals.append(time.monotonic())

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            while not arrivals:
                time.sleep(0.01)
            # A later turn of a conversation this host never saw: its prompt holds an end of turn, so it asks Redis.
            later_turn = template.encode_chat([{"role": "user", "content": "Hello"},
                                               {"role": "assistant", "content": "Hi there."},
                                               {"role": "user", "content": "And now?"}])
            began = time.monotonic()
            turn = engine.submit(later_turn, SamplingParams(max_tokens=2, temperature=0.0))
            fetched = time.monotonic()
            list(turn.events())
            decoding.cancel()
            reader.join(30)
        finally:
            engine.stop()
    assert fetched - began >= REDIS_DELAY_SECONDS * 0.9  # it did wait for Redis, in its own thread
    during = [arrival for arrival in arrivals if began <= arrival <= fetched + 0.5]
    gaps = [later - earlier for earlier, later in zip(during, during[1:])]
    assert len(during) > 10 and max(gaps) < LONGEST_GAP_SECONDS, max(gaps, default=None)
