"""The master imports torch and transformers and loads the tokenizer before fork (PRELOAD_LIBRARIES):
workers forked from it work as unforked processes do, and share what the master imported."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from harness import chat, cpu_ticks_by_thread, ready_facts, send_until_every_worker_served, threads_of
from service.engine import SamplingParams, TextDelta
from service.settings import Settings
from service.topology import physical_cores

PROMPTS = [[{"role": "user", "content": f"Question {number}: what is a lighthouse for?"}] for number in range(3)]
REPLY_TOKENS = 12
# A prompt long enough that its pass runs torch's parallel loops (their grain is 32,768 elements).
LONG_PROMPT = [{"role": "user", "content": "The keeper climbs the stairs and lights the lamp. " * 60}]


@pytest.fixture(scope="module")
def default_server(gunicorn):
    """Run Gunicorn with the defaults of `make serve` (one worker per core, PRELOAD_LIBRARIES on)."""
    with gunicorn(workers=physical_cores()) as server:
        yield server


def maps_of(pid: int) -> str:
    """Return a process's memory map."""
    return Path(f"/proc/{pid}/maps").read_text()


def greedy_reply(server, messages) -> str:
    """Return a worker's greedy reply, past the response cache."""
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0},
        headers={"Connection": "close", "Cache-Control": "no-cache"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def unforked_reply(engine, messages) -> str:
    """Return the greedy reply of the in-process engine, which never forked."""
    generation = engine.submit(engine.template.encode(engine.template.render(messages)),
                               SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0))
    return "".join(event.text for event in generation.events() if isinstance(event, TextDelta))


def test_master_imports_torch_and_loads_the_tokenizer_but_holds_no_model_and_no_other_thread(default_server,
                                                                                             tiny_model_dir):
    """A single-threaded master cannot fork while another thread holds a lock; no model is loaded
    there, and every worker uses the tokenizer it inherited instead of building its own."""
    master = default_server.process.pid
    assert "libtorch_cpu" in maps_of(master)
    assert len(threads_of(master)) == 1
    assert str(tiny_model_dir) not in maps_of(master)
    assert all(str(tiny_model_dir) in maps_of(pid) for pid in default_server.worker_pids())
    facts = ready_facts(default_server)
    assert len(facts) == default_server.workers and all(worker["tokenizer_inherited"] for worker in facts.values())


def test_workers_under_load_above_capacity_reply_as_an_unforked_engine(default_server, engine):
    """Past every worker's running and queue places, all replies complete; greedy replies match."""
    defaults = Settings()
    places = defaults.max_running + defaults.max_queue
    capacity = default_server.workers * places
    results = []

    def send() -> None:
        results.append(chat(default_server, max_tokens=REPLY_TOKENS, stream=False).status_code)

    threads = [threading.Thread(target=send) for _ in range(capacity + 8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results.count(200) + results.count(503) == len(threads)
    # However unevenly the kernel hands out connections, the busiest worker fills all its places.
    assert results.count(200) >= places

    expected = [unforked_reply(engine, messages) for messages in PROMPTS]

    def send_round() -> None:
        assert [greedy_reply(default_server, messages) for messages in PROMPTS] == expected

    served = send_until_every_worker_served(default_server, send_round, most_rounds=20)
    assert all(served.values()), served


def test_a_worker_forked_after_the_master_served_for_a_while_works(default_server, engine):
    """A worker killed now is replaced by a fork of the long-running master, which replies as before."""
    victim = default_server.worker_pids()[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (victim in default_server.worker_pids()
                                           or len(default_server.ready_workers()) < default_server.workers):
        time.sleep(0.2)
    assert victim not in default_server.worker_pids()
    assert len(default_server.ready_workers()) == default_server.workers
    expected = unforked_reply(engine, PROMPTS[0])

    def send_round() -> None:
        assert greedy_reply(default_server, PROMPTS[0]) == expected

    served = send_until_every_worker_served(default_server, send_round, most_rounds=20)
    assert all(served.values()), served


def test_a_forked_worker_runs_its_own_intra_op_thread_pool(gunicorn):
    """With two torch threads, a long prompt keeps two threads of the forked worker busy."""
    with gunicorn(workers=1, torch_threads=2, warmup="false") as server:
        (pid,) = server.worker_pids()
        assert ready_facts(server)[pid]["torch_threads"] == 2
        before = cpu_ticks_by_thread(pid)
        assert chat(server, messages=LONG_PROMPT, max_tokens=1).status_code == 200
        after = cpu_ticks_by_thread(pid)
    used = sorted((ticks - before.get(tid, 0) for tid, ticks in after.items()), reverse=True)
    assert used[0] > 0
    assert used[1] >= 0.25 * used[0], used[:4]


def test_without_preloading_the_master_never_loads_torch(gunicorn):
    """PRELOAD_LIBRARIES=false keeps torch out of the master, as before preloading existed."""
    with gunicorn(workers=1, preload_libraries="false", warmup="false") as server:
        assert "libtorch" not in maps_of(server.process.pid)
        (pid,) = server.worker_pids()
        assert "libtorch_cpu" in maps_of(pid)
        assert ready_facts(server)[pid]["tokenizer_inherited"] is False
        assert chat(server, max_tokens=2).status_code == 200
