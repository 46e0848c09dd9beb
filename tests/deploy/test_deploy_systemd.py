"""deploy/systemd: the unit verifies, its user is created, and the server its ExecStart line
starts answers, reloads on its ExecReload and flushes on its KillSignal.

systemd is not PID 1 here, so the unit's command lines are
run as systemd would run them: ExecStart parsed from the unit file, with the unit's
Environment= and the directories its RuntimeDirectory= and StateDirectory= create, under
a scratch root (/opt/kvstore is this virtualenv; /etc/kvstore, /run/kvstore and
/var/lib/kvstore are directories of the test); ExecReload run with $MAINPID; KillSignal
sent and the exit awaited for TimeoutStopSec. The server's config is
deploy/systemd/server.yaml with its paths under that root, loopback ports and sizes for a
test machine, and the host tier writing back (so that what reaches the disk at stop is
what the stop flushed). test_deploy_containers.py runs the unit under systemd itself, in a
container (with the tests marked ``containers``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from deploy_clients import CHUNKS, LAYOUT, block_files, put_chunks, read_chunks, remote
from deploy_clients import wait_healthy as wait_healthy_url

from kvstore import KVStore
from kvstore.cli.servers import HOST, free_port
from kvstore.errors import AccessDeniedError

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
UNIT = SYSTEMD / "kvstore.service"
TOKEN_A = "systemd-test-token-aaaaaaaaaaaa"
TOKEN_B = "systemd-test-token-bbbbbbbbbbbb"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's settings: section -> key -> values in order (systemd's syntax:
    ``#``/``;`` comments, a trailing backslash continues the line)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    logical = re.sub(r"\\\n", " ", text)
    for raw in logical.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a setting before any section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a setting: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


SERVICE = parse_unit(UNIT.read_text())["Service"]


def setting(key: str) -> str:
    """The value in force of a [Service] setting (the last one given)."""
    return SERVICE[key][-1]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart= is an executable: this virtualenv's, in a copy.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/kvstore/bin/", f"{sys.prefix}/bin/"))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    # ... and says so when a key is misspelt: silence above is not a verify that saw nothing.
    bad = tmp_path / "bad" / UNIT.name
    bad.parent.mkdir()
    bad.write_text(unit.read_text().replace("KillSignal=", "KillSignall="))
    done = subprocess.run([analyze, "verify", str(bad)], capture_output=True, text=True)
    assert "Unknown key" in done.stdout + done.stderr


def test_sysusers_file_creates_the_service_user(tmp_path: Path) -> None:
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    conf = SYSTEMD / "kvstore.sysusers.conf"
    subprocess.run([sysusers, f"--root={tmp_path}", str(conf)], check=True, capture_output=True)
    users = {
        line.split(":")[0]: line.split(":")
        for line in (tmp_path / "etc/passwd").read_text().split()
    }
    assert users[setting("User")][5:] == ["/var/lib/kvstore", "/usr/sbin/nologin"]
    assert setting("Group") in (tmp_path / "etc/group").read_text()


def test_unit_promises_what_the_server_does() -> None:
    assert setting("KillSignal") == "SIGTERM"  # the server drains and flushes on it
    assert shlex.split(setting("ExecReload")) == ["/bin/kill", "-HUP", "$MAINPID"]
    assert setting("RestartPreventExitStatus") == "2"  # kvstore-server's config errors
    assert setting("RuntimeDirectory") == "kvstore" and setting("StateDirectory") == "kvstore"
    config = yaml.safe_load((SYSTEMD / "server.yaml").read_text())
    assert config["server"]["unix_socket"].startswith("/run/kvstore/")
    assert next(t for t in config["tiers"] if t["kind"] == "disk")["path"].startswith(
        "/var/lib/kvstore/"
    )
    argv = shlex.split(setting("ExecStart"))
    assert argv[argv.index("--config") + 1] == "/etc/kvstore/server.yaml"


@dataclass
class Root:
    """The scratch root the unit runs under: where each of its paths lands."""

    base: Path

    @property
    def paths(self) -> dict[str, str]:
        return {
            "/opt/kvstore": sys.prefix,
            "/etc/kvstore": str(self.base / "etc"),
            "/run/kvstore": str(self.base / "run"),
            "/var/lib/kvstore": str(self.base / "state"),
        }

    def map(self, text: str) -> str:
        for unit_path, here in self.paths.items():
            text = text.replace(unit_path, here)
        return text


class Service:
    """The unit's ExecStart, started as systemd starts it, under ``root``."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.log = root.base / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        for assignment in shlex.split(" ".join(SERVICE.get("Environment", []))):
            name, _, value = assignment.partition("=")
            env[name] = self.root.map(value)
        return env

    def start(self) -> subprocess.Popen[bytes]:
        for directory in ("RuntimeDirectory", "StateDirectory"):
            assert setting(directory) == "kvstore"
        (self.root.base / "run").mkdir(exist_ok=True)
        (self.root.base / "state").mkdir(exist_ok=True)
        argv = shlex.split(self.root.map(setting("ExecStart")))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        return self.proc

    def reload(self) -> None:
        """ExecReload, $MAINPID the server's pid."""
        assert self.proc is not None
        argv = [
            a.replace("$MAINPID", str(self.proc.pid)) for a in shlex.split(setting("ExecReload"))
        ]
        subprocess.run(argv, check=True)

    def stop(self) -> int:
        """KillSignal, then the exit code within TimeoutStopSec."""
        assert self.proc is not None
        self.proc.send_signal(getattr(signal, setting("KillSignal")))
        return self.proc.wait(timeout=float(setting("TimeoutStopSec")))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def root() -> Iterator[Root]:
    base = Path(f"/tmp/kvunit-{os.getpid()}-{time.monotonic_ns() % 10**6}")  # short: a socket
    (base / "etc").mkdir(parents=True)
    yield Root(base)
    shutil.rmtree(base, ignore_errors=True)


