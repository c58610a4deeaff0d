"""What the views need, kept on the app: the settings, the engine and the serving classes.

Imports no serving class at run time: the access control (auth.py) reads the settings through here,
and Gunicorn's master imports it with the worker class, without torch.
"""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flask import Flask, current_app

from ..settings import Settings

if TYPE_CHECKING:
    from .chat import ChatCompletions
    from .completions import TextCompletions
    from .responses_api.serving import ResponsesServing
    from .serving import ChatEngine
    from .tokenizing import Tokenization

# The app's extension under which the record is kept (Flask's registry of extensions).
EXTENSION = "corechat"


@dataclass
class Corechat:
    """One worker's app state: its settings, its engine, and the serving classes the views call."""

    settings: Settings
    engine: "ChatEngine"
    chat: "ChatCompletions"
    completions: "TextCompletions"
    tokens: "Tokenization"
    responses: "ResponsesServing"
    started_at: int = field(default_factory=lambda: int(time.time()))

    def init_app(self, app: Flask) -> None:
        """Keep this state on the app."""
        app.extensions[EXTENSION] = self


def corechat_of(app: Flask) -> Corechat:
    """Return the state an app was built with."""
    return app.extensions[EXTENSION]


def current_corechat() -> Corechat:
    """Return the state of the app handling the current request."""
    return corechat_of(current_app)
