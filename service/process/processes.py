"""What the supervisor reads of processes and asks of the kernel for them: children from /proc, exit
statuses in words, and the open-files limit."""

import logging
import os
import resource
import signal
from pathlib import Path

log = logging.getLogger("corechat.supervisor")


def children(pid: int) -> set[int]:
    """Return the pids of a process's children (of its main thread, which forks them)."""
    try:
        return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def exit_description(status: int) -> str:
    """Describe a wait status in words: "exit status 3" or "killed by SIGKILL"."""
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def raise_open_files_limit(wanted: int) -> None:
    """Raise the soft open-files limit to what the unit asks, and warn if the hard limit is lower.

    systemd quietly caps LimitNOFILE= at the limit it has itself (a container's, for one).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < min(wanted, hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    if hard < wanted:
        log.warning("the open-files limit is %d, below the %d the unit asks for (LimitNOFILE=): systemd caps it "
                    "at its own limit. Every stream, keep-alive connection and Redis connection takes one; raise "
                    "the host's or container's limit (systemd-nspawn --rlimit=RLIMIT_NOFILE=%d) to serve that many",
                    hard, wanted, wanted)