def write_config(root: Root, port: int, metrics: int) -> None:
    config = yaml.safe_load(root.map((SYSTEMD / "server.yaml").read_text()))
    host, disk = config["tiers"]
    host.update(capacity="64MiB", write_policy="write_back")
    disk["capacity"] = "1GiB"
    config["server"].update(listen=f"{HOST}:{port}", metrics_listen=f"{HOST}:{metrics}")
    (root.base / "etc" / "server.yaml").write_text(yaml.safe_dump(config))


def test_exec_start_serves_reloads_tokens_and_flushes_on_stop(root: Root) -> None:
    port, metrics = free_port(), free_port()
    write_config(root, port, metrics)
    token = root.base / "etc" / "token"
    token.write_text(TOKEN_A + "\n")
    socket = f"unix:{root.base}/run/kvstore.sock"
    service = Service(root)
    try:
        service.start()
        wait_healthy_url(f"http://{HOST}:{metrics}/healthz", 120, service.output)
        keys, kv = put_chunks(remote(socket, token=TOKEN_A), "systemd")
        assert read_chunks(remote(f"{HOST}:{port}", token=TOKEN_A), keys)[0] == CHUNKS

        token.write_text(TOKEN_B + "\n")  # a rotated token file, taken by the reload
        service.reload()
        wait_for(lambda: "reloaded tenants and tokens" in service.output(), service.output)
        with pytest.raises(AccessDeniedError):
            KVStore(LAYOUT, remote(socket, token=TOKEN_A)).close()
        found, got, _ = read_chunks(remote(socket, token=TOKEN_B), keys)
        assert found == CHUNKS and got is not None and torch.equal(got, kv)

        state = root.base / "state"
        assert block_files(state) == 0, "write_back: the blocks are in memory only"
        assert service.stop() == 0, service.output()
        assert block_files(state) == CHUNKS, service.output()

        service.start()  # as after a reboot: the disk tier has every block
        wait_healthy_url(f"http://{HOST}:{metrics}/healthz", 120, service.output)
        found, got, _ = read_chunks(remote(f"{HOST}:{port}", token=TOKEN_B), keys)
        assert found == CHUNKS and got is not None and torch.equal(got, kv)
        assert service.stop() == 0, service.output()
    finally:
        service.kill()


def test_a_config_error_is_the_exit_status_the_unit_does_not_restart(root: Root) -> None:
    write_config(root, free_port(), free_port())  # its token file does not exist
    service = Service(root)
    try:
        proc = service.start()
        assert proc.wait(timeout=120) == int(setting("RestartPreventExitStatus"))
        assert "kvstore-server: error: server.token.token_file" in service.output()
    finally:
        service.kill()


def wait_for(
    condition: Callable[[], bool], context: Callable[[], str], timeout: float = 30.0
) -> None:
    """Until ``condition()`` is true; AssertionError with ``context()`` after ``timeout``."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, context()
        time.sleep(0.1)
