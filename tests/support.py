"""Helpers of the tests alone; what the benchmarks drive corechat with too lives in harness/."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

# The key the `keyed_server` fixture asks for.
TEST_API_KEY = "sk-corechat-test-key"


def bearer(key: str) -> dict:
    """Return the Authorization header carrying a key."""
    return {"Authorization": f"Bearer {key}"}


def openai_client(server, api_key: str = "unused", timeout: float = 120):
    """Return the official client of a server, never retrying (a retry would hide the answer under test)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def wait_until(predicate, timeout: float) -> bool:
    """Poll predicate until it holds or timeout seconds pass; return whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@contextmanager
def started_engine(settings, timeout: float = 300) -> Iterator:
    """Start an engine in this process, fail unless it is ready within timeout seconds, and stop it on exit."""
    from service.engine import Engine

    engine = Engine(settings)
    engine.start()
    try:
        assert engine.wait_ready(timeout), engine.facts
        yield engine
    finally:
        engine.stop()


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set, restoring it after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
