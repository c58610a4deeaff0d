"""The legacy `functions` and `function_call` through real Gunicorn and the official client: mapped onto the
tools path (the same prompt, grammar and cache entry) and answered in the legacy shape, whole and streamed.

Random weights never choose to call a function, so the calls are forced with a named function_call."""

import json

import pytest
import requests
from jsonschema import Draft202012Validator

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FUNCTIONS = [{"name": "get_weather", "description": "Weather of a city.", "parameters": PARAMETERS},
             {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]
TOOLS = [{"type": "function", "function": function} for function in FUNCTIONS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"name": "get_weather"}


def assert_follows_the_schema(arguments: str) -> None:
    """Fail unless a call's arguments are a JSON object that get_weather's schema accepts."""
    Draft202012Validator(PARAMETERS).validate(json.loads(arguments))


def test_a_forced_function_call_comes_back_whole_as_message_function_call(solo_client):
    reply = solo_client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS, function_call=FORCED,
                                                max_tokens=80, seed=4)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call", choice
    assert choice.message.content is None and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    assert_follows_the_schema(choice.message.function_call.arguments)


def test_a_streamed_function_call_comes_as_name_then_arguments_pieces(solo_client):
    whole = solo_client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS, function_call=FORCED,
                                                max_tokens=80, seed=5)
    chunks = list(solo_client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS,
                                                      function_call=FORCED, max_tokens=80, seed=5, stream=True))
    pieces = [chunk.choices[0].delta.function_call for chunk in chunks
              if chunk.choices and chunk.choices[0].delta.function_call]
    assert pieces[0].name == "get_weather" and all(piece.name is None for piece in pieces[1:])
    assert all(chunk.choices[0].delta.tool_calls is None for chunk in chunks)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "function_call"
    arguments = "".join(piece.arguments or "" for piece in pieces)
    assert arguments == whole.choices[0].message.function_call.arguments
    assert_follows_the_schema(arguments)


def test_a_legacy_conversation_prompts_as_its_tools_form_does(solo_client):
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}
    called = {"role": "assistant", "content": None, "function_call": call}
    legacy = solo_client.chat.completions.create(
        model="tiny", messages=[*ASK, called, {"role": "function", "name": "get_weather", "content": "sunny"}],
        functions=FUNCTIONS, max_tokens=2, seed=1)
    tools = solo_client.chat.completions.create(
        model="tiny", tools=TOOLS, max_tokens=2, seed=1, messages=[
            *ASK, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "call_1", "type": "function", "function": call}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert legacy.usage.prompt_tokens == tools.usage.prompt_tokens
    assert legacy.choices[0].message.content == tools.choices[0].message.content


@pytest.mark.parametrize("function_call, tool_choice", [("auto", "auto"), (None, "auto"), ("none", "none")])
def test_function_call_auto_and_none_show_the_functions_as_tool_choice_does(solo_client, function_call, tool_choice):
    legacy = {"functions": FUNCTIONS, **({"function_call": function_call} if function_call else {})}
    as_legacy = solo_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, seed=1, **legacy)
    as_tools = solo_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, seed=1, tools=TOOLS,
                                                   tool_choice=tool_choice)
    assert as_legacy.usage.prompt_tokens == as_tools.usage.prompt_tokens
    assert as_legacy.choices[0].message.content == as_tools.choices[0].message.content


def test_the_legacy_and_the_tools_form_share_a_cache_entry_each_answered_in_its_shape(solo_server):
    body = {"messages": [{"role": "user", "content": "Weather, cached?"}], "max_tokens": 80, "temperature": 0}
    legacy = requests.post(f"{solo_server.url}/v1/chat/completions", timeout=60,
                           json={**body, "functions": FUNCTIONS, "function_call": FORCED})
    tools = requests.post(f"{solo_server.url}/v1/chat/completions", timeout=60, json={
        **body, "tools": TOOLS, "tool_choice": {"type": "function", "function": FORCED}, "parallel_tool_calls": False})
    assert (legacy.headers["X-Cache"], tools.headers["X-Cache"]) == ("miss", "hit")
    legacy_message, tools_message = legacy.json()["choices"][0]["message"], tools.json()["choices"][0]["message"]
    assert set(legacy_message) == {"role", "content", "function_call"}
    called = tools_message["tool_calls"][0]["function"]
    assert legacy_message["function_call"] == {key: called[key] for key in ("name", "arguments")}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
        ({"functions": FUNCTIONS, "tool_choice": "auto"}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"functions": FUNCTIONS, "function_call": {"name": "get_news"}}, "function_call"),
        ({"functions": FUNCTIONS, "function_call": "required"}, "function_call"),
        ({"functions": [*FUNCTIONS, FUNCTIONS[0]]}, "functions"),
        ({"functions": []}, "functions"),
        ({"functions": [{"name": "no spaces"}]}, "functions[0].name"),
        ({"messages": [*ASK, {"role": "function", "content": "sunny"}]}, "messages[1].name"),
        ({"messages": [{"role": "user", "content": "hi", "function_call": {"name": "f", "arguments": "{}"}}]},
         "messages[0].function_call"),
        ({"messages": [*ASK, {"role": "assistant", "function_call": {"name": "f", "arguments": "{oops"}}]},
         "messages[1].function_call.arguments"),
    ],
)
def test_a_bad_legacy_field_is_a_400_naming_it(solo_server, body, param):
    response = requests.post(f"{solo_server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body},
                             timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
