"""End to end: real Gunicorn with 2 workers on the tiny model, over real HTTP."""

import contextlib
import http.server
import json
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from harness import COUNTING, anonymous_megabytes, chat, ready_facts, send_until_every_worker_served, sse_stream
from tests.support import wait_until


def test_stream_over_real_http(gunicorn_server):
    with requests.post(
        f"{gunicorn_server.url}/v1/chat/completions",
        json={"messages": COUNTING, "max_tokens": 20, "seed": 5, "stream": True},
        stream=True,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        payloads = list(sse_stream(response.iter_lines(decode_unicode=True)))
    assert payloads[-1] == "[DONE]"
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"  # seeded: runs to max_tokens


def test_both_workers_generate(gunicorn_server):
    sent = []

    def send_round() -> None:
        for _ in range(10):
            assert chat(gunicorn_server, max_tokens=2).status_code == 200
            sent.append(1)

    served = send_until_every_worker_served(gunicorn_server, send_round, most_rounds=30)
    assert len(served) == 2
    assert sum(served.values()) == len(sent)
    assert all(count > 0 for count in served.values()), served


def test_health_answers_fast_during_a_long_stream(gunicorn_server):
    first_chunk = threading.Event()
    finished = {}

    def long_stream():
        with requests.post(
            f"{gunicorn_server.url}/v1/chat/completions",
            json={"messages": COUNTING, "max_tokens": 800, "temperature": 0, "stream": True},
            stream=True,
            timeout=120,
        ) as response:
            for payload in sse_stream(response.iter_lines(decode_unicode=True)):
                first_chunk.set()
                if payload == "[DONE]":
                    finished["done_at"] = time.monotonic()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first_chunk.wait(30)
    latencies = []
    while thread.is_alive() and len(latencies) < 20:
        began = time.monotonic()
        assert requests.get(f"{gunicorn_server.url}/healthz", headers={"Connection": "close"}, timeout=5).ok
        latencies.append(time.monotonic() - began)
    thread.join()
    assert "done_at" in finished
    assert len(latencies) >= 5, "the stream ended before health was probed"
    assert max(latencies) < 1.0, latencies


def test_stream_longer_than_gunicorn_timeout_completes(gunicorn_server):
    """The workers run with a 3 s timeout; a stream kept open for longer still ends with [DONE]."""
    began = time.monotonic()
    with requests.post(
        f"{gunicorn_server.url}/v1/chat/completions",
        json={"messages": COUNTING, "max_tokens": 2000, "temperature": 0, "stream": True},
        stream=True,
        timeout=120,
    ) as response:
        payloads = []
        for payload in sse_stream(response.iter_lines(decode_unicode=True)):
            payloads.append(payload)
            if time.monotonic() - began < 4.5 and payload != "[DONE]":
                time.sleep(0.01)  # read slowly, so the stream outlives the timeout
    assert time.monotonic() - began > 3
    assert payloads[-1] == "[DONE]"


def test_workers_share_one_copy_of_the_weights(gunicorn_server, tiny_model_dir):
    """Summed over workers, the PSS of the mapped weight file stays near one copy of it."""
    weights = tiny_model_dir / "model.safetensors"
    total_pss = 0
    for pid in gunicorn_server.worker_pids():
        mapping_pss = 0
        in_weights = False
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                in_weights = fields[-1] == str(weights)
            elif in_weights and fields[0] == "Pss:":
                mapping_pss += int(fields[1]) * 1024
        assert mapping_pss > 0
        total_pss += mapping_pss
    assert total_pss <= 1.1 * weights.stat().st_size


def test_workers_report_threads_slot_and_timings(gunicorn_server):
    facts = ready_facts(gunicorn_server)
    assert sorted(body["slot"] for body in facts.values()) == [0, 1]
    for body in facts.values():
        assert body["torch_threads"] >= 1
        assert body["load_seconds"] > 0
        assert body["warmup_seconds"] > 0


def test_pinned_workers_each_report_the_whole_worker_count(gunicorn):
    """Pinned to its own cores, a worker counted the cores it could still see: `workers: 1` while two ran."""
    from harness import scrape
    from service.topology import physical_cores

    server = gunicorn(workers=physical_cores(), pin_workers=True)
    server.env["WORKERS"] = "0"  # the default, one worker per physical core
    with server:
        assert {facts["workers"] for facts in ready_facts(server).values()} == {server.workers}
        info = [dict(labels) for (name, labels) in scrape(server) if name == "corechat_model_info"]
        assert info and {labels["workers"] for labels in info} == {str(server.workers)}


@contextlib.contextmanager
def master_only(server):
    """Run a master until it has made its metrics folder and forked its worker, then stop it at once
    (SIGINT). The folder is the master's business: the worker need not load the model first, nor
    the master import the workers' libraries."""
    server.env["PRELOAD_LIBRARIES"] = "false"
    # A worker that the master's SIGQUIT reaches just after fork, before it has set its own signal
    # handlers, never sees it: the master then kills it after GRACEFUL_TIMEOUT, and exits all the same.
    server.env["GRACEFUL_TIMEOUT"] = "5"
    server.launch()
    try:
        assert wait_until(lambda: "Booting worker" in server.log(), 60), server.log()
        yield server
    finally:
        from service.process.lifecycle import WORKER_BOOT_ERROR

        # A worker still importing when the master's SIGQUIT reaches it fails its boot (its exit
        # interrupts the import), and the master then halts with Gunicorn's WORKER_BOOT_ERROR
        # instead of 0: either way through its exit hook, which owns the folder.
        assert server.stop(signal.SIGINT) in (0, WORKER_BOOT_ERROR), server.log()


@pytest.mark.parametrize("unset", [True, False], ids=["unset", "empty"])
def test_master_removes_its_default_metrics_folder(monkeypatch, unset, gunicorn):
    """Each start made a /tmp/corechat-metrics-<pid> folder that outlived it.
    Empty (the example environment file's commented default, uncommented) means the default too."""
    import tempfile
    if unset:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    else:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    with master_only(gunicorn(workers=1)) as server:
        default = Path(tempfile.gettempdir()) / f"corechat-metrics-{server.process.pid}"
        assert default.is_dir()
    assert not default.exists()


def test_master_keeps_a_chosen_metrics_folder(tmp_path, gunicorn):
    """A folder the operator chose outlives the master."""
    chosen = tmp_path / "metrics"
    with master_only(gunicorn(workers=1, prometheus_multiproc_dir=chosen)):
        assert chosen.is_dir()
    assert chosen.is_dir()


def test_prompts_of_ever_new_lengths_do_not_grow_a_bfloat16_worker(gunicorn):
    """oneDNN keeps a compiled primitive per prompt length (1,024 by default), each holding memory;
    gunicorn.conf.py caps them, so 70 new lengths leave a worker's memory as it was."""
    with gunicorn(workers=1, dtype="bfloat16", prefix_cache_mb=0) as server:
        worker = server.worker_pids()[0]

        def ask(words: int) -> None:
            body = {"messages": [{"role": "user", "content": "word " * words}], "max_tokens": 1}
            assert requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 200

        for words in range(1, 31):
            ask(words)  # the shapes in steady use, and the allocator's own growth
        before = anonymous_megabytes(worker)
        for words in range(31, 101):
            ask(words)
        assert anonymous_megabytes(worker) - before < 100


def test_a_server_whose_port_was_taken_moves_to_another_and_never_takes_the_impostor_for_itself(gunicorn):
    """Tests in parallel start servers at once: another may bind the port free_port chose before Gunicorn does.
    Its /readyz must not pass for this server's (once a keyed server answered a test's requests this way), and
    the server starts again on another free port."""
    impostor = http.server.HTTPServer(("127.0.0.1", 0), ReadyImpostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    server = gunicorn(workers=1)
    taken = impostor.server_address[1]
    server.port, server.env["BIND"] = taken, f"127.0.0.1:{taken}"
    try:
        with server:
            assert server.port != taken
            assert requests.get(f"{server.url}/readyz", timeout=10).json()["worker_pid"] in server.worker_pids()
    finally:
        impostor.shutdown()
        impostor.server_close()


class ReadyImpostor(http.server.BaseHTTPRequestHandler):
    """Another server on the port: it answers /readyz as a ready worker would."""

    def do_GET(self) -> None:
        body = json.dumps({"status": "ready", "worker_pid": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        """Stay quiet."""
