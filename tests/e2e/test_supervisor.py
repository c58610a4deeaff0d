"""service/process/supervisor.py with real Gunicorn and the tiny model, as the unit runs it, without systemd:
reloads under traffic fail nothing and leave one master, a stop drains, a reload that cannot start
leaves the serving master alone, a restart hands the listening socket over, a master's crash exits 1.

systemd itself cannot run here (deploy/test/run.py boots it in a container for the same guarantees):
a unix datagram socket stands in for its notify socket, keeping descriptors sent with FDSTORE=1 as
systemd's store does, and handing them to the next start as systemd would (LISTEN_FDS).
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

from harness import COUNTING, REPO, GunicornServer, scrape, value
from service.process.listener import STORED_SOCKET_NAME
from service.process.processes import children
from service.process.supervisor import DEFAULT_READY_TIMEOUT_SECONDS, RESTART_SIGNAL
from tests.support import wait_until

pytestmark = pytest.mark.serial

WORKERS = 2
CLIENTS = {"whole": 2, "stream": 2}
STALL_SECONDS = 2.0  # no request may wait longer than this for its response to begin
PASS_SOCKET = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "os.dup2(fd, 3)\n"
    "os.close(fd)\n"
    "os.environ['LISTEN_PID'] = str(os.getpid())\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class FakeSystemd:
    """A notify socket that records every message and keeps the descriptors stored with FDSTORE=1."""

    def __init__(self, path: Path):
        self.path = path
        self.messages: list[str] = []
        self.store: dict[str, list[int]] = {}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.running = True
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        """Record messages until stopped; keep or drop stored descriptors as systemd does."""
        while self.running:
            try:
                data, fds, _flags, _address = socket.recv_fds(self.sock, 4096, 4)
            except TimeoutError:
                continue
            message = data.decode()
            fields = dict(line.split("=", 1) for line in message.splitlines() if "=" in line)
            if fields.get("FDSTORE") == "1":
                self.store.setdefault(fields.get("FDNAME", "stored"), []).extend(fds)
            else:
                for fd in fds:
                    os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1":
                for fd in self.store.pop(fields["FDNAME"], []):
                    os.close(fd)
            self.messages.append(message)

    def saw(self, prefix: str) -> bool:
        """Tell whether some message began with prefix."""
        return any(message.startswith(prefix) for message in self.messages)

    def close(self) -> None:
        """Stop receiving and drop what the store holds."""
        self.running = False
        self.thread.join()
        self.sock.close()
        for fds in self.store.values():
            for fd in fds:
                os.close(fd)


class Supervised(GunicornServer):
    """corechat under `python -m service.process.supervisor`, as the unit's ExecStart runs it."""

    def __init__(self, log_dir: Path, systemd: FakeSystemd, code_dir: Path | None = None, port: int | None = None,
                 ready_timeout: float = DEFAULT_READY_TIMEOUT_SECONDS, **settings):
        super().__init__(log_dir, workers=WORKERS, **settings)
        if port:
            self.port, self.env["BIND"] = port, f"127.0.0.1:{port}"
            self.log_path = log_dir / f"supervisor-{port}-again.log"
        self.ready_timeout = ready_timeout
        self.control = log_dir / f"control-{self.port}.sock"
        self.env["NOTIFY_SOCKET"] = str(systemd.path)
        self.systemd = systemd
        # Gunicorn's --pythonpath puts code_dir first, so a wsgi.py written there later is "the code on disk".
        self.gunicorn_args = ["--", "--pythonpath", str(code_dir)] if code_dir else []
        self.inherit: int | None = None

    def launch(self) -> "Supervised":
        """Start the supervisor; with `inherit` set, hand it that socket as systemd's store would."""
        command = [sys.executable, "-m", "service.process.supervisor", "--control-socket", str(self.control),
                   "--ready-timeout", str(self.ready_timeout), *self.gunicorn_args]
        pass_fds = ()
        if self.inherit is not None:
            # As systemd passes it: the socket as descriptor 3, LISTEN_PID the process that execs.
            command = [sys.executable, "-c", PASS_SOCKET, str(self.inherit), *command]
            self.env.update(LISTEN_FDS="1", LISTEN_FDNAMES=STORED_SOCKET_NAME)
            pass_fds = (self.inherit,)
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=self._log,
                                        stderr=subprocess.STDOUT, pass_fds=pass_fds)
        return self

    def wait_ready(self, timeout: float = 300) -> None:
        """Block until the supervisor told systemd READY=1."""
        if not wait_until(lambda: self.systemd.saw("READY=1") or self.process.poll() is not None, timeout):
            raise TimeoutError(f"no READY=1 after {timeout} s:\n{self.log()}")
        assert self.process.poll() is None, self.log()

    def masters(self) -> dict[int, set[int]]:
        """Return the supervisor's children (the masters) with theirs (the workers)."""
        return {master: children(master) for master in children(self.process.pid)}

    def reload(self) -> subprocess.CompletedProcess:
        """Run the unit's ExecReload."""
        return subprocess.run([sys.executable, "-m", "service.process.reload", "--control-socket", str(self.control)],
                              cwd=REPO, env=self.env, capture_output=True, text=True, timeout=300)


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
                with requests.post(f"{self.url}/v1/chat/completions", json=body, stream=True, timeout=180,
                                   headers={"Connection": "close", "Cache-Control": "no-cache"}) as response:
                    result["waited"] = time.monotonic() - result["began"]
                    result["status"] = response.status_code
                    text = response.text
                result["complete"] = "[DONE]" in text if kind == "stream" else '"finish_reason":"length"' in text
                if response.status_code != 200:
                    result["body"] = text[:500]  # the error's message, for the failure's report
            except requests.RequestException as error:
                result["error"] = repr(error)
            result["ended"] = time.monotonic()
            self.results.append(result)

    def failures(self) -> list[dict]:
        """Return the requests that failed in any way."""
        return [r for r in self.results if "error" in r or r["status"] != 200 or not r["complete"]]

    def stalled(self) -> list[float]:
        """Return how long each request that waited too long for its response to begin waited."""
        return [round(r["waited"], 2) for r in self.results if r.get("waited", 0) >= STALL_SECONDS]


