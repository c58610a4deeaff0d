"""A Debian 12 machine booted with systemd as PID 1 in systemd-nspawn, for deploy/test/run.py.

The base system comes from Debian's own packages (debootstrap, then the apt line of docs/deploy.md)
and is cached under ~/.cache/corechat/ by what decides it; every run boots a throwaway overlay of it
with no network but loopback, so nothing it starts can meet the host's ports. Needs root,
debootstrap and systemd-nspawn (apt-get install debootstrap systemd-container).
"""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "corechat"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# What a Debian 12 server has before the operator follows docs/deploy.md.
BASE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "ca-certificates")
SOURCES = (
    f"deb {MIRROR} {SUITE} main\n"
    f"deb {MIRROR} {SUITE}-updates main\n"
    f"deb http://deb.debian.org/debian-security {SUITE}-security main\n"
)
# Bump when the way the base is built changes in a way the key below does not see.
BASE_RECIPE = 1
BOOT_SECONDS = 60


def log(message: str) -> None:
    """Tell the operator what the harness is doing (stderr; the table goes to stdout)."""
    print(f"[deploy-test {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def documented_apt_packages() -> list[str]:
    """Return the packages docs/deploy.md tells an operator to install, so the test installs those."""
    line = re.search(r"^apt-get update && apt-get install -y (.+)$", (REPO / "docs/deploy.md").read_text(),
                     flags=re.MULTILINE)
    if not line:
        raise RuntimeError("docs/deploy.md has no `apt-get update && apt-get install -y ...` line")
    return line.group(1).split()


def base_system() -> Path:
    """Return a Debian 12 root with systemd and the documented packages, building it once (minutes)."""
    packages = documented_apt_packages()
    key = hashlib.sha256(repr((BASE_RECIPE, SUITE, MIRROR, BASE_PACKAGES, SOURCES, packages)).encode()).hexdigest()
    base = CACHE / f"deploy-base-{key[:16]}"
    if (base / ".complete").exists():
        return base
    log(f"building the Debian {SUITE} base in {base} (debootstrap, a few minutes, once)")
    building = base.with_name(base.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    building.parent.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(building), MIRROR])
    (building / "etc/apt/sources.list").write_text(SOURCES)
    # The operator's step, as the docs write it (with the host's network, as a real host has).
    run(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "-D", str(building), "--pipe", "sh", "-c",
         "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q " + " ".join(packages)
         + " && apt-get clean"])
    (building / "etc/hostname").write_text("corechat-test\n")
    (building / ".complete").write_text(" ".join(packages) + "\n")
    shutil.rmtree(base, ignore_errors=True)
    building.rename(base)
    return base


def host_pip_binds() -> list[str]:
    """Return nspawn options that give pip in the base what the host's pip finds on this disk.

    A machine's pip reads /etc/xdg/pip (the host's global config: local indexes and constraints);
    the host's PIP_* environment (wheels such as torch's CPU build in /opt/wheels, the certificates
    its network needs in PIP_CERT) goes in as it is, with the files it names.
    """
    paths = ["/etc/xdg/pip", "/opt/wheels", "/opt/pypi", "/opt/pypi-more", os.environ.get("PIP_CERT", "")]
    options = [f"--bind-ro={path}" for path in paths if path and Path(path).exists()]
    return options + [f"--setenv={key}={value}" for key, value in os.environ.items() if key.startswith("PIP_")]


