"""A conversation's next turn reuses the KV state of its earlier prompt and reply from any worker of
the host, and replies exactly as the same request computed cold (two engines on one prefix folder
stand for two workers; tests/e2e/test_gunicorn_prefixes.py does it with real Gunicorn workers)."""

import pytest
import torch

from service.engine import Engine, Failed, Finished, SamplingParams, TextDelta, scheduler, speculation
from tests.support import started_engine

QUESTION = "Tell me about the sea and the ships on it, at length."
FOLLOW_UP = "And what about the harbours they come home to?"
REPLY_TOKENS = 24


@pytest.fixture(scope="module", params=["int8", "int4"])
def engines(request, make_settings, tmp_path_factory):
    """Two engines sharing one prefix folder (two workers of a host), and one without prefix reuse."""
    folder = tmp_path_factory.mktemp("prefixes")
    shared = make_settings(max_model_len=4096, dtype=request.param, prefix_cache_dir=str(folder))
    with (started_engine(shared) as first, started_engine(shared) as second,
          started_engine(make_settings(max_model_len=4096, dtype=request.param, prefix_cache_mb=0)) as cold):
        yield [first, second], cold


def reply(engine: Engine, prompt_ids: list[int], params: SamplingParams,
          monkeypatch) -> tuple[str, list[int], Finished, list]:
    """Generate a reply; return its text, token ids, final event and every logit row it was sampled from."""
    rows = []
    original = scheduler.sample_tokens

    def recording(samplers, logits):
        rows.extend(row.clone() for row in logits)
        return original(samplers, logits)

    with monkeypatch.context() as patch:
        patch.setattr(scheduler, "sample_tokens", recording)
        patch.setattr(speculation, "sample_tokens", recording)
        text, ids, finished = "", [], None
        for event in engine.submit(prompt_ids, params).events():
            assert not isinstance(event, Failed), event
            if isinstance(event, TextDelta):
                text += event.text
                ids += event.token_ids
            elif isinstance(event, Finished):
                finished = event
    return text, ids, finished, rows


def same_reply(shared, computed) -> bool:
    """Tell whether two replies have the same text and were sampled from the same logits, bit for bit."""
    return (shared[0] == computed[0] and len(shared[3]) == len(computed[3])
            and all(torch.equal(a, b) for a, b in zip(shared[3], computed[3])))


@pytest.mark.parametrize("seed", [None, 77], ids=["greedy", "seeded"])
def test_a_turn_on_the_other_worker_reuses_the_prompt_and_reply_and_equals_the_cold_reply(engines, seed, monkeypatch):
    """Turn 2 on the second engine finds turn 1's prompt and reply, stored by the first, and its
    reply and every logit equal the same request on an engine that computes everything.

    Turn 2 continues turn 1's own ids, as a frontend's resent conversation does whenever the reply's
    text tokenises back into the ids it was generated as (a real model's replies nearly always do;
    this random-weight model's often do not, which the next test covers).
    """
    (first, second), cold = engines
    params = SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0 if seed is None else 1.0, seed=seed)
    turn_one = first.template.encode_chat([{"role": "user", "content": f"{QUESTION} ({seed})"}])
    _, answer_ids, finished, _ = reply(first, turn_one, params, monkeypatch)
    assert finished.completion_tokens == len(answer_ids) == REPLY_TOKENS
    next_turn = f"<|im_end|>\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
    turn_two = turn_one + answer_ids + first.tokenizer.encode(next_turn, add_special_tokens=False)

    shared = reply(second, turn_two, params, monkeypatch)
    computed = reply(cold, turn_two, params, monkeypatch)
    assert same_reply(shared, computed)
    assert computed[2].cached_prompt_tokens == 0
    # Everything but the reply's last token, which was sampled and never fed to the model.
    assert shared[2].cached_prompt_tokens == len(turn_one) + REPLY_TOKENS - 1


def test_a_resent_conversation_whose_reply_tokenises_otherwise_still_equals_the_cold_reply(engines, monkeypatch):
    """Rendered from text, the reply may tokenise into other ids than it was generated as: the match
    stops where they part, and the reply is still exactly the cold one."""
    (first, second), cold = engines
    params = SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0)
    conversation = [{"role": "user", "content": QUESTION}]
    turn_one = first.template.encode_chat(conversation)
    answer, _, _, _ = reply(first, turn_one, params, monkeypatch)
    conversation += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    turn_two = first.template.encode_chat(conversation)
    shared = reply(second, turn_two, params, monkeypatch)
    assert same_reply(shared, reply(cold, turn_two, params, monkeypatch))
    assert shared[2].cached_prompt_tokens >= len(turn_one) - 1
