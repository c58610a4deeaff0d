"""service/process/multiproc.py: a worker's readiness read from the metric files it shares."""

from prometheus_client import CollectorRegistry, Gauge, values
from prometheus_client.values import MultiProcessValue

from service.process.multiproc import worker_reported_ready

PID = 4242


def write_ready(value: float) -> None:
    """Write corechat_workers_ready as worker PID's live-summed gauge into PROMETHEUS_MULTIPROC_DIR,
    as metrics.py does."""
    original = values.ValueClass
    values.ValueClass = MultiProcessValue(process_identifier=lambda: PID)
    try:
        gauge = Gauge("corechat_workers_ready", "ready", multiprocess_mode="livesum", registry=CollectorRegistry())
        gauge.set(value)
    finally:
        values.ValueClass = original


def test_a_worker_is_ready_once_its_gauge_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert not worker_reported_ready(PID, str(tmp_path))
    write_ready(0)
    assert not worker_reported_ready(PID, str(tmp_path))
    write_ready(1)
    assert worker_reported_ready(PID, str(tmp_path))


def test_a_value_file_being_created_or_grown_reads_as_not_ready_yet(tmp_path):
    value_file = tmp_path / f"gauge_livesum_{PID}.db"
    value_file.write_bytes(b"")  # created, not yet sized
    assert not worker_reported_ready(PID, str(tmp_path))
    value_file.write_bytes(b"\x00\x01")  # shorter than its header
    assert not worker_reported_ready(PID, str(tmp_path))
    value_file.write_bytes((4096).to_bytes(4, "little") + b"\xff" * 60)  # claims more than is there
    assert not worker_reported_ready(PID, str(tmp_path))
