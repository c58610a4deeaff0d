"""Idle workers lend their cores to busy ones, with the defaults of `make serve` over HTTP: a lone request
runs on every core, and streams started while a worker has room gather on it."""

import json
import socket
import time

import pytest

from harness import COUNTING, NO_END_OF_TURN, chat, cpu_ticks_by_thread, ready_facts
from service.engine.cores import busy_cpu_seconds
from service.settings import Settings
from service.topology import physical_cores

# A prompt long enough that its pass runs torch's parallel loops (their grain is 32,768 elements).
LONG_PROMPT = [{"role": "user", "content": "The keeper climbs the stairs and lights the lamp. " * 200}]
# A worker lends no core while other processes keep half a CPU busy (service/engine/cores.py): the
# test waits for that much quiet, as long as a server's shutdown or a test before it may take.
QUIET_CPUS = 0.3
QUIET_WAIT_SECONDS = 30


def wait_for_a_quiet_machine() -> None:
    """Wait until the machine's CPUs, all processes together, are busy less than QUIET_CPUS over half a second."""
    deadline = time.monotonic() + QUIET_WAIT_SECONDS
    while time.monotonic() < deadline:
        before, began = busy_cpu_seconds(), time.monotonic()
        time.sleep(0.5)
        if (busy_cpu_seconds() - before) / (time.monotonic() - began) < QUIET_CPUS:
            return
    raise AssertionError(f"the machine stayed busy for {QUIET_WAIT_SECONDS} s: no core is idle to lend")


@pytest.mark.serial
def test_a_lone_request_runs_on_every_core_with_the_defaults(gunicorn):
    """With one worker per core and one thread each (`make serve` on this machine), a worker alone
    with work borrows the idle worker's core: its long prompt keeps two of its threads busy.

    Run alone (serial): on a machine busy with other tests no core is idle, so none is lent.
    """
    assert physical_cores() > 1, "lending needs a second core"
    with gunicorn(workers=physical_cores()) as server:
        pids = server.worker_pids()
        assert all(facts["lends_cores"] for facts in ready_facts(server).values())
        wait_for_a_quiet_machine()
        before = {pid: cpu_ticks_by_thread(pid) for pid in pids}
        assert chat(server, messages=LONG_PROMPT, max_tokens=1).status_code == 200
        after = {pid: cpu_ticks_by_thread(pid) for pid in pids}
    used = {pid: sorted((ticks - before[pid].get(tid, 0) for tid, ticks in after[pid].items()), reverse=True)
            for pid in pids}
    served = max(pids, key=lambda pid: sum(used[pid]))
    assert used[served][0] > 0
    assert used[served][1] >= 0.25 * used[served][0], used[served][:4]


def start_stream(server, index: int, until: bytes) -> socket.socket:
    """Send a streamed chat on a raw socket and read until `until` arrives, then nothing more.

    A client that parsed every event would itself keep half a CPU busy on the tiny model's fast
    streams, and a worker gathers (like it borrows cores) only while other processes leave a core
    free: the replies wait in the kernel's buffers instead, and end when the socket closes.
    """
    messages = [{**COUNTING[0], "content": f"{COUNTING[0]['content']} ({index})"}]
    payload = json.dumps({"messages": messages, "max_tokens": 1000, "temperature": 0, "stream": True,
                          "logit_bias": NO_END_OF_TURN}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Cache-Control: no-cache\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    received = b""
    while until not in received:
        data = sock.recv(4096)
        assert data, f"stream {index} ended before {until!r}: {received[:300]!r}"
        received += data
    return sock


def start_batch_and_two(server, batch: int) -> tuple[list[socket.socket], list[int], int]:
    """Start batch + 2 streams one after another, each running before the next starts (the last two
    only answered); return their sockets, the workers' running counts (largest first) and everything
    running or waiting."""
    streams = []
    try:
        for index in range(batch + 2):
            streams.append(start_stream(server, index, b'"content":"' if index < batch else b"X-Cache:"))
        facts = ready_facts(server)
        assert len(facts) == physical_cores(), facts
        running = sorted((worker["running"] for worker in facts.values()), reverse=True)
        return streams, running, sum(worker["running"] + worker["waiting"] for worker in facts.values())
    except BaseException:
        for sock in streams:
            sock.close()
        raise


@pytest.mark.serial
def test_streams_started_while_a_worker_has_room_gather_on_it_beyond_capacity_with_the_defaults(gunicorn):
    """One stream after another, each running before the next starts, two more than a batch holds: the
    first MAX_RUNNING run on one worker, as one batch on both cores, and the rest find a place.

    Run alone (serial): a worker gathers only while other processes leave a core to lend, and on a
    shared virtual machine another guest's moment of load (steal time) stops it, by design, as it
    stops lending: the scenario gets three tries, each with fresh streams.
    """
    batch = Settings.model_construct().max_running
    assert physical_cores() > 1, "gathering needs a second core to lend"
    with gunicorn(workers=physical_cores()) as server:
        tries = []
        for _ in range(3):
            wait_for_a_quiet_machine()
            streams, running, held = start_batch_and_two(server, batch)
            for sock in streams:
                sock.close()
            tries.append(running)
            assert held == batch + 2, (held, running)
            if running[0] == batch:
                break
            deadline = time.monotonic() + 30  # the closed streams end at their next token
            while any(worker["running"] + worker["waiting"] for worker in ready_facts(server).values()):
                assert time.monotonic() < deadline, "closed streams still running"
                time.sleep(0.1)
        assert tries[-1][0] == batch, tries
