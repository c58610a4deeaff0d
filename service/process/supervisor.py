"""The systemd unit's main process: it holds the listening socket and runs Gunicorn masters under it.

    python -m service.process.supervisor [--open-files N] [--control-socket PATH] [-- GUNICORN ARGS...]

systemd starts this process and it stays the unit's main process for the unit's whole life, so
systemd always supervises a process it started and sees every exit, stop and crash; a Gunicorn
master that USR2 starts is not systemd's child, and systemd neither drains it on stop nor notices
its end. The supervisor imports neither torch nor Flask, and reads /proc of its own children only.

- It listens on BIND through a socket systemd keeps across restarts (listener.py).
- It runs a Gunicorn master as its child on that socket and tells systemd READY=1 once all of its
  workers are ready (each accepts connections only once its model is loaded and warmed up).
- A reload (`python -m service.process.reload` over the control socket, or HUP or USR2, Gunicorn's
  own reload and upgrade signals) starts a second master on the same socket with the code on disk.
  Once all of its workers are ready the old master gets TERM (its workers stop accepting at once and
  finish what they serve), and the reload answers once the old master has exited. One that cannot
  complete (the new master exits, or its workers are not ready within --ready-timeout) stops what
  it started, waits until only the old master is left, and answers why.
- TERM (systemctl stop) takes the socket out of the store and closes it, so new connections are
  refused, and passes TERM on to the masters, which drain. RESTART_SIGNAL (the unit's
  RestartKillSignal, systemctl restart) does the same but leaves the socket in the store.
- If the serving master dies unexpectedly it stops the rest and exits 1, for systemd
  (Restart=on-failure) to start the service again.
"""

import argparse
import ctypes
import logging
import os
import selectors
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings, get_settings
from . import systemd
from .listener import STORED_SOCKET_NAME, listening_socket
from .multiproc import empty_multiproc_dir, forget_worker, worker_reported_ready
from .processes import children, exit_description, raise_open_files_limit

log = logging.getLogger("corechat.supervisor")

DEFAULT_CONTROL_SOCKET = "/run/corechat/supervisor.sock"
# The signal systemd sends for a restart (the unit's RestartKillSignal=), told apart from a stop's TERM.
RESTART_SIGNAL = signal.SIGUSR1
# Gunicorn's own reload and upgrade signals, which an operator may send the unit's main process: each
# is a reload here (left to their default, they would end the unit and every stream).
RELOAD_SIGNALS = (signal.SIGHUP, signal.SIGUSR2)
# The unit's TimeoutStartSec bounds a reload; this leaves room in it for the old master's drain.
DEFAULT_READY_TIMEOUT_SECONDS = 240.0
POLL_SECONDS = 0.2
# After TERM a master exits within GRACEFUL_TIMEOUT (Gunicorn kills workers still draining then); one
# still there this much later hangs, and is killed.
KILL_GRACE_SECONDS = 10.0
CLIENT_READ_SECONDS = 2.0
# Tells gunicorn.conf.py that its master is one of several on one metrics folder, which the
# supervisor empties (once, at its start) instead of each master.
SUPERVISOR_ENV = "CORECHAT_SUPERVISOR_PID"
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Reload:
    """A reload under way: who asked, the master it started, and how it ended once it has."""

    # The control socket's client; None for a reload asked for by a signal (HUP, USR2), told in the log alone.
    client: socket.socket | None
    successor: int
    deadline: float
    outcome: str = ""
    ok: bool = False

    def tell(self, line: str) -> None:
        """Send the client a line (it may have gone: systemd kills ExecReload on its timeout)."""
        if self.client is None:
            return
        try:
            self.client.sendall(f"{line}\n".encode())
        except OSError:
            pass

    def end(self, ok: bool, outcome: str) -> None:
        """Record how the reload ended; the answer goes out once only the serving master is left."""
        self.ok, self.outcome = ok, outcome

    def answer(self) -> None:
        """Log the outcome, give it to the client, and hang up."""
        (log.info if self.ok else log.error)("reload %s: %s", "done" if self.ok else "failed", self.outcome)
        self.tell(f"{'ok' if self.ok else 'failed'}: {self.outcome}")
        if self.client is not None:
            self.client.close()


