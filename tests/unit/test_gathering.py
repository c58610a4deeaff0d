"""New streams gather on a busy worker while its batch has room (service/process/gathering.py): the table's
policy with a controlled clock, and across fork."""

import os
import time
from pathlib import Path

import pytest

from service.process.gathering import DEFER_SECONDS, FRESH_SECONDS, MOST_DEFER_SECONDS, Gathering, make_table


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lock_path(tmp_path) -> Path:
    """Return where the workers' shared lock lives (the master's run folder)."""
    return tmp_path / "gathering.lock"


@pytest.fixture
def workers(lock_path):
    """Return a function making a clock and `count` workers' views of one table (slots 0, 1, ...)."""

    def make(count: int = 2):
        clock, table = Clock(), make_table(64)
        return clock, [Gathering(table, slot, lock_path, clock) for slot in range(count)]

    return make


def test_an_idle_worker_defers_to_a_gathering_one_and_a_busy_one_never_defers(workers):
    _, (busy, idle) = workers()
    assert not idle.defers(idle=True), "nobody gathers yet"
    busy.publish(True)
    assert idle.defers(idle=True)
    assert not idle.defers(idle=False), "a worker with streams of its own accepts as any worker"
    assert not busy.defers(idle=True), "a worker never defers to itself"
    busy.publish(False)
    assert not idle.defers(idle=True), "a full worker, or one with a long prompt ahead, draws nothing"


def test_a_published_state_goes_stale_after_fresh_seconds(workers):
    clock, (busy, idle) = workers()
    busy.publish(True)
    clock.now += FRESH_SECONDS - 0.01
    assert idle.another_gathers()
    clock.now += 0.02
    assert not idle.another_gathers(), "a worker that died, or whose loop stopped, draws no connections"


def test_connections_left_waiting_are_accepted_after_the_most_deferral(workers):
    clock, (busy, idle) = workers()
    busy.publish(True)
    waited = 0.0
    while idle.defers(idle=True):
        clock.now += DEFER_SECONDS
        waited += DEFER_SECONDS
        busy.publish(True)
        assert waited <= MOST_DEFER_SECONDS + DEFER_SECONDS, "deferred without end"
    assert waited >= MOST_DEFER_SECONDS - DEFER_SECONDS
    assert idle.defers(idle=True), "the next connection starts a new streak"


def test_a_streak_ends_once_the_listener_stayed_quiet(workers):
    clock, (busy, idle) = workers()
    busy.publish(True)
    for _ in range(3):
        assert idle.defers(idle=True)
        clock.now += MOST_DEFER_SECONDS  # each a new connection, long after the last deferral
        busy.publish(True)


def test_any_of_several_workers_may_gather_and_a_fresh_view_clears_its_slot(workers, lock_path):
    _, views = workers(4)
    views[3].publish(True)
    assert all(view.defers(idle=True) for view in views[:3])
    clock = Clock()
    table = make_table(64)
    Gathering(table, 2, lock_path, clock).publish(True)
    Gathering(table, 2, lock_path, clock)  # the slot's next worker starts closed
    assert not Gathering(table, 0, lock_path, clock).another_gathers()


def test_forked_workers_see_each_other_through_the_masters_table(lock_path):
    table = make_table(64)
    pid = os.fork()
    if pid == 0:
        Gathering(table, 1, lock_path).publish(True)
        os._exit(0)
    os.waitpid(pid, 0)
    assert Gathering(table, 0, lock_path).another_gathers()


def test_one_worker_at_a_time_decides_and_a_dead_holder_lets_go(lock_path):
    table = make_table(64)
    held = 0.3
    pid = os.fork()
    if pid == 0:
        with Gathering(table, 1, lock_path).deciding():
            time.sleep(held)
            os._exit(0)  # dies holding it: the kernel releases the lock
    time.sleep(0.05)
    began = time.monotonic()
    with Gathering(table, 0, lock_path).deciding():
        waited = time.monotonic() - began
    os.waitpid(pid, 0)
    assert waited >= held - 0.1, waited
    assert waited < 10, "a dead holder's lock was not released"


class Listener:
    """A listening socket that counts the times the worker accepted from it."""

    def __init__(self) -> None:
        self.accepted = 0


def idle_worker(gathering: Gathering, max_running: int = 8):
    """Return corechat's Gunicorn worker with only what its gathering reads (no arbiter, no sockets)."""
    from service.process.worker import CorechatWorker

    worker = object.__new__(CorechatWorker)
    worker.places = worker.free_places = 24
    worker.max_running = max_running
    worker.arriving = {}
    worker.gathering, worker.gather_room = gathering, lambda: True
    worker.open_for_requests, worker.alive, worker.stopped_listening = True, True, False
    worker.accepting_again_at = 0.0
    worker.enabled = []
    worker.set_accept_enabled = worker.enabled.append
    worker.accept_some = lambda listener: setattr(listener, "accepted", listener.accepted + 1)
    return worker


def arriving(method: bytes | None, *, idle: bool = False):
    """Return a connection's request as the worker's loop holds it: its method (None before its head)."""
    from service.process.arrival import ArrivingRequest

    request = ArrivingRequest(None, 0.0, idle=idle, max_body_bytes=1024)
    if method is not None:
        request.take(method + b" /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    return request


def test_a_worker_gathers_while_it_holds_streams_below_a_batch_and_has_room(workers):
    clock, (mine, other) = workers()
    worker = idle_worker(mine)
    worker.publish_gathering()
    assert not other.another_gathers(), "no stream: nothing to gather onto"
    worker.arriving[object()] = arriving(b"GET")
    worker.arriving[object()] = arriving(None, idle=True)
    worker.publish_gathering()
    assert not other.another_gathers(), "a probe and an idle kept-alive connection are no streams"
    worker.arriving[object()] = arriving(None)
    worker.publish_gathering()
    assert other.another_gathers(), "a new connection counts as a stream until its method shows"
    worker.arriving.clear()
    worker.free_places -= 1
    worker.publish_gathering()
    assert other.another_gathers(), "a POST holding a place"
    worker.gather_room = lambda: False
    worker.publish_gathering()
    assert not other.another_gathers(), "a long prompt ahead, or no core to borrow"
    worker.gather_room = lambda: True
    worker.free_places = worker.places - worker.max_running
    worker.publish_gathering()
    assert not other.another_gathers(), "a full batch"
    worker.free_places += 1
    worker.publish_gathering()
    assert other.another_gathers()
    worker.stopped_listening = True
    worker.publish_gathering()
    assert not other.another_gathers(), "a worker that stopped listening"


def test_an_idle_worker_leaves_a_connection_to_the_gathering_one_and_looks_again_soon(workers):
    clock, (gathering, mine) = workers()
    worker, listener = idle_worker(mine), Listener()
    worker.accept(listener)
    assert listener.accepted == 1, "nobody gathers: it accepts"
    gathering.publish(True)
    worker.accept(listener)
    assert listener.accepted == 1 and worker.enabled == [False], "it stops watching its listeners"
    assert worker.accepting_again_at > 0
    worker.free_places -= 1
    worker.accept(listener)
    assert listener.accepted == 2, "a worker with a stream of its own accepts as any worker"
