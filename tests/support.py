"""Helpers of the tests alone; what the benchmarks drive corechat with too lives in harness/."""

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


# Qwen3's generation prompt, and the one of templates that open the thinking themselves (Qwen3-Thinking-2507's,
# DeepSeek-R1's): with it, a random-weight model's every reply is thinking, which no grammar field of the
# Responses API could make it write.
QWEN3_GENERATION_PROMPT = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}"""
OPENED_GENERATION_PROMPT = """    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}"""


def thinking_opened_by_the_prompt(folder: Path, into: Path) -> Path:
    """Copy a Qwen3 model folder with a template that ends its generation prompt with `<think>\\n` unless told not
    to think."""
    shutil.copytree(folder, into)
    config_path = into / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert QWEN3_GENERATION_PROMPT in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(QWEN3_GENERATION_PROMPT, OPENED_GENERATION_PROMPT)
    config_path.write_text(json.dumps(config))
    template_path = into / "chat_template.jinja"
    if template_path.exists():
        template_path.write_text(config["chat_template"])
    return into
