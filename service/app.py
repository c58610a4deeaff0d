"""The application factory: each worker builds its app after fork (wsgi.py); tests build theirs here too.

Gunicorn's master never imports this module, so it imports the whole app at the top.
"""

import logging

from flask import Flask

from . import errors
from .api import auth, limits, openapi, routes, ui
from .api.chat import ChatCompletions
from .api.completions import TextCompletions
from .api.corechat import Corechat
from .api.responses_api.serving import ResponsesServing
from .api.serving import ChatEngine
from .api.tokenizing import Tokenization
from .cache import ResponseCache
from .cache import init_app as init_cache
from .cache.kvshare import RedisPrefixes
from .cache.stored_responses import StoredResponses
from .engine import Engine
from .observability import metrics
from .settings import Settings, get_settings


def create_app(settings: Settings | None = None, *, engine: ChatEngine | None = None,
               cache: ResponseCache | None = None) -> Flask:
    """Build the Flask app; the engine is created here but started by the worker hook (or a test)."""
    settings = settings or get_settings()
    # Named by its package: Flask serves the package's static/ folder and logs under its name.
    app = Flask(__package__)
    configure_logging(settings)
    register_core(app, settings, engine or Engine(settings, shared_prefixes=RedisPrefixes.from_settings(settings)))
    init_cache(app, settings, cache)
    errors.init_app(app)
    auth.init_app(app)
    limits.init_app(app, settings)
    routes.init_app(app)
    metrics.init_app(app, settings)
    openapi.init_app(app)
    ui.init_app(app)
    return app


def configure_logging(settings: Settings) -> None:
    """Log to stderr, which Gunicorn and journald collect."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
    )


def register_core(app: Flask, settings: Settings, engine: ChatEngine) -> None:
    """Attach the engine and the serving classes built around it to the app (the response store's Redis client
    here, so each forked worker has its own pool)."""
    chat = ChatCompletions(engine, settings)
    responses = ResponsesServing(chat, StoredResponses.from_settings(settings))
    core = Corechat(settings=settings, engine=engine, chat=chat, completions=TextCompletions(chat),
                    tokens=Tokenization(chat), responses=responses)
    core.init_app(app)
