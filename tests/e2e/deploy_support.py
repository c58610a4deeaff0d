"""The shipped deploy/ files run for real: nginx and redis-server started from them on loopback."""

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from harness import REPO, free_port

DEPLOY = REPO / "deploy"
NGINX_SITE = DEPLOY / "nginx" / "corechat.conf"
MAKE_TLS_CERT = DEPLOY / "nginx" / "make-tls-cert.sh"
# Where the shipped site reads its certificate, as install.sh lays it out.
TLS_DIR = "/etc/corechat/tls"
REDIS_CONF = DEPLOY / "redis" / "corechat.conf"
REDIS_KV_CONF = DEPLOY / "redis" / "corechat-kv.conf"
# The placeholders of the shipped Redis config (install.sh replaces them with generated passwords).
REDIS_CORECHAT_PASSWORD = "CHANGE-ME-corechat-redis-password"
REDIS_ADMIN_PASSWORD = "CHANGE-ME-admin-redis-password"


def substitute_once(pattern: str, replacement: str, text: str) -> str:
    """Replace the one match of pattern, failing loudly if the shipped file changed shape."""
    result, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
    assert count == 1, f"expected one match of {pattern!r} in the shipped nginx config, found {count}"
    return result


def render_nginx_site(
    upstream_ports: list[int], listen_port: int, read_timeout: str | None = None, *, http_port: int, tls_dir: Path,
    text: str | None = None,
) -> str:
    """Return the shipped nginx site (or `text`, an installed copy of it) with the test's upstreams,
    HTTPS and HTTP ports, certificate folder and stream read timeout.

    The stream route also ignores the service's `X-Accel-Buffering: no` header, so a test through it
    shows that the config alone keeps nginx from buffering streams. The HTTP redirect names the
    test's HTTPS port, which the shipped file leaves at the default 443.
    """
    text = text or NGINX_SITE.read_text()
    text = substitute_once(
        r"^(    location = /v1/chat/completions \{\n)", r"\1        proxy_ignore_headers X-Accel-Buffering;\n", text
    )
    servers = "".join(f"    server 127.0.0.1:{port} max_fails=3 fail_timeout=10s;\n" for port in upstream_ports)
    text = substitute_once(r"^    server 127\.0\.0\.1:8000 .*;\n", servers, text)
    text = substitute_once(r"^    listen 443 ssl;$", f"    listen 127.0.0.1:{listen_port} ssl;", text)
    text = substitute_once(r"^    listen 80;$", f"    listen 127.0.0.1:{http_port};", text)
    text = substitute_once(r"https://\$host\$request_uri", f"https://$host:{listen_port}$request_uri", text)
    for name in ("fullchain.pem", "privkey.pem"):
        text = substitute_once(re.escape(f"{TLS_DIR}/{name}"), str(tls_dir / name), text)
    if read_timeout:
        text = substitute_once(r"proxy_read_timeout \S+;", f"proxy_read_timeout {read_timeout};", text)
    return text


def make_tls_cert(folder: Path) -> Path:
    """Make a self-signed certificate in folder with the script install.sh uses; return the folder."""
    subprocess.run(["bash", str(MAKE_TLS_CERT), str(folder), "localhost"], check=True, capture_output=True)
    return folder


def write_nginx_main(work_dir: Path, site: Path) -> Path:
    """Write a minimal nginx.conf that includes the site, with every path in work_dir.

    It compresses every type, as a host's main config may (Debian's turns gzip on): the shipped
    site must keep streams uncompressed, since gzip holds output back until its buffer fills.
    """
    main = work_dir / "nginx.conf"
    temp_paths = "".join(f"    {kind}_temp_path {work_dir}/{kind}_temp;\n"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main.write_text(
        f"daemon off;\nworker_processes 1;\npid {work_dir}/nginx.pid;\nerror_log {work_dir}/error.log info;\n"
        f"events {{ worker_connections 256; }}\n"
        f"http {{\n    access_log {work_dir}/access.log;\n    gzip on;\n    gzip_types *;\n    gzip_min_length 1;\n"
        f"{temp_paths}    include {site};\n}}\n"
    )
    return main


def nginx_binary() -> str:
    """Return the path of nginx, or fail with how to get it."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise RuntimeError("nginx is not installed (apt-get install nginx)")
    return binary


class NginxServer:
    """nginx on loopback ports in front of Gunicorn instances, from the shipped site config: HTTPS with
    a self-signed certificate (`ca_file` is what clients must trust), and HTTP that redirects to it."""

    def __init__(self, work_dir: Path, upstream_ports: list[int], read_timeout: str | None = None):
        self.port = free_port()
        self.http_port = free_port()
        self.work_dir = work_dir
        tls_dir = make_tls_cert(work_dir / "tls")
        self.ca_file = str(tls_dir / "fullchain.pem")
        site = work_dir / "corechat.conf"
        site.write_text(render_nginx_site(upstream_ports, self.port, read_timeout, http_port=self.http_port,
                                          tls_dir=tls_dir))
        self.config = write_nginx_main(work_dir, site)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Return the base URL nginx serves (HTTPS)."""
        return f"https://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """Return the base URL of nginx's plain HTTP port (which only redirects)."""
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> "NginxServer":
        """Start nginx in the foreground and wait until it accepts connections."""
        self.process = subprocess.Popen(
            [nginx_binary(), "-c", str(self.config), "-e", str(self.work_dir / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port, self.process, lambda: self.log())
        return self

    def log(self) -> str:
        """Return nginx's error log."""
        path = self.work_dir / "error.log"
        return path.read_text(errors="replace")[-10000:] if path.exists() else ""

    def stop(self) -> None:
        """Stop nginx."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


class ShippedRedis:
    """redis-server running a shipped config (deploy/redis/corechat.conf, or corechat-kv.conf), on a free port
    in work_dir."""

    def __init__(self, work_dir: Path, conf: Path = REDIS_CONF):
        self.port = free_port()
        self.work_dir = work_dir
        self.conf = conf
        self.process: subprocess.Popen | None = None

    def url(self, user: str = "corechat", password: str = REDIS_CORECHAT_PASSWORD) -> str:
        """Return a redis:// URL for an ACL user of the shipped config."""
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    def start(self) -> "ShippedRedis":
        """Start redis-server with the shipped config, overriding only where it listens and writes.

        The folder is changed in a copy of the config, not by a later --dir: redis-server enters each
        `dir` as it reads it, and /var/lib/redis lets in only root and redis, so any other user running
        the tests stopped at the shipped line.
        """
        config = self.work_dir / self.conf.name
        config.write_text(re.sub(r"^dir .*$", f"dir {self.work_dir}", self.conf.read_text(), count=1, flags=re.M))
        self.process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", str(config), "--port", str(self.port),
             "--pidfile", str(self.work_dir / "redis.pid")],
            stdout=(self.work_dir / "redis.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_for_port(self.port, self.process, lambda: (self.work_dir / "redis.log").read_text())
        return self

    def stop(self) -> None:
        """Stop redis-server."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def wait_for_port(port: int, process: subprocess.Popen, log, timeout: float = 15) -> None:
    """Block until something accepts connections on the loopback port, or the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{log()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port} after {timeout} s:\n{log()}")
