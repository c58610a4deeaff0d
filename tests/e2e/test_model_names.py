"""Model names through Gunicorn and the official client: the aliases listed, the reply echoing the name the
client sent, and any other name a 404 listing those accepted."""

import shutil

import openai
import pytest
import requests

from harness import GunicornServer
from tests.support import openai_client

HUB_ID = "corechat-test/tiny-chat"
ALIASES = "demo-qwen2.5-0.5b, team-default"
USER = [{"role": "user", "content": "Name a colour."}]


def hub_cache(tiny_model_dir, home) -> None:
    """Lay the tiny model out in a Hugging Face cache under `home` as a download of HUB_ID leaves it."""
    repo = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)


@pytest.fixture(scope="module")
def hub_server(tiny_model_dir, tmp_path_factory):
    """Run Gunicorn on the tiny model named by a hub id (from an offline Hugging Face cache), with two aliases."""
    home = tmp_path_factory.mktemp("hf-home")
    hub_cache(tiny_model_dir, home)
    with GunicornServer(home, workers=1, model=HUB_ID, model_name=ALIASES, hf_home=home, hf_hub_offline=1) as server:
        yield server


@pytest.fixture(scope="module")
def client(hub_server):
    """Return an openai client of the hub-id server that never retries."""
    return openai_client(hub_server)


def test_models_list_every_alias_then_the_hub_id(client):
    assert [model.id for model in client.models.list()] == ["demo-qwen2.5-0.5b", "team-default", HUB_ID]
    assert client.models.retrieve(HUB_ID).id == HUB_ID
    assert client.models.retrieve("team-default").id == "team-default"


@pytest.mark.parametrize("name", ["demo-qwen2.5-0.5b", "team-default", HUB_ID])
def test_a_reply_echoes_the_name_the_client_sent_whole_and_streamed(client, name):
    whole = client.chat.completions.create(model=name, messages=USER, max_tokens=3, temperature=0)
    assert whole.model == name
    chunks = list(client.chat.completions.create(model=name, messages=USER, max_tokens=3, temperature=0, stream=True))
    assert {chunk.model for chunk in chunks} == {name}
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_a_request_without_a_model_gets_the_first_alias(hub_server):
    reply = requests.post(f"{hub_server.url}/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "demo-qwen2.5-0.5b"


def test_a_cached_reply_carries_the_name_its_own_request_sent(hub_server):
    body = {"messages": [{"role": "user", "content": "Cache me by name."}], "max_tokens": 4, "temperature": 0}
    first = requests.post(f"{hub_server.url}/v1/chat/completions", json={**body, "model": HUB_ID}, timeout=60)
    again = requests.post(f"{hub_server.url}/v1/chat/completions", json={**body, "model": "team-default"}, timeout=60)
    assert first.headers["X-Cache"] == "miss" and again.headers["X-Cache"] == "hit"
    assert (first.json()["model"], again.json()["model"]) == (HUB_ID, "team-default")
    assert first.json()["choices"] == again.json()["choices"]


@pytest.mark.parametrize("name",
                         ["Qwen2.5-0.5B-Instruct", "tiny-chat", "corechat-test/tiny-chat/", "DEMO-QWEN2.5-0.5B"])
def test_any_other_name_is_a_404_model_not_found_listing_the_accepted_names(client, name):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model=name, messages=USER, max_tokens=2)
    error = raised.value
    assert error.status_code == 404
    assert (error.code, error.param, error.type) == ("model_not_found", "model", "invalid_request_error")
    assert all(f"'{accepted}'" in error.message for accepted in ("demo-qwen2.5-0.5b", "team-default", HUB_ID))
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)