class Stream:
    """A long stream read in a thread, to be in flight when the server is told to stop."""

    def __init__(self, url: str):
        self.started = threading.Event()
        self.text = ""
        self.error = ""
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        """Stream a long reply, noting when its first event arrived."""
        body = {"messages": COUNTING, "max_tokens": 1000, "stream": True}
        try:
            with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=180,
                               headers={"Cache-Control": "no-cache"}) as response:
                for line in response.iter_lines(decode_unicode=True):
                    self.started.set()
                    self.text += line + "\n"
        except requests.RequestException as error:
            self.error = repr(error)
        self.started.set()

    def finished(self) -> bool:
        """Tell whether the stream ended with its last event."""
        return not self.thread.is_alive() and "data: [DONE]" in self.text


def refused(port: int) -> bool:
    """Tell whether a new connection to the port is refused."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture()
def systemd(tmp_path):
    """A stand-in for systemd's notify socket and descriptor store."""
    fake = FakeSystemd(tmp_path / "notify")
    yield fake
    fake.close()


def test_reloads_in_a_row_under_traffic_fail_nothing_and_leave_one_master_then_a_stop_drains(tmp_path, systemd):
    server = Supervised(tmp_path, systemd).start()
    try:
        assert systemd.store.get(STORED_SOCKET_NAME), systemd.messages  # the socket, for a restart
        first = server.masters()
        assert len(first) == 1 and all(len(workers) == WORKERS for workers in first.values())
        with Traffic(server.url) as traffic:
            time.sleep(2)
            served_before = value(scrape(server), "corechat_requests_total", outcome="length")
            for _ in range(2):
                before = server.masters()
                reload = server.reload()
                assert reload.returncode == 0 and reload.stdout.rstrip().splitlines()[-1].startswith("ok:"), \
                    reload.stdout + reload.stderr + server.log()
                after = server.masters()
                # The old master drained and exited before the reload answered: one master, all new workers.
                assert len(after) == 1 and not set(after) & set(before), (before, after)
                assert all(len(workers) == WORKERS for workers in after.values())
                assert not set().union(*after.values()) & set().union(*before.values())
            time.sleep(2)
        assert not traffic.failures(), (traffic.failures(), server.log()[-6000:])
        assert not traffic.stalled(), f"of {len(traffic.results)}: {traffic.stalled()}"
        # The masters share the supervisor's metrics folder: counts carry on across reloads.
        assert value(scrape(server), "corechat_requests_total", outcome="length") > served_before
        assert sum(message.startswith("READY=1") for message in systemd.messages) == 1

        streams = [Stream(server.url) for _ in range(2)]
        assert all(stream.started.wait(60) for stream in streams)
        server.process.send_signal(signal.SIGTERM)
        assert wait_until(lambda: refused(server.port), 10), "new connections still accepted during the drain"
        assert not all(stream.finished() for stream in streams), "the streams ended before the refusal was seen"
        assert server.process.wait(180) == 0, server.log()
        for stream in streams:
            stream.thread.join(10)
            assert stream.finished(), (stream.error, stream.text[-300:])
        assert systemd.saw(f"FDSTOREREMOVE=1\nFDNAME={STORED_SOCKET_NAME}")  # a stop closes the socket for good
        assert not children(server.process.pid)
    finally:
        server.stop()


def test_gunicorns_reload_and_upgrade_signals_sent_to_the_supervisor_reload_under_traffic(tmp_path, systemd):
    """HUP and USR2, which an operator used to Gunicorn sends the unit's main process, ask for a reload
    instead of ending the unit: HUP's runs under traffic (a new master, every request served), and USR2
    sent during it is a second reload request, refused as one while the first is under way."""
    server = Supervised(tmp_path, systemd).start()
    try:
        before = server.masters()

        def replaced() -> bool:
            after = server.masters()
            return (len(after) == 1 and not set(after) & set(before)
                    and all(len(workers) == WORKERS for workers in after.values()))

        with Traffic(server.url) as traffic:
            time.sleep(1)
            server.process.send_signal(signal.SIGHUP)
            assert wait_until(lambda: len(server.masters()) == 2, 60), server.log()
            server.process.send_signal(signal.SIGUSR2)
            assert wait_until(replaced, 240), server.log()
            time.sleep(1)
        assert server.process.poll() is None, server.log()
        assert not traffic.failures(), (traffic.failures(), server.log()[-6000:])
        log = server.log()
        assert log.count("reload done") == 1
        assert "refused a SIGUSR2 (a reload) request: a reload is already under way" in log
    finally:
        server.stop()


