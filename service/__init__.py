"""corechat: an OpenAI-compatible chat server for CPUs, on Flask and Gunicorn.

The layers, from the top, each importing only those below it:

- process/: Gunicorn's hooks and worker class, and the supervisor under systemd; the Gunicorn
  master runs this layer, which never brings torch in by itself (see its docstring).
- app.py: `create_app`, which each worker calls after fork (wsgi.py).
- api/: the HTTP API: the routes, the request and response models, and the serving classes that
  take a request to the engine and its events to OpenAI's wire format.
- cache/: the response cache.
- observability/: metrics and the per-request record the hooks and views share.
- engine/: tokenizer, model and the generation loop; it knows nothing of HTTP.
- settings.py, topology.py, errors.py: the settings, the CPUs, and the one error shape.

This file imports nothing, so importing any of them imports no more than it needs.
"""
