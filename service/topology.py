"""The CPUs this process may run on, grouped by physical core.

Read by the settings (a worker per physical core, torch threads per worker) and by the process
layer, which pins workers to their cores; it imports nothing of corechat, so both can.
"""

import os
from pathlib import Path


def allowed_cpus() -> list[int]:
    """Return the CPUs this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def physical_core_groups() -> list[list[int]]:
    """Group the CPUs this process may use by physical core (SMT siblings share a group)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in allowed_cpus():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            package, core = "?", str(cpu)
        groups.setdefault((package, core), []).append(cpu)
    return list(groups.values())


def physical_cores() -> int:
    """Count the physical cores this process may use (logical CPUs minus SMT siblings)."""
    return max(1, len(physical_core_groups()))
