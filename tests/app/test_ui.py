"""The chat page's files through Flask's test client (the page itself, including that replies and errors
carrying markup show as text and run nothing, is tested in a browser in tests/e2e/test_chat_page.py)."""

import re

import pytest


def test_chat_page_is_served_at_the_root_under_a_strict_policy(client):
    response = client.get("/")
    assert response.status_code == 200
    assert response.mimetype == "text/html"
    policy = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_page_loads_only_its_own_files(client):
    html = client.get("/").get_data(as_text=True)
    references = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert references, "the page references no scripts or styles"
    assert all(reference.startswith("/static/") for reference in references), references
    assert "<script>" not in html and "style=" not in html, "inline code would need 'unsafe-inline'"
    for reference in references:
        assert client.get(reference).status_code == 200, reference


@pytest.mark.parametrize("name, mimetype", [("chat.js", "text/javascript"), ("sse.js", "text/javascript"),
                                            ("chat.css", "text/css")])
def test_page_assets_have_their_content_types(client, name, mimetype):
    response = client.get(f"/static/{name}")
    assert response.status_code == 200
    assert response.mimetype == mimetype
