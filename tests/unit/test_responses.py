"""The response models (service/api/responses.py) refuse a chunk they do not describe, which is what gives
the byte-for-byte checks of app/ and e2e/ their meaning."""

import pytest

from service.api.responses import ChatCompletionChunk


def test_a_chunk_the_model_does_not_describe_is_refused():
    """The byte-for-byte checks above mean something only if the model refuses what it does not describe."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "system_fingerprint": None,
             "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]}
    ChatCompletionChunk.model_validate(chunk)
    for bad in ({**chunk, "extra": 1}, {**chunk, "choices": [{**chunk["choices"][0], "delta": {"content": None}}]},
                {**chunk, "choices": [{**chunk["choices"][0], "finish_reason": "cancelled"}]},
                {**chunk, "created": "1"}, {key: value for key, value in chunk.items() if key != "system_fingerprint"}):
        with pytest.raises(ValueError):
            ChatCompletionChunk.model_validate(bad)
