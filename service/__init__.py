"""corechat: an OpenAI-compatible chat server for CPUs, on Flask and Gunicorn.

Only the standard library and the settings are imported at the top: gunicorn.conf.py imports
service.settings in the master, which runs this file, and with PRELOAD_LIBRARIES=false the master
never loads torch. The factory imports the app's modules, as the workers call it after fork.
"""

import logging
import time
from dataclasses import dataclass, field

from .settings import Settings, get_settings


@dataclass
class Corechat:
    """What the views need, kept on the app: settings, the engine and the serving classes."""

    settings: Settings
    engine: object
    chat: object
    completions: object
    tokens: object
    started_at: int = field(default_factory=lambda: int(time.time()))


def create_app(settings: Settings | None = None, *, engine=None, cache=None):
    """Build the Flask app; the engine is created here but started by the worker hook (or a test)."""
    from flask import Flask

    from . import api, auth, errors, limits, openapi, ui
    from .observability import metrics
    from .cache import init_app as init_cache

    settings = settings or get_settings()
    app = Flask(__name__)
    configure_logging(settings)
    register_core(app, settings, engine)
    init_cache(app, cache)
    errors.init_app(app)
    auth.init_app(app)
    limits.init_app(app)
    api.init_app(app)
    metrics.init_app(app)
    openapi.init_app(app)
    ui.init_app(app)
    return app


def configure_logging(settings: Settings) -> None:
    """Log to stderr, which Gunicorn and journald collect."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
    )


def register_core(app, settings: Settings, engine) -> None:
    """Attach the engine and the serving classes to the app."""
    from .chat import ChatCompletions
    from .completions import TextCompletions
    from .engine import Engine
    from .tokenizing import Tokenization

    engine = engine or Engine(settings)
    chat = ChatCompletions(engine, settings)
    app.extensions["corechat"] = Corechat(settings=settings, engine=engine, chat=chat, completions=TextCompletions(chat),
                                          tokens=Tokenization(chat))
