"""The shipped Prometheus files: valid for promtool, true to the real metrics, and scraped for real."""

import json
import re
import shutil
import subprocess
import time

import pytest
import requests
import yaml

from harness import REPO, chat, free_port, scrape
from tests.support import TEST_API_KEY

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "corechat-rules.yml"
DASHBOARD = PROMETHEUS_DIR / "corechat-dashboard.json"


def promtool(*args: str) -> subprocess.CompletedProcess:
    """Run promtool (Debian's prometheus package) and return its result."""
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (apt-get install prometheus)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def dashboard_queries() -> list[str]:
    """Return every PromQL expression of the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def recorded_names() -> set[str]:
    """Return the names the recording rules produce."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def config_with_key_file(tmp_path, key: str) -> dict:
    """Return the shipped config with its credentials file moved to tmp_path, holding key."""
    config = yaml.safe_load(CONFIG.read_text())
    (job,) = config["scrape_configs"]
    assert job["authorization"]["credentials_file"] == "/etc/prometheus/corechat-api-key"
    key_file = tmp_path / "corechat-api-key"
    key_file.write_text(key)
    job["authorization"]["credentials_file"] = str(key_file)
    return config


def test_scrape_config_and_rules_pass_promtool(tmp_path):
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump({**config_with_key_file(tmp_path, TEST_API_KEY), "rule_files": [str(RULES)]}))
    checked = promtool("check", "config", str(config_path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_rules_and_dashboard_reference_only_metrics_that_exist(gunicorn_server):
    assert chat(gunicorn_server, max_tokens=2).status_code == 200
    scraped = {name for name, _ in scrape(gunicorn_server)}
    texts = [RULES.read_text(), *dashboard_queries()]
    referenced = {name for text in texts for name in re.findall(r"\bcorechat_[a-z0-9_]+", text)}
    assert referenced, "no corechat metric referenced at all"
    assert referenced <= scraped, referenced - scraped
    used_records = {name for query in dashboard_queries() for name in re.findall(r"\bcorechat:[a-z0-9_:]+", query)}
    assert used_records <= recorded_names(), used_records - recorded_names()


@pytest.fixture()
def prometheus(keyed_server, tmp_path):
    """Run a real Prometheus on loopback with the shipped config, pointed at a test service that
    needs a key (on /metrics too, by default), which Prometheus reads from its credentials file."""
    config = config_with_key_file(tmp_path, TEST_API_KEY)
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    job.update(scrape_timeout="1s")
    job["static_configs"] = [{"targets": [keyed_server.url.removeprefix("http://")]}]
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            shutil.which("prometheus"),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("wb"),
    )
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(30)


def query(prometheus_url: str, promql: str) -> list[dict]:
    """Run an instant query through Prometheus's HTTP API; return its result vector."""
    response = requests.get(f"{prometheus_url}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    return response.json()["data"]["result"]


def test_real_prometheus_scrapes_the_service_with_the_shipped_config_and_key(prometheus, keyed_server):
    deadline = time.monotonic() + 60
    ready, recorded = [], []
    while time.monotonic() < deadline and not (ready and recorded):
        try:
            ready = query(prometheus, 'corechat_workers_ready{job="corechat"}')
            recorded = query(prometheus, "corechat:requests_running:sum")
        except requests.ConnectionError:
            pass  # Prometheus is still starting
        time.sleep(0.5)
    assert ready, "Prometheus never stored a corechat series"
    assert float(ready[0]["value"][1]) == keyed_server.workers
    assert recorded, "the shipped recording rules never ran"
    assert float(recorded[0]["value"][1]) == 0
