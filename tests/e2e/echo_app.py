"""A WSGI entry point for the framing tests: the real app, plus a route that tells what a request
looked like once it reached the app.

tests/e2e/test_framing.py sends raw bytes and compares what the app saw (its body, Content-Length and
headers) with what a reference parser decodes from the same bytes. Production code carries no test
routes, so this module (which Gunicorn imports in each worker, `gunicorn ... tests.e2e.echo_app:app`) adds one
to the app the factory built; everything else is the app `make serve` runs.
"""

import hashlib

from flask import jsonify, request

from service.app import create_app

# Bodies up to this size come back whole; longer ones only by length and hash.
ECHOED_BODY_BYTES = 4096

app = create_app()


@app.post("/echo")
def echo_request():
    """Describe the request as the app received it."""
    body = request.get_data()
    return jsonify(
        body=body.decode("latin-1") if len(body) <= ECHOED_BODY_BYTES else None,
        body_length=len(body),
        body_sha256=hashlib.sha256(body).hexdigest(),
        content_length=request.environ.get("CONTENT_LENGTH"),
        headers=dict(request.headers.items()),
    )
