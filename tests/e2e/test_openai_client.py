"""The official `openai` Python client against real Gunicorn: typed replies, streams and errors."""

import openai
import pytest

from tests.support import TEST_API_KEY, openai_client

USER = [{"role": "user", "content": "Write a short poem about caches."}]


@pytest.fixture(scope="module")
def client(keyed_server):
    """Return an openai client with the right key."""
    return openai_client(keyed_server, api_key=TEST_API_KEY)


def streamed(client, **params) -> tuple[str, list]:
    """Stream a completion and return its text and every chunk."""
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, stream=True, **params))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    return text, chunks


def test_models_list_names_the_alias_then_the_folder_name(client, tiny_model_dir):
    assert [model.id for model in client.models.list()] == ["tiny", tiny_model_dir.name]


def test_non_streaming_create_returns_a_typed_completion(client):
    completion = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, seed=3)
    assert completion.object == "chat.completion"
    assert completion.model == "tiny"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    # Seeded on the fixed random-weight model: it runs to max_tokens.
    assert choice.finish_reason == "length"
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.usage.completion_tokens == 8


def test_stream_with_usage_matches_the_whole_reply(client):
    text, chunks = streamed(client, max_tokens=8, seed=21, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 8
    assert all(chunk.usage is None for chunk in chunks[:-1])
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, seed=21)
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stream_without_usage_option_has_no_usage(client):
    text, chunks = streamed(client, max_tokens=3, seed=5)
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_same_seed_gives_the_same_reply(client):
    params = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 1.0, "seed": 1234}
    first = client.chat.completions.create(**params).choices[0].message.content
    second = client.chat.completions.create(**params).choices[0].message.content
    assert first == second


def test_stop_string_ends_the_reply_before_it(client):
    params = {"model": "tiny", "messages": USER, "max_tokens": 24, "temperature": 1.0, "seed": 99}
    full = client.chat.completions.create(**params).choices[0].message.content
    assert len(full) > 12
    stop = full[8:11]
    cut = client.chat.completions.create(**params, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    text, _ = streamed(client, **{key: value for key, value in params.items() if key not in ("model", "messages")},
                       stop=stop)
    assert text == full[: full.index(stop)]


def test_bad_request_raises_bad_request_error_with_our_message(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=USER, temperature=5)
    error = raised.value
    assert error.status_code == 400
    assert error.param == "temperature"
    assert error.type == "invalid_request_error"
    assert "invalid 'temperature'" in error.message


def test_too_many_tokens_raises_bad_request_error_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=999999, stream=True)
    assert "above this server's limit of 32000" in raised.value.message
    assert raised.value.param == "max_tokens"


def test_wrong_key_raises_authentication_error(keyed_server):
    wrong = openai_client(keyed_server, api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as raised:
        wrong.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    error = raised.value
    assert error.status_code == 401
    assert error.code == "invalid_api_key"
    assert "incorrect API key provided" in error.message


def test_full_server_raises_503_with_retry_after(client):
    held = []
    try:
        for _ in range(2):  # one running, one waiting: the worker takes no more
            stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30000, stream=True)
            next(iter(stream))
            held.append(stream)
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    finally:
        for stream in held:
            stream.close()
    error = raised.value
    assert error.status_code == 503
    assert error.code == "overloaded"
    assert error.response.headers["Retry-After"] == "1"
    assert "places of this worker are taken" in error.message
