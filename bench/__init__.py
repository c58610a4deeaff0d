"""corechat's benchmark: `python bench/run.py` (see docs/performance.md), and its probes."""

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def machine() -> dict[str, str]:
    """Return what a figure needs to be traced: the CPU, its kernel paths, the date and the commit."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu_model(), "kernel_paths": kernel_paths(), "cpus": str(len(_online_cpus())),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit + ("+uncommitted" if dirty else "")}


def _online_cpus() -> set[int]:
    """Return the CPUs this process may run on."""
    import os

    return os.sched_getaffinity(0)


def save_results(name: str, results: dict, table: str, results_dir: Path = RESULTS_DIR) -> None:
    """Print a probe's table and write it, with the figures behind it and the machine, to <name>.md and <name>.json."""
    where = machine()
    header = (f"{where['cpu']} ({where['cpus']} CPUs; kernel paths {where['kernel_paths']}), {where['date']}, "
              f"commit {where['commit']}\n\n")
    print(header + table)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps({"machine": where, **results}, indent=2) + "\n")
    (results_dir / f"{name}.md").write_text(header + table)
