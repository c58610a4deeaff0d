"""New streams gathered on a busy worker while its batch has room.

A decode step reads every weight once however many rows it runs, and an idle worker lends its cores
to the busy one (engine/cores.py): so four streams decode faster as one batch of four on every core
than as two batches of two, each worker reading all the weights on its own core. The kernel hands a
new connection to whichever worker accepts first, so without help a burst of streams splits between
the workers. Here each worker publishes, in a table the master makes before it forks, whether it is
gathering: it holds streams, fewer than MAX_RUNNING, and little prompt work is ahead of it (a new
stream's first token would not wait behind a long prompt). A worker with nothing to do then leaves
new connections to a gathering worker: it stops watching its listeners for DEFER_SECONDS, and
accepts anyway once one has waited MOST_DEFER_SECONDS (the gathering worker's loop may be slow to
take it). Once it holds streams of its own, or no worker gathers, it accepts as any worker does.

A burst arriving at idle workers wakes them all at once. So an idle worker decides and accepts
holding a lock the workers share (flock on a file in the master's run folder, which the kernel
releases if its holder dies): the first takes a connection and publishes that it gathers before it
lets go, and the others, finding it gathering, leave the rest to it. A connection whose request has
not yet shown its method counts as a stream until it does.

A published state holds FRESH_SECONDS, refreshed by every turn of the worker's event loop (every
GATHER_REFRESH_SECONDS while it holds streams, at least once a second otherwise), so a worker that
died stops drawing connections soon after. Connections kept alive
stay where they are: gathering steers only new connections.
"""

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

FRESH_SECONDS = 2.5
# How often a worker holding streams says again whether it gathers: its engine's queue and prompt
# work change between the events that wake its loop.
GATHER_REFRESH_SECONDS = 0.05
DEFER_SECONDS = 0.02
MOST_DEFER_SECONDS = 0.25
# A gathering worker's prompt work ahead of a new stream: about a second of prompt pass on two cores.
GATHER_PROMPT_TOKENS = 512
SLOT_BYTES = 8


def make_table(slots: int) -> mmap.mmap:
    """Make the table (in the master, before any fork): per slot, until when its worker gathers."""
    return mmap.mmap(-1, slots * SLOT_BYTES)


class Gathering:
    """A worker's slot in the table, and its view of the others'."""

    def __init__(self, table: mmap.mmap, slot: int, lock_path: Path, clock: Callable[[], float] = time.monotonic):
        self._table, self._slot, self._clock = table, slot, clock
        # Opened by each worker itself: flock excludes open files, and forked copies share one.
        self._lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._slots = len(table) // SLOT_BYTES
        self._streak_began: float | None = None
        self._last_deferred = 0.0
        self.publish(False)

    @contextlib.contextmanager
    def deciding(self) -> Iterator[None]:
        """Hold the workers' shared lock while an idle worker decides whether to accept, and accepts."""
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def publish(self, gathering: bool) -> None:
        """Say whether this worker gathers new streams (for the next FRESH_SECONDS)."""
        struct.pack_into("d", self._table, self._slot * SLOT_BYTES, self._clock() + FRESH_SECONDS if gathering else 0.0)

    def another_gathers(self) -> bool:
        """Tell whether another worker gathers now (CLOCK_MONOTONIC is the machine's: the workers share it)."""
        now = self._clock()
        until = struct.unpack_from(f"{self._slots}d", self._table)
        return any(deadline > now for slot, deadline in enumerate(until) if slot != self._slot)

    def defers(self, idle: bool) -> bool:
        """Tell whether a worker that may accept now leaves the connections to another.

        Deferrals follow each other within twice DEFER_SECONDS while the same connections wait; after
        MOST_DEFER_SECONDS of them the worker accepts.
        """
        now = self._clock()
        if not idle or not self.another_gathers():
            self._streak_began = None
            return False
        if self._streak_began is None or now - self._last_deferred > 2 * DEFER_SECONDS:
            self._streak_began = now
        if now - self._streak_began >= MOST_DEFER_SECONDS:
            self._streak_began = None
            return False
        self._last_deferred = now
        return True
