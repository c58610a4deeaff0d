"""What the tests and the benchmarks both drive corechat with, from outside its processes.

- `servers`: corechat under real Gunicorn and a throwaway redis-server, on free loopback ports.
- `sse`: the one reader of server-sent events.
- `client`: chat requests, streamed and timed (the benchmarks' client) or read in a thread.
- `observe`: what a running server says of itself: /readyz of every worker, /metrics, its log.
- `procfs`: what /proc says of its processes: memory (PSS, RSS, anonymous), mappings, threads.
- `loadgen`: many exchanges at once from one selector loop, timed as they happen.
- `proxy`: a TCP proxy that holds back replies (a slow Redis).

Nothing here imports torch or the service's engine, so a benchmark's client stays light.
"""

from harness.client import (
    COUNTING,
    NO_END_OF_TURN,
    StreamingClient,
    StreamResult,
    chat,
    concurrent_streams,
    hang_up_all,
    short_chat,
    stream_chat,
    stream_reply,
)
from harness.observe import (
    finished_by_worker,
    parse_first_token_timings,
    parse_samples,
    ready_facts,
    scrape,
    send_until_every_worker_served,
    value,
    wait_for_samples,
)
from harness.procfs import (
    anonymous_megabytes,
    cpu_ticks_by_thread,
    file_mappings,
    mapping_rss_kb,
    memory_of,
    threads_of,
)
from harness.proxy import DelayingProxy
from harness.servers import REPO, TINY_MODEL_DIR, GunicornServer, RedisServer, free_port, processes_of
from harness.sse import DONE, sse_payload, sse_payloads, sse_stream

__all__ = [
    "COUNTING", "DONE", "NO_END_OF_TURN", "REPO", "TINY_MODEL_DIR", "DelayingProxy", "GunicornServer", "RedisServer",
    "StreamResult", "StreamingClient",
    "anonymous_megabytes", "chat", "concurrent_streams", "cpu_ticks_by_thread", "file_mappings", "finished_by_worker",
    "free_port", "hang_up_all", "mapping_rss_kb", "memory_of", "parse_first_token_timings", "parse_samples",
    "processes_of", "ready_facts", "scrape", "send_until_every_worker_served", "short_chat", "sse_payload",
    "sse_payloads", "sse_stream", "stream_chat", "stream_reply", "threads_of", "value", "wait_for_samples",
]
