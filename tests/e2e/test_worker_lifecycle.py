"""The worker's guards at its edges, under real Gunicorn: at start (Gunicorn settings it cannot
honour), at accept (peers outside loopback and ALLOWED_NETWORKS), and at stop (a draining worker's
event loop does not spin). Each test starts a one-worker server of its own, with every other setting
at its default.
"""

import os
import signal
import socket
import time

import pytest

from harness import COUNTING, StreamingClient, cpu_ticks_by_thread
from service.settings import Settings

# A stream that outlasts the test.
LONG_STREAM = {"messages": COUNTING, "max_tokens": Settings.model_construct().max_tokens_limit, "stream": True}


@pytest.mark.parametrize("option",
                         ["--proxy-protocol=v1", "--casefold-http-method", "--permit-unconventional-http-method"])
def test_gunicorn_settings_the_worker_cannot_honour_stop_it_at_start_with_the_reason(option, gunicorn):
    server = gunicorn(workers=1)
    server.env["GUNICORN_CMD_ARGS"] = option
    server.launch()
    assert server.process.wait(60) != 0
    server.stop()
    setting = option.removeprefix("--").partition("=")[0].replace("-", "_")
    assert f"corechat's worker needs Gunicorn's {setting}" in server.log()


def own_address() -> str:
    """Return this host's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
    assert not address.startswith("127."), "the test needs an address besides loopback"
    return address


def served_from(address: str, port: int) -> bool:
    """Tell whether a probe sent to address:port (so coming from it) gets an answer, not a closed connection."""
    with socket.create_connection((address, port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        try:
            return sock.recv(12) == b"HTTP/1.1 200"
        except ConnectionResetError:
            return False  # closed with the probe unread


def test_peers_outside_loopback_and_allowed_networks_are_closed_at_once(gunicorn):
    """Bound to every interface, as a multi-host BIND: a peer from this host's own network address is
    not loopback, so it is served only once ALLOWED_NETWORKS lists it."""
    address = own_address()
    for allowed, served in (("", False), (f"{address}/32", True)):
        server = gunicorn(workers=1, allowed_networks=allowed)
        server.env["BIND"] = f"0.0.0.0:{server.port}"
        with server:
            assert served_from("127.0.0.1", server.port)
            assert served_from(address, server.port) is served


def test_a_draining_worker_does_not_spin_on_a_connection_waiting_in_the_backlog(gunicorn):
    """SIGTERM makes a worker stop listening while its stream goes on. The master's copy of the
    listener keeps the socket open, so a connection can wait in its backlog with no one to accept it
    (the master is stopped here, so no new worker takes it): a listener closed while still in the
    worker's epoll woke its event loop without end. The loop's own thread is measured (the engine's
    threads generate the stream meanwhile); one worker, to know whose."""
    with gunicorn(workers=1) as server:
        (worker,) = server.worker_pids()
        stream = StreamingClient(server.url, LONG_STREAM)
        stream.wait_for_chunks(1)
        server.process.send_signal(signal.SIGSTOP)
        try:
            os.kill(worker, signal.SIGTERM)
            waiting = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            chunks_before, loop_before = len(stream.chunks), cpu_ticks_by_thread(worker)[worker]
            time.sleep(1.0)  # the measurement window
            spent = cpu_ticks_by_thread(worker)[worker] - loop_before
            assert len(stream.chunks) > chunks_before, "the draining worker stopped streaming"
            assert spent < 0.3 * os.sysconf("SC_CLK_TCK"), f"the event loop used {spent} ticks in 1 s"
            waiting.close()
            stream.hang_up()
        finally:
            server.process.send_signal(signal.SIGCONT)
