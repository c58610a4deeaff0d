"""Grammars as request fields (vLLM's `structured_outputs`, llama.cpp's `grammar`) and the named tool_choice's
one call, through Flask's test client on the tiny random-weight model.

The model writes arbitrary tokens, so a reply that matches its constraint shows the constraint was enforced:
each test checks the text itself (a regex fullmatch, choice membership, a schema validation).
"""

import json
import re

import pytest
from jsonschema import Draft202012Validator

from harness import DONE, sse_payloads

USER = [{"role": "user", "content": "Answer in the required form."}]
SEEDS = (1, 2, 3)


def chat(client, **body):
    """POST a chat completion with the given fields."""
    return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 60, **body})


def complete(client, **body):
    """POST a legacy completion with the given fields."""
    return client.post("/v1/completions", json={"prompt": "The answer:", "max_tokens": 60, **body})


def whole_text(response) -> str:
    """Return the content of a whole chat reply that ended by itself."""
    assert response.status_code == 200, response.get_json()
    choice = response.get_json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


def streamed_text(response) -> str:
    """Return the content of a streamed chat reply that ended by itself."""
    assert response.status_code == 200, response.get_data(as_text=True)
    payloads = sse_payloads(response.get_data(as_text=True))
    assert payloads[-1] == DONE
    chunks = [payload for payload in payloads[:-1] if payload["choices"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)


def test_a_regex_holds_over_the_whole_reply_whole_and_streamed(client):
    pattern = r"(yes|no), [0-9]{2,4}!"
    for seed in SEEDS:
        constraint = {"structured_outputs": {"regex": pattern}, "seed": seed, "temperature": 1.0}
        whole = whole_text(chat(client, **constraint))
        assert re.fullmatch(pattern, whole), whole
        assert streamed_text(chat(client, stream=True, **constraint)) == whole


def test_every_choice_of_n_is_one_of_the_given_strings(client):
    choices = ["red", 'say "hi"', "back\\slash", "naïve café", "two\nlines", "🙂"]
    body = {"structured_outputs": {"choice": choices}, "n": 6, "seed": 7, "temperature": 1.0}
    reply = chat(client, **body).get_json()
    texts = [choice["message"]["content"] for choice in reply["choices"]]
    assert all(text in choices for text in texts), texts
    assert len(set(texts)) > 1, "a random model should not pick the same string six times"


def test_a_lark_grammar_holds_and_its_rules_and_terminals_shape_the_text(client):
    lark = 'start: pair "; " pair\npair: KEY "=" VALUE\nKEY: /[a-z]{1,4}/\nVALUE: /[0-9]{1,3}/\n'
    for seed in SEEDS:
        text = whole_text(chat(client, structured_outputs={"grammar": lark}, seed=seed, temperature=1.0))
        assert re.fullmatch(r"[a-z]{1,4}=[0-9]{1,3}; [a-z]{1,4}=[0-9]{1,3}", text), text


def test_a_recursive_lark_grammar_holds(client):
    """Balanced brackets are no regular language: the reply is k opening brackets, `x`, then k closing ones."""
    lark = 'start: expr\nexpr: "x" | "(" expr ")"\n'
    for seed in SEEDS:
        reply = chat(client, structured_outputs={"grammar": lark}, seed=seed, temperature=1.0,
                     max_tokens=120).get_json()["choices"][0]
        text = reply["message"]["content"]
        depth = len(text) - len(text.lstrip("("))
        if reply["finish_reason"] == "stop":
            assert text == "(" * depth + "x" + ")" * depth, text
        else:  # cut by max_tokens: still a prefix of a sentence of the grammar
            assert reply["finish_reason"] == "length" and set(text) == {"("}, reply


def test_llama_cpp_gbnf_grammar_field_holds_on_chat_and_completions(client):
    gbnf = 'root ::= "id-" digit digit letters\ndigit ::= [0-9]\nletters ::= [a-c]{1,3}\n'
    for seed in SEEDS:
        text = whole_text(chat(client, grammar=gbnf, seed=seed, temperature=1.0))
        assert re.fullmatch(r"id-[0-9]{2}[a-c]{1,3}", text), text
        completion = complete(client, grammar=gbnf, seed=seed, temperature=1.0).get_json()["choices"][0]
        assert completion["finish_reason"] == "stop"
        assert re.fullmatch(r"id-[0-9]{2}[a-c]{1,3}", completion["text"]), completion


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "count"], "additionalProperties": False}


@pytest.mark.parametrize("schema", [SCHEMA, json.dumps(SCHEMA)], ids=["object", "text"])
def test_a_json_schema_given_as_object_or_text_is_followed(client, schema):
    for seed in SEEDS:
        text = whole_text(chat(client, structured_outputs={"json": schema}, seed=seed, temperature=1.0))
        Draft202012Validator(SCHEMA).validate(json.loads(text))


