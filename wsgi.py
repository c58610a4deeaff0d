"""Gunicorn's entry point: `gunicorn wsgi:app` (see gunicorn.conf.py)."""

from service import create_app

app = create_app()