def test_a_reload_whose_master_dies_stops_its_orphaned_workers_even_a_stuck_one(tmp_path, systemd):
    """The new master is killed while one of its workers is ready and the other stopped (SIGSTOP) before it
    was: the reload fails and answers, the stuck orphan is killed past its deadline, the ready one's
    readiness leaves /metrics, and the next reload completes."""
    server = Supervised(tmp_path, systemd, graceful_timeout=3).start()
    try:
        (serving,) = server.masters()
        answers = []
        asking = threading.Thread(target=lambda: answers.append(server.reload()), daemon=True)
        asking.start()

        def new_workers() -> set[int]:
            return set().union(*(workers for master, workers in server.masters().items() if master != serving))

        assert wait_until(lambda: len(new_workers()) == WORKERS, 120), server.log()
        (successor,) = set(server.masters()) - {serving}
        stuck, ready = sorted(new_workers())
        os.kill(stuck, signal.SIGSTOP)
        assert wait_until(lambda: value(scrape(server), "corechat_workers_ready") == WORKERS + 1, 120), server.log()
        os.kill(successor, signal.SIGKILL)
        asking.join(60)
        assert answers and answers[0].returncode == 1, server.log()
        assert "failed: the new Gunicorn master" in answers[0].stderr, answers[0].stderr
        assert set(server.masters()) == {serving} and not {stuck, ready} & set(children(server.process.pid))
        assert value(scrape(server), "corechat_workers_ready") == WORKERS
        again = server.reload()
        assert again.returncode == 0, again.stdout + again.stderr + server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("broken_app, ready_timeout, reason", [
    # An exception while importing the app: Gunicorn stops the new master (WORKER_BOOT_ERROR).
    ('raise RuntimeError("test: this version of the code does not start")\n', DEFAULT_READY_TIMEOUT_SECONDS,
     "failed: the new Gunicorn master"),
    # A worker that exits at once, again and again: Gunicorn starts another each time, and the
    # supervisor stops the new master once --ready-timeout has passed.
    ('raise SystemExit("test: this version of the code does not start")\n', 15,
     "were not all ready within 15 s, so it was stopped"),
], ids=["new-master-exits", "workers-never-ready"])
def test_a_reload_that_cannot_complete_fails_and_leaves_the_serving_master_alone(tmp_path, systemd, broken_app,
                                                                                 ready_timeout, reason):
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    server = Supervised(tmp_path, systemd, code_dir=code_dir, ready_timeout=ready_timeout).start()
    try:
        before = server.masters()
        (code_dir / "wsgi.py").write_text(broken_app)
        with Traffic(server.url) as traffic:
            reload = server.reload()
        assert reload.returncode == 1, reload.stdout + reload.stderr
        assert reason in reload.stderr, reload.stderr
        assert server.masters() == before  # the processes it started with, and only those
        # The new master exited: the traceback above the supervisor's words says why.
        if ready_timeout == DEFAULT_READY_TIMEOUT_SECONDS:
            assert "this version of the code does not start" in server.log_path.read_text()
        assert not traffic.failures(), (traffic.failures(), server.log()[-6000:])
        assert server.process.poll() is None
    finally:
        server.stop()


def test_a_restart_hands_the_socket_to_the_next_start_and_a_crashed_master_exits_1(tmp_path, systemd):
    """Connections made while no supervisor runs wait in the kept socket's backlog and are answered."""
    first = Supervised(tmp_path, systemd).start()
    first.process.send_signal(RESTART_SIGNAL)
    assert first.process.wait(60) == 0, first.log()
    assert not systemd.saw("FDSTOREREMOVE=1")
    (stored,) = systemd.store[STORED_SOCKET_NAME]
    waiting = Traffic(first.url)
    with waiting:
        time.sleep(1)  # the clients' connections wait in the backlog, no worker to accept them
        second = Supervised(tmp_path, systemd, port=first.port)
        second.inherit = stored
        second.start()
        assert wait_until(lambda: len(waiting.results) >= 8, 120)
    assert not waiting.failures(), waiting.failures()
    assert "the socket systemd kept across the restart" in second.log()

    (master,) = second.masters()
    os.kill(master, signal.SIGKILL)
    assert second.process.wait(60) == 1, second.log()
    assert "exited unexpectedly (killed by SIGKILL)" in second.log()
    assert not children(second.process.pid)
    assert systemd.store.get(STORED_SOCKET_NAME)  # kept for the start Restart=on-failure makes
    second.stop()
