"""Idle workers lend their cores to busy ones, with the defaults of `make serve` over HTTP: a lone request
runs on every core."""

import pytest

from harness import chat, cpu_ticks_by_thread, ready_facts
from service.topology import physical_cores

# A prompt long enough that its pass runs torch's parallel loops (their grain is 32,768 elements).
LONG_PROMPT = [{"role": "user", "content": "The keeper climbs the stairs and lights the lamp. " * 200}]


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
        before = {pid: cpu_ticks_by_thread(pid) for pid in pids}
        assert chat(server, messages=LONG_PROMPT, max_tokens=1).status_code == 200
        after = {pid: cpu_ticks_by_thread(pid) for pid in pids}
    used = {pid: sorted((ticks - before[pid].get(tid, 0) for tid, ticks in after[pid].items()), reverse=True)
            for pid in pids}
    served = max(pids, key=lambda pid: sum(used[pid]))
    assert used[served][0] > 0
    assert used[served][1] >= 0.25 * used[served][0], used[served][:4]
