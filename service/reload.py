"""Reload Gunicorn without a gap; the systemd unit's ExecReload runs it.

    python -m service.reload MASTER_PID [--timeout SECONDS]

Gunicorn's own reload (HUP) stops the old workers right after forking the new ones, and until the
new ones have loaded the model nothing serves. This sends USR2 instead: the old master starts a new
master (with the code now on disk) on the same listening sockets, and the old workers keep serving
while the new ones load. Once every new worker is ready (it accepts connections only then), systemd
is told the new main PID and the old master gets TERM: its workers stop accepting at once and finish
what they serve. If the new workers are not ready in time, the new master is stopped, the old one
serves on, and this exits 1.

Settings are not re-read: the new master starts with the environment the old one started with
(settings changes need `systemctl restart`).
"""

import argparse
import logging
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from .metrics import worker_reported_ready
from .settings import get_settings, systemd_notify_socket

log = logging.getLogger("corechat.reload")

# Below the unit's TimeoutStartSec, which bounds a reload: past it systemd would stop waiting first.
DEFAULT_TIMEOUT_SECONDS = 240.0
POLL_SECONDS = 0.2
# Forking and exec'ing a master takes well under a second; longer means Gunicorn ignored the USR2
# (it does while the old master of a previous reload still drains).
NEW_MASTER_SECONDS = 30.0
BARRIER_SECONDS = 5.0


def children(pid: int) -> list[int]:
    """Return the pids of a process's children."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def environment(pid: int) -> dict[str, str]:
    """Return the environment a process was started with (empty if it is gone or not ours)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def alive(pid: int) -> bool:
    """Tell whether a process exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def new_master_of(old_master: int) -> int | None:
    """Return the master that USR2 made the old one start (Gunicorn marks it with GUNICORN_PID)."""
    for child in children(old_master):
        if environment(child).get("GUNICORN_PID") == str(old_master):
            return child
    return None


def workers_ready(master: int, workers: int) -> bool:
    """Tell whether a master runs its full count of workers and each reported ready."""
    metrics_dir = environment(master).get("PROMETHEUS_MULTIPROC_DIR", "")
    pids = children(master)
    return len(pids) >= workers and all(worker_reported_ready(pid, metrics_dir) for pid in pids)


def wait_for(probe, deadline: float, watched: int):
    """Call probe until it returns something true, and return that; None once the deadline passes
    or the watched process exits."""
    while not (result := probe()):
        if time.monotonic() > deadline or not alive(watched):
            return None
        time.sleep(POLL_SECONDS)
    return result


def notify_systemd(state: str) -> None:
    """Send a state to systemd's notify socket, and wait until systemd has processed it (a barrier)."""
    address = systemd_notify_socket()
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as barrier:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(address)
                sock.sendall(state.encode())
                # systemd closes the write end it receives once it has handled every earlier
                # message; with ours closed too, the read end then reports end of file.
                socket.send_fds(sock, [b"BARRIER=1"], [write_end])
        finally:
            os.close(write_end)
        if not select.select([barrier], [], [], BARRIER_SECONDS)[0]:
            log.warning("systemd did not confirm %r within %.0f s", state, BARRIER_SECONDS)


def reload(old_master: int, workers: int, timeout: float) -> int:
    """Replace a Gunicorn master and its workers with new ones, without a moment where none serves."""
    deadline = time.monotonic() + timeout
    os.kill(old_master, signal.SIGUSR2)
    new_master = wait_for(
        lambda: new_master_of(old_master), min(deadline, time.monotonic() + NEW_MASTER_SECONDS), old_master
    )
    if new_master is None:
        log.error("no new master appeared after USR2 to %d; a previous reload may still be draining", old_master)
        return 1
    log.info("new master %d started; waiting for its %d workers to be ready", new_master, workers)
    if not wait_for(lambda: workers_ready(new_master, workers), deadline, new_master):
        log.error("the new workers were not ready within %.0f s; stopping new master %d, %d serves on",
                  timeout, new_master, old_master)
        if alive(new_master):
            os.kill(new_master, signal.SIGTERM)
        return 1
    notify_systemd(f"MAINPID={new_master}")
    os.kill(old_master, signal.SIGTERM)
    log.info("new master %d serves; old master %d drains and exits", new_master, old_master)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and reload."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("master_pid", type=int, help="the running Gunicorn master ($MAINPID under systemd)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS,
                        help=f"seconds the new workers may take to be ready (default {DEFAULT_TIMEOUT_SECONDS:g})")
    args = parser.parse_args(argv)
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return reload(args.master_pid, settings.worker_count, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
