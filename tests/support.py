"""Real servers for the end-to-end tests: Gunicorn running corechat, and redis-server."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
# The key the `keyed_server` fixture asks for.
TEST_API_KEY = "sk-corechat-test-key"


def free_port() -> int:
    """Return a TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Built once per machine (by the tiny_model_dir fixture, or by GunicornServer when it defaults to
# it): the tiny model takes seconds to build and never changes for a given devmodel version (the
# builder checks its marker file, so asking again is cheap).
TINY_MODEL_DIR = Path(os.environ.get("CORECHAT_TEST_MODEL_DIR", Path.home() / ".cache" / "corechat" / "test-tiny"))


# A prompt the tiny model answers at any length: the end-to-end tests' default.
COUNTING = [{"role": "user", "content": "Count to a thousand, slowly."}]


def chat(server, **body) -> requests.Response:
    """Send one chat request (COUNTING unless `messages` is given) on a fresh connection, so requests spread
    over the workers."""
    return requests.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": COUNTING, **body},
        headers={"Connection": "close"},
        timeout=60,
    )


def finished_by_worker(server) -> dict[int, int]:
    """Return the generations each worker of a server finished, keyed by pid."""
    return {pid: facts["requests_finished"] for pid, facts in ready_facts(server).items()}


def send_until_every_worker_served(server, send_round, most_rounds: int) -> dict[int, int]:
    """Call send_round until every worker has finished a generation since (or most_rounds calls);
    return how many each finished. The kernel may hand many connections in a row to one worker, and a
    worker forked meanwhile starts from zero."""
    before = finished_by_worker(server)
    for _ in range(most_rounds):
        send_round()
        served = {pid: count - before.get(pid, 0) for pid, count in finished_by_worker(server).items()}
        if all(served.values()):
            break
    return served


def wait_until(predicate, timeout: float) -> bool:
    """Poll predicate until it holds or timeout seconds pass; return whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def file_mappings(path) -> list[tuple[int, int, str]]:
    """Return this process's memory mappings of a file: (start, end, permissions)."""
    mappings = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 6 and fields[5] == str(path):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                mappings.append((start, end, fields[1]))
    return mappings


