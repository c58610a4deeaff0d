"""What Gunicorn's hooks do: give workers slots and cores, then start each worker's engine."""

import gc
import ipaddress
import logging
import mmap
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..api.corechat import corechat_of
from ..engine.cores import LOAD_WINDOW_SECONDS, SLOT_BYTES, SharedCores, busy_cpu_seconds
from ..observability.metrics import report_not_ready, report_ready
from ..topology import physical_core_groups, physical_cores
from .gathering import GATHER_PROMPT_TOKENS, Gathering, make_table

if TYPE_CHECKING:
    from ..api.serving import ChatEngine

log = logging.getLogger(__name__)

# Workers in a row whose model failed to load before the master gives up: a corrupt or truncated
# model fails every time, while a load cut short by memory pressure deserves another try.
MODEL_LOAD_ATTEMPTS = 3
# The exit status on which Gunicorn's master stops instead of starting another worker (its
# Arbiter.WORKER_BOOT_ERROR), as it does when a worker cannot boot at all (a MODEL that is missing).
WORKER_BOOT_ERROR = 3


def import_worker_libraries(model: str, converted_dir: str) -> None:
    """Import torch, transformers and the app's modules in the master, and load the model's
    tokenizer, for the workers to share; a GGUF file is converted first, in a child process.

    No model, no tensor, no thread pool (gunicorn.conf.py keeps OpenBLAS from starting one; loading
    a tokenizer starts none, encoding would), so the master stays single-threaded and forks hold no
    lock another thread took; each worker sets its own threads and loads its own model after fork.
    gc.freeze() keeps the workers' garbage collections from writing to, and so copying, the pages
    these objects live on. What importing and loading freed goes back to the kernel first: glibc
    would keep it in the master's heap, where it lingers as the master's own once the workers
    (which trim theirs when idle) drop their copies of those pages.
    """
    from .. import app  # noqa: F401 (the whole app, the engine's core with torch and transformers among it)
    from ..engine.gguf import convert_in_child, is_gguf_file
    from ..engine.loading import preload_tokenizer
    from ..engine.memory import return_freed_memory

    if is_gguf_file(model) and Path(model).expanduser().is_file():
        model = str(convert_in_child(Path(model).expanduser().resolve(), Path(converted_dir)))
    preload_tokenizer(model)
    gc.collect()
    return_freed_memory()
    gc.freeze()


def peers_shut_out(bind: str, allowed_networks: tuple) -> str | None:
    """Return a warning when Gunicorn listens beyond loopback while only loopback may connect.

    With ALLOWED_NETWORKS empty, a worker closes every other host's connection at accept and logs it
    at debug level only, so a BIND opened for other machines would seem to work here and fail there.
    """
    if allowed_networks or bind.startswith(("unix:", "fd://")):
        return None
    host, colon, port = bind.rpartition(":")
    host = (host if colon and port.isdigit() else bind).strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"BIND {bind} listens beyond loopback but ALLOWED_NETWORKS is empty, so the workers close every "
            "connection from another host at once: list the clients' addresses or networks in ALLOWED_NETWORKS")


# The table through which this master's workers lend idle cores (engine/cores.py): per slot a byte
# of threads held and a float64 of CPU seconds used. Made in the master before its first fork, so
# every worker it forks shares it; far more slots than workers, as a respawned worker takes the
# lowest free slot.
CORE_TABLE_SLOTS = 64
_core_table: mmap.mmap | None = None
# The table through which they gather new streams on a busy worker (gathering.py), slot for slot.
_gather_table: mmap.mmap | None = None


def assign_slot(server, worker) -> None:
    """Give a new worker the lowest slot no live worker holds (in the master, before fork)."""
    global _core_table, _gather_table
    if _core_table is None:
        _core_table = mmap.mmap(-1, CORE_TABLE_SLOTS * SLOT_BYTES)
        _gather_table = make_table(CORE_TABLE_SLOTS)
    taken = {getattr(other, "slot", None) for other in server.WORKERS.values()}
    worker.slot = next(slot for slot in range(len(taken) + 1) if slot not in taken)


