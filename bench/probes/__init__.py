"""Micro-probes: each times one part of corechat (a kernel, a decode step, attention, a prompt's products,
the first token, memory, the cache, request framing, a stall setting) and writes its own results file.

Each runs from the repository's root as `python bench/probes/<name>.py`; the ones that need torch
in a process of their own, apart from a benchmark's client, run as `python -m bench.probes ...`
(run_probe). What was measured once to decide something, and is no longer kept runnable, is in
bench/archive.md.
"""

import json
import subprocess
import sys

from bench import REPO


def run_probe(*args: str) -> dict:
    """Run a torch probe in its own process and return its JSON."""
    output = subprocess.run([sys.executable, "-m", "bench.probes", *args], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])
