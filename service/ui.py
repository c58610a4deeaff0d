"""The built-in chat page: static HTML, CSS and JavaScript, no build step and nothing from a CDN.

Flask itself serves `service/static/` at `/static/` (the app's own static folder); this blueprint
adds the page at `/`.
"""

from flask import Blueprint, current_app

bp = Blueprint("ui", __name__)


@bp.get("/")
def show_chat_page():
    """Serve the chat page."""
    return current_app.send_static_file("index.html")


def init_app(app) -> None:
    """Register the chat page."""
    app.register_blueprint(bp)
