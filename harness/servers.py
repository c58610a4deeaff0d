"""Real servers on free loopback ports: corechat under Gunicorn, configured as operators configure it, and
redis-server."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """Return a TCP port on loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Built once per machine (by the tiny_model_dir fixture, or by GunicornServer when it defaults to
# it): the tiny model takes seconds to build and never changes for a given devmodel version (the
# builder checks its marker file, so asking again is cheap).
TINY_MODEL_DIR = Path(os.environ.get("CORECHAT_TEST_MODEL_DIR", Path.home() / ".cache" / "corechat" / "test-tiny"))


class PortTaken(RuntimeError):
    """Gunicorn could not bind its port: another process took it after free_port chose it."""


class GunicornServer:
    """corechat under real Gunicorn, configured through the environment as operators do.

    Settings are keyword arguments (they become environment variables); the model defaults to the
    tiny test model, served as "tiny". `app` replaces wsgi.py's app with another, as `module:app`
    importable from the repository (`tests.e2e.echo_app:app`); `repo` is the checkout it runs. As a
    context manager it starts on entry and stops on exit.
    """

    def __init__(self, log_dir: Path, *, workers: int = 2, app: str | None = None, repo: Path = REPO, **settings):
        if "model" not in settings:
            from devtools.devmodel import build_dev_model

            settings = {"model": build_dev_model(TINY_MODEL_DIR, preset="tiny"), "model_name": "tiny", **settings}
        self.port = free_port()
        self.workers = workers
        # The checkout Gunicorn runs: this one, or another revision's tree (bench/probes/served_ab.py).
        self.repo = repo
        self.app_args = [app] if app else []
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

    def start(self, timeout: float = 120, attempts: int = 3) -> "GunicornServer":
        """Start Gunicorn and wait until every worker reports ready; on another free port if another server
        took this one between free_port and Gunicorn's bind (tests in parallel start servers at once)."""
        for attempt in range(attempts):
            self.launch()
            try:
                self.wait_ready(timeout)
                return self
            except PortTaken:
                if attempt == attempts - 1:
                    raise
                self._log.close()
                self.port = free_port()
                self.env["BIND"] = f"127.0.0.1:{self.port}"
                self.log_path = self.log_path.with_name(f"gunicorn-{self.port}.log")
        return self

    def launch(self) -> "GunicornServer":
        """Start Gunicorn without waiting for its workers."""
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            # No control socket: every test master would otherwise share ~/.gunicorn/gunicorn.ctl.
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--no-control-socket", *self.app_args],
            cwd=self.repo,
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
            # Only this master's workers: a server that held the port before this one bound it answers too.
            if response.status_code == 200 and (pid := response.json()["worker_pid"]) in self.worker_pids():
                pids.add(pid)
            if len(pids) == self.workers:
                break
        return pids

    def wait_ready(self, timeout: float = 120) -> None:
        """Block until all workers answer /readyz with 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log()
                if "Connection in use" in log:
                    raise PortTaken(f"port {self.port} was taken before gunicorn bound it:\n{log}")
                raise RuntimeError(f"gunicorn exited with {self.process.returncode}:\n{log}")
            if len(self.ready_workers()) == self.workers:
                return
            time.sleep(0.2)
        raise TimeoutError(f"workers not ready after {timeout} s:\n{self.log()}")

    def worker_pids(self) -> list[int]:
        """Return the pids of the master's children (the workers)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text()
        return [int(pid) for pid in children.split()]

    def log(self) -> str:
        """Return what Gunicorn and the app logged so far, all of it."""
        return self.log_path.read_text(errors="replace")

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


def processes_of(server: GunicornServer) -> list[int]:
    """Return the pids of Gunicorn's master and every worker."""
    return [server.process.pid, *server.worker_pids()]