def anonymous_megabytes(pid: int | str = "self") -> float:
    """Return a process's anonymous memory in MB (this process's by default)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Anonymous line for {pid}")


class GunicornServer:
    """corechat under real Gunicorn, configured through the environment as operators do.

    Settings are keyword arguments (they become environment variables); the model defaults to the
    tiny test model, served as "tiny". `app` replaces wsgi.py's app with a module of tests/ (as
    `module:app`). As a context manager it starts on entry and stops on exit.
    """

    def __init__(self, log_dir: Path, *, workers: int = 2, app: str | None = None, **settings):
        if "model" not in settings:
            from devtools.devmodel import build_dev_model

            settings = {"model": build_dev_model(TINY_MODEL_DIR, preset="tiny"), "model_name": "tiny", **settings}
        self.port = free_port()
        self.workers = workers
        self.app_args = ["--pythonpath", str(REPO / "tests"), app] if app else []
        self.log_path = log_dir / f"gunicorn-{self.port}.log"
        self.env = {
            **os.environ,
            "BIND": f"127.0.0.1:{self.port}",
            "WORKERS": str(workers),
            "PYTHONUNBUFFERED": "1",
            # The workers of one server share a prefix store; no other server's prompts are in it.
            "PREFIX_CACHE_DIR": str(log_dir / f"prefixes-{self.port}"),
            **{key.upper(): str(value) for key, value in settings.items()},
        }
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Return the base URL of the server."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "GunicornServer":
        """Start Gunicorn and wait until every worker reports ready."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self) -> "GunicornServer":
        """Start Gunicorn without waiting for its workers."""
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            # No control socket: every test master would otherwise share ~/.gunicorn/gunicorn.ctl.
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--no-control-socket", *self.app_args],
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    def __enter__(self) -> "GunicornServer":
        """Start the server."""
        return self.start()

    def __exit__(self, *exc_info) -> None:
        """Stop the server."""
        self.stop()

    def ready_workers(self, attempts: int = 40) -> set[int]:
        """Ask /readyz on fresh connections and return the pids of workers that answered ready."""
        pids = set()
        for _ in range(attempts):
            try:
                response = requests.get(f"{self.url}/readyz", timeout=2, headers={"Connection": "close"})
            except requests.RequestException:
                continue
            if response.status_code == 200:
                pids.add(response.json()["worker_pid"])
            if len(pids) == self.workers:
                break
        return pids

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until all workers answer /readyz with 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.process.returncode}:\n{self.log()}")
            if len(self.ready_workers()) == self.workers:
                return
            time.sleep(0.2)
        raise TimeoutError(f"workers not ready after {timeout} s:\n{self.log()}")

    def worker_pids(self) -> list[int]:
        """Return the pids of the master's children (the workers)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text()
        return [int(pid) for pid in children.split()]

    def log(self) -> str:
        """Return what Gunicorn and the app logged so far."""
        return self.log_path.read_text(errors="replace")[-20000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Stop the master and return its exit code."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


class RedisServer:
    """A throwaway redis-server on a free loopback port, without persistence (and with a password if given).

    With `replica_of` it replicates that server (with the same password, which it also asks of its
    own clients, so it can stand in for the master once promoted).
    """

    def __init__(self, work_dir: Path, password: str = "", replica_of: "RedisServer | None" = None):
        self.port = free_port()
        self.work_dir = work_dir
        self.password = password
        self.replica_of = replica_of
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Return the redis:// URL of the server."""
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        """Start redis-server and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.work_dir), *(["--requirepass", self.password, "--masterauth", self.password]
                                            if self.password else []),
             *(["--replicaof", "127.0.0.1", str(self.replica_of.port)] if self.replica_of else [])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    # A server with a password refuses PING with -NOAUTH: it answers, so it is up.
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        """Kill redis-server (as a crash would)."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# Reading a running server ------------------------------------------------------------------


def stream_lines(response):
    """Yield the SSE data payloads of a streaming response as they arrive."""
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def stream_reply(url: str, body: dict, reply: dict, joined: threading.Event | None = None) -> None:
    """Stream a reply into `reply`: X-Cache, content chunks, first-content and end times."""
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300) as response:
        reply["status"] = response.headers["X-Cache"]
        if joined:
            joined.set()
        reply["chunks"] = []
        try:
            for payload in stream_lines(response):
                if payload == "[DONE]":
                    reply["done_at"] = time.monotonic()
                    break
                content = payload["choices"][0]["delta"].get("content") if payload["choices"] else None
                if content:
                    reply.setdefault("first_content_at", time.monotonic())
                    reply["chunks"].append(content)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            reply["broken"] = True  # the serving worker died


def ready_facts(server, rounds: int = 40) -> dict[int, dict]:
    """Return /readyz of every worker, keyed by pid (fewer if some never answered in `rounds` rounds).

    Each round asks on several connections at once: asked one at a time, the kernel may hand every
    connection to the same worker (the one already awake wins each accept race)."""

    def ask(_) -> dict:
        return requests.get(f"{server.url}/readyz", headers={"Connection": "close"}, timeout=5).json()

    facts = {}
    with ThreadPoolExecutor(2 * server.workers) as pool:
        for _ in range(rounds):
            for body in pool.map(ask, range(2 * server.workers)):
                facts[body["worker_pid"]] = body
            if len(facts) >= server.workers:
                break
            time.sleep(0.05)
    return facts


