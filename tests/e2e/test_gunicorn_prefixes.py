"""A conversation's next turn, answered by the other Gunicorn worker, starts from the KV state the
first worker stored, and replies byte for byte as the same request computed cold (real Gunicorn,
two workers, the defaults)."""

import shutil

import requests

from harness import finished_by_worker

REPLY_TOKENS = 24
MOST_TRIES = 30


def ask(server, messages: list[dict]) -> dict:
    """Send a greedy chat request on a fresh connection, past the response cache; return the reply."""
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0},
        headers={"Connection": "close", "Cache-Control": "no-cache"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def answered_by(server, messages: list[dict]) -> tuple[dict, int]:
    """Send a request and return its reply and the pid of the worker that generated it."""
    before = finished_by_worker(server)
    body = ask(server, messages)
    after = finished_by_worker(server)
    (pid,) = [pid for pid, count in after.items() if count > before.get(pid, 0)]
    return body, pid


def test_the_next_turn_on_the_other_worker_reuses_the_first_workers_kv_and_equals_the_cold_reply(gunicorn):
    """Turn 1 goes to one worker; follow-ups are sent until the other worker answers one: that one
    reuses at least turn 1's prompt, stored by the first worker, and equals its cold reply."""
    with gunicorn() as server:
        conversation = [{"role": "user", "content": "Describe the harbour at dawn, please."}]
        first, first_pid = answered_by(server, conversation)
        prompt_tokens = first["usage"]["prompt_tokens"]
        conversation.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
        for attempt in range(MOST_TRIES):
            turn = [*conversation, {"role": "user", "content": f"And the boats, {attempt}?"}]
            shared, pid = answered_by(server, turn)
            if pid != first_pid:
                break
        else:
            raise AssertionError(f"the other worker answered none of {MOST_TRIES} follow-ups")
        assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 1

        shutil.rmtree(server.env["PREFIX_CACHE_DIR"])
        cold = ask(server, turn)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold["choices"][0]["message"] == shared["choices"][0]["message"]
        assert cold["usage"]["completion_tokens"] == shared["usage"]["completion_tokens"] == REPLY_TOKENS
