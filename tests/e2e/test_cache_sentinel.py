"""The response cache behind Redis Sentinel: a real failover under real Gunicorn.

The failover test runs a master, its replica and three redis-sentinel processes, kills the master
with SIGKILL while requests keep coming, and checks what docs/cache.md promises: no request fails,
and the cache comes back by itself on the promoted replica.
"""

import logging
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote

import pytest
import redis
import requests

from harness import RedisServer
from tests.e2e.sentinel_support import SentinelGroup

log = logging.getLogger(__name__)

# Characters a URL must percent-encode, and ones Redis's config files and ACLs treat specially.
MASTER_PASSWORD = "m@ster:pass/w%rd?#1"
SENTINEL_PASSWORD = "s3ntinel@pass:2"


# A failover under real Gunicorn ---------------------------------------------------------------


@dataclass
class Reply:
    """One request of the load: when it was sent and answered, its status, X-Cache, and whether its body was whole."""

    sent_at: float
    answered_at: float
    status_code: int
    x_cache: str
    whole: bool


def whole_reply(response: requests.Response, streamed: bool) -> bool:
    """Tell whether a reply's body is whole: a JSON reply with its text, or a stream ending in [DONE] with no error."""
    if response.status_code != 200:
        return False
    if streamed:
        return response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text
    choice = response.json()["choices"][0]
    return bool(choice["message"]["content"]) and choice["finish_reason"] in ("stop", "length")


class Load:
    """Requests sent back to back from threads until stopped: one repeated reply and a stream of new ones."""

    def __init__(self, url: str, repeated: dict):
        self.url = url
        self.repeated = repeated
        self.replies: dict[str, list[Reply]] = {"repeated": [], "new": []}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(kind,), daemon=True) for kind in self.replies]

    def _send(self, kind: str) -> None:
        """Send one kind of request until stopped."""
        index = 0
        while not self._stop.is_set():
            index += 1
            body = self.repeated if kind == "repeated" else {
                "messages": [{"role": "user", "content": f"Question number {index} during a failover."}],
                "max_tokens": 8, "temperature": 0, "stream": True}
            sent_at = time.monotonic()
            try:
                response = requests.post(f"{self.url}/v1/chat/completions", json=body,
                                         headers={"Connection": "close"}, timeout=30)
            except requests.RequestException:
                self.replies[kind].append(Reply(sent_at, time.monotonic(), 0, "", False))
                continue
            self.replies[kind].append(Reply(sent_at, time.monotonic(), response.status_code,
                                            response.headers.get("X-Cache", ""), whole_reply(response, kind == "new")))

    def __enter__(self) -> "Load":
        """Start sending."""
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop sending and wait for the last replies."""
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def first_hit_after(self, moment: float) -> Reply | None:
        """Return the first repeated request sent after a moment that was a hit."""
        return next((reply for reply in list(self.replies["repeated"]) if reply.sent_at > moment
                     and reply.x_cache == "hit"), None)


def wait_for(condition, timeout: float, what: str):
    """Poll condition() until it returns something truthy, and return it; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.05)
    return result


def cached(url: str, body: dict) -> str:
    """Send a request and return its X-Cache."""
    response = requests.post(f"{url}/v1/chat/completions", json=body, headers={"Connection": "close"}, timeout=30)
    assert response.status_code == 200
    return response.headers["X-Cache"]


def stored_replies(server: RedisServer) -> int:
    """Count the replies stored on one Redis server."""
    client = redis.Redis(port=server.port, password=server.password or None, socket_timeout=2)
    return len(client.keys("corechat:v2:reply:*"))


@pytest.fixture()
def sentinel_group(tmp_path):
    """Run a master, its replica and three sentinels, all with passwords."""
    group = SentinelGroup(tmp_path, password=MASTER_PASSWORD, sentinel_password=SENTINEL_PASSWORD).start()
    yield group
    group.stop()


def test_killing_the_master_mid_load_fails_no_request_and_hits_resume_on_the_promoted_replica(sentinel_group, gunicorn):
    repeated = {"messages": [{"role": "user", "content": "What survives a failover?"}], "max_tokens": 8,
                "temperature": 0}
    with gunicorn(workers=2, warmup=False, redis_url=sentinel_group.url(),
                  redis_sentinel_password=SENTINEL_PASSWORD) as server:
        assert cached(server.url, repeated) == "miss"
        assert cached(server.url, repeated) == "hit"
        with Load(server.url, repeated) as load:
            wait_for(lambda: len(load.replies["new"]) >= 3 and len(load.replies["repeated"]) >= 3, 30, "load")
            sentinel_group.master.stop()  # SIGKILL
            killed_at = time.monotonic()
            wait_for(lambda: sentinel_group.master_port() == sentinel_group.replica.port, 30, "a promotion")
            promoted_at = time.monotonic()
            resumed = wait_for(lambda: load.first_hit_after(killed_at), 30, "a hit after the failover")
            wait_for(lambda: any(reply.sent_at > resumed.answered_at for reply in load.replies["new"]), 30, "more load")
        replies = load.replies["repeated"] + load.replies["new"]
        assert [reply for reply in replies if not (reply.status_code == 200 and reply.whole)] == []
        missed = [reply for reply in load.replies["repeated"] if killed_at < reply.sent_at < resumed.sent_at]
        # The kill was felt: the repeated reply, a hit before, was served uncached until the cache came back.
        assert missed and {reply.x_cache for reply in missed} == {"bypass"}
        log.info("master killed: sentinels named the replica after %.2f s, the first hit came %.2f s after the kill "
                 "(%d repeated requests served uncached meanwhile)", promoted_at - killed_at,
                 resumed.sent_at - killed_at, len(missed))

        # New replies are stored on the promoted replica and hit from there. Each worker has its own breaker,
        # and the worker that did not serve the first hit may still be waiting out its own, or may meet its
        # stale connection to the dead master now and wait once more: it serves uncached meanwhile.
        before = stored_replies(sentinel_group.replica)
        fresh = {**repeated, "messages": [{"role": "user", "content": "Asked after the failover."}]}
        statuses: list[str] = []
        wait_for(lambda: statuses.append(cached(server.url, fresh)) or statuses[-1] == "hit", 30, "a new reply's hit")
        assert "miss" in statuses and set(statuses[:-1]) <= {"miss", "bypass"}, statuses
        assert stored_replies(sentinel_group.replica) == before + 1
        whole_log = server.log()
        assert "response cache store failed" in whole_log
        for secret in (MASTER_PASSWORD, quote(MASTER_PASSWORD, safe=""), SENTINEL_PASSWORD):
            assert secret not in whole_log
