"""Install corechat as docs/deploy.md says, under a real systemd, and check what reload, restart and
stop guarantee under continuous traffic; print a table of what held.

    make test-deploy        (as root: python3 deploy/test/run.py [--source DIR])

A Debian 12 machine (deploy/test/container.py: debootstrap's base, cached; systemd 252 as PID 1 in
systemd-nspawn; loopback only) gets the source tree (read-only), runs `deploy/install.sh
--dev-model tiny` with pip reading wheels prepared once, and then, with clients streaming and asking
for short replies both directly and through the shipped nginx site, the checks below run in order on
the one machine. The table goes to stdout and to deploy/test/results.md (with the date, CPU and
commit). Takes minutes; the first run builds the base and the wheels too.
"""

import argparse
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from container import REPO, Machine, base_system, wheelhouse

SOURCE_IN_MACHINE = "/usr/local/src/corechat"
WHEELS_IN_MACHINE = "/srv/wheels"
RESULTS = Path(__file__).with_name("results.md")
TRAFFIC_DIR = "/var/tmp/corechat-traffic"
# Steady traffic: each kind on each path, one request after another on fresh connections.
STEADY = {"stream": 2, "whole": 2}
VIA = {"direct": "127.0.0.1:8000", "nginx": "https://127.0.0.1:443"}
WARM_SECONDS = 3.0
AFTER_SECONDS = 3.0
GAP_LIMIT_SECONDS = 1.0
RELOADS_IN_A_ROW = 3
BROKEN_LINE = 'raise RuntimeError("deploy test: this version of the code does not start")\n'
PROCESSES = r"""
import json, subprocess
def show(name):
    command = ["systemctl", "show", "-p", name, "--value", "corechat"]
    return subprocess.run(command, capture_output=True, text=True).stdout.strip()
def children(pid):
    try:
        return [int(child) for child in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []
main, group, procs = int(show("MainPID")), show("ControlGroup"), []
for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup"):
    try:
        procs = sorted(int(pid) for pid in open(f"{root}{group}/cgroup.procs").read().split())
        break
    except OSError:
        pass
print(json.dumps({"main": main, "masters": {str(m): children(m) for m in children(main)}, "unit": procs}))
"""


@dataclass
class Row:
    """One line of the table: what was checked, whether it held, and what was measured."""

    check: str
    held: bool
    measured: str


class Traffic:
    """traffic.py running in the machine for the length of a with block; results() reads what it wrote."""

    def __init__(self, machine: Machine, name: str, clients: dict[str, int], via: dict[str, str] = VIA):
        self.machine, self.name, self.clients, self.via = machine, name, clients, via
        self.out = f"{TRAFFIC_DIR}/{name}.jsonl"
        self.stop_file = f"{TRAFFIC_DIR}/{name}.stop"

    def __enter__(self) -> "Traffic":
        """Start the clients."""
        self.machine.path(TRAFFIC_DIR).mkdir(parents=True, exist_ok=True)
        arguments = [f"--via {name}={address}" for name, address in self.via.items()]
        arguments += [f"--clients {kind}={count}" for kind, count in self.clients.items()]
        traffic = f"{SOURCE_IN_MACHINE}/deploy/test/traffic.py"
        self.process = self.machine.run(
            f"exec python3 {traffic} {self.out} {self.stop_file} {' '.join(arguments)}", background=True
        )
        return self

    def __exit__(self, *exc_info) -> None:
        """Stop the clients after their current requests."""
        self.machine.path(self.stop_file).touch()
        self.process.wait(180)

    def results(self) -> list[dict]:
        """Return every request recorded so far."""
        path = self.machine.path(self.out)
        return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def failed(result: dict) -> bool:
    """Tell whether a request failed in any way: refused, reset, an error status, or cut short."""
    return "error" in result or result.get("status") != 200 or not result.get("complete")


def during(results: list[dict], began: float, ended: float) -> list[dict]:
    """Return the requests that were under way at some moment of [began, ended]."""
    return [result for result in results if result["ended"] >= began and result["began"] <= ended]


def longest_gap(results: list[dict], began: float, ended: float) -> float:
    """Return the longest time between two successive responses starting, over [began, ended]."""
    starts = sorted(result["first_byte"] for result in results if "first_byte" in result)
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:]) if later >= began and earlier <= ended]
    return max(gaps, default=float("inf"))


