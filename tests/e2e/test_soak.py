"""The soak script itself: its quick mode runs in the suite and must pass every check."""

import json
import subprocess
import sys

from harness import REPO


def test_quick_soak_passes_every_check(tiny_model_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/soak.py", "--quick", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["passed"], report["checks"]
    assert all(report["checks"][check]
               for check in ("no_5xx", "no_hung_requests", "every_stream_complete", "queues_back_to_zero"))
    assert report["requests"] == 60
    assert set(report["by_kind"]) == {"stream", "whole", "repeat", "hang_up", "invalid", "long"}
    assert report["long_prompt_tokens"] == 2_000
    assert "| no_5xx | pass |" in (tmp_path / "soak.md").read_text()