def cores_for_slot(slot: int, workers: int) -> list[int]:
    """Return the CPUs of the physical cores that belong to a worker slot."""
    groups = physical_core_groups()
    per_worker = max(1, len(groups) // workers)
    start = (slot * per_worker) % len(groups)
    return [cpu for group in groups[start : start + per_worker] for cpu in group]


def boot_worker(worker) -> None:
    """Pin the worker if asked, set torch's threads, and start its engine; the worker accepts
    connections once the engine is ready (after fork, where the app and torch are already imported)."""
    import torch

    core = corechat_of(worker.wsgi)
    settings = core.settings
    slot = getattr(worker, "slot", 0)
    if settings.pin_workers:
        cpus = cores_for_slot(slot, settings.worker_count)
        os.sched_setaffinity(0, cpus)
        log.info("worker %d (slot %d) pinned to CPUs %s", os.getpid(), slot, cpus)
    torch.set_num_threads(settings.threads_per_worker)
    torch.set_num_interop_threads(1)
    # A pinned worker may only run on its own cores.
    lending = settings.lend_idle_cores and not settings.pin_workers
    cores = SharedCores(_core_table if lending else None, slot, physical_cores(), settings.threads_per_worker,
                        torch.set_num_threads, busy_seconds=busy_cpu_seconds)
    core.engine.facts.update(slot=slot, workers=settings.worker_count, lends_cores=cores.lends)
    if cores.lends:
        worker.sample_load, worker.idle_wake_seconds = cores.sample_load, LOAD_WINDOW_SECONDS
    # Streams gathered on one worker decode on the cores the others lend it: without lending (or
    # while other processes keep the CPUs busy) they would share its own core while the others idle.
    if settings.gather_streams and cores.lends and _gather_table is not None:
        lock_path = Path(settings.prometheus_multiproc_dir or ".") / f"corechat-gathering-{worker.ppid}.lock"
        try:
            worker.gathering = Gathering(_gather_table, slot, lock_path)
        except OSError as error:
            log.warning("worker %d gathers no streams: cannot open %s (%s)", os.getpid(), lock_path, error)
        worker.gather_room = lambda: (cores.others_leave_a_core()
                                      and core.engine.prompt_tokens_left <= GATHER_PROMPT_TOKENS)
    failures_file = load_failures_file(settings.prometheus_multiproc_dir, worker.ppid)
    core.engine.start(
        on_ready=partial(failures_file.unlink, missing_ok=True),
        on_failure=partial(exit_after_engine_failure, worker, failures_file),
        cores=cores,
    )
    worker.open_when(lambda: wait_until_settled(core.engine),
                     lambda: report_ready(core.engine.snapshot_facts(), settings))


def wait_until_settled(engine: "ChatEngine") -> bool:
    """Block until the engine is ready (True) or failed (False).

    A worker whose model failed opens anyway and answers 503 until it exits, so clients and probes
    see why.
    """
    while not engine.wait_ready(timeout=1.0):
        if engine.failed:
            return False
    return True


def load_failures_file(run_folder: str, master_pid: int) -> Path:
    """Return the file that counts this master's failed model loads in a row (one line each).

    It lives in the folder the master's workers already share (the metrics folder), named by the
    master's pid so that a previous run's count never applies.
    """
    return Path(run_folder or ".") / f"corechat-model-load-failures-{master_pid}"


def exit_after_engine_failure(worker, failures_file: Path, reason: str, while_loading: bool) -> None:
    """Exit a worker whose engine cannot serve, so Gunicorn starts a fresh one (from the engine thread).

    Every request already got its last event; SIGTERM lets their responses go out. After
    MODEL_LOAD_ATTEMPTS failed loads in a row the worker exits with WORKER_BOOT_ERROR, which stops
    the master: a model that never loads must fail the service visibly, not restart forever.
    """
    report_not_ready()
    if while_loading:
        with failures_file.open("a") as failures:
            failures.write(f"{os.getpid()}\n")
        attempts = len(failures_file.read_text().splitlines())
        # Exactly one worker stops the master: two HaltServers at once leave Gunicorn another exit status.
        if attempts == MODEL_LOAD_ATTEMPTS:
            log.critical("the model failed to load in %d workers in a row (last: %s); stopping the server",
                         attempts, reason)
            worker.exit_status = WORKER_BOOT_ERROR
        else:
            log.error("the model failed to load (%s); worker %d exits so Gunicorn starts another (attempt %d of %d)",
                      reason, os.getpid(), attempts, MODEL_LOAD_ATTEMPTS)
    else:
        log.error("the engine of worker %d failed (%s); it exits so Gunicorn starts a new one", os.getpid(), reason)
    os.kill(os.getpid(), signal.SIGTERM)


def stop_worker(worker) -> None:
    """Stop the engine thread before the worker exits, so no torch call is cut off mid-flight."""
    if hasattr(worker, "wsgi"):  # a worker that failed before loading its app has no engine
        corechat_of(worker.wsgi).engine.stop()
    status = getattr(worker, "exit_status", 0)
    if status:
        # Raised from Gunicorn's worker_exit hook, this replaces the worker's exit status of 0.
        sys.exit(status)