class Deployment:
    """The machine with corechat installed: systemctl, the journal, and the unit's processes."""

    def __init__(self, machine: Machine):
        self.machine = machine

    def systemctl(self, command: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, float]:
        """Run `systemctl COMMAND corechat` and return its result and how long it took."""
        began = time.time()
        result = self.machine.run(f"systemctl {command} corechat", check=False, timeout=timeout)
        return result, time.time() - began

    def show(self, *names: str) -> dict[str, str]:
        """Return properties of the unit."""
        output = self.machine.run(f"systemctl show corechat -p {','.join(names)}").stdout
        return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)

    def processes(self) -> dict:
        """Return the main PID, its children (the masters) with theirs (the workers), and every process of the unit."""
        return json.loads(self.machine.run(f"python3 -c '{PROCESSES}'").stdout)

    def journal(self, since: float) -> str:
        """Return what the unit logged since a moment (wall clock)."""
        return self.machine.run(f"journalctl -u corechat --since @{since - 1:.0f} -o cat --no-pager").stdout

    def wait_active(self, timeout: float = 300) -> None:
        """Block until the unit is active (the supervisor said READY=1)."""
        deadline = time.monotonic() + timeout
        while self.show("ActiveState")["ActiveState"] != "active":
            if time.monotonic() > deadline:
                raise TimeoutError("corechat did not become active:\n" + self.journal(time.time() - timeout)[-4000:])
            time.sleep(0.5)

    def readyz(self) -> str:
        """Return the HTTP status of GET /readyz right now, as curl gives it (000: no answer)."""
        return self.machine.run("curl -s -o /dev/null -m 5 -w '%{http_code}' 127.0.0.1:8000/readyz", check=False).stdout


def one_master(tree: dict, workers: int) -> tuple[bool, str]:
    """Tell whether the unit runs exactly the supervisor, one master and its workers, and describe it."""
    masters = tree["masters"]
    everyone = {tree["main"], *map(int, masters), *(pid for pids in masters.values() for pid in pids)}
    held = (len(masters) == 1 and all(len(pids) == workers for pids in masters.values())
            and set(tree["unit"]) == everyone)
    shape = ", ".join(f"master {master} with {len(pids)} workers" for master, pids in masters.items())
    return held, f"MainPID {tree['main']}: {shape or 'no master'}; {len(tree['unit'])} processes in the unit"


def check_install(deployment: Deployment, began: float) -> list[Row]:
    """The documented install starts the unit, which is active only once it serves, and warns of a capped
    LimitNOFILE."""
    ready_at_once = deployment.readyz()
    state = deployment.show("ActiveState", "MainPID")
    limits = deployment.machine.run(f"grep 'Max open files' /proc/{state['MainPID']}/limits").stdout.split()
    soft = int(limits[3])
    warned = "below the 65536 the unit asks for" in deployment.journal(began)
    security = deployment.machine.run("systemd-analyze security corechat --no-pager | tail -1").stdout
    score = re.search(r"exposure level for corechat\.service: (.+)$", security.strip())
    redis = deployment.machine.run("systemctl is-active redis-server@corechat redis-server@corechat-kv",
                                   check=False).stdout.strip()
    return [
        Row("install.sh --dev-model tiny, as documented: unit active, /readyz 200 at once",
            state["ActiveState"] == "active" and ready_at_once == "200",
            f"installed and started in {time.time() - began:.0f} s; /readyz {ready_at_once} right after"),
        Row("LimitNOFILE capped below the unit's 65536: a warning at start", warned == (soft < 65536),
            f"open-files limit {soft}; {'warned' if warned else 'no warning'}"),
        Row("systemd-analyze security (live)", bool(score), score.group(1) if score else security),
        Row("the replies' and the KV state's Redis instances run apart", redis == "active\nactive",
            f"redis-server@corechat, redis-server@corechat-kv: {redis.replace(chr(10), ', ')}"),
    ]


