"""Engine faults through real Gunicorn: a failing sequence, a failing engine loop, a model that fails to load.

The faults are injected by tests/e2e/fault_injection.py, a WSGI module that patches the engine in the
worker (see there why); everything else runs as `make serve` runs it, with the default admission
limits (MAX_RUNNING 8, MAX_QUEUE 16).
"""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from harness import COUNTING, DONE, REPO, free_port, sse_stream
from tests.e2e.fault_injection import LOOP_FAULT_SEED, SEQUENCE_FAULT_SEED
from tests.support import wait_until

# Generations outlast each test step; MAX_GENERATION_SECONDS ends them in bounded time.
ENDLESS = {"messages": COUNTING, "max_tokens": 30_000, "temperature": 0, "stream": True}
NO_CACHE = {"Cache-Control": "no-cache"}  # identical requests must each generate, not share one reply
READ_SECONDS = 60  # a stream still open after this hung (pings keep its socket busy forever)


@pytest.fixture(scope="module")
def fault_server(gunicorn):
    """Run one worker, with the default admission limits, whose engine fails on cue."""
    with gunicorn(workers=1, app="tests.e2e.fault_injection:app", max_tokens_limit=100_000, max_generation_seconds=40,
                  sse_ping_seconds=0.2) as server:
        yield server


def read_stream(server, body: dict) -> dict:
    """Send a streamed request and read it to its end (or READ_SECONDS); return what arrived."""
    began = time.monotonic()
    outcome = {"payloads": [], "done": False}
    with requests.post(f"{server.url}/v1/chat/completions", json=body, headers=NO_CACHE, stream=True,
                       timeout=30) as response:
        outcome["status"] = response.status_code
        for payload in sse_stream(response.iter_lines(decode_unicode=True)):
            if payload == DONE:
                outcome["done"] = True
                break
            outcome["payloads"].append(payload)
            if time.monotonic() - began > READ_SECONDS:
                break
    return outcome


def ended_with_error(outcome: dict) -> bool:
    """Tell whether a stream's last event before [DONE] is an internal_error."""
    return outcome["done"] and outcome["payloads"][-1].get("error", {}).get("code") == "internal_error"


def ended_normally(outcome: dict) -> bool:
    """Tell whether a stream ended with a finish_reason and [DONE]."""
    return outcome["done"] and any(
        choice.get("finish_reason") for payload in outcome["payloads"] for choice in payload.get("choices", [])
    )


def readyz(server) -> tuple[int, dict]:
    """Return the single worker's /readyz status code and body."""
    response = requests.get(f"{server.url}/readyz", headers={"Connection": "close"}, timeout=10)
    return response.status_code, response.json()


def test_a_fault_in_one_sequence_fails_it_alone_and_the_others_complete(fault_server):
    _, before = readyz(fault_server)
    with ThreadPoolExecutor(8) as pool:
        normal = [pool.submit(read_stream, fault_server, {**ENDLESS, "max_tokens": 40, "seed": seed})
                  for seed in range(6)]
        faulty_stream = pool.submit(read_stream, fault_server, {**ENDLESS, "seed": SEQUENCE_FAULT_SEED})
        faulty_whole = pool.submit(
            requests.post, f"{fault_server.url}/v1/chat/completions",
            json={**ENDLESS, "stream": False, "seed": SEQUENCE_FAULT_SEED}, headers=NO_CACHE, timeout=READ_SECONDS,
        )
        assert ended_with_error(faulty_stream.result()), faulty_stream.result()["payloads"][-3:]
        assert faulty_whole.result().status_code == 500
        assert faulty_whole.result().json()["error"]["code"] == "internal_error"
        assert all(ended_normally(outcome.result()) for outcome in normal)
    status, after = readyz(fault_server)
    assert status == 200 and after["worker_pid"] == before["worker_pid"]
    assert wait_until(lambda: readyz(fault_server)[1]["running"] == 0, 10)


def test_a_fault_in_the_engine_loop_ends_every_request_and_the_worker_is_replaced(fault_server):
    _, before = readyz(fault_server)
    # Eight running and seven queued fill the worker's sixteen HTTP threads with the faulty request.
    with ThreadPoolExecutor(16) as pool:
        running = [pool.submit(read_stream, fault_server, {**ENDLESS, "seed": seed}) for seed in range(8)]
        assert wait_until(lambda: readyz(fault_server)[1]["running"] == 8, 30)
        queued = [pool.submit(read_stream, fault_server, {**ENDLESS, "seed": seed}) for seed in range(8, 14)]
        queued_whole = pool.submit(
            requests.post, f"{fault_server.url}/v1/chat/completions",
            json={**ENDLESS, "stream": False}, headers=NO_CACHE, timeout=READ_SECONDS,
        )
        assert wait_until(lambda: readyz(fault_server)[1]["waiting"] == 7, 30)
        faulty = pool.submit(read_stream, fault_server, {**ENDLESS, "seed": LOOP_FAULT_SEED})

        outcomes = [future.result() for future in running + queued + [faulty]]
        assert all(ended_with_error(outcome) for outcome in outcomes), [
            outcome["payloads"][-1:] for outcome in outcomes]
        assert queued_whole.result().status_code == 500

    fault_server.wait_ready(120)
    status, after = readyz(fault_server)
    assert status == 200 and after["worker_pid"] != before["worker_pid"]
    assert before["worker_pid"] not in fault_server.worker_pids()
    log = fault_server.log_path.read_text()
    assert "the engine loop failed: RuntimeError: injected fault in the engine loop" in log
    assert ended_normally(read_stream(fault_server, {**ENDLESS, "max_tokens": 5}))


def test_a_model_whose_weights_are_truncated_restarts_its_workers_then_stops_the_master(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "truncated"
    model_dir.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        (model_dir / name).symlink_to(tiny_model_dir / name)
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    log_path = tmp_path / "gunicorn.log"
    env = {"MODEL": str(model_dir), "BIND": f"127.0.0.1:{free_port()}", "WORKERS": "2", "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        master = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--no-control-socket"],
            cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            exit_status = master.wait(120)
        finally:
            master.kill()
    text = log_path.read_text()
    assert exit_status == 3, text[-3000:]  # Gunicorn's "worker failed to boot" status
    assert text.count("Booting worker") >= 3
    # safetensors checks the header against the file's size before mapping anything.
    assert "the model failed to load (the model failed to load: SafetensorError" in text
    assert "file not fully covered" in text
    assert "attempt 1 of 3" in text and "stopping the server" in text
