"""Access control: API keys and CORS, through Flask's test client."""

import pytest

from service.app import create_app
from tests.support import bearer

KEYS = ("sk-first-0123456789", "sk-second-abcdefghij")
ALLOWED_ORIGIN = "https://chat.example.com"
OTHER_ORIGIN = "https://evil.example.net"
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture()
def locked_client(make_settings, engine):
    """Return a test client of an app that needs a key and allows one browser origin."""
    settings = make_settings(max_model_len=256, api_keys=",".join(KEYS), cors_origins=ALLOWED_ORIGIN)
    return create_app(settings, engine=engine).test_client()


def assert_invalid_api_key(response) -> None:
    """Check a 401 in OpenAI's shape that reveals no configured key."""
    assert response.status_code == 401
    error = response.get_json()["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert "sk-" not in response.get_data(as_text=True), "a key, or part of one, was echoed back"


def test_without_configured_keys_the_api_is_open(client):
    assert client.get("/v1/models").status_code == 200


def test_missing_key_gets_401_saying_how_to_send_one(locked_client):
    response = locked_client.get("/v1/models")
    assert_invalid_api_key(response)
    assert "Authorization: Bearer" in response.get_json()["error"]["message"]


@pytest.mark.parametrize(
    "authorization",
    ["Bearer sk-wrong", f"Bearer {KEYS[0][:-1]}", f"Bearer {KEYS[0]}x", f"Basic {KEYS[0]}", KEYS[0], "Bearer ",
     "Bearer sk-ké"],
)
def test_wrong_key_or_scheme_gets_401_without_echoing_it(locked_client, authorization):
    assert_invalid_api_key(locked_client.get("/v1/models", headers={"Authorization": authorization}))


@pytest.mark.parametrize("key", KEYS)
def test_every_configured_key_is_accepted(locked_client, key):
    assert locked_client.get("/v1/models", headers=bearer(key)).status_code == 200
    response = locked_client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers=bearer(key)
    )
    assert response.status_code == 200


def test_chat_completions_need_the_key(locked_client):
    response = locked_client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    assert_invalid_api_key(response)


def test_unknown_routes_need_the_key_too(locked_client):
    assert_invalid_api_key(locked_client.get("/v1/nothing-here"))


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/", "/static/chat.js", "/static/chat.css"])
def test_probes_and_chat_page_are_open_without_a_key(locked_client, path):
    assert locked_client.get(path).status_code == 200


def test_metrics_need_the_key_by_default(locked_client):
    assert_invalid_api_key(locked_client.get("/metrics"))
    # /metrics is another module's route: let in means "not refused for the key", whatever it answers.
    assert locked_client.get("/metrics", headers=bearer(KEYS[1])).status_code != 401


def test_metrics_are_open_when_the_key_is_turned_off_for_them(make_settings, engine):
    settings = make_settings(max_model_len=256, api_keys=KEYS[0], metrics_require_key=False)
    client = create_app(settings, engine=engine).test_client()
    assert client.get("/metrics").status_code != 401


def preflight(client, origin: str, path: str = "/v1/chat/completions"):
    """Send the preflight a browser sends before a JSON POST with a key."""
    return client.options(
        path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_preflight_from_allowed_origin_gets_the_allow_headers_without_a_key(locked_client):
    response = preflight(locked_client, ALLOWED_ORIGIN)
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    allowed_headers = {name.strip().lower() for name in response.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "cache-control"} <= allowed_headers
    assert "Origin" in response.headers["Vary"]


def test_preflight_from_other_origin_is_refused_with_403(locked_client):
    response = preflight(locked_client, OTHER_ORIGIN)
    assert response.status_code == 403
    assert response.get_json()["error"]["code"] == "origin_not_allowed"
    assert not any(name.startswith("Access-Control-") for name in response.headers.keys())


def test_no_origin_is_allowed_by_default(client):
    response = preflight(client, ALLOWED_ORIGIN)
    assert response.status_code == 403
    assert "Access-Control-Allow-Origin" not in response.headers


def test_allowed_origin_reads_responses_and_cache_headers(locked_client):
    response = locked_client.get("/v1/models", headers={"Origin": ALLOWED_ORIGIN, **bearer(KEYS[0])})
    assert response.status_code == 200
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    exposed = {name.strip() for name in response.headers["Access-Control-Expose-Headers"].split(",")}
    assert {"X-Cache", "Retry-After"} <= exposed


def test_allowed_origin_can_read_a_401(locked_client):
    """A page on an allowed origin must be able to show "wrong key" instead of a network error."""
    response = locked_client.get("/v1/models", headers={"Origin": ALLOWED_ORIGIN})
    assert_invalid_api_key(response)
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN


def test_other_origin_gets_no_cors_headers(locked_client):
    response = locked_client.get("/v1/models", headers={"Origin": OTHER_ORIGIN, **bearer(KEYS[0])})
    assert "Access-Control-Allow-Origin" not in response.headers


def test_json_replies_tell_browsers_not_to_sniff_or_store_them(locked_client):
    response = locked_client.get("/v1/models", headers=bearer(KEYS[0]))
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Cache-Control"] == "no-store"
    refused = locked_client.get("/v1/models")
    assert refused.status_code == 401 and refused.headers["Cache-Control"] == "no-store"
