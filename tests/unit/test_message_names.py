"""A message's `name` reaches the chat template only when given, as transformers and vLLM pass it."""

from service.api.chat_parts import ChatMessage


def said_by(name: str | None, content: str = "Which colour is the sea?") -> list[dict]:
    """Return a one-message conversation, said by `name` (or by no one in particular)."""
    return [{"role": "user", "content": content, **({"name": name} if name else {})}]


def test_the_template_gets_the_name_and_only_when_given():
    assert ChatMessage.model_validate(said_by("alice")[0]).for_template()["name"] == "alice"
    assert "name" not in ChatMessage.model_validate(said_by(None)[0]).for_template()