def check_reload(deployment: Deployment, number: int, workers: int, first_main: int) -> Row:
    """A reload under traffic: the job succeeds, nothing fails, no gap of a second, one master after."""
    before = deployment.processes()
    old_workers = {pid for pids in before["masters"].values() for pid in pids}
    with Traffic(deployment.machine, f"reload-{number}", STEADY) as traffic:
        time.sleep(WARM_SECONDS)
        began = time.time()
        result, took = deployment.systemctl("reload")
        ended = time.time()
        time.sleep(AFTER_SECONDS)
    after = deployment.processes()
    shape_held, shape = one_master(after, workers)
    new_workers = {pid for pids in after["masters"].values() for pid in pids}
    requests = during(traffic.results(), began, ended)
    failures = [request for request in requests if failed(request)]
    gap = longest_gap(traffic.results(), began, ended)
    gap_before = longest_gap(traffic.results(), began - WARM_SECONDS + 1, began)
    via_nginx = sum(request["via"] == "nginx" for request in requests)
    held = (result.returncode == 0 and not failures and gap < GAP_LIMIT_SECONDS and shape_held
            and after["main"] == first_main and not new_workers & old_workers)
    return Row(f"reload {number} under traffic", held,
               f"job {'ok' if result.returncode == 0 else 'FAILED'} in {took:.1f} s; {len(requests)} requests "
               f"({via_nginx} via nginx), {len(failures)} failed; longest gap {gap:.2f} s ({gap_before:.2f} s "
               f"in the {WARM_SECONDS - 1:.0f} s before); after: {shape}"
               f"{'' if after['main'] == first_main else ' (MainPID CHANGED)'}"
               f"{'' if not new_workers & old_workers else ' (old workers remain)'}"
               + (f"; {failures[0]}" if failures else "")
               + (f"; {result.stderr.strip()[-300:]}" if result.returncode else ""))


def check_signal_reload(deployment: Deployment, signal_name: str, workers: int, first_main: int) -> Row:
    """Gunicorn's reload or upgrade signal sent to the unit's main process under traffic: a reload (nothing
    fails, no gap of a second, one master with new workers, the same MainPID), not the unit's end."""
    before = deployment.processes()
    old_workers = {pid for pids in before["masters"].values() for pid in pids}
    with Traffic(deployment.machine, f"signal-{signal_name}", STEADY) as traffic:
        time.sleep(WARM_SECONDS)
        began = time.time()
        deployment.machine.run(f"systemctl kill -s {signal_name} --kill-whom=main corechat")
        deadline = time.monotonic() + 300
        while True:
            after = deployment.processes()
            shape_held, shape = one_master(after, workers)
            new_workers = {pid for pids in after["masters"].values() for pid in pids}
            if (shape_held and new_workers and not new_workers & old_workers) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        ended = time.time()
        time.sleep(AFTER_SECONDS)
    requests = during(traffic.results(), began, ended)
    failures = [request for request in requests if failed(request)]
    gap = longest_gap(traffic.results(), began, ended)
    active = deployment.show("ActiveState")["ActiveState"]
    held = (shape_held and not new_workers & old_workers and after["main"] == first_main and not failures
            and gap < GAP_LIMIT_SECONDS and active == "active")
    return Row(f"SIG{signal_name} to the main process under traffic: a reload", held,
               f"unit {active}; new workers in {ended - began:.1f} s; {len(requests)} requests, {len(failures)} "
               f"failed; longest gap {gap:.2f} s; after: {shape}"
               f"{'' if after['main'] == first_main else ' (MainPID CHANGED)'}"
               + (f"; {failures[0]}" if failures else ""))


def check_failed_reload(deployment: Deployment) -> Row:
    """A reload of code that cannot start fails, leaves the processes as they were, and says why."""
    app = "/opt/corechat/app/wsgi.py"
    deployment.machine.run(f"cp {app} /var/tmp/wsgi.py.good && printf '%s' '{BROKEN_LINE}' >> {app}")
    before = deployment.processes()
    try:
        with Traffic(deployment.machine, "failed-reload", STEADY) as traffic:
            time.sleep(WARM_SECONDS)
            began = time.time()
            result, took = deployment.systemctl("reload")
            ended = time.time()
            time.sleep(AFTER_SECONDS)
    finally:
        deployment.machine.run(f"cp /var/tmp/wsgi.py.good {app}")
    after = deployment.processes()
    journal = deployment.journal(began)
    reason = next((line for line in journal.splitlines() if "reload failed" in line), "")
    failures = [request for request in during(traffic.results(), began, ended) if failed(request)]
    held = (result.returncode != 0 and after == before and "reload failed" in journal
            and "this version of the code does not start" in journal and not failures)
    return Row("reload of code that cannot start", held,
               f"job {'failed' if result.returncode else 'SUCCEEDED'} in {took:.1f} s; processes "
               f"{'as before' if after == before else 'CHANGED'}; {len(failures)} requests failed; journal: "
               f"{reason.split(': ', 1)[-1][:160] or 'NO REASON'}")


