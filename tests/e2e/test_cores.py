"""Idle workers lend their cores to busy ones, with the defaults of `make serve` over HTTP: a lone request
runs on every core, and streams started while a worker has room gather on it."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from harness import COUNTING, NO_END_OF_TURN, chat, cpu_ticks_by_thread, finished_by_worker, ready_facts
from service.engine.cores import busy_cpu_seconds
from service.settings import Settings
from service.topology import physical_cores

# A prompt long enough that its pass runs torch's parallel loops (their grain is 32,768 elements).
LONG_PROMPT = [{"role": "user", "content": "The keeper climbs the stairs and lights the lamp. " * 200}]
# A worker lends no core while other processes keep half a CPU busy (service/engine/cores.py): the
# test waits for that much quiet, as long as a server's shutdown or a test before it may take.
QUIET_CPUS = 0.3
QUIET_WAIT_SECONDS = 30


def keep_every_cpu_busy(seconds: float) -> None:
    """Run a spinning process on each CPU for `seconds`, as a build or another server's burst would."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(seconds)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


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
    sock = send_stream(server, index)
    read_until(sock, index, until)
    return sock


def send_stream(server, index: int, max_tokens: int = 1000) -> socket.socket:
    """Send a streamed chat on a raw socket (start_stream's) and return the socket, nothing read."""
    messages = [{**COUNTING[0], "content": f"{COUNTING[0]['content']} ({index})"}]
    payload = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                          "logit_bias": NO_END_OF_TURN}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Cache-Control: no-cache\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def read_until(sock: socket.socket, index: int, until: bytes) -> None:
    """Read a stream's socket until `until` arrives."""
    received = b""
    while until not in received:
        data = sock.recv(4096)
        assert data, f"stream {index} ended before {until!r}: {received[:300]!r}"
        received += data


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


@pytest.mark.serial
def test_a_burst_just_after_other_processes_went_quiet_gathers_on_one_worker_with_the_defaults(gunicorn):
    """Four streams sent within milliseconds, moments after another process kept every CPU busy for
    seconds and the machine went quiet, run as one batch on one worker: the idle workers read the
    machine's load every window, so they decide on the quiet last window, not on an average since
    they last had work (which split such a burst over the workers, each stream decoding slower to
    its end).

    Run alone (serial), each try after its own busy seconds; two of three tries must gather. Another
    guest's moment of load may stop one, as in the test above; reading the load over the stale
    window, the burst went to one worker by the accept race alone, in about a third of the tries.
    """
    assert physical_cores() > 1, "gathering needs a second core to lend"
    with gunicorn(workers=physical_cores()) as server:
        tries = []
        for _ in range(3):
            before = finished_by_worker(server)
            keep_every_cpu_busy(3.0)
            wait_for_a_quiet_machine()
            streams = []
            try:
                for index in range(4):  # as clients of a burst connect, a few milliseconds apart
                    streams.append(send_stream(server, index, max_tokens=200))
                    time.sleep(0.03)
                for index, sock in enumerate(streams):
                    read_until(sock, index, b"data: [DONE]")
            finally:
                for sock in streams:
                    sock.close()
            after = finished_by_worker(server)
            tries.append(sorted((after[pid] - before.get(pid, 0) for pid in after), reverse=True))
            if sum(counts[0] == 4 for counts in tries) == 2:
                break
        assert sum(counts[0] == 4 for counts in tries) >= 2, tries
