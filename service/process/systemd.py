"""The parts of systemd's protocols the supervisor speaks: notifications and passed descriptors.

sd_notify(3): datagrams to NOTIFY_SOCKET (READY=1, STATUS=..., and FDSTORE=1 with a descriptor
attached, which systemd keeps for the service and passes back to its next start). sd_listen_fds(3):
descriptors passed from 3 on, counted by LISTEN_FDS, named by LISTEN_FDNAMES, meant for the process
LISTEN_PID names. Without systemd (NOTIFY_SOCKET unset) notifications go nowhere.
"""

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify_socket() -> str:
    """Return the socket systemd gave this process for its notifications (NOTIFY_SOCKET), or "".

    systemd's protocol, not a setting: systemd sets it for the processes of a Type=notify unit.
    """
    return os.environ.get("NOTIFY_SOCKET", "")


def listen_fds() -> list[tuple[int, str]]:
    """Return the descriptors systemd passed this process (from 3 on) with their names, once.

    systemd's protocol, not a setting: LISTEN_FDS counts them, LISTEN_FDNAMES names them, and they
    are meant only for the process LISTEN_PID names. The variables are removed, as sd_listen_fds(3)
    does, so no child mistakes them for its own.
    """
    meant_for_us = os.environ.pop("LISTEN_PID", "") == str(os.getpid())
    count = int(os.environ.pop("LISTEN_FDS", "0") or 0)
    names = os.environ.pop("LISTEN_FDNAMES", "").split(":")
    if not meant_for_us:
        return []
    return [(3 + index, names[index] if index < len(names) else "unknown") for index in range(count)]


def notify(message: str, fds: tuple[int, ...] = ()) -> bool:
    """Send a notification (with descriptors attached, for FDSTORE=1) and tell whether it went out."""
    address = notify_socket()
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
    for fd, name in listen_fds():
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)
        passed.setdefault(name, []).append(sock)
    return passed