def test_structured_outputs_hold_on_completions_of_token_ids(client):
    for seed in SEEDS:
        body = {"prompt": [9707, 1879], "max_tokens": 40, "seed": seed, "temperature": 1.0,
                "structured_outputs": {"regex": "[A-Z][0-9]{3}"}}
        choice = client.post("/v1/completions", json=body).get_json()["choices"][0]
        assert choice["finish_reason"] == "stop" and re.fullmatch("[A-Z][0-9]{3}", choice["text"]), choice


def test_without_a_constraint_the_random_model_leaves_the_form(client):
    """The control: the checks above would not pass by chance on this model."""
    text = chat(client, seed=1, temperature=1.0, max_tokens=20).get_json()["choices"][0]["message"]["content"]
    assert not re.fullmatch(r"(yes|no), [0-9]{2,4}!", text)


STRICT_TOOL = {"type": "function", "function": {"name": "f", "strict": True,
                                                "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("body, param, words", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs.regex", "look-around"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "unknown name"),
    ({"structured_outputs": {"grammar": "start: \"a"}}, "structured_outputs.grammar", "Lark grammar"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "Empty grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not a JSON schema"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "JSON object"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json", "nonsense"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json", "dictionary"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice[1]", "string"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "choice and regex"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": None}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "backend": "x", "whitespace_pattern": " "}}, "structured_outputs",
     "'backend', 'whitespace_pattern' are not supported"),
    ({"structured_outputs": "[a-z]+"}, "structured_outputs", "valid dictionary"),
    ({"grammar": "root = \"a\""}, "grammar", "Expected ::="),
    ({"grammar": "start ::= \"a\""}, "grammar", "No 'root' rule"),
    ({"grammar": "root ::= item"}, "grammar", "'item' not found"),
    ({"grammar": ["root ::= \"a\""]}, "grammar", "string"),
    ({"grammar": "root ::= \"a\"", "structured_outputs": {"regex": "a"}}, "grammar", "'structured_outputs'"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "response_format"),
    ({"structured_outputs": {"choice": ["a"]},
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "structured_outputs", "response_format"),
    ({"grammar": "root ::= \"a\"", "tools": [STRICT_TOOL]}, "grammar", "strict tools"),
    ({"structured_outputs": {"regex": "a"}, "tools": [STRICT_TOOL], "tool_choice": NAMED}, "structured_outputs",
     "forces a tool call"),
    ({"structured_outputs": {"regex": "a"}, "tools": [STRICT_TOOL], "tool_choice": "required"},
     "structured_outputs", "forces a tool call"),
])
def test_bad_grammar_fields_get_400_naming_the_field(client, body, param, words):
    response = chat(client, **body)
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}}, "structured_outputs"),
    ({"grammar": "root ::= nothing"}, "grammar"),
    ({"structured_outputs": {"oops": 1}}, "structured_outputs"),
])
def test_bad_grammar_fields_get_400_on_completions_too(client, body, param):
    response = complete(client, **body)
    assert response.status_code == 400 and response.get_json()["error"]["param"] == param


def test_text_format_and_non_strict_auto_tools_leave_room_for_a_grammar(client):
    tool = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    for extra in ({"response_format": {"type": "text"}}, {"tools": [tool]}):
        text = whole_text(chat(client, structured_outputs={"regex": "[0-9]{3}"}, seed=1, temperature=1.0, **extra))
        assert re.fullmatch("[0-9]{3}", text), text


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_makes_one_call_and_finishes_with_stop_as_openai(client):
    for seed in SEEDS:
        reply = chat(client, tools=[WEATHER, OTHER], tool_choice=FORCE_WEATHER, seed=seed, temperature=1.0,
                     max_tokens=50).get_json()
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]
        # The reply ended after its one call, with room left for more.
        assert reply["usage"]["completion_tokens"] < 50


def test_a_streamed_named_tool_choice_sends_one_call_then_stop(client):
    response = chat(client, tools=[WEATHER, OTHER], tool_choice=FORCE_WEATHER, seed=2, temperature=1.0,
                    max_tokens=50, stream=True)
    payloads = sse_payloads(response.get_data(as_text=True))
    assert payloads[-1] == DONE
    deltas = [delta for payload in payloads[:-1] for delta in payload["choices"][0]["delta"].get("tool_calls", [])]
    assert {delta["index"] for delta in deltas} == {0}
    assert [delta["function"]["name"] for delta in deltas if "id" in delta] == ["get_weather"]
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_required_still_finishes_with_tool_calls(client):
    reply = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, seed=1,
                 temperature=1.0, max_tokens=50).get_json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1, choice
