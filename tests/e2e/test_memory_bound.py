"""A worker's memory is bounded by KV_CACHE_MB, with the defaults a user gets, under more long prompts
than its KV budget holds: what does not fit waits, nothing is killed.

The model is the dev model's `kv-heavy` preset: a real Qwen2 with the real vocabulary and more KV
state per token (16 KiB) than Qwen2.5-0.5B, around almost no products, so that the default 1 GiB
budget fills in seconds. A team pastes one long document: it is stored once (the prefix store), and
then each of many requests starts from it, so every request's pages are written in full.
"""

import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from devtools.devmodel import build_dev_model
from harness import ready_facts
from service.engine.memory import PAGE_TOKENS
from service.settings import Settings

MIB = 1024 * 1024
# What a worker's anonymous memory may grow by beyond KV_CACHE_MB while it serves: a decode
# step's logits, a prompt chunk's activations, one layer's KV state in flight to or from the prefix
# store, glibc's slack. docs/reliability.md states it.
TRANSIENT_MB = 192
DOCUMENT_WORDS = 8000
# Short replies: the pages are the prompts'; decoding 8 rows at 8k tokens of context is slow here.
REPLY_TOKENS = 16
NO_CACHE = {"Cache-Control": "no-cache"}


def status(pid: int) -> dict[str, int]:
    """Return a process's memory counters from /proc/<pid>/status, in bytes."""
    counters = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            counters[name] = int(value.split()[0]) * 1024
    return counters


class MemoryWatch:
    """Poll the workers' anonymous and mapped (weights, prefix store) memory until stopped; keep each one's largest."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.largest_anonymous = {pid: 0 for pid in pids}
        self.largest_mapped = {pid: 0 for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid in self.pids:
                counters = status(pid)
                self.largest_anonymous[pid] = max(self.largest_anonymous[pid], counters["RssAnon"])
                self.largest_mapped[pid] = max(self.largest_mapped[pid], counters["RssFile"] + counters["RssShmem"])
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def kv_heavy_model_dir(tiny_model_dir) -> Path:
    """Return the kv-heavy dev model's folder, building it if needed."""
    return build_dev_model(tiny_model_dir.parent / "test-kv-heavy", preset="kv-heavy")


def ask(server, content: str, **body) -> requests.Response:
    """Send one chat request and return the whole response."""
    return requests.post(f"{server.url}/v1/chat/completions", headers=NO_CACHE, timeout=600,
                         json={"messages": [{"role": "user", "content": content}], **body})


@pytest.fixture()
def tmpfs_folder():
    """Return a fresh folder on /dev/shm, where the prefix store lives by default."""
    folder = tempfile.mkdtemp(prefix="corechat-test-prefixes-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_long_prompts_beyond_the_kv_budget_wait_and_a_workers_memory_stays_within_it(kv_heavy_model_dir,
                                                                                     tmpfs_folder, gunicorn):
    defaults = Settings()
    with gunicorn(workers=defaults.worker_count, model=str(kv_heavy_model_dir), model_name="kv-heavy",
                  prefix_cache_dir=tmpfs_folder) as server:
        pids = server.worker_pids()
        facts = ready_facts(server)
        page_bytes = PAGE_TOKENS * next(iter(facts.values()))["kv_bytes_per_token"]
        at_ready = {pid: status(pid) for pid in pids}
        lines = (f"line{index % 97} holds figure {index}." for index in range(DOCUMENT_WORDS // 4))
        document = "Report. " + " ".join(lines)
        first = ask(server, document + " Summarise.", max_tokens=4, temperature=0)
        assert first.status_code == 200, first.text
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        assert prompt_tokens > 7000
        pages_each = -(-(prompt_tokens + REPLY_TOKENS) // PAGE_TOKENS)
        fitting = defaults.kv_cache_mb * MIB // page_bytes // pages_each
        assert fitting < defaults.max_running, "the load would not exceed the KV budget"
        requests_count = defaults.max_running * len(pids)

        watch = MemoryWatch(pids)
        try:
            with ThreadPoolExecutor(requests_count + len(pids)) as pool:
                long = [pool.submit(ask, server, f"{document} Question {index}: which line comes first?",
                                    max_tokens=REPLY_TOKENS, temperature=0)
                        for index in range(requests_count)]
                short = [pool.submit(ask, server, f"Say hello {index}.", max_tokens=64, stream=False, temperature=0)
                         for index in range(len(pids))]
                most_waiting = 0
                while not all(future.done() for future in long + short):
                    facts = ready_facts(server, rounds=4)
                    most_waiting = max([most_waiting, *(fact.get("waiting", 0) for fact in facts.values())])
                    time.sleep(0.2)
                responses = [future.result() for future in long + short]
        finally:
            watch.stop()
        assert [response.status_code for response in responses] == [200] * len(responses), \
            [response.text for response in responses if response.status_code != 200][:3]
        assert all(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 7000
                   for response in responses[:requests_count])
        assert most_waiting > 0, "no request waited for pages: the load did not exceed the budget"
        assert server.worker_pids() == pids, "a worker was replaced (killed?)"
        budget = defaults.kv_cache_mb * MIB
        for pid in pids:
            grown = watch.largest_anonymous[pid] - at_ready[pid]["RssAnon"]
            assert grown <= budget + TRANSIENT_MB * MIB, (pid, grown / MIB)
            # The kernel's peak of all its memory: the same, and the host's mapped files (the weights, the
            # prefix store's sequences, which PREFIX_CACHE_MB bounds for the whole host) as they grew.
            peak = status(pid)["VmHWM"] - at_ready[pid]["VmRSS"]
            mapped = watch.largest_mapped[pid] - at_ready[pid]["RssFile"] - at_ready[pid]["RssShmem"]
            assert mapped <= defaults.prefix_cache_mb * MIB + TRANSIENT_MB * MIB, (pid, mapped / MIB)
            assert peak <= budget + mapped + TRANSIENT_MB * MIB, (pid, peak / MIB, mapped / MIB)
