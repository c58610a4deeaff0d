"""Idle workers lend their cores to busy ones, with the defaults of `make serve` over HTTP: a lone request
runs on every core, and streams started while a worker has room gather on it."""

import time

import pytest

from harness import COUNTING, StreamingClient, chat, cpu_ticks_by_thread, hang_up_all, ready_facts
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


@pytest.mark.serial
def test_streams_started_while_a_worker_has_room_gather_on_it_beyond_capacity_with_the_defaults(gunicorn):
    """One stream after another, each running before the next starts, two more than a batch holds: the
    first MAX_RUNNING run on one worker, as one batch on both cores, and the rest find a place.

    Run alone (serial): a worker gathers only while other processes leave a core to lend.
    """
    batch = Settings.model_construct().max_running
    assert physical_cores() > 1, "gathering needs a second core to lend"
    with gunicorn(workers=physical_cores()) as server:
        wait_for_a_quiet_machine()
        streams = []
        try:
            for index in range(batch + 2):
                messages = [{**COUNTING[0], "content": f"{COUNTING[0]['content']} ({index})"}]
                body = {"messages": messages, "max_tokens": 1000, "temperature": 0, "stream": True}
                streams.append(StreamingClient(server.url, body, {"Cache-Control": "no-cache"}))
                if index < batch:
                    streams[-1].wait_for_chunks(1)
                else:
                    streams[-1].wait_for_headers()
            facts = ready_facts(server)
            assert len(facts) == physical_cores(), facts
            running = sorted((worker["running"] for worker in facts.values()), reverse=True)
            assert running[0] == batch, running
            assert sum(worker["running"] + worker["waiting"] for worker in facts.values()) == batch + 2
        finally:
            hang_up_all(streams)
