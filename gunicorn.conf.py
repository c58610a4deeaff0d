"""Gunicorn settings for corechat, every one from the environment (see service/settings.py).

The master imports the libraries the workers use and loads the model's tokenizer
(PRELOAD_LIBRARIES, on by default) but never creates the app, loads a model or runs torch: each
worker creates the app after fork and loads its own engine in post_worker_init.
"""

import os
import shutil
import tempfile

# prometheus_client decides when it is first imported whether metric values live in per-process
# files in this folder (what lets any worker's /metrics report all of them), so it is set before
# anything imports the service; workers inherit it through fork. The default is one folder per
# master, stable across a config reload (SIGHUP), which re-reads this file in the same process.
# Unset or empty (as the example environment file's commented default reads) both mean the default.
# Under service/process/supervisor.py (SUPERVISED), the folder is the supervisor's: two masters share it
# during a reload, and the supervisor empties it once, at its start, instead of each master.
SUPERVISED = "CORECHAT_SUPERVISOR_PID" in os.environ
DEFAULT_METRICS_DIR_PREFIX = os.path.join(tempfile.gettempdir(), "corechat-metrics-")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = (
    os.environ.get("PROMETHEUS_MULTIPROC_DIR") or f"{DEFAULT_METRICS_DIR_PREFIX}{os.getpid()}"
)
os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)

# torch's oneDNN kernels (bf16 matrix products) keep a compiled primitive per input shape, 1,024 of
# them by default, each holding memory: prompts of ever new lengths would grow a DTYPE=bfloat16 worker
# until it held all of them. 64 still holds every shape in steady use (batch sizes times layer
# shapes); test_gunicorn.py checks that such a worker stays flat. Read when a worker first uses
# oneDNN, after fork.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
# numpy (which torch imports) starts an OpenBLAS thread pool at import; nothing in corechat calls
# numpy's BLAS, and a master with no other thread cannot fork while one holds a lock.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# After the metrics folder is set (see above); these modules never import torch (service/process/).
from service.process import lifecycle, multiproc  # noqa: E402
from service.settings import get_settings  # noqa: E402

settings = get_settings()

if settings.preload_libraries:
    lifecycle.import_worker_libraries(settings.model, settings.converted_weights_dir)

wsgi_app = "wsgi:app"
bind = settings.bind
# One worker per physical core: decoding is bound by memory bandwidth, and a worker per SMT
# sibling would only split the same bandwidth and caches.
workers = settings.worker_count
# gthread, except that each request is read whole in the worker's event loop before a thread takes
# it, and a worker accepts connections only once its model is ready (service/process/worker.py).
worker_class = "service.process.worker.CorechatWorker"
# A thread per chat request a worker admits (MAX_RUNNING running + MAX_QUEUE queued; its event loop
# refuses the next with a 503 at once), plus SPARE_HTTP_THREADS that stay free for probes, scrapes
# and other quick requests: no request waits for a thread behind generations.
threads = settings.http_threads
# The app (and the model) load in each worker, never in the master.
preload_app = False
# gthread workers heartbeat from their main loop, not from request threads, so a stream that lasts
# minutes does not trip this timeout; it only catches a hung worker.
timeout = settings.worker_timeout
graceful_timeout = settings.graceful_timeout
keepalive = 5
# Every response goes out through send(), where the worker's send deadline applies
# (SEND_TIMEOUT_SECONDS); Python's sendfile() would wait for a client that never reads without end.
sendfile = False
loglevel = settings.log_level
accesslog = "-"
errorlog = "-"


def on_starting(server):
    """Empty the metrics folder of a previous run, before any worker writes to it (unless SUPERVISED)."""
    if not SUPERVISED:
        multiproc.empty_multiproc_dir(settings.prometheus_multiproc_dir)


def on_exit(server):
    """Remove the metrics folder when this master made it (an operator did not choose it)."""
    if settings.prometheus_multiproc_dir.startswith(DEFAULT_METRICS_DIR_PREFIX) and not SUPERVISED:
        shutil.rmtree(settings.prometheus_multiproc_dir, ignore_errors=True)


def when_ready(server):
    """Warn at start when other hosts can reach the socket but ALLOWED_NETWORKS lets none of them in."""
    warning = lifecycle.peers_shut_out(settings.bind, settings.allowed_network_list)
    if warning:
        server.log.warning(warning)


def child_exit(server, worker):
    """Forget a dead worker's live gauges (requests running, ready), even after a SIGKILL."""
    multiproc.forget_worker(worker.pid, settings.prometheus_multiproc_dir)


def pre_fork(server, worker):
    """Give the worker a stable slot, used for CPU pinning."""
    lifecycle.assign_slot(server, worker)


def post_worker_init(worker):
    """Set threads, pin, load and warm the model of this worker (after fork, in the worker)."""
    lifecycle.boot_worker(worker)


def worker_exit(server, worker):
    """Stop the engine after in-flight streams drained (in the worker, as it exits)."""
    lifecycle.stop_worker(worker)
