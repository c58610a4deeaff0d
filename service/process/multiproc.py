"""The folder of metric value files that a service's workers share (prometheus_client's multiprocess
mode), read and tidied by the processes above them: Gunicorn's master hooks and the supervisor.

Without Flask (the supervisor never imports it); service/observability/metrics.py writes the files.
"""

import logging
import struct
from pathlib import Path

from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger(__name__)


def empty_multiproc_dir(path: str) -> None:
    """Delete the value files of a previous run (before any worker starts)."""
    for value_file in Path(path).glob("*.db"):
        value_file.unlink(missing_ok=True)
    log.info("workers share their metrics through %s", path)


def forget_worker(pid: int, path: str) -> None:
    """Drop a dead worker's live gauges, so its running requests and readiness do not linger."""
    mark_process_dead(pid, path)


def worker_reported_ready(pid: int, path: str) -> bool:
    """Tell whether a worker (of any master sharing this metrics folder) reported itself ready."""
    value_file = Path(path) / f"gauge_livesum_{pid}.db"
    try:
        metrics = MultiProcessCollector.merge([str(value_file)])
    except (OSError, struct.error, ValueError):
        # Not there yet, or the worker is creating or growing it: it has not reported yet, as far as
        # this read can tell; the next look sees the file whole.
        return False
    return any(sample.name == "corechat_workers_ready" and sample.value == 1
               for metric in metrics for sample in metric.samples)
