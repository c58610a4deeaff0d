"""Idle workers lend their cores to busy ones (service/engine/cores.py): the policy on one shared table, and
across fork."""

import mmap
import os
import time

from service.engine.cores import LOAD_WINDOW_SECONDS, MachineLoad, SharedCores, busy_cpu_seconds, no_sharing

CORES = 2


class Threads:
    """Record what a view sets torch's thread count to."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, threads: int) -> None:
        self.calls.append(threads)


def new_table() -> mmap.mmap:
    """Return a table as the master makes it (service/process/lifecycle.py): a byte and a float64 per slot."""
    return mmap.mmap(-1, 64 * 9)


def views(table: mmap.mmap, cores: int = CORES, own: int = 1) -> tuple[SharedCores, SharedCores, Threads, Threads]:
    """Return two workers' views of one table (slots 0 and 1) and their thread recorders."""
    first, second = Threads(), Threads()
    return SharedCores(table, 0, cores, own, first), SharedCores(table, 1, cores, own, second), first, second


def test_a_lone_busy_worker_takes_every_core_and_gives_them_back_when_idle():
    table = new_table()
    a, _, threads, _ = views(table)
    assert a.take() == CORES and threads.calls == [CORES]
    assert a.take() == CORES and threads.calls == [CORES], "no call while nothing changes"
    assert table[0] == CORES
    a.release()
    assert table[0] == 0 and a.threads == 1 and threads.calls == [CORES, 1]


def test_a_worker_turning_busy_takes_its_share_and_the_lender_returns_the_rest_at_its_next_layer():
    table = new_table()
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
    table = new_table()
    a, b, _, _ = views(table)
    # Both read the other as idle before either writes: for one layer each holds every core.
    table[0] = table[1] = 2
    assert a.take() == 1 and b.take() == 1
    assert a.take() == 1 and b.take() == 1


def test_more_cores_are_split_among_the_busy_workers():
    table = new_table()
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
    table = new_table()
    table[0] = 2  # a worker killed while busy
    other = SharedCores(table, 1, CORES, 1, Threads())
    assert other.take() == 1, "the stale slot still counts"
    SharedCores(table, 0, CORES, 1, Threads())
    assert other.take() == 2


def test_forked_workers_see_each_other_through_the_masters_table():
    table = new_table()  # made before fork, as the master does
    a = SharedCores(table, 0, CORES, 1, Threads())
    a.take()
    child = os.fork()
    if child == 0:
        b = SharedCores(table, 1, CORES, 1, Threads())
        os._exit(0 if b.take() == 1 and table[1] == 1 else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert table[1] == 1 and a.take() == 1


class Clocks:
    """A machine's busy CPU seconds, each worker's CPU seconds and the time, set by the test."""

    def __init__(self) -> None:
        self.busy = self.now = 0.0
        self.workers = [0.0, 0.0]

    def view(self, table: mmap.mmap, slot: int) -> SharedCores:
        """Return worker `slot`'s view of the table, reading these clocks."""
        return SharedCores(table, slot, CORES, 1, Threads(), busy_seconds=lambda: self.busy,
                           process_seconds=lambda: self.workers[slot], clock=lambda: self.now, cpus=CORES)

    def advance(self, seconds: float, busy_cpus: float, workers_cpus: tuple[float, float] = (0.0, 0.0)) -> None:
        """Let time pass with the machine busy on busy_cpus CPUs, workers_cpus of them the workers'."""
        self.now += seconds
        self.busy += seconds * busy_cpus
        for slot, cpus in enumerate(workers_cpus):
            self.workers[slot] += seconds * cpus


def test_a_machine_busy_with_other_processes_lends_no_core():
    clocks = Clocks()
    lender = clocks.view(new_table(), 0)
    clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=0.1)
    assert lender.take() == 2, "a tenth of a CPU elsewhere leaves a core idle"
    clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=2.0, workers_cpus=(2.0, 0.0))
    assert lender.take() == 2, "this worker's own threads are not another's load"
    clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=2.0, workers_cpus=(1.0, 0.0))
    assert lender.take() == 1, "another process kept a CPU busy: the second thread would wait for it"
    clocks.advance(LOAD_WINDOW_SECONDS / 2, busy_cpus=1.0, workers_cpus=(1.0, 0.0))
    assert lender.take() == 1, "the load is measured again only once a window is over"
    clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=1.0, workers_cpus=(1.0, 0.0))
    assert lender.take() == 2


