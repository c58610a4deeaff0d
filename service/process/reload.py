"""Ask corechat's supervisor for a reload and exit with its outcome; the unit's ExecReload runs it.

    python -m service.process.reload [--control-socket PATH]

The supervisor (supervisor.py) starts new Gunicorn workers with the code on disk beside
the serving ones, retires the old ones once the new ones are ready, and answers when the old master
has drained and exited, or why the reload could not complete. This prints its lines (to the journal,
under systemd) and exits 0 only for a reload that completed, so `systemctl reload` fails truthfully.
Settings are not re-read: a change to the environment file needs `systemctl restart`.
"""

import argparse
import socket
import sys

from .supervisor import DEFAULT_CONTROL_SOCKET


def main(argv: list[str] | None = None) -> int:
    """Send the request, print the supervisor's lines, and return 0 if the last one says ok."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-socket", default=DEFAULT_CONTROL_SOCKET,
                        help=f"the supervisor's control socket (default {DEFAULT_CONTROL_SOCKET})")
    args = parser.parse_args(argv)
    last = ""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(args.control_socket)
        except OSError as error:
            print(f"failed: no corechat supervisor answers at {args.control_socket} ({error.strerror}): "
                  "is corechat running? (systemctl status corechat)", file=sys.stderr)
            return 1
        sock.sendall(b"reload\n")
        for line in sock.makefile(encoding="utf-8", errors="replace"):
            last = line.rstrip("\n")
            print(last, file=sys.stderr if last.startswith("failed") else sys.stdout, flush=True)
    if not last:
        print("failed: the supervisor hung up without an answer (it stopped, or was killed)", file=sys.stderr)
    return 0 if last.startswith("ok:") else 1


if __name__ == "__main__":
    sys.exit(main())
