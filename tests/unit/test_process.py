"""The process layer (service/process/) keeps its rule: the Gunicorn master never imports torch.

Each check runs in a fresh interpreter whose import system refuses the named packages, as a host
without them would: whatever the master (or the supervisor) imports that reaches for one fails
there, and the attempt is reported even where code swallows the ImportError.
"""

import ipaddress
import json
import os
import pkgutil
import subprocess
import sys

import service.process
from harness import REPO
from service.process import lifecycle

# Installed first in the child: refuses the blocked top-level packages and records each attempt.
REFUSE_IMPORTS = """
import importlib.abc, json, sys

BLOCKED = set(json.loads(sys.argv[1]))
attempts = []


class RefuseBlockedPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            attempts.append(name)
            raise ImportError(f"{name} is unimportable in this test")
        return None


sys.meta_path.insert(0, RefuseBlockedPackages())
"""

# What a Gunicorn master runs of corechat before and around its forks, without forking: it reads
# gunicorn.conf.py, resolves and checks the worker class (Arbiter.setup), runs on_starting, makes a
# worker object and runs pre_fork for it, then child_exit and on_exit.
RUN_THE_MASTER = """
import os
from gunicorn.app.wsgiapp import WSGIApplication
from gunicorn.arbiter import Arbiter

sys.argv = ["gunicorn", "-c", "gunicorn.conf.py"]
arbiter = Arbiter(WSGIApplication("%(prog)s [OPTIONS] [APP_MODULE]"))
arbiter.cfg.on_starting(arbiter)
worker = arbiter.worker_class(1, os.getpid(), [], arbiter.app, arbiter.timeout / 2.0, arbiter.cfg, arbiter.log)
arbiter.cfg.pre_fork(arbiter, worker)
worker.pid = os.getpid() + 1
arbiter.cfg.child_exit(arbiter, worker)
arbiter.cfg.on_exit(arbiter)
assert arbiter.worker_class.__name__ == "CorechatWorker", arbiter.worker_class
"""

REPORT = """
print(json.dumps(attempts))
"""


def imports_refused(blocked: tuple[str, ...], code: str, tmp_path, **env: str) -> list[str]:
    """Run `code` in a fresh interpreter in the repository where `blocked` packages cannot be imported;
    return the imports of them it attempted."""
    metrics = tmp_path / "metrics"
    metrics.mkdir(exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", REFUSE_IMPORTS + code + REPORT, json.dumps(blocked)],
        cwd=REPO,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_the_master_reads_its_config_and_runs_its_hooks_without_torch(tmp_path):
    """With PRELOAD_LIBRARIES=false, gunicorn.conf.py, the worker class and the master's hooks import no torch."""
    assert imports_refused(("torch",), RUN_THE_MASTER, tmp_path, PRELOAD_LIBRARIES="false", WORKERS="2") == []


def test_every_module_of_the_process_layer_imports_without_torch(tmp_path):
    """No module of service/process/ reaches torch at import, whatever imports it first."""
    names = [f"service.process.{module.name}" for module in pkgutil.iter_modules(service.process.__path__)]
    assert "service.process.worker" in names and "service.process.lifecycle" in names
    code = "import importlib\n" + "".join(f"importlib.import_module({name!r})\n" for name in names)
    assert imports_refused(("torch",), code, tmp_path) == []


def test_the_supervisor_and_reload_need_neither_torch_nor_flask(tmp_path):
    """The unit's main process and its ExecReload stay small: no torch, no Flask."""
    code = "import service.process.supervisor, service.process.reload\n"
    assert imports_refused(("torch", "flask", "transformers"), code, tmp_path) == []


def test_a_bind_beyond_loopback_with_no_allowed_network_is_warned_of_at_start():
    """Other hosts' connections are closed unseen unless ALLOWED_NETWORKS lists them: say so at start."""
    for bind in ("0.0.0.0:8000", "[::]:8000", "192.0.2.7:8000", "0.0.0.0", "chat.example.com:8000"):
        assert "ALLOWED_NETWORKS" in lifecycle.peers_shut_out(bind, ()), bind
    for bind in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.2", "unix:/run/corechat.sock"):
        assert lifecycle.peers_shut_out(bind, ()) is None, bind
    assert lifecycle.peers_shut_out("0.0.0.0:8000", (ipaddress.ip_network("10.0.0.0/24"),)) is None