def wheelhouse(base: Path) -> Path:
    """Return a folder of wheels for everything install.sh and the dev model install, built once by the
    base's own Python (so the wheels fit it) with the network, for a machine that has none."""
    requirements = [REPO / "requirements.txt", REPO / "requirements-devmodel.txt"]
    key = hashlib.sha256(base.name.encode() + b"".join(path.read_bytes() for path in requirements)).hexdigest()
    folder = CACHE / f"deploy-wheels-{key[:16]}"
    if (folder / ".complete").exists():
        return folder
    log(f"collecting wheels for the machine's Python in {folder} (once)")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    run(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--volatile=overlay", "-D", str(base),
         *host_pip_binds(), f"--bind-ro={REPO}:/src", f"--bind={folder}:/wheels", "--pipe", "sh", "-c",
         "python3 -m venv /tmp/pip && /tmp/pip/bin/pip install --quiet --upgrade pip"
         " && /tmp/pip/bin/pip wheel --quiet -r /src/requirements-devmodel.txt -w /wheels"
         " && /tmp/pip/bin/pip download --quiet pip -d /wheels"])
    (folder / ".complete").touch()
    return folder


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a host command, failing loudly with its output."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        output = result.stdout[-4000:] + result.stderr[-4000:]
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{output}")
    return result


class Machine:
    """A booted overlay of the base: run commands in it, read its files, power it off."""

    def __init__(self, base: Path, work: Path, binds: dict[str, str]):
        self.base = base
        self.work = work
        self.binds = binds
        self.name = f"corechat-test-{os.getpid()}"
        self.root = work / "root"
        self.process: subprocess.Popen | None = None
        self.leader = 0

    def boot(self) -> "Machine":
        """Mount the overlay, boot systemd in it and wait until it has started its units."""
        for folder in ("upper", "overlay-work", "root"):
            (self.work / folder).mkdir(parents=True, exist_ok=True)
        layers = f"lowerdir={self.base},upperdir={self.work / 'upper'},workdir={self.work / 'overlay-work'}"
        run(["mount", "-t", "overlay", "overlay", "-o", layers, str(self.root)])
        binds = [f"--bind-ro={source}:{target}" for source, target in self.binds.items()]
        self.console = (self.work / "console.log").open("wb")
        self.process = subprocess.Popen(
            ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--private-network", "-D", str(self.root),
             f"--machine={self.name}", *binds, "--boot"],
            stdin=subprocess.DEVNULL, stdout=self.console, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + BOOT_SECONDS
        while not self.leader:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"systemd-nspawn did not boot:\n{(self.work / 'console.log').read_text()[-4000:]}")
            self.leader = self._find_leader()
            time.sleep(0.2)
        state = ""
        while state not in ("running", "degraded"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the machine did not finish booting ({state}):\n"
                                   + self.run("systemctl --failed --no-pager", check=False).stdout)
            time.sleep(0.5)
            state = self.run("systemctl is-system-running", check=False).stdout.strip()
        log(f"booted {self.name} (systemd {self.run('systemctl --version').stdout.split()[1]}, {state})")
        return self

    def _find_leader(self) -> int:
        """Return the pid of the container's PID 1 (systemd, a child of systemd-nspawn), or 0."""
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        for pid in children.split():
            if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                return int(pid)
        return 0

    def run(self, script: str, *, check: bool = True, timeout: float = 600, env: dict | None = None,
            background: bool = False):
        """Run a shell script inside the machine as root (in all its namespaces), and return its result."""
        variables = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                     "HOME": "/root", **(env or {})}
        command = ["nsenter", f"--target={self.leader}", "--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup",
                   "--root", "--wd", "env", "-i", *[f"{key}={value}" for key, value in variables.items()],
                   "sh", "-c", script]
        if background:
            return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"in the machine, `{script}` exited {result.returncode}:\n"
                               f"{result.stdout[-4000:]}{result.stderr[-4000:]}")
        return result

    def path(self, inside: str) -> Path:
        """Return where a path of the machine lies on the host."""
        return self.root / inside.lstrip("/")

    def poweroff(self) -> None:
        """Power the machine off (kill it if it does not go), unmount and remove the overlay."""
        if self.process and self.process.poll() is None:
            # systemd-nspawn turns SIGTERM into a clean shutdown of the container.
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        subprocess.run(["umount", str(self.root)], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)
