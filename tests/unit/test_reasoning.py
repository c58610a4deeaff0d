"""The reasoning parser: a thinking model's reply split into reasoning and content, the same whole as in
pieces cut anywhere (a stream's deltas join into the whole reply's fields)."""

import pytest

from service.api.reasoning import ReasoningParser
from service.engine import ReasoningMarkers

QWEN3 = ReasoningMarkers("<think>", "</think>")
OPENED = ReasoningMarkers("<think>", "</think>", opened_by_prompt=True)

# (markers, reply, reasoning, content)
CASES = [
    (QWEN3, "<think>\nFirst, add.\n\nThen check.\n</think>\n\nIt is 4.", "First, add.\n\nThen check.", "It is 4."),
    (QWEN3, "It is 4.", "", "It is 4."),
    (QWEN3, "\n<think>\nplan\n</think>\n\nanswer\n", "plan", "answer\n"),
    (QWEN3, "<think>\n\n</think>\n\nHi", "", "Hi"),
    (QWEN3, "<think>\ncut off in the mid", "cut off in the mid", ""),
    (QWEN3, "<think>\nends on a marker's start </thi", "ends on a marker's start </thi", ""),
    (QWEN3, "<thin", "", "<thin"),
    (QWEN3, "  \n", "", "  \n"),
    (QWEN3, "a <think> later is content", "", "a <think> later is content"),
    (QWEN3, "<think>a</think>b</think>c", "a", "b</think>c"),
    (QWEN3, "<think>\n<tool_call> inside thinking\n</think>\n\n<tool_call>", "<tool_call> inside thinking",
     "<tool_call>"),
    (OPENED, "\nplan\n</think>\n\nanswer", "plan", "answer"),
    (OPENED, "no closing marker", "no closing marker", ""),
]


def run(markers: ReasoningMarkers, pieces: list[str]) -> tuple[str, str]:
    """Feed the pieces then finish; return the joined reasoning and content."""
    parser = ReasoningParser(markers)
    reasoning, content = [], []
    for piece in pieces:
        thought, text = parser.feed(piece)
        reasoning.append(thought)
        content.append(text)
    thought, text = parser.finish()
    return "".join(reasoning) + thought, "".join(content) + text


@pytest.mark.parametrize("markers, reply, reasoning, content", CASES, ids=range(len(CASES)))
def test_a_reply_splits_into_its_reasoning_and_content_whole_and_in_pieces_cut_anywhere(markers, reply, reasoning,
                                                                                        content):
    assert run(markers, [reply]) == (reasoning, content)
    assert run(markers, list(reply)) == (reasoning, content)
    for cut in range(len(reply) + 1):
        assert run(markers, [reply[:cut], reply[cut:]]) == (reasoning, content), cut


def test_settled_reasoning_goes_out_before_the_reply_ends():
    """A stream shows the thinking as it comes, holding back only what may be a marker or its newlines."""
    parser = ReasoningParser(QWEN3)
    assert parser.feed("<think>\nstep one") == ("step one", "")
    assert parser.feed("\n</th") == ("", "")
    assert parser.feed("ink>\n\nThe answer") == ("", "The answer")
    assert parser.finish() == ("", "")
