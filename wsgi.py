"""Gunicorn's entry point: `gunicorn wsgi:app` (see gunicorn.conf.py)."""

from service.app import create_app

app = create_app()
