"""What a running server says of itself: /readyz of every worker, /metrics samples, and the lines of its log."""

import re
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from prometheus_client.parser import text_string_to_metric_families

# The debug line service/observability/observed.py logs for each request's first token.
FIRST_TOKEN_TIMINGS = re.compile(r"first token timings \(ms\): (.*)$")


def ready_facts(server, rounds: int = 40) -> dict[int, dict]:
    """Return /readyz of every worker, keyed by pid (fewer if some never answered in `rounds` rounds).

    Each round asks on several connections at once: asked one at a time, the kernel may hand every
    connection to the same worker (the one already awake wins each accept race)."""

    def ask(_) -> dict:
        return requests.get(f"{server.url}/readyz", headers={"Connection": "close"}, timeout=5).json()

    facts = {}
    with ThreadPoolExecutor(2 * server.workers) as pool:
        for _ in range(rounds):
            for body in pool.map(ask, range(2 * server.workers)):
                facts[body["worker_pid"]] = body
            if len(facts) >= server.workers:
                break
            time.sleep(0.05)
    return facts


def finished_by_worker(server) -> dict[int, int]:
    """Return the generations each worker of a server finished, keyed by pid."""
    return {pid: facts["requests_finished"] for pid, facts in ready_facts(server).items()}


def send_until_every_worker_served(server, send_round, most_rounds: int) -> dict[int, int]:
    """Call send_round until every worker has finished a generation since (or most_rounds calls);
    return how many each finished. The kernel may hand many connections in a row to one worker, and a
    worker forked meanwhile starts from zero."""
    before = finished_by_worker(server)
    for _ in range(most_rounds):
        send_round()
        served = {pid: count - before.get(pid, 0) for pid, count in finished_by_worker(server).items()}
        if all(served.values()):
            break
    return served


def parse_samples(text: str) -> dict[tuple, float]:
    """Return every sample of a scrape keyed by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(server) -> dict[tuple, float]:
    """Scrape a server's /metrics once and return its samples, with its first API key as Prometheus sends it."""
    headers = {"Connection": "close"}
    keys = server.env.get("API_KEYS", "")
    if keys:
        headers["Authorization"] = f"Bearer {keys.split(',')[0]}"
    response = requests.get(f"{server.url}/metrics", headers=headers, timeout=5)
    assert response.status_code == 200
    return parse_samples(response.text)


def value(samples: dict, name: str, **labels) -> float:
    """Return one sample's value (0 when the series does not exist)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_samples(server, condition, timeout: float = 30) -> dict:
    """Scrape until condition(samples) holds; return those samples or fail with the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if condition(samples) or time.monotonic() > deadline:
            assert condition(samples), {
                key: val
                for key, val in samples.items()
                if key[0] in ("corechat_requests_running", "corechat_requests_waiting", "corechat_workers_ready")
            }
            return samples
        time.sleep(0.1)


def parse_first_token_timings(log_text: str) -> list[dict[str, float]]:
    """Return the fields of every `first token timings` line of a server log."""
    rows = []
    for line in log_text.splitlines():
        match = FIRST_TOKEN_TIMINGS.search(line)
        if match:
            fields = dict(item.split("=", 1) for item in match.group(1).split())
            rows.append({key: float(value) for key, value in fields.items() if value != "-"})
    return rows
