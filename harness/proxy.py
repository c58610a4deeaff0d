"""A TCP proxy on loopback that holds back every reply for a while: a slow network, or a Redis that
still answers but late, for the tests that must show nothing else waits for it."""

import socket
import threading

from harness.servers import free_port

CHUNK = 65536


class DelayingProxy:
    """Forward loopback connections to a port, each chunk of the server's replies held back `delay_seconds`.

    As a context manager it listens on entry and closes every connection on exit.
    """

    def __init__(self, upstream_port: int, delay_seconds: float):
        self.upstream_port = upstream_port
        self.delay_seconds = delay_seconds
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []

    def __enter__(self) -> "DelayingProxy":
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, name="delaying-proxy", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        for sock in [self._listener, *self._sockets]:
            try:
                sock.close()
            except OSError:
                pass

    def _accept(self) -> None:
        """Take each client and pair it with a connection to the server."""
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.delay_seconds), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, delay: float) -> None:
        """Copy one direction of a connection, waiting `delay` before each chunk, until either side closes."""
        try:
            while chunk := source.recv(CHUNK):
                if delay and self._closed.wait(delay):
                    return
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
