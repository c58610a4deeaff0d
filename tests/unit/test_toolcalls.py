"""The tool-call parser on scripted model text.

A random-weight model never chooses to write a `<tool_call>` block under tool_choice `auto`, so
these tests feed the parser text written here, as Qwen2.5 writes it, cut into pieces at every
possible place, the way tokens arrive. The end-to-end tests force real calls with tool_choice.
"""

import json

import pytest

from service.api.toolcalls import ToolCallParser, merge_deltas

WEATHER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"note": "}</tool_call"}]}}'
           '\n</tool_call>')


def parse_in_pieces(text: str, cuts: list[int]) -> tuple[str, list[dict], list[dict]]:
    """Feed text cut at the given offsets; return the content, the deltas and the merged calls."""
    parser = ToolCallParser()
    content, deltas = "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        piece_content, piece_deltas = parser.feed(text[start:end])
        content += piece_content
        deltas += piece_deltas
    rest, last = parser.finish()
    return content + rest, deltas + last, merge_deltas(deltas + last)


def every_two_cuts(text: str):
    """Yield cut lists that split text at every offset, and at every pair of offsets a few apart."""
    for cut in range(1, len(text)):
        yield [cut]
    for cut in range(1, len(text) - 3, 3):
        yield [cut, cut + 1, cut + 3]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello there, no tools needed.", "Hello there, no tools needed.", []),
        (WEATHER, "", [("get_weather", '{"city": "Paris", "days": [1, {"note": "}</tool_call"}]}')]),
        ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
         '<tool_call>\n{"name": "b", "arguments": {"q": "<b>\\"x\\""}}\n</tool_call>',
         "Let me check.", [("a", "{}"), ("b", '{"q": "<b>\\"x\\""}')]),
        # Arguments before the name cannot stream; the call still comes out whole.
        ('<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call>', "", [("late", '{"x": 1}')]),
        ("<tool_call>\nnot json\n</tool_call> said the model", "<tool_call>\nnot json\n</tool_call> said the model",
         []),
        ("a < b and <tool", "a < b and <tool", []),
    ],
)
def test_blocks_become_tool_calls_and_the_rest_content_wherever_the_text_is_cut(text, content, calls):
    for cuts in every_two_cuts(text):
        got_content, deltas, merged = parse_in_pieces(text, cuts)
        assert got_content == content, cuts
        assert [(call["function"]["name"], call["function"]["arguments"]) for call in merged] == calls, cuts
        assert "<tool_call>" not in got_content or not calls
        for call in merged:
            assert call["id"].startswith("call_") and call["type"] == "function"
            json.loads(call["function"]["arguments"])


def test_a_streamed_call_sends_index_id_and_name_first_then_argument_pieces():
    tokens = ["<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":',
              " {", '"city', '":', ' "', "Paris", '"}}', "\n", "</tool_call>"]
    _, deltas, _ = parse_in_pieces("".join(tokens), [sum(map(len, tokens[:n])) for n in range(1, len(tokens))])
    first, *rest = deltas
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) > 2, "the arguments should arrive in pieces"
    assert all(set(delta) == {"index", "function"} and delta["index"] == 0 for delta in rest)
    assert "".join(delta["function"]["arguments"] for delta in rest) == '{"city": "Paris"}'


def test_a_call_cut_by_max_tokens_keeps_its_partial_arguments():
    content, _, merged = parse_in_pieces('<tool_call>\n{"name": "a", "arguments": {"x": 12', [20])
    assert content == "" and merged[0]["function"] == {"name": "a", "arguments": '{"x": 12'}


def test_each_call_gets_its_own_id():
    text = "\n".join(['<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'] * 2)
    _, _, merged = parse_in_pieces(text, [])
    assert len({call["id"] for call in merged}) == 2
