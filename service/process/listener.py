"""The socket corechat listens on under systemd: bound once, kept in systemd's file descriptor store.

The supervisor binds BIND at its first start and stores the socket (FDSTORE=1); systemd hands it
back (LISTEN_FDS) to the next start while a restart, or Restart=, is pending, so connections made
meanwhile wait in the socket's backlog instead of being refused.
"""

import logging
import os
import socket
import stat

from gunicorn.util import is_ipv6, parse_address

from . import systemd

log = logging.getLogger("corechat.supervisor")

# The socket's name in systemd's file descriptor store.
STORED_SOCKET_NAME = "corechat-listen"
# Gunicorn's default: the connections the kernel holds while no worker accepts (during a restart).
BACKLOG = 2048


def listening_socket(bind: str) -> socket.socket:
    """Return the socket to serve BIND on: the one systemd kept in its store if it still fits, else a
    new one, which goes into the store."""
    passed = systemd.passed_sockets()
    stored = passed.pop(STORED_SOCKET_NAME, [])
    for name, sockets in passed.items():
        log.warning("closing %d descriptor(s) named %r that systemd passed: not corechat's", len(sockets), name)
        for sock in sockets:
            sock.close()
    address = parse_address(bind)
    kept = next((sock for sock in stored if serves_address(sock, address)), None)
    for sock in stored:
        if sock is not kept:
            sock.close()
    if kept:
        log.info("listening on %s, the socket systemd kept across the restart", bind)
        return kept
    if stored:
        log.info("BIND changed to %s: replacing the socket systemd kept", bind)
        systemd.notify(f"FDSTOREREMOVE=1\nFDNAME={STORED_SOCKET_NAME}")
    sock = bind_socket(address)
    systemd.notify(f"FDSTORE=1\nFDNAME={STORED_SOCKET_NAME}", (sock.fileno(),))
    log.info("listening on %s", bind)
    return sock


def serves_address(sock: socket.socket, address) -> bool:
    """Tell whether a listening socket is bound where BIND asks."""
    if isinstance(address, str):
        try:
            return sock.family == socket.AF_UNIX and sock.getsockname() == address and \
                stat.S_ISSOCK(os.stat(address).st_mode)
        except OSError:
            return False
    host, port = address
    family = socket.AF_INET6 if is_ipv6(host) else socket.AF_INET
    wanted = socket.getaddrinfo(host or None, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0][4]
    return sock.family == family and sock.getsockname()[:2] == wanted[:2]


def bind_socket(address) -> socket.socket:
    """Bind and listen on a TCP address (host, port) or a unix socket path."""
    if isinstance(address, int):
        raise SystemExit("BIND=fd://N is not for the supervisor: it binds BIND itself and systemd keeps the socket")
    if isinstance(address, str):
        if os.path.exists(address) and stat.S_ISSOCK(os.stat(address).st_mode):
            os.unlink(address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if is_ipv6(address[0]) else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(BACKLOG)
    return sock