def parse_samples(text: str) -> dict[tuple, float]:
    """Return every sample of a scrape keyed by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(server) -> dict[tuple, float]:
    """Scrape a server's /metrics once and return its samples, with its first API key as Prometheus sends it."""
    headers = {"Connection": "close"}
    keys = server.env.get("API_KEYS", "")
    if keys:
        headers["Authorization"] = f"Bearer {keys.split(',')[0]}"
    response = requests.get(f"{server.url}/metrics", headers=headers, timeout=5)
    assert response.status_code == 200
    return parse_samples(response.text)


def value(samples: dict, name: str, **labels) -> float:
    """Return one sample's value (0 when the series does not exist)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_samples(server, condition, timeout: float = 30) -> dict:
    """Scrape until condition(samples) holds; return those samples or fail with the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if condition(samples) or time.monotonic() > deadline:
            assert condition(samples), {
                key: val
                for key, val in samples.items()
                if key[0] in ("corechat_requests_running", "corechat_requests_waiting", "corechat_workers_ready")
            }
            return samples
        time.sleep(0.1)


class StreamingClient:
    """A streamed chat request read in its own thread, which the test can watch and hang up.

    `chunks` grows as content arrives; `status` is the X-Cache header; `ended` is set once the stream
    ended, broke, or was hung up.
    """

    def __init__(self, url: str, body: dict, headers: dict | None = None):
        self.url = url
        self.body = body
        self.headers = {"Connection": "close", **(headers or {})}
        self.status: str | None = None
        self.chunks: list[str] = []
        self.errors: list[dict] = []
        self.done = False
        self.ended = threading.Event()
        self._hang_up = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        """Read the stream until its end, or until told to hang up."""
        try:
            with requests.post(f"{self.url}/v1/chat/completions", json=self.body, headers=self.headers, stream=True,
                               timeout=300) as response:
                self.status = response.headers.get("X-Cache")
                for payload in stream_lines(response):
                    if payload == "[DONE]":
                        self.done = True
                        break
                    if "error" in payload:
                        self.errors.append(payload["error"])
                        continue
                    content = payload["choices"][0]["delta"].get("content") if payload["choices"] else None
                    if content:
                        self.chunks.append(content)
                    if self._hang_up.is_set():
                        break
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            pass
        finally:
            self.ended.set()

    @property
    def text(self) -> str:
        """Return the content received so far."""
        return "".join(self.chunks)

    def wait_for_headers(self, timeout: float = 60) -> None:
        """Block until the response's headers arrived (a queued request has them before any token)."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            assert not self.ended.is_set(), "the stream ended before its headers"
            assert time.monotonic() < deadline, f"no headers after {timeout} s"
            time.sleep(0.01)

    def wait_for_chunks(self, count: int, timeout: float = 120) -> None:
        """Block until `count` content chunks arrived (failing if the stream ends or time runs out first)."""
        deadline = time.monotonic() + timeout
        while len(self.chunks) < count:
            assert not self.ended.is_set(), f"the stream ended after {len(self.chunks)} chunks"
            assert time.monotonic() < deadline, f"only {len(self.chunks)} chunks after {timeout} s"
            time.sleep(0.01)

    def hang_up(self) -> None:
        """Close the connection at the next chunk, as a client that goes away does, and wait for it."""
        hang_up_all([self])

    def finish(self, timeout: float = 300) -> "StreamingClient":
        """Wait for the stream to end."""
        assert self.ended.wait(timeout), "the stream did not end"
        return self


def hang_up_all(clients: list[StreamingClient]) -> None:
    """Hang up every client at its next chunk, then wait for all: a queued stream's next chunk comes
    only once the one ahead of it is gone, so waiting for each in turn could wait on the queued one."""
    for client in clients:
        client._hang_up.set()
    for client in clients:
        assert client.ended.wait(120), "a hung-up stream did not end"


def threads_of(pid: int) -> list[int]:
    """Return the thread ids of a process."""
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


def cpu_ticks_by_thread(pid: int) -> dict[int, int]:
    """Return each thread's user plus system CPU time, in clock ticks."""
    ticks = {}
    for tid in threads_of(pid):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks
