"""corechat's benchmark: `python bench/run.py` (see docs/performance.md), and its probes."""

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def save_results(name: str, results: dict, table: str, results_dir: Path = RESULTS_DIR) -> None:
    """Print a probe's table and write it, with the figures behind it, to <name>.md and <name>.json."""
    print(table)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (results_dir / f"{name}.md").write_text(table)