class Supervisor:
    """Runs Gunicorn masters on one listening socket; see the module's docstring."""

    def __init__(self, settings: Settings, listener: socket.socket, command: list[str], control_path: str,
                 ready_timeout: float):
        self.settings = settings
        self.listener = listener
        self.command = command
        self.ready_timeout = ready_timeout
        self.control_path = control_path
        self.metrics_dir, self.made_metrics_dir = settings.prometheus_multiproc_dir, False
        self.serving = 0
        self.masters: set[int] = set()
        self.reload: Reload | None = None
        self.announced = False
        self.exit_status: int | None = None
        self.childless = False
        self.kill_at: dict[int, float] = {}
        self.signals: list[int] = []
        self.selector = selectors.DefaultSelector()

    # Setting up -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Become the reaper of orphaned workers, prepare the metrics folder, catch signals, and listen
        for reload requests."""
        # A worker whose master died (or a half-started master's) becomes our child, not PID 1's, so
        # a reload knows when everything it started is gone and nothing escapes a stop.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if not self.metrics_dir:
            self.metrics_dir, self.made_metrics_dir = tempfile.mkdtemp(prefix="corechat-metrics-"), True
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        os.makedirs(self.metrics_dir, exist_ok=True)
        empty_multiproc_dir(self.metrics_dir)
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
        wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wakeup_write)
        for signum in (signal.SIGTERM, signal.SIGINT, RESTART_SIGNAL, signal.SIGCHLD, *RELOAD_SIGNALS):
            signal.signal(signum, lambda signum, _frame: self.signals.append(signum))
        self.selector.register(wakeup_read, selectors.EVENT_READ, lambda: os.read(wakeup_read, 512))
        if os.path.exists(self.control_path) and stat.S_ISSOCK(os.stat(self.control_path).st_mode):
            os.unlink(self.control_path)
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control.bind(self.control_path)
        os.chmod(self.control_path, 0o600)
        self.control.listen(8)
        self.selector.register(self.control, selectors.EVENT_READ, self.accept_request)

    def start_master(self) -> int:
        """Fork and exec a Gunicorn master that serves the listening socket (as LISTEN_FDS, fd 3)."""
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(self.listener.fileno(), 3)
                os.set_inheritable(3, True)
                # systemd hears the supervisor alone (NotifyAccess=main).
                os.environ.pop("NOTIFY_SOCKET", None)
                os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
                os.execv(self.command[0], self.command)
            except BaseException as error:
                print(f"corechat supervisor: cannot start {self.command}: {error}", file=sys.stderr, flush=True)
            os._exit(127)
        self.masters.add(pid)
        self.childless = False
        return pid

    # The loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped, and return the exit status."""
        self.prepare()
        self.serving = self.start_master()
        log.info("started Gunicorn master %d; READY=1 once its %d workers are ready",
                 self.serving, self.settings.worker_count)
        try:
            while self.exit_status is None or not self.childless:
                for key, _events in self.selector.select(POLL_SECONDS):
                    key.data()
                self.handle_signals()
                self.reap()
                self.advance()
        finally:
            self.control.close()
            Path(self.control_path).unlink(missing_ok=True)
            if self.made_metrics_dir:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
        log.info("exiting with status %d", self.exit_status)
        return self.exit_status

    def handle_signals(self) -> None:
        """Act on the signals caught since the last turn (SIGCHLD only wakes the loop to reap)."""
        while self.signals:
            signum = self.signals.pop(0)
            if signum == signal.SIGCHLD or self.exit_status is not None:
                continue
            if signum in RELOAD_SIGNALS:
                self.begin_reload(None, f"{signal.Signals(signum).name} (a reload)")
            elif signum == RESTART_SIGNAL:
                log.info("restarting: the masters drain; the socket stays in systemd's store, so new "
                         "connections wait for the next start")
                self.stop(0, keep_socket=True)
            else:
                log.info("stopping: the socket closes, so new connections are refused; the masters drain")
                self.stop(0, keep_socket=False)

    def reap(self) -> None:
        """Collect every child that exited, and note when none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.childless = True
                return
            if pid == 0:
                return
            self.kill_at.pop(pid, None)
            if pid in self.masters:
                self.masters.discard(pid)
                self.master_exited(pid, exit_description(status))
            else:
                # A worker whose master died before it (a failed reload's): no master's child_exit
                # forgets its gauges, so its readiness would count in /metrics for good.
                forget_worker(pid, self.metrics_dir)
                log.info("orphaned worker %d exited (%s)", pid, exit_description(status))

    def master_exited(self, pid: int, how: str) -> None:
        """Make sense of a master's exit: an expected one, a failed reload, or a crash."""
        if self.reload and pid == self.reload.successor and not self.reload.outcome:
            self.reload.end(False, f"the new Gunicorn master {pid} exited ({how}) before its workers were ready, "
                                   f"so master {self.serving} serves on: the code or model on disk does not "
                                   f"start; its log lines above say why")
        elif pid == self.serving and self.exit_status is None:
            log.error("Gunicorn master %d exited unexpectedly (%s); stopping, for systemd to restart corechat",
                      pid, how)
            self.stop(1, keep_socket=True)
        else:
            log.info("Gunicorn master %d exited (%s)", pid, how)

    def advance(self) -> None:
        """Move startup and any reload on, and kill what outlived its TERM by too long."""
        now = time.monotonic()
        for pid, deadline in list(self.kill_at.items()):
            if now > deadline:
                log.warning("process %d still runs %.0f s after TERM; killing it", pid, now - deadline)
                self.kill(pid, signal.SIGKILL)
                del self.kill_at[pid]
        if self.exit_status is not None:
            return
        if not self.announced and self.workers_ready(self.serving):
            self.announced = True
            log.info("the %d workers of master %d are ready", self.settings.worker_count, self.serving)
            systemd.notify(f"READY=1\nSTATUS={self.status()}")
        reload = self.reload
        if reload is None:
            return
        if not reload.outcome:
            if self.workers_ready(reload.successor):
                retired, self.serving = self.serving, reload.successor
                self.terminate(retired)
                log.info("reload: the workers of master %d are ready; old master %d drains", self.serving, retired)
                reload.tell(f"the workers of new master {self.serving} are ready; old master {retired} "
                            f"finishes its streams (up to GRACEFUL_TIMEOUT, {self.settings.graceful_timeout} s)")
                reload.end(True, f"master {self.serving} serves the code on disk; "
                                 f"old master {retired} drained and exited")
            elif now > reload.deadline:
                self.terminate(reload.successor)
                reload.end(False, f"the workers of new master {reload.successor} were not all ready within "
                                  f"{self.ready_timeout:.0f} s, so it was stopped and master {self.serving} serves "
                                  f"on: look for why they load slowly or not at all in the log above")
        else:
            left = children(os.getpid()) - {self.serving}
            if not left:
                reload.answer()
                self.reload = None
                systemd.notify(f"STATUS={self.status()}")
            # What a failed reload left (its master's orphaned workers) gets TERM, and KILL if it is still
            # there past its deadline, so the reload always answers and the next one can start.
            for pid in left - self.kill_at.keys():
                log.warning("reload: process %d of the reload is left behind; stopping it", pid)
                self.terminate(pid)

    # Requests and stopping ----------------------------------------------------------------------

    def accept_request(self) -> None:
        """Answer a client of the control socket; a reload's answer comes when it ends."""
        client, _address = self.control.accept()
        client.settimeout(CLIENT_READ_SECONDS)
        try:
            request = client.recv(64).decode(errors="replace").strip()
        except OSError:
            client.close()
            return
        if request != "reload":
            self.refuse(client, repr(request), f"unknown request {request!r} (the only one is: reload)")
            return
        self.begin_reload(client, "'reload'")

    def begin_reload(self, client: socket.socket | None, request: str) -> None:
        """Start a reload asked for over the control socket (client) or by a signal (None), unless it cannot start."""
        refusal = None
        if self.exit_status is not None:
            refusal = "corechat is stopping"
        elif not self.announced:
            refusal = "corechat is still starting: its first workers are not ready yet"
        elif self.reload:
            refusal = f"a reload is already under way (new master {self.reload.successor}); retry once it ends"
        if refusal:
            self.refuse(client, request, refusal)
            return
        successor = self.start_master()
        self.reload = Reload(client, successor, time.monotonic() + self.ready_timeout)
        log.info("reload: started Gunicorn master %d beside master %d", successor, self.serving)
        self.reload.tell(f"started new master {successor} with the code on disk; waiting for its "
                         f"{self.settings.worker_count} workers to be ready")
        systemd.notify(f"STATUS=reloading: master {self.serving} serves while new master {successor} starts")

    @staticmethod
    def refuse(client: socket.socket | None, request: str, refusal: str) -> None:
        """Log a refused request and tell its client, if it has one, why."""
        log.warning("refused a %s request: %s", request, refusal)
        if client is None:
            return
        with client:
            try:
                client.sendall(f"failed: {refusal}\n".encode())
            except OSError:
                pass

    def stop(self, status: int, keep_socket: bool) -> None:
        """Stop every master (they drain), and exit with status once they are gone."""
        self.exit_status = status
        systemd.notify("STOPPING=1")
        if not keep_socket:
            systemd.notify(f"FDSTOREREMOVE=1\nFDNAME={STORED_SOCKET_NAME}")
            self.listener.close()
        if self.reload:
            if not self.reload.outcome:
                self.reload.end(False, "corechat is stopping")
            self.reload.answer()
            self.reload = None
        for pid in children(os.getpid()):
            self.terminate(pid)

    def terminate(self, pid: int) -> None:
        """Send TERM, and note when to kill the process if it has not exited by then."""
        self.kill(pid, signal.SIGTERM)
        self.kill_at[pid] = time.monotonic() + self.settings.graceful_timeout + KILL_GRACE_SECONDS

    @staticmethod
    def kill(pid: int, signum: int) -> None:
        """Send a signal to a process that may have exited already."""
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def workers_ready(self, master: int) -> bool:
        """Tell whether a master runs its full count of workers and each reported ready."""
        ready = [pid for pid in children(master) if worker_reported_ready(pid, self.metrics_dir)]
        return len(ready) >= self.settings.worker_count

    def status(self) -> str:
        """Describe what serves, for `systemctl status`."""
        return f"master {self.serving} serves with {self.settings.worker_count} workers"


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, listen, and supervise until stopped."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--open-files", type=int, default=65536,
                        help="the open-files limit to run with; warn when the hard limit is lower (default 65536)")
    parser.add_argument("--control-socket", default=DEFAULT_CONTROL_SOCKET,
                        help=f"where to listen for reload requests (default {DEFAULT_CONTROL_SOCKET})")
    parser.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT_SECONDS,
                        help="seconds a reload waits for the new workers to be ready "
                             f"(default {DEFAULT_READY_TIMEOUT_SECONDS:g})")
    parser.add_argument("gunicorn_args", nargs="*", help="more arguments for each Gunicorn master (after --)")
    args = parser.parse_args(argv)
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    raise_open_files_limit(args.open_files)
    # Two masters run side by side during a reload: they must not share Gunicorn's control socket,
    # whose path each would bind and the first to exit remove.
    command = [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--no-control-socket", *args.gunicorn_args]
    listener = listening_socket(settings.bind)
    return Supervisor(settings, listener, command, args.control_socket, args.ready_timeout).run()


if __name__ == "__main__":
    sys.exit(main())
