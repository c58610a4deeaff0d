"""Idle workers lend their cores to busy ones (service/engine/cores.py): the policy on one shared
table, across fork, and with the defaults of `make serve` over HTTP."""

import mmap
import os

from service.engine.cores import SharedCores, no_sharing

CORES = 2


class Threads:
    """Record what a view sets torch's thread count to."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, threads: int) -> None:
        self.calls.append(threads)


def views(table: mmap.mmap, cores: int = CORES, own: int = 1) -> tuple[SharedCores, SharedCores, Threads, Threads]:
    """Return two workers' views of one table (slots 0 and 1) and their thread recorders."""
    first, second = Threads(), Threads()
    return SharedCores(table, 0, cores, own, first), SharedCores(table, 1, cores, own, second), first, second


def test_a_lone_busy_worker_takes_every_core_and_gives_them_back_when_idle():
    table = mmap.mmap(-1, 64)
    a, _, threads, _ = views(table)
    assert a.take() == CORES and threads.calls == [CORES]
    assert a.take() == CORES and threads.calls == [CORES], "no call while nothing changes"
    assert table[0] == CORES
    a.release()
    assert table[0] == 0 and a.threads == 1 and threads.calls == [CORES, 1]


def test_a_worker_turning_busy_takes_its_share_and_the_lender_returns_the_rest_at_its_next_layer():
    table = mmap.mmap(-1, 64)
    a, b, _, _ = views(table)
    assert a.take() == 2
    # b sees a holding both cores: it keeps its own one, and so oversubscribes for a's current layer.
    assert b.take() == 1
    assert a.take() == 1, "a gives the lent core back at its next layer"
    assert b.take() == 1 and a.take() == 1, "both busy: each keeps its own"
    assert table[0] + table[1] == CORES
    b.release()
    assert a.take() == 2, "b idle again: a takes its core"


def test_two_workers_turning_busy_together_settle_on_their_own_share():
    table = mmap.mmap(-1, 64)
    a, b, _, _ = views(table)
    # Both read the other as idle before either writes: for one layer each holds every core.
    table[0] = table[1] = 2
    assert a.take() == 1 and b.take() == 1
    assert a.take() == 1 and b.take() == 1


def test_more_cores_are_split_among_the_busy_workers():
    table = mmap.mmap(-1, 64)
    a, b, _, _ = views(table, cores=8, own=2)
    assert a.take() == 8
    assert b.take() == 2
    assert a.take() == 6, "a keeps what b does not hold"
    assert b.take() == 2


def test_no_table_a_slot_beyond_it_or_no_spare_core_means_no_lending():
    calls = Threads()
    for view in (no_sharing(1), SharedCores(mmap.mmap(-1, 4), 4, CORES, 1, calls),
                 SharedCores(mmap.mmap(-1, 4), 0, CORES, CORES, calls)):
        assert not view.lends
        assert view.take() == view.threads
        view.release()
    assert calls.calls == []


def test_a_fresh_view_clears_what_a_dead_worker_left_in_its_slot():
    table = mmap.mmap(-1, 64)
    table[0] = 2  # a worker killed while busy
    other = SharedCores(table, 1, CORES, 1, Threads())
    assert other.take() == 1, "the stale slot still counts"
    SharedCores(table, 0, CORES, 1, Threads())
    assert other.take() == 2


def test_forked_workers_see_each_other_through_the_masters_table():
    table = mmap.mmap(-1, 64)  # made before fork, as the master does
    a = SharedCores(table, 0, CORES, 1, Threads())
    a.take()
    child = os.fork()
    if child == 0:
        b = SharedCores(table, 1, CORES, 1, Threads())
        os._exit(0 if b.take() == 1 and table[1] == 1 else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert table[1] == 1 and a.take() == 1
