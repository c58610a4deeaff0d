"""A message's `name` and a template that does not render it (Qwen2.5's): the same prompt."""

from tests.unit.test_message_names import said_by


def test_a_template_that_ignores_names_sees_the_same_prompt(client):
    counted = [client.post("/tokenize", json={"messages": said_by(name)}).get_json()["tokens"]
               for name in (None, "alice")]
    assert counted[0] == counted[1]
