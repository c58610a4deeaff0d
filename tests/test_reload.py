"""A reload under steady traffic, as `systemctl reload corechat` runs it (the unit's ExecReload:
`python -m service.reload $MAINPID`): no request fails or waits on a model load, the new workers
serve afterwards, the metrics carry on, and systemd is told the new main PID.

systemd itself cannot run here (it is not PID 1 in this sandbox): a unix datagram socket stands in
for its notify socket, answering BARRIER=1 as systemd does, by closing the descriptor it receives.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from service.reload import alive, children
from support import COUNTING, REPO, GunicornServer, ready_facts, scrape, value

pytestmark = pytest.mark.serial

CLIENTS = {"whole": 2, "stream": 2}
STALL_SECONDS = 2.0  # no request may wait longer than this for its response to begin


class FakeSystemd:
    """A notify socket that records every message and confirms barriers."""

    def __init__(self, path: Path):
        self.path = path
        self.messages: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        """Record messages until stopped; close any descriptor passed (the barrier's answer)."""
        while self.running:
            try:
                data, fds, _flags, _address = socket.recv_fds(self.sock, 4096, 4)
            except TimeoutError:
                continue
            for fd in fds:
                os.close(fd)
            self.messages.append(data.decode())

    def close(self) -> None:
        """Stop receiving."""
        self.running = False
        self.thread.join()
        self.sock.close()


class Traffic:
    """Client threads that send short requests and streams, each on a fresh connection, until stopped."""

    def __init__(self, url: str):
        self.url = url
        self.results: list[dict] = []
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._send, args=(kind,), daemon=True)
            for kind, count in CLIENTS.items()
            for _ in range(count)
        ]

    def __enter__(self) -> "Traffic":
        """Start the clients."""
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop the clients after their current request."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)

    def _send(self, kind: str) -> None:
        """Send requests of one kind in a loop, recording each one's outcome and wait."""
        # Short, so that the wait for a response's start measures the server's availability, not a generation.
        body = {"messages": COUNTING, "max_tokens": 2 if kind == "whole" else 32, "stream": kind == "stream"}
        while not self.stopping.is_set():
            result = {"kind": kind, "began": time.monotonic()}
            try:
                with requests.post(f"{self.url}/v1/chat/completions", json=body, stream=True, timeout=30,
                                   headers={"Connection": "close", "Cache-Control": "no-cache"}) as response:
                    result["waited"] = time.monotonic() - result["began"]
                    result["status"] = response.status_code
                    text = response.text
                result["complete"] = "[DONE]" in text if kind == "stream" else '"finish_reason":"length"' in text
            except requests.RequestException as error:
                result["error"] = repr(error)
            result["ended"] = time.monotonic()
            self.results.append(result)


@pytest.fixture()
def notified_server(tiny_model_dir, tmp_path):
    """Run Gunicorn with 2 workers under a fake systemd notify socket; stop whichever master serves at the end."""
    systemd = FakeSystemd(tmp_path / "notify")
    server = GunicornServer(tmp_path, workers=2, notify_socket=str(systemd.path)).start()
    yield server, systemd
    for pid in [int(message.split("=", 1)[1]) for message in systemd.messages if message.startswith("MAINPID=")]:
        if alive(pid):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    server.stop()
    systemd.close()


def test_reload_under_traffic_fails_and_stalls_nothing_and_hands_over_to_new_workers(notified_server):
    server, systemd = notified_server
    old_master, old_workers = server.process.pid, set(server.worker_pids())
    assert systemd.messages[0].startswith("READY=1")
    with Traffic(server.url) as traffic:
        time.sleep(2)
        served_before = value(scrape(server), "corechat_requests_total", outcome="length")
        began = time.monotonic()
        reload = subprocess.run([sys.executable, "-m", "service.reload", str(old_master)], cwd=REPO,
                                env=server.env, capture_output=True, text=True, timeout=180)
        reloaded = time.monotonic()
        assert reload.returncode == 0, reload.stderr + server.log()
        assert server.process.wait(timeout=60) == 0  # the old master drained and exited
        time.sleep(3)

    mainpid = [message for message in systemd.messages if message.startswith("MAINPID=")]
    assert len(mainpid) == 1, systemd.messages
    new_master = int(mainpid[0].removeprefix("MAINPID="))
    new_workers = set(children(new_master))
    assert len(new_workers) == 2 and not new_workers & old_workers
    assert set(ready_facts(server)) == new_workers

    results = traffic.results
    failed = [result for result in results if "error" in result or result["status"] != 200 or not result["complete"]]
    assert not failed, failed
    stalled = [(round(result["waited"], 2), round(result["began"] - began, 1)) for result in results
               if result["waited"] >= STALL_SECONDS]
    assert not stalled, f"(seconds waited, seconds into the reload) of {len(results)}: {stalled}"
    during = [result for result in results if result["ended"] > began and result["began"] < reloaded]
    after = [result for result in results if result["began"] > reloaded]
    assert len(during) >= 10 and len(after) >= 5, (len(during), len(after))
    # The new master shares the old one's metrics folder instead of emptying it: counts carry on.
    assert value(scrape(server), "corechat_requests_total", outcome="length") >= served_before + len(during)
    assert "READY=1" not in "".join(systemd.messages[1:])  # only the first master's start