def check_stop(deployment: Deployment) -> Row:
    """A stop (after reloads) lets in-flight streams finish, refuses new connections, and ends in success."""
    with Traffic(deployment.machine, "stop", {"long": 2, "probe": 1}, via={"direct": VIA["direct"]}) as traffic:
        time.sleep(WARM_SECONDS)
        began = time.time()
        result, took = deployment.systemctl("stop", timeout=300)
        time.sleep(1)
    state = deployment.show("ActiveState", "Result", "ExecMainStatus")
    results = traffic.results()
    streams = [r for r in results if r["kind"] == "long" and r.get("first_byte", began) < began < r["ended"]]
    cut = [r for r in streams if failed(r)]
    probes = [r for r in results if r["kind"] == "probe" and r["began"] > began + 0.2]
    refused = [r for r in probes if r.get("error") == "refused"]
    other = [r for r in probes if failed(r) and r.get("error") != "refused" and r["began"] < began + took]
    journal = deployment.journal(began)
    killed = "SIGKILL" in journal or "Killing process" in journal
    held = (result.returncode == 0 and streams and not cut and refused and not other and not killed
            and state["Result"] == "success" and state["ActiveState"] == "inactive")
    return Row("stop after the reloads, with streams in flight", bool(held),
               f"stop took {took:.1f} s; {len(streams)} streams in flight, {len(cut)} cut; {len(refused)} of "
               f"{len(probes)} new connections refused, {len(other)} otherwise failed; Result={state['Result']}, "
               f"status {state['ExecMainStatus']}{'; SIGKILL in the journal' if killed else ''}")


def check_crash(deployment: Deployment, workers: int) -> Row:
    """After a reload, a killed master is noticed and the unit restarted, its socket kept meanwhile."""
    result, _took = deployment.systemctl("reload")
    before = deployment.processes()
    restarts = int(deployment.show("NRestarts")["NRestarts"])
    master = int(next(iter(before["masters"])))
    with Traffic(deployment.machine, "crash", STEADY | {"probe": 1}) as traffic:
        time.sleep(WARM_SECONDS)
        began = time.time()
        deployment.machine.run(f"kill -KILL {master}")
        deadline = time.monotonic() + 300
        while int(deployment.show("NRestarts")["NRestarts"]) == restarts and time.monotonic() < deadline:
            time.sleep(0.2)
        deployment.wait_active()
        back = time.time() - began
        time.sleep(AFTER_SECONDS)
    after = deployment.processes()
    shape_held, shape = one_master(after, workers)
    journal = deployment.journal(began)
    noticed = next((line for line in journal.splitlines() if "exited unexpectedly" in line), "")
    results = during(traffic.results(), began, began + back)
    refused = [r for r in results if r.get("error") == "refused"]
    cut = [r for r in results if failed(r) and r.get("error") != "refused"]
    held = (result.returncode == 0 and noticed and after["main"] != before["main"] and shape_held
            and deployment.readyz() == "200")
    return Row("master killed after a reload: noticed, restarted", bool(held),
               f"serving again {back:.1f} s after the kill (RestartSec=5 and a start); {len(refused)} connections "
               f"refused, {len(cut)} requests cut (the killed master's); after: {shape}; journal: "
               f"{noticed.split(': ', 1)[-1][:100] or 'NOTHING'}")


