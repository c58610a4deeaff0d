"""Cores a worker with nothing to do lends to the workers that have work.

One worker per physical core keeps each core busy under load, but leaves a lone stream (a first
token, a quiet hour) one core while the others idle. Gunicorn's master makes a small table in
shared memory before it forks; each worker's engine writes there the threads it is using (0 while
idle) and, before every decoder layer, takes the cores no other busy worker of the same master
holds: a lone stream runs on all of them, and once every worker is busy each keeps its own share.
A worker that turns busy while another holds a lent core takes its own share at once, and the
lender gives it back at its next layer, so cores are oversubscribed for at most one layer.

Threads never change a result: the kernels compute each output whole on one thread (ops.cpp).
"""

import mmap
from collections.abc import Callable


class SharedCores:
    """A worker's view of the table (one byte per worker slot): which cores it may use now, and
    what it holds."""

    def __init__(self, table: mmap.mmap | None, slot: int, cores: int, own_threads: int,
                 set_threads: Callable[[int], None]):
        # No table (an engine outside Gunicorn) or a slot beyond it: the worker keeps its own threads.
        self.lends = table is not None and 0 <= slot < len(table) and cores > own_threads
        self._table, self._slot = table, slot
        self._cores, self._own = cores, own_threads
        self._set_threads = set_threads
        self.threads = own_threads
        if self.lends:
            self._table[slot] = 0

    def take(self) -> int:
        """Use the cores no other busy worker holds (at least this worker's own); return the threads."""
        if not self.lends:
            return self.threads
        others = sum(self._table[:]) - self._table[self._slot]
        threads = max(self._own, min(self._cores - others, 255))
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        self._table[self._slot] = threads
        return threads

    def release(self) -> None:
        """Hold no core (the engine has nothing to do) and fall back to this worker's own threads."""
        if not self.lends:
            return
        self._table[self._slot] = 0
        if self.threads != self._own:
            self._set_threads(self._own)
            self.threads = self._own


def no_sharing(own_threads: int) -> SharedCores:
    """Return a view that keeps the worker's own threads (no table)."""
    return SharedCores(None, 0, own_threads, own_threads, lambda threads: None)
