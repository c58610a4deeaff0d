"""Cores a worker with nothing to do lends to the workers that have work.

One worker per physical core keeps each core busy under load, but leaves a lone stream (a first
token, a quiet hour) one core while the others idle. Gunicorn's master makes a small table in
shared memory before it forks; each worker's engine writes there the threads it is using (0 while
idle) and, before every decoder layer, takes the cores no other busy worker of the same master
holds: a lone stream runs on all of them, and once every worker is busy each keeps its own share.
A worker that turns busy while another holds a lent core takes its own share at once, and the
lender gives it back at its next layer, so cores are oversubscribed for at most one layer.

A lent core must really be idle: a product split over two threads waits for the slower, and a
thread that shares its core with another process makes every product wait for the scheduler
(a loaded machine ran a prompt many times slower this way). So a worker also lends only while
processes other than the master's workers leave a whole CPU free: what kept the machine's CPUs
busy over the last LOAD_WINDOW_SECONDS (/proc/stat) less the CPU time the workers publish in the
table. The workers' own time is left out because the table already says which of them are busy,
at once, where a window would still count a sibling that has just gone idle. A window runs from the
last reading to the next, so an idle worker's event loop reads the load every LOAD_WINDOW_SECONDS
(sample_load): otherwise the first reading after an idle minute would average the whole minute, and
a burst arriving just after another process's work ended would split over the workers and its
streams decode slower to their end (docs/performance.md).

Threads never change a result: the kernels compute each output whole on one thread (ops.cpp).
"""

import mmap
import os
import struct
import threading
import time
from collections.abc import Callable

# How long the machine's load is measured over before it is read again: /proc/stat counts in
# 10 ms ticks, so a window holds tens of ticks per CPU.
LOAD_WINDOW_SECONDS = 0.2
# A table slot: a byte of threads held, then (after every slot's byte) a float64 of CPU seconds.
SLOT_BYTES = 9
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal; all but idle and iowait
# are busy (steal too: another guest had the CPU).
IDLE_FIELDS = (3, 4)


def busy_cpu_seconds() -> float:
    """Return the CPU time all processes of the machine have used, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:9]
    ticks = sum(int(value) for index, value in enumerate(fields) if index not in IDLE_FIELDS)
    return ticks / os.sysconf("SC_CLK_TCK")


class MachineLoad:
    """How many CPUs processes other than ours kept busy over the last window."""

    def __init__(self, busy_seconds: Callable[[], float], own_seconds: Callable[[], float],
                 clock: Callable[[], float] = time.monotonic):
        self._busy_seconds, self._own_seconds, self._clock = busy_seconds, own_seconds, clock
        self._since = (clock(), busy_seconds(), own_seconds())
        self._others = 0.0
        self._lock = threading.Lock()

    def others(self) -> float:
        """Return the CPUs other processes used over the last window (measured again once it is over;
        the engine's thread and the worker's event loop both ask)."""
        with self._lock:
            now = self._clock()
            began, busy, own = self._since
            if now - began >= LOAD_WINDOW_SECONDS:
                busy_now, own_now = self._busy_seconds(), self._own_seconds()
                self._others = max(0.0, ((busy_now - busy) - (own_now - own)) / (now - began))
                self._since = (now, busy_now, own_now)
            return self._others


class SharedCores:
    """A worker's view of the table: which cores it may use now, what it holds, the CPU it used."""

    def __init__(self, table: mmap.mmap | None, slot: int, cores: int, own_threads: int,
                 set_threads: Callable[[int], None], *, busy_seconds: Callable[[], float] | None = None,
                 process_seconds: Callable[[], float] = time.process_time, clock: Callable[[], float] = time.monotonic,
                 cpus: int | None = None):
        self._slots = len(table) // SLOT_BYTES if table is not None else 0
        # No table (an engine outside Gunicorn) or a slot beyond it: the worker keeps its own threads.
        self.lends = 0 <= slot < self._slots and cores > own_threads
        self._table, self._slot = table, slot
        self._cores, self._own = cores, own_threads
        self._set_threads = set_threads
        self._process_seconds = process_seconds
        self._cpus = cpus or os.cpu_count() or 1
        self.threads = own_threads
        if not self.lends:
            return
        self._table[slot] = 0
        self._publish()
        self._seen = self._published()
        self._workers_seconds = 0.0
        self._load = MachineLoad(busy_seconds, self._workers_cpu_seconds, clock) if busy_seconds else None

    def take(self) -> int:
        """Use the cores no other busy worker holds (at least this worker's own); return the threads."""
        if not self.lends:
            return self.threads
        self._publish()
        spare = self._cores - (sum(self._table[: self._slots]) - self._table[self._slot])
        if self._load is not None and spare > self._own:
            spare = min(spare, self._cpus_others_leave())
        threads = max(self._own, min(spare, 255))
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        self._table[self._slot] = threads
        return threads

    def sample_load(self) -> None:
        """Read the machine's load if its window is over (the idle event loop calls this every
        LOAD_WINDOW_SECONDS), so that the next reading covers the last window, not the time since
        this worker last had work."""
        if self.lends and self._load is not None:
            self._load.others()

    def others_leave_a_core(self) -> bool:
        """Tell whether other processes leave this worker a core to borrow now (from any thread)."""
        return self.lends and (self._load is None or self._cpus_others_leave() > self._own)

    def _cpus_others_leave(self) -> int:
        """Return the CPUs processes other than the master's workers leave free. Rounded: a busy
        daemon's tenth of a CPU does not stop lending; half a CPU does."""
        return round(self._cpus - self._load.others())

    def release(self) -> None:
        """Hold no core (the engine has nothing to do) and fall back to this worker's own threads."""
        if not self.lends:
            return
        self._publish()
        self._table[self._slot] = 0
        if self.threads != self._own:
            self._set_threads(self._own)
            self.threads = self._own

    def _publish(self) -> None:
        """Write this process's CPU seconds into its slot."""
        struct.pack_into("d", self._table, self._slots + 8 * self._slot, self._process_seconds())

    def _published(self) -> tuple[float, ...]:
        """Return every slot's published CPU seconds."""
        return struct.unpack_from(f"{self._slots}d", self._table, self._slots)

    def _workers_cpu_seconds(self) -> float:
        """Return the CPU seconds the master's workers used, summed as it grows: a slot whose worker
        was replaced starts again from its new worker's count. This worker's own count is read now:
        its slot holds what take() last published, and the fused layers call take() once a forward,
        so during a long prompt pass the slot lags by seconds of this worker's own work, which the
        event loop (asking whether to gather) would otherwise count as another process's load."""
        published = list(self._published())
        published[self._slot] = self._process_seconds()
        self._workers_seconds += sum(max(0.0, now - before) for now, before in zip(published, self._seen, strict=True))
        self._seen = tuple(published)
        return self._workers_seconds


def no_sharing(own_threads: int) -> SharedCores:
    """Return a view that keeps the worker's own threads (no table)."""
    return SharedCores(None, 0, own_threads, own_threads, lambda threads: None)