def check_restart(deployment: Deployment, workers: int) -> Row:
    """A restart under traffic refuses no connection: they wait in the kept socket's backlog and are served."""
    with Traffic(deployment.machine, "restart", STEADY | {"probe": 1}) as traffic:
        time.sleep(WARM_SECONDS)
        began = time.time()
        result, took = deployment.systemctl("restart")
        ended = time.time()
        time.sleep(AFTER_SECONDS)
    results = during(traffic.results(), began, ended)
    refused = [r for r in results if r.get("error") == "refused"]
    failures = [r for r in results if failed(r)]
    waits = [r["first_byte"] - r["began"] for r in results if "first_byte" in r and r["began"] >= began]
    _shape_held, shape = one_master(deployment.processes(), workers)
    held = result.returncode == 0 and not failures and _shape_held
    return Row("restart under traffic", held,
               f"job {'ok' if result.returncode == 0 else 'FAILED'} in {took:.1f} s; {len(results)} requests, "
               f"{len(refused)} refused, {len(failures)} failed; "
               f"longest wait for an answer {max(waits, default=0):.1f} s; "
               f"after: {shape}" + (f"; {failures[0]}" if failures else ""))


def install(machine: Machine) -> Deployment:
    """Install as docs/deploy.md's trial install says, with pip offline on the prepared wheels."""
    machine.run(f"cd {SOURCE_IN_MACHINE} && deploy/install.sh --dev-model tiny", timeout=1800,
                env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": WHEELS_IN_MACHINE})
    deployment = Deployment(machine)
    deployment.wait_active()
    return deployment


def checks(machine: Machine) -> list[Row]:
    """Run every check in order, on the one machine."""
    began = time.time()
    deployment = install(machine)
    workers = len(next(iter(deployment.processes()["masters"].values())))
    rows = check_install(deployment, began)
    first_main = deployment.processes()["main"]
    rows += [check_reload(deployment, number, workers, first_main) for number in range(1, RELOADS_IN_A_ROW + 1)]
    rows += [check_signal_reload(deployment, name, workers, first_main) for name in ("HUP", "USR2")]
    rows.append(check_failed_reload(deployment))
    rows.append(check_stop(deployment))
    result, took = deployment.systemctl("start")
    rows.append(Row("start after the stop", result.returncode == 0 and deployment.readyz() == "200",
                    f"active (every worker ready) {took:.1f} s after `systemctl start`"))
    rows.append(check_crash(deployment, workers))
    rows.append(check_restart(deployment, workers))
    return rows


def table(rows: list[Row], header: str) -> str:
    """Render the rows as a markdown table under a header."""
    lines = [header, "", "| Check | Held | Measured |", "|---|---|---|"]
    for row in rows:
        measured = " ".join(row.measured.replace("|", "/").split())
        lines.append(f"| {row.check} | {'yes' if row.held else '**NO**'} | {measured} |")
    return "\n".join(lines) + "\n"


def source_commit(source: Path) -> str:
    """Name the commit of the source tree (dirty: with changes not committed)."""
    return subprocess.run(["git", "-C", str(source), "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip() or "not a git tree"


def describe_run(commit: str, seconds: float, systemd_version: str) -> str:
    """Say when, where and on what this ran."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"`make test-deploy` on {time.strftime('%Y-%m-%d')}, commit {commit}, {cpu}, "
            f"{systemd_version} in systemd-nspawn (Debian 12), {seconds / 60:.1f} min")


def main() -> int:
    """Build, boot, install, check, print the table, and power the machine off whatever happened."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=REPO, help="the source tree to install (default: this one)")
    parser.add_argument("--results", type=Path, help=f"where to write the table (default {RESULTS.relative_to(REPO)} "
                        "when the source is this tree)")
    args = parser.parse_args()
    commit = source_commit(args.source)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    started = time.time()
    base = base_system()
    wheels = wheelhouse(base)
    work = Path(tempfile.mkdtemp(prefix="corechat-deploy-test-"))
    machine = Machine(base, work, {str(args.source.resolve()): SOURCE_IN_MACHINE, str(wheels): WHEELS_IN_MACHINE})
    try:
        machine.boot()
        systemd_version = " ".join(machine.run("systemctl --version").stdout.split()[:2])
        rows = checks(machine)
    finally:
        if machine.leader:
            journal = machine.run("journalctl -u corechat -o short-monotonic --no-pager", check=False).stdout
            (Path(tempfile.gettempdir()) / "corechat-deploy-test-journal.txt").write_text(journal)
        machine.poweroff()
    output = table(rows, describe_run(commit, time.time() - started, systemd_version))
    print(output)
    results = args.results or (RESULTS if args.source.resolve() == REPO else None)
    if results:
        results.write_text(output)
    return 0 if all(row.held for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
