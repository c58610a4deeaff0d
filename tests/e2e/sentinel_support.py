"""A real Redis Sentinel group for the failover tests: a master, its replica and three redis-sentinel processes."""

import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from harness import RedisServer, free_port


class SentinelGroup:
    """Three sentinels watching a master (with one replica) under the name `master_name`, on free loopback ports.

    Failover is made quick (the master counts as down after `down_after_ms`), so a test sees a
    promotion within seconds. With `password` the master, the replica and the sentinels all ask
    for one (the sentinels for `sentinel_password`).
    """

    master_name = "corechat"

    def __init__(self, work_dir: Path, *, password: str = "", sentinel_password: str = "", down_after_ms: int = 500,
                 failover_timeout_ms: int = 3000):
        self.work_dir = work_dir
        self.password = password
        self.sentinel_password = sentinel_password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        (work_dir / "master").mkdir()
        (work_dir / "replica").mkdir()
        self.master = RedisServer(work_dir / "master", password)
        self.replica = RedisServer(work_dir / "replica", password, replica_of=self.master)
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.processes: list[subprocess.Popen] = []

    def url(self, password: str | None = None) -> str:
        """Return the redis+sentinel:// URL of the group (with the master's password, or the one given)."""
        password = self.password if password is None else password
        credentials = f":{quote(password, safe='')}@" if password else ""
        sentinels = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{credentials}{sentinels}/{self.master_name}/0"

    def start(self, timeout: float = 30) -> "SentinelGroup":
        """Start the master, the replica and the sentinels; wait until the replica follows the master and every
        sentinel knows the others and the replica."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.master.start()
        self.replica.start()
        for port in self.sentinel_ports:
            config = self.work_dir / f"sentinel-{port}.conf"
            config.write_text(self._config(port))
            self.processes.append(subprocess.Popen([binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        while not (self._replica_linked() and all(self._knows_everyone(port) for port in self.sentinel_ports)):
            if time.monotonic() > deadline:
                raise TimeoutError("the sentinels did not find each other and the replica")
            time.sleep(0.2)
        return self

    def _config(self, port: int) -> str:
        """Return one sentinel's configuration file (sentinel rewrites it as it learns)."""
        lines = [
            f"port {port}", "bind 127.0.0.1", f"dir {self.work_dir}",
            f"sentinel monitor {self.master_name} 127.0.0.1 {self.master.port} 2",
            f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}",
            f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {self.master_name} {self.password}")
        if self.sentinel_password:
            lines += [f"requirepass {self.sentinel_password}", f"sentinel sentinel-pass {self.sentinel_password}"]
        return "\n".join(lines) + "\n"

    def sentinel(self, port: int) -> redis.Redis:
        """Return a client of one sentinel."""
        return redis.Redis(port=port, password=self.sentinel_password or None, socket_timeout=1)

    def _replica_linked(self) -> bool:
        """Tell whether the replica has its copy of the master and follows its writes."""
        replica = redis.Redis(port=self.replica.port, password=self.password or None, socket_timeout=1)
        try:
            return replica.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def _knows_everyone(self, port: int) -> bool:
        """Tell whether a sentinel sees the master with its replica and the two other sentinels."""
        try:
            state = self.sentinel(port).sentinel_master(self.master_name)
        except redis.RedisError:
            return False
        return state["num-other-sentinels"] == 2 and state["num-slaves"] == 1 and state["port"] == self.master.port

    def master_port(self) -> int | None:
        """Return the port of the master every sentinel names now, or None while they disagree."""
        ports = set()
        for port in self.sentinel_ports:
            try:
                ports.add(int(self.sentinel(port).sentinel_get_master_addr_by_name(self.master_name)[1]))
            except (redis.RedisError, TypeError):
                return None
        return ports.pop() if len(ports) == 1 else None

    def stop(self) -> None:
        """Kill the sentinels, the replica and the master."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.replica.stop()
        self.master.stop()
