"""Access control: optional API keys and CORS for an explicit allowlist of browser origins.

CORS is a small hook here rather than flask-cors: we need a refused preflight to be a 403 in
OpenAI's error shape, preflights answered before the key check (browsers never send credentials
on them), and nothing but an exact allowlist; flask-cors answers refused preflights with a plain
200 and brings options (wildcards, regexes, credentials) we would have to turn off one by one.
"""

import hashlib
import hmac

from flask import make_response, request

from ..errors import APIError, Unauthorized
from ..observability.request_record import current_record
from ..settings import Settings
from .corechat import current_corechat

# Endpoints anyone may reach: liveness and readiness probes, and the chat page with its files
# (the page must load without a key so the user can type one in).
OPEN_ENDPOINTS = frozenset({"api.check_health", "api.check_ready", "ui.show_chat_page", "static"})
METRICS_PATH = "/metrics"

CORS_ALLOWED_METHODS = "GET, POST, OPTIONS"
CORS_ALLOWED_HEADERS = "Authorization, Content-Type, Cache-Control"
CORS_EXPOSED_HEADERS = "X-Cache, Retry-After"
CORS_PREFLIGHT_MAX_AGE_SECONDS = 600


class OriginNotAllowed(APIError):
    """A browser page from an origin not on the CORS allowlist asked to call the API."""

    status = 403
    code = "origin_not_allowed"


def _settings() -> Settings:
    """Return the app's settings."""
    return current_corechat().settings


def _is_preflight() -> bool:
    """Tell whether the request is a browser's CORS preflight."""
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


def _origin_allowed() -> bool:
    """Tell whether the request comes from a page on an allowed origin."""
    return request.headers.get("Origin", "") in _settings().cors_origin_set


def answer_preflight():
    """Answer a CORS preflight: 204 with the allowed methods and headers, or 403 for other origins."""
    if not _is_preflight():
        return None
    if not _origin_allowed():
        raise OriginNotAllowed("this origin may not call the API from a browser (see CORS_ORIGINS)")
    response = make_response("", 204)
    response.headers["Access-Control-Allow-Methods"] = CORS_ALLOWED_METHODS
    response.headers["Access-Control-Allow-Headers"] = CORS_ALLOWED_HEADERS
    response.headers["Access-Control-Max-Age"] = str(CORS_PREFLIGHT_MAX_AGE_SECONDS)
    return response


def cors_headers(origin: str | None, allowed_origins: frozenset[str]) -> dict[str, str]:
    """Return the CORS headers of a response to a page on `origin`: none while no origin is allowed.

    The worker's event loop adds them to the answers it gives itself (a 503's Retry-After must be
    readable by the page too), so this takes no request.
    """
    if not allowed_origins:
        return {}
    # The answer depends on Origin, so shared caches must not serve one origin's answer to another.
    headers = {"Vary": "Origin"}
    if origin in allowed_origins:
        headers["Access-Control-Allow-Origin"] = origin
        headers["Access-Control-Expose-Headers"] = CORS_EXPOSED_HEADERS
    return headers


def add_cors_headers(response):
    """Let pages on allowed origins read the response, errors included, and its cache and retry headers."""
    headers = cors_headers(request.headers.get("Origin"), _settings().cors_origin_set)
    if headers:
        response.vary.add(headers.pop("Vary"))
        response.headers.update(headers)
    return response


def add_security_headers(response):
    """Keep browsers from guessing a response's type, and caches from storing a JSON reply (it may hold
    a conversation or a model's answer to it)."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    if response.mimetype == "application/json":
        response.headers["Cache-Control"] = "no-store"
    return response


def _is_open_route() -> bool:
    """Tell whether the route is reachable without a key."""
    if request.path == METRICS_PATH:
        return not _settings().metrics_require_key
    return request.endpoint in OPEN_ENDPOINTS


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    """Compare the presented key with every configured key in constant time (no early exit)."""
    presented_bytes = presented.encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented_bytes, key.encode())
    return matched


def require_api_key():
    """Refuse the request with a 401 unless it carries a configured key or the route is open."""
    keys = _settings().api_key_list
    if not keys or _is_open_route():
        return
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not presented.strip():
        raise Unauthorized(
            "no API key given: send it in the Authorization header as 'Authorization: Bearer YOUR_KEY'",
            headers=challenge,
        )
    # The key is never echoed back or logged, not even in part.
    if not key_matches(presented.strip(), keys):
        raise Unauthorized("incorrect API key provided", headers=challenge)
    current_record().api_key_hash = hashlib.sha256(presented.strip().encode()).hexdigest()


def may_see_details() -> bool:
    """Tell whether an open route may answer in full: the API needs no key, or the request carries a valid one."""
    keys = _settings().api_key_list
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return not keys or (scheme.lower() == "bearer" and key_matches(presented.strip(), keys))


def caller_key_hash() -> str | None:
    """Return a hash of the API key this request was let in with, or None when the API needs no key."""
    return current_record().api_key_hash


def init_app(app) -> None:
    """Answer preflights first, then check keys; mark every response for allowed origins and browsers."""
    app.before_request(answer_preflight)
    app.before_request(require_api_key)
    app.after_request(add_cors_headers)
    app.after_request(add_security_headers)
