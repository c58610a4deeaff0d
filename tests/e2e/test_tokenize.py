"""`POST /tokenize` and `POST /detokenize` through real Gunicorn: llama.cpp's and vLLM's bodies, round trips,
the same key and body limits as the API, and a 4xx in OpenAI's shape for every id that is not one."""

import pytest
import requests

from tests.support import TEST_API_KEY, openai_client

KEY = {"Authorization": f"Bearer {TEST_API_KEY}"}
TEXTS = ["Hello world", "  spaces  and\ttabs\n\nnewlines ", "naïve café, 東京, 🙂👍🏽",
         "<|im_start|>user\nhi<|im_end|>", ""]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
# The tiny dev model has Qwen2.5's vocabulary: its tokenizer knows this many ids.
VOCAB_SIZE = 151665


@pytest.fixture(scope="module")
def server(gunicorn):
    """Run Gunicorn with one worker that needs TEST_API_KEY, takes bodies of at most 64 KiB and sequences of
    at most 4096 tokens."""
    with gunicorn(workers=1, api_keys=TEST_API_KEY, max_request_bytes=64 * 1024, max_model_len=4096) as server:
        yield server


def post(server, path: str, body, headers=KEY) -> requests.Response:
    """POST a JSON body to the server."""
    return requests.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def tokens_of(server, **body) -> dict:
    """Tokenize and return the reply's JSON, failing on any status but 200."""
    response = post(server, "/tokenize", body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_through_tokenize_and_detokenize_under_both_peers_names(server, text):
    llama = tokens_of(server, content=text)
    vllm = tokens_of(server, prompt=text)
    assert llama["tokens"] == vllm["tokens"] and llama["count"] == len(llama["tokens"])
    if not text:
        assert llama["tokens"] == []
        return
    back = post(server, "/detokenize", {"tokens": llama["tokens"]})
    assert back.status_code == 200
    assert back.json() == {"prompt": text, "content": text}


def test_control_tokens_typed_in_text_are_the_special_tokens(server):
    assert tokens_of(server, content="<|im_start|><|im_end|>")["tokens"] == [151644, 151645]


def test_messages_count_what_a_chat_request_with_them_is_charged(server):
    client = openai_client(server, api_key=TEST_API_KEY)
    completion = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    counted = tokens_of(server, model="tiny", messages=USER)
    assert counted["count"] == completion.usage.prompt_tokens
    without_opening = tokens_of(server, messages=USER, add_generation_prompt=False)["tokens"]
    assert counted["tokens"][: len(without_opening)] == without_opening and len(without_opening) < counted["count"]
    detokenized = post(server, "/detokenize", {"tokens": counted["tokens"]}).json()["prompt"]
    assert detokenized.endswith("<|im_start|>assistant\n")


def test_max_model_len_is_the_longest_sequence_a_chat_request_may_reach(server):
    limit = tokens_of(server, content="x")["max_model_len"]
    facts = requests.get(f"{server.url}/readyz", headers=KEY, timeout=10).json()
    assert limit == min(facts["context_length"], facts["kv_token_budget"])


def test_both_routes_need_the_key_like_the_api(server):
    for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})):
        response = post(server, path, body, headers={})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_body_over_max_request_bytes_is_a_413(server):
    response = post(server, "/tokenize", {"content": "x" * (64 * 1024)})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_a_body_that_is_not_json_is_a_415(server):
    response = requests.post(f"{server.url}/detokenize", data="[1, 2]", headers={**KEY, "Content-Type": "text/plain"},
                             timeout=10)
    assert response.status_code == 415


def test_an_unknown_model_is_a_404_model_not_found(server):
    for path, body in (("/tokenize", {"content": "hi"}), ("/detokenize", {"tokens": [1]})):
        response = post(server, path, {**body, "model": "gpt-4o"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "tokens, param",
    [
        ([], "tokens"),
        ([VOCAB_SIZE], "tokens[0]"),
        ([9707, VOCAB_SIZE + 1000], "tokens[1]"),
        ([2**64], "tokens[0]"),
        ([-1], "tokens[0]"),
        ([True], "tokens[0]"),
        ([1.0], "tokens[0]"),
        ([1.5], "tokens[0]"),
        (["1"], "tokens[0]"),
        ([None], "tokens[0]"),
        ([[1]], "tokens[0]"),
        ("1 2", "tokens"),
        (None, "tokens"),
        ([1] * 4097, "tokens"),
    ],
)
def test_every_id_that_is_not_one_of_the_models_is_a_400_naming_it(server, tokens, param):
    response = post(server, "/detokenize", {"tokens": tokens})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_the_largest_id_of_the_vocabulary_detokenizes(server):
    assert post(server, "/detokenize", {"tokens": [VOCAB_SIZE - 1]}).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, None),
        ({"content": "a", "prompt": "b"}, "prompt"),
        ({"prompt": "a", "messages": USER}, "messages"),
        ({"content": 5}, "content"),
        ({"prompt": ["a"]}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].tool_call_id"),
        ({"messages": USER, "add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"content": "a\ud800b"}, "content"),
    ],
)
def test_a_bad_tokenize_body_is_a_400_naming_the_field(server, body, param):
    response = post(server, "/tokenize", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
