"""Streaming detokenization and stop strings, on the real Qwen2 tokenizer."""

import pytest

from service.engine.text import StopStringFilter, TextAssembler


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """Load the dev model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def feed_all(assembler, ids):
    """Feed token ids one by one and return the pieces the assembler shows."""
    pieces = [assembler.add(token_id) for token_id in ids]
    pieces.append(assembler.finish())
    return pieces


@pytest.mark.parametrize("text", ["你好，世界！今天天气很好。", "emoji 🎉🧑‍💻👍🏽 done", "naïve café ñ"])
def test_streamed_pieces_are_whole_characters_and_rebuild_the_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = feed_all(TextAssembler(tokenizer), ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_character_split_across_tokens_arrives_whole(tokenizer):
    text = "𪚥🧑‍💻"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # byte-level BPE splits these characters' bytes over tokens
    pieces = feed_all(TextAssembler(tokenizer), ids)
    assert "".join(pieces) == text
    assert "" in pieces[:-1]
    assert all(piece == "" or piece[0] in text for piece in pieces)


def test_special_tokens_are_not_shown(tokenizer):
    ids = tokenizer("hi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert "".join(feed_all(TextAssembler(tokenizer), ids)) == "hi"


def test_stop_string_spanning_tokens_is_never_shown(tokenizer):
    text = "The answer is END_OF_ANSWER and more"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assembler = TextAssembler(tokenizer, stop=("END_OF_ANSWER",))
    shown = ""
    for token_id in ids:
        shown += assembler.add(token_id)
        assert "END" not in shown
        if assembler.stopped:
            break
    shown += assembler.finish()
    assert assembler.stopped
    assert shown == "The answer is "


def test_stop_filter_holds_back_only_a_possible_stop_prefix():
    stop_filter = StopStringFilter(("###",))
    assert stop_filter.feed("abc#") == "abc"
    assert stop_filter.feed("#x") == "##x"
    assert stop_filter.feed("##") == ""
    assert stop_filter.feed("#tail") == ""
    assert stop_filter.stopped


def test_stop_filter_flushes_held_text_when_generation_ends_without_stop():
    stop_filter = StopStringFilter(("</end>",))
    assert stop_filter.feed("value </e") == "value "
    assert stop_filter.flush() == "</e"
    assert not stop_filter.stopped


def test_earliest_of_several_stop_strings_wins():
    stop_filter = StopStringFilter(("zz", "b"))
    assert stop_filter.feed("a b zz") == "a "
