"""The parts of systemd's protocols the supervisor speaks: notifications and passed descriptors.

sd_notify(3): datagrams to NOTIFY_SOCKET (READY=1, STATUS=..., and FDSTORE=1 with a descriptor
attached, which systemd keeps for the service and passes back to its next start). sd_listen_fds(3):
descriptors passed from 3 on, counted by LISTEN_FDS, named by LISTEN_FDNAMES, meant for the process
LISTEN_PID names. Without systemd (NOTIFY_SOCKET unset) notifications go nowhere.
"""

import logging
import socket

from .settings import systemd_listen_fds, systemd_notify_socket

log = logging.getLogger(__name__)


def notify(message: str, fds: tuple[int, ...] = ()) -> bool:
    """Send a notification (with descriptors attached, for FDSTORE=1) and tell whether it went out."""
    address = systemd_notify_socket()
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            socket.send_fds(sock, [message.encode()], list(fds))
        except OSError as error:
            log.warning("could not notify systemd of %r: %s", message.split("\n", 1)[0], error)
            return False
    return True


def passed_sockets() -> dict[str, list[socket.socket]]:
    """Return the sockets systemd passed this process, by name, and mark them close-on-exec."""
    passed: dict[str, list[socket.socket]] = {}
    for fd, name in systemd_listen_fds():
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)
        passed.setdefault(name, []).append(sock)
    return passed
