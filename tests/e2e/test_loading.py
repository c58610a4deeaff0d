"""Finding the model under Gunicorn: a missing model stops it with the reason."""

import os
import subprocess
import sys
import time

from harness import REPO, free_port


def test_gunicorn_stops_with_the_reason_when_the_model_is_missing(tmp_path):
    env = {"MODEL": str(tmp_path / "missing"), "BIND": f"127.0.0.1:{free_port()}", "WORKERS": "1"}
    began = time.monotonic()
    result = subprocess.run(
        # No control socket: it would take (and then delete) the one in the user's home.
        [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", "--no-control-socket"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "devtools.devmodel" in result.stdout + result.stderr
    assert time.monotonic() - began < 60
