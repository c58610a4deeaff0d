"""What parsing a chunked request costs a worker: its CPU time per request, for bodies sent in
512-byte and in one-byte chunks, against one Gunicorn worker with every setting at its default.

    python bench/probes/framing_probe.py                          # this checkout
    python bench/probes/framing_probe.py --repo DIR --name NAME   # another checkout (an older commit)

The figures of docs/reliability.md (the framing limits); tests/e2e/test_framing.py checks the same
proportion with a bound that only catches a quadratic cost. Each request goes to
/v1/chat/completions on a fresh connection; its body is not JSON, so the app reads it whole and
answers 400 without generating, and the worker's CPU is mostly the request's parsing.
"""

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)
# (label, chunk size, chunks, requests)
CASES = (
    ("512-byte chunks, 256 KiB", 512, 512, 12),
    ("512-byte chunks, 1 MiB", 512, 2048, 12),
    ("1-byte chunks, 40,000", 1, 40_000, 1),
    ("1-byte chunks, 150,000", 1, 150_000, 1),
)


def worker_cpu_seconds(server) -> float:
    """Return the CPU time the server's workers have used."""
    ticks = 0
    for pid in server.worker_pids():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def send(port: int, raw: bytes) -> int:
    """Send a request (in a thread, as the server may refuse it before reading it all); return its status."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=900)
    threading.Thread(target=lambda: _send_all(sock, raw), daemon=True).start()
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except OSError:
        pass
    sock.close()
    return int(received.split()[1]) if received.startswith(b"HTTP/1.1") else 0


def _send_all(sock: socket.socket, raw: bytes) -> None:
    """Send everything the server takes."""
    try:
        sock.sendall(raw)
    except OSError:
        pass


def gunicorn_server_of(repo: Path):
    """Return the GunicornServer class of a checkout (harness/'s, or tests/support.py's before harness/), which
    starts that checkout's Gunicorn."""
    path = repo / "harness" / "servers.py"
    if not path.exists():
        path = repo / "tests" / "support.py"
    spec = importlib.util.spec_from_file_location(f"servers_of_{repo.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GunicornServer


def measured_commit(repo: Path) -> str:
    """Return the commit of the checkout measured (the results record this one's too)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    return commit or repo.name


def main() -> None:
    """Measure every case and save the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose Gunicorn worker to measure")
    parser.add_argument("--name", default="framing")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from bench import save_results

    rows = []
    with gunicorn_server_of(args.repo)(Path(tempfile.mkdtemp(prefix="corechat-framing-")), workers=1) as server:
        for label, size, count, requests in CASES:
            raw = HEAD + b"".join(b"%x\r\n%s\r\n" % (size, b"x" * size) for _ in range(count)) + b"0\r\n\r\n"
            before, started = worker_cpu_seconds(server), time.monotonic()
            statuses = {send(server.port, raw) for _ in range(requests)}
            rows.append({
                "case": label, "wire_bytes": len(raw), "requests": requests, "statuses": sorted(statuses),
                "cpu_ms_per_request": round((worker_cpu_seconds(server) - before) / requests * 1000, 1),
                "wall_ms_per_request": round((time.monotonic() - started) / requests * 1000, 1),
            })
    results = {"rows": rows, "measured_commit": measured_commit(args.repo)}
    lines = ["| case | bytes on the wire | status | worker CPU ms per request | wall ms per request |", "|---|---|---|---|---|"]
    lines += [f"| {row['case']} | {row['wire_bytes']:,} | {', '.join(map(str, row['statuses']))} | "
              f"{row['cpu_ms_per_request']} | {row['wall_ms_per_request']} |" for row in rows]
    lines += ["", f"Measured: commit {results['measured_commit']}."]
    save_results(args.name, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
