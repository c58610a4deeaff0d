"""Access control's settings: CORS origins must be exact origins, and keys stay out of the settings' repr."""

import pydantic
import pytest

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")


@pytest.mark.parametrize("origins", ["*", "chat.example.com", "https://chat.example.com/", "ftp://x.org"])
def test_cors_origins_must_be_exact_origins(make_settings, origins):
    with pytest.raises(pydantic.ValidationError, match="cors_origins"):
        make_settings(cors_origins=origins)


def test_keys_are_hidden_in_the_settings_repr(make_settings):
    assert KEYS[0] not in repr(make_settings(api_keys=KEYS[0]))
