"""Gunicorn settings for corechat, every one from the environment (see service/settings.py).

The master never imports torch or the app: each worker imports the app after fork and loads its
own engine in post_worker_init, so the master stays small and forks stay cheap.
"""

from service.settings import get_settings

settings = get_settings()

wsgi_app = "wsgi:app"
bind = settings.bind
# One worker per physical core: decoding is bound by memory bandwidth, and a worker per SMT
# sibling would only split the same bandwidth and caches.
workers = settings.worker_count
# Threads let /healthz, /readyz and /metrics answer while the engine thread generates, and let one
# worker hold many open streams; generation itself is serialised in the engine thread.
worker_class = "gthread"
threads = settings.http_threads
# The app (and torch) load in each worker, never in the master.
preload_app = False
# gthread workers heartbeat from their main loop, not from request threads, so a stream that lasts
# minutes does not trip this timeout; it only catches a hung worker.
timeout = settings.worker_timeout
graceful_timeout = settings.graceful_timeout
keepalive = 5
loglevel = settings.log_level
accesslog = "-"
errorlog = "-"


def pre_fork(server, worker):
    """Give the worker a stable slot, used for CPU pinning."""
    from service.lifecycle import assign_slot

    assign_slot(server, worker)


def post_worker_init(worker):
    """Set threads, pin, load and warm the model of this worker (after fork, in the worker)."""
    from service.lifecycle import boot_worker, refuse_connections_on_term

    refuse_connections_on_term(worker)
    boot_worker(worker)
