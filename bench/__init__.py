"""corechat's benchmark suite: `python bench/run.py` and the scripts beside it, the micro-probes in
bench/probes/, and what they share: where results go and what they record, how a benchmark starts
corechat, and its progress lines. The servers and the client come from harness/, as in the tests.

Results go to bench/results/<machine>/<name>.json and .md, the machine named by its CPU model and
the best instruction-set path corechat's kernels build for it (two CPUs sold under one name, such as
AMD EPYCs with and without AVX-512, get folders of their own), and every file records the CPU, its
kernel paths, the date and the commit.
"""

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from harness import GunicornServer
from service.topology import physical_cores

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Where the benchmarks build their dev models and llama.cpp.
CACHE_DIR = Path.home() / ".cache" / "corechat"
# The context of one sequence, corechat's MAX_MODEL_LEN and each of llama-server's slots alike.
CONTEXT_TOKENS = 4096


def cpu_model() -> str:
    """Return this machine's CPU model name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def kernel_paths() -> str:
    """Return the instruction-set paths corechat's kernels build for this CPU, best last (the best is what serves)."""
    from service.engine import kernels  # imports torch: only once the measuring is over

    return ",".join(["reference", *(isa.name for isa in kernels.instruction_sets(kernels.cpu_flags()))])


def git(*arguments: str, check: bool = True) -> str:
    """Run git in this repository; return its output."""
    return subprocess.run(["git", "-C", str(REPO), *arguments], capture_output=True, text=True, check=check).stdout


def machine() -> dict[str, str]:
    """Return what a figure needs to be traced: the CPU, its kernel paths, the date and the commit."""
    commit = git("rev-parse", "--short", "HEAD", check=False).strip()
    dirty = git("status", "--porcelain", "--untracked-files=no", check=False).strip()
    return {"cpu": cpu_model(), "kernel_paths": kernel_paths(), "cpus": str(len(_online_cpus())),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit + ("+uncommitted" if dirty else "")}


def _online_cpus() -> set[int]:
    """Return the CPUs this process may run on."""
    return os.sched_getaffinity(0)


def machine_folder(cpu: str, paths: str) -> str:
    """Return the results folder of a machine: its CPU model and its best kernel path, e.g. amd-epyc-avx512-vnni
    (avx512_bf16, attention's alone, does not name a machine)."""
    model = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$", " ", cpu.lower())
    best = [path for path in paths.split(",") if path != "avx512_bf16"][-1]
    words = re.findall(r"[a-z0-9]+", f"{model} {best}")
    return "-".join(words) or "unknown"


def save_results(name: str, results: dict, table: str, results_dir: Path | None = None) -> Path:
    """Print a probe's table and write it, with the figures behind it and the machine, to <name>.md and <name>.json.

    The files go to this machine's folder under bench/results/ unless results_dir names another;
    return their path without the suffix. A probe's own `machine` entries (its cores, its load) are
    kept beside the record.
    """
    where = machine()
    header = (f"{where['cpu']} ({where['cpus']} CPUs; kernel paths {where['kernel_paths']}), {where['date']}, "
              f"commit {where['commit']}\n\n")
    print(header + table)
    results_dir = results_dir or RESULTS_DIR / machine_folder(where["cpu"], where["kernel_paths"])
    results_dir.mkdir(parents=True, exist_ok=True)
    record = {**results, "machine": {**results.get("machine", {}), **where}}
    (results_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (results_dir / f"{name}.md").write_text(header + table)
    return results_dir / name


def start_corechat(log_dir: Path, model_dir: Path, redis_url: str, **settings) -> tuple[GunicornServer, float]:
    """Start Gunicorn as operators do and return it with the seconds until every worker was ready."""
    workers = int(settings.pop("workers", 0)) or physical_cores()
    if redis_url:
        settings["redis_url"] = redis_url
    settings = {"max_queue": 64, "max_model_len": CONTEXT_TOKENS, **settings}
    server = GunicornServer(log_dir, workers=workers, model=model_dir, **settings)
    began = time.perf_counter()
    server.start(timeout=600)
    return server, time.perf_counter() - began


def progress(message: str) -> None:
    """Tell the person waiting what the benchmark is doing now."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
