"""What Gunicorn's hooks do: give workers slots and cores, then start each worker's engine."""

import logging
import os
import signal

from .metrics import report_when_ready
from .settings import physical_core_groups

log = logging.getLogger(__name__)


def import_worker_libraries() -> None:
    """Import torch, transformers and the app's modules in the master, for the workers to share.

    Only imports run here: no model, no tensor, no thread pool (gunicorn.conf.py keeps OpenBLAS from
    starting one), so the master stays single-threaded and forks hold no lock another thread took;
    each worker sets its own threads and loads its own model after fork. gc.freeze() keeps the
    workers' garbage collections from writing to, and so copying, the pages these objects live on.
    """
    import gc

    from . import api, auth, cache, chat, engine, errors, limits, metrics, observed, openapi, ui  # noqa: F401

    gc.freeze()


def assign_slot(server, worker) -> None:
    """Give a new worker the lowest slot no live worker holds (in the master, before fork)."""
    taken = {getattr(other, "slot", None) for other in server.WORKERS.values()}
    worker.slot = next(slot for slot in range(len(taken) + 1) if slot not in taken)


def cores_for_slot(slot: int, workers: int) -> list[int]:
    """Return the CPUs of the physical cores that belong to a worker slot."""
    groups = physical_core_groups()
    per_worker = max(1, len(groups) // workers)
    start = (slot * per_worker) % len(groups)
    return [cpu for group in groups[start : start + per_worker] for cpu in group]


def boot_worker(worker) -> None:
    """Pin the worker if asked, set torch's threads, and start its engine (after fork)."""
    import torch

    core = worker.wsgi.extensions["corechat"]
    settings = core.settings
    slot = getattr(worker, "slot", 0)
    if settings.pin_workers:
        cpus = cores_for_slot(slot, settings.worker_count)
        os.sched_setaffinity(0, cpus)
        log.info("worker %d (slot %d) pinned to CPUs %s", os.getpid(), slot, cpus)
    torch.set_num_threads(settings.threads_per_worker)
    torch.set_num_interop_threads(1)
    core.engine.facts.update(slot=slot, workers=settings.worker_count)
    core.engine.start()
    report_when_ready(core.engine, settings)


def stop_worker(worker) -> None:
    """Stop the engine thread before the worker exits, so no torch call is cut off mid-flight."""
    core = worker.wsgi.extensions["corechat"] if hasattr(worker, "wsgi") else None
    if core is not None:
        core.engine.stop()


def refuse_connections_on_term(worker) -> None:
    """Make SIGTERM close this worker's listening sockets before it drains (after fork, in the worker).

    On SIGTERM the master closes its listeners, but every worker holds inherited copies, so the
    kernel kept completing new connections into a backlog that no one would accept: clients hung
    until the worker exited and then got a reset. Closed here, new connections are refused at once
    and go to another host, while the streams in flight finish within graceful_timeout.
    """
    drain = worker.handle_exit

    def close_listeners_then_drain(signum, frame):
        """Stop listening, then let Gunicorn's graceful exit run."""
        for listener in worker.sockets:
            listener.close()
        drain(signum, frame)

    signal.signal(signal.SIGTERM, close_listeners_then_drain)
