"""Errors a client sees: one shape, and nothing of our internals in it."""

from service.app import create_app

SECRET = "sk-very-secret-0123456789"


def test_unexpected_exception_gets_a_generic_500_without_traceback_path_or_secret(make_settings, engine):
    """A test-only route that raises stands in for a bug: nothing in the service raises on purpose."""
    app = create_app(make_settings(), engine=engine)

    @app.get("/test-only/boom")
    def boom():
        raise RuntimeError(f"database password {SECRET} in /srv/corechat/service/secret.py")

    response = app.test_client().get("/test-only/boom")
    assert response.status_code == 500
    assert response.get_json() == {
        "error": {"message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}
    }
    text = response.get_data(as_text=True)
    assert SECRET not in text and "/srv/" not in text and "Traceback" not in text and "RuntimeError" not in text