def test_whether_others_leave_a_core_follows_the_machines_load_measured_again_once_a_window_is_over():
    clocks = Clocks()
    worker = clocks.view(new_table(), 0)
    assert worker.others_leave_a_core()
    clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=2.0, workers_cpus=(1.0, 0.0))
    assert not worker.others_leave_a_core(), "another process kept a CPU busy"
    clocks.advance(LOAD_WINDOW_SECONDS / 2, busy_cpus=0.0)
    assert not worker.others_leave_a_core(), "measured again only once a window is over"
    clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=0.0)
    assert worker.others_leave_a_core()
    assert not no_sharing(1).others_leave_a_core(), "a worker that cannot lend gathers nothing on lent cores"


def test_a_load_sampled_while_idle_reads_the_last_window_not_the_time_since_the_last_work():
    """An idle worker's loop samples the load every window: a burst that arrives just after another
    process's minute of work ended reads the quiet last window and gathers (unsampled, the first
    reading averages the whole minute, and the burst splits over the workers to its end)."""
    for sampled in (False, True):
        clocks = Clocks()
        worker = clocks.view(new_table(), 0)
        worker.release()
        assert worker.others_leave_a_core()
        clocks.advance(60.0, busy_cpus=2.0)  # another process's minute on both CPUs
        for _ in range(3):
            clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=0.0)
            if sampled:
                worker.sample_load()
        assert worker.others_leave_a_core() is sampled
        assert worker.take() == (2 if sampled else 1)


def test_a_long_forward_between_takes_is_not_counted_as_load_when_the_event_loop_asks():
    """The fused layers call take() once a forward: during a prompt pass of seconds this worker's
    published CPU time stands still while the machine's grows. Measured then (by the event loop
    asking whether to gather), that must not read as another process's load, or the next forward
    runs on one thread: a lone 850-token prompt took twice as long, served."""
    clocks, shared = Clocks(), new_table()
    worker, idle = clocks.view(shared, 0), clocks.view(shared, 1)
    idle.release()
    assert worker.take() == 2
    for _ in range(5):  # one forward of a second on both cores, no take() meanwhile
        clocks.advance(LOAD_WINDOW_SECONDS, busy_cpus=2.0, workers_cpus=(2.0, 0.0))
        assert worker.others_leave_a_core(), "this worker's own forward is not another process's load"
    assert worker.take() == 2, "the next forward keeps both cores"


def test_a_sibling_that_just_went_idle_is_not_counted_as_load():
    """The table says at once that a sibling is idle; its CPU over the last window is not another
    process's load, so the first layer after it went idle already lends."""
    clocks, shared = Clocks(), new_table()
    a, b = clocks.view(shared, 0), clocks.view(shared, 1)
    a.release()
    assert b.take() == 2
    clocks.advance(5 * LOAD_WINDOW_SECONDS, busy_cpus=2.0, workers_cpus=(0.0, 2.0))
    b.release()
    assert a.take() == 2


def test_the_machine_load_reads_this_machine():
    load = MachineLoad(busy_cpu_seconds, time.process_time)
    before = busy_cpu_seconds()
    deadline = time.monotonic() + LOAD_WINDOW_SECONDS
    while time.monotonic() < deadline:
        pass  # this process's own work, which others() leaves out
    assert busy_cpu_seconds() >= before
    assert 0.0 <= load.others() <= (os.cpu_count() or 1)
