"""A message's `name` through Gunicorn, with a template that renders it: prompted and cached apart."""

import json
import shutil

import pytest
import requests

from tests.support import openai_client
from tests.unit.test_message_names import said_by

# Qwen2.5's user turn, with the speaker's name after the role when the message has one.
STOCK_USER_TURN = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
NAMED_USER_TURN = ("{{- '<|im_start|>' + message.role + (' name=' + message.name if message.name else '') + '\\n' "
                   "+ message.content + '<|im_end|>' + '\\n' }}")


@pytest.fixture(scope="module")
def named_model_dir(tiny_model_dir, tmp_path_factory):
    """Return a copy of the tiny model whose chat template writes each user message's name."""
    folder = tmp_path_factory.mktemp("named") / "named-tiny"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("corechat-int*"))
    template = (folder / "chat_template.jinja").read_text()
    assert STOCK_USER_TURN in template
    (folder / "chat_template.jinja").write_text(template.replace(STOCK_USER_TURN, NAMED_USER_TURN))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(named_model_dir, gunicorn):
    """Run Gunicorn with one worker on the model whose template renders names."""
    with gunicorn(workers=1, model=named_model_dir) as server:
        yield server


def test_the_rendered_prompt_carries_the_name(server):
    tokens = requests.post(f"{server.url}/tokenize", json={"messages": said_by("alice")}, timeout=10).json()["tokens"]
    text = requests.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=10).json()["prompt"]
    assert "<|im_start|>user name=alice\nWhich colour is the sea?<|im_end|>" in text


def test_each_name_is_prompted_and_cached_apart(server):
    client = openai_client(server)

    def x_cache(name: str | None) -> tuple[str, int]:
        response = client.chat.completions.with_raw_response.create(
            model="named-tiny", messages=said_by(name, "Cache me by speaker."), max_tokens=3, temperature=0)
        return response.headers["X-Cache"], response.parse().usage.prompt_tokens

    alice, alice_again, bob, nobody = x_cache("alice"), x_cache("alice"), x_cache("bob"), x_cache(None)
    assert [alice[0], alice_again[0], bob[0], nobody[0]] == ["miss", "hit", "miss", "miss"]
    assert alice[1] == bob[1] > nobody[1]
