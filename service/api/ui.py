"""The built-in chat page: static HTML, CSS and JavaScript, no build step and nothing from a CDN.

Flask itself serves `service/static/` at `/static/` (the app's own static folder); this blueprint
adds the page at `/`.
"""

from flask import Blueprint, current_app, request

bp = Blueprint("ui", __name__)

# Defence in depth behind rendering replies as text: the page runs only its own scripts, loads
# nothing from elsewhere, talks only to this server and cannot be framed.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


PAGE_ENDPOINTS = frozenset({"ui.show_chat_page", "static"})


@bp.get("/")
def show_chat_page():
    """Serve the chat page."""
    return current_app.send_static_file("index.html")


def add_page_headers(response):
    """Put the page's security headers on the page and on every static file, errors included, however it is
    reached (`/static/index.html` is the same page)."""
    if request.endpoint in PAGE_ENDPOINTS:
        response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        response.headers["Referrer-Policy"] = "no-referrer"
    return response


def init_app(app) -> None:
    """Register the chat page and the headers of everything it is made of."""
    app.register_blueprint(bp)
    app.after_request(add_page_headers)
