"""deploy/Dockerfile and deploy/compose/compose.yaml, built and run with podman.

The image is built from this checkout as deploy/Dockerfile is written (on a Debian base
made from Debian's packages, with the machine's CPU torch wheel: deploy_podman.py), then:
it holds a CPU-only torch and runs as a non-root user; the server in it answers its health
check, engines on the host over TCP (with the token) and over the Unix socket in a mounted
directory (shared memory), and `podman stop` (SIGTERM) flushes memory to the mounted disk,
where a new container finds every block; the demo runs in it; the compose file's cluster
(Redis, S3, two nodes) serves a chunk stored through node a to a client of node b; and
deploy/systemd/kvstore.service runs under systemd itself, reloads and flushes.

Marked ``containers``: run with ``-m containers`` (conftest.py says why and how).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml
from deploy_clients import (
    CHUNKS,
    LAYOUT,
    block_files,
    health,
    put_chunks,
    read_chunks,
    remote,
    wait_healthy,
)
from deploy_podman import IMAGES, REPO, Podman, build, build_server_image, build_standins

from kvstore import KVStore
from kvstore.cli.servers import HOST, free_port
from kvstore.errors import AccessDeniedError

pytestmark = [pytest.mark.containers, pytest.mark.timeout(2400)]

UID = 10001  # the image's user (deploy/Dockerfile)
#: A CPU torch image is ~1.4 GB; CUDA wheels alone are several GB more.
MAX_IMAGE_BYTES = 2.5e9
SYSTEMD_IMAGE = "localhost/kvstore-test/systemd:latest"
#: What deploy/kubernetes/daemonset.yaml's securityContext gives the server: a read-only
#: root filesystem (an emptyDir on /tmp), no capabilities, no privilege escalation.
LOCKED_DOWN = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL"]
LOCKED_DOWN += ["--security-opt", "no-new-privileges"]
TOKEN_A = "systemd-token-aaaaaaaaaaaaaaaa"
TOKEN_B = "systemd-token-bbbbbbbbbbbbbbbb"


@pytest.fixture(scope="module")
def image(podman: Podman) -> str:
    with podman.lock():
        start = time.monotonic()
        name = build_server_image(podman)
    print(f"\nimage {name} ready in {time.monotonic() - start:.1f} s")
    return name


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory the image's user owns the parts of (short: it holds a Unix socket)."""
    path = Path(f"/tmp/kvdeploy-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def owned_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, UID)
    return path


def token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    os.chown(path, UID, UID)
    path.chmod(0o400)
    return path


def test_image_has_cpu_torch_a_user_and_a_health_check(podman: Podman, image: str) -> None:
    info = json.loads(podman("image", "inspect", image).stdout)[0]
    config = info["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert "http://127.0.0.1:9090/healthz" in " ".join(info["Healthcheck"]["Test"])
    assert {"7070/tcp", "9090/tcp"} <= set(config["ExposedPorts"])
    assert config["Cmd"] == ["kvstore-server", "--config", "/etc/kvstore/server.yaml"]
    assert info["Size"] < MAX_IMAGE_BYTES, f"image of {info['Size'] / 1e9:.2f} GB"
    probe = (
        "id -u; python -c 'import torch, kvstore.native._chain; print(torch.__version__, "
        "torch.version.cuda)'; pip list --format=freeze"
    )
    out = podman("run", "--rm", image, "sh", "-c", probe).stdout.splitlines()
    assert out[0] == str(UID)
    version, cuda = out[1].split()
    assert version.endswith("+cpu") and cuda == "None", out[1]
    packages = [line.split("==")[0].lower() for line in out[2:]]
    assert "kvstore-tiers" in packages
    assert not [p for p in packages if p.startswith("nvidia") or "cuda" in p], packages


def test_server_refuses_to_start_without_its_token(podman: Podman, image: str) -> None:
    done = podman("run", "--rm", image, check=False)
    assert done.returncode == 2, done.stderr
    assert (
        "kvstore-server: error: server.token.token_file '/run/secrets/kvstore-token'" in done.stderr
    )


class Container:
    """A detached ``podman run`` of the image, removed (with its volumes) at the end."""

    def __init__(self, podman: Podman, *args: str) -> None:
        self.podman = podman
        self.name = f"kvstore-test-{uuid.uuid4().hex[:10]}"
        podman("run", "-d", "--name", self.name, "--health-interval=disable", *args)

    def logs(self) -> str:
        done = self.podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def stop(self, timeout: int = 90) -> int:
        """SIGTERM (the image's STOPSIGNAL), then its exit code."""
        self.podman("stop", "-t", str(timeout), self.name, timeout=timeout + 30)
        state = json.loads(self.podman("inspect", self.name).stdout)[0]["State"]
        return int(state["ExitCode"])

    def remove(self) -> None:
        self.podman("rm", "-f", "-v", self.name, check=False)


def test_server_serves_engines_and_flushes_on_stop(
    podman: Podman, image: str, scratch: Path
) -> None:
    data, run = owned_dir(scratch / "data"), owned_dir(scratch / "run")
    token = token_file(scratch / "token", "deploy-test-token-0123456789")
    port, metrics = free_port(), free_port()
    mounts = [
        *("-v", f"{data}:/var/lib/kvstore", "-v", f"{run}:/run/kvstore"),
        *("-v", f"{token}:/run/secrets/kvstore-token:ro"),
    ]
    # Blocks stay in memory until the stop flushes them (the image's config writes through).
    args = [*mounts, *LOCKED_DOWN, "-e", "KVSTORE_HOST_WRITE_POLICY=write_back"]
    ports = ["-p", f"{HOST}:{port}:7070", "-p", f"{HOST}:{metrics}:9090"]
    server = Container(podman, *args, *ports, image)
    try:
        wait_healthy(f"http://{HOST}:{metrics}/healthz", context=server.logs)
        # The image's own HEALTHCHECK command, run in the container.
        assert podman("healthcheck", "run", server.name, check=False).returncode == 0

        over_tcp = remote(f"{HOST}:{port}", token_file=str(token))
        tcp_keys, tcp_kv = put_chunks(over_tcp, "over-tcp")
        found, got, _ = read_chunks(over_tcp, tcp_keys)
        assert found == CHUNKS and got is not None and torch.equal(got, tcp_kv)
        with pytest.raises(AccessDeniedError):
            KVStore(LAYOUT, remote(f"{HOST}:{port}", token="x" * 24)).close()

        # An engine on the host through the socket in the mounted directory: shared memory.
        over_unix = remote(f"unix:{run}/kvstore.sock", token_file=str(token))
        unix_keys, unix_kv = put_chunks(over_unix, "over-unix")
        found, got, stats = read_chunks(over_unix, unix_keys)
        assert found == CHUNKS and got is not None and torch.equal(got, unix_kv)
        assert stats["shm_blocks"] > 0 and stats["socket_blocks"] == 0, stats

        assert block_files(data) == 0, "write_back: the blocks are in memory only"
        assert server.stop() == 0, server.logs()
        assert block_files(data) == 2 * CHUNKS, server.logs()
    finally:
        server.remove()

    again = Container(podman, *mounts, *LOCKED_DOWN, *ports, image)
    try:
        wait_healthy(f"http://{HOST}:{metrics}/healthz", context=again.logs)
        found, got, _ = read_chunks(over_tcp, tcp_keys)
        assert found == CHUNKS and got is not None and torch.equal(got, tcp_kv)
        found, got, _ = read_chunks(over_tcp, unix_keys)
        assert found == CHUNKS and got is not None and torch.equal(got, unix_kv)
        assert again.stop() == 0
        assert health(f"http://{HOST}:{metrics}/healthz")[0] == 0  # stopped, port closed
    finally:
        again.remove()


def test_demo_runs_in_the_image(podman: Podman, image: str) -> None:
    start = time.monotonic()
    done = podman("run", "--rm", image, "kvstore", "demo", "--sessions", "2", "--turns", "2")
    out = done.stdout
    assert "verified bit-exact" in out and "after a restart" in out, out
    print(f"\ndemo in the image: {time.monotonic() - start:.1f} s")


def test_compose_cluster_serves_a_chunk_stored_on_a_through_b(
    podman: Podman, image: str, tmp_path: Path
) -> None:
    with podman.lock():
        redis, s3 = build_standins(podman)
    # The compose files as shipped, in a directory of their own with the token beside them.
    project = tmp_path / "compose"
    shutil.copytree(REPO / "deploy" / "compose", project)
    token = project / "kvstore.token"
    token.write_text("compose-test-token-0123456789\n")
    token.chmod(0o644)  # the nodes' user reads the secret
    ports = {name: free_port() for name in ("A", "A_METRICS", "B", "B_METRICS")}
    env = {
        "KVSTORE_IMAGE": image,
        "REDIS_IMAGE": redis,
        "S3_IMAGE": s3,
        **{f"NODE_{name}_PORT": str(port) for name, port in ports.items()},
    }
    name = f"kvtest{uuid.uuid4().hex[:8]}"
    compose = ["podman-compose", "-p", name, "-f", str(project / "compose.yaml")]
    try:
        podman.run([*compose, "up", "-d"], env=env, cwd=project, timeout=300)
        for node in ("A", "B"):
            url = f"http://{HOST}:{ports[node + '_METRICS']}/healthz"
            wait_healthy(url, context=lambda: compose_logs(podman, name))
        a = remote(f"{HOST}:{ports['A']}", token_file=str(token))
        b = remote(f"{HOST}:{ports['B']}", token_file=str(token))
        keys, kv = put_chunks(a, "compose")
        end, found = time.monotonic() + 30, 0
        while found < CHUNKS and time.monotonic() < end:  # a publishes at its heartbeat
            found, got, _ = read_chunks(b, keys)
            time.sleep(0.2)
        assert found == CHUNKS and got is not None and torch.equal(got, kv)
        assert bucket_objects(podman, f"{name}_s3_1") >= CHUNKS  # written through to S3
    finally:
        podman.run([*compose, "down", "-v"], env=env, cwd=project, check=False, timeout=300)
        podman("network", "rm", "-f", f"{name}_default", check=False)
        podman("volume", "prune", "-f", check=False)


def bucket_objects(podman: Podman, container: str, timeout: float = 30.0) -> int:
    """Objects in the compose S3 server's bucket once they stop growing (or ``timeout``)."""
    count = (
        "import boto3; print(boto3.client('s3', endpoint_url='http://127.0.0.1:5000', "
        "region_name='us-east-1', aws_access_key_id='t', aws_secret_access_key='t')"
        ".list_objects_v2(Bucket='kvstore-local').get('KeyCount', 0))"
    )
    end, seen = time.monotonic() + timeout, -1
    while time.monotonic() < end:
        now = int(podman("exec", container, "python3", "-c", count).stdout.strip())
        if now == seen and now >= CHUNKS:
            return now
        seen = now
        time.sleep(1)
    return seen


def compose_logs(podman: Podman, project: str) -> str:
    """The last lines of every container of the compose project."""
    names = podman("ps", "-a", "--format", "{{.Names}}", "--filter", f"name={project}_").stdout
    return "\n".join(
        f"--- {name}\n" + podman("logs", "--tail", "30", name, check=False).stderr
        for name in names.split()
    )


def test_systemd_unit_under_systemd_reloads_and_flushes(
    podman: Podman, image: str, tmp_path: Path
) -> None:
    """deploy/systemd/kvstore.service run by systemd itself, hardening and all (the
    ExecStart line alone runs in test_deploy_systemd.py)."""
    context = tmp_path / "systemd"
    shutil.copytree(REPO / "deploy" / "systemd", context)
    shutil.copy(IMAGES / "systemd.Containerfile", context)
    config = yaml.safe_load((context / "server.yaml").read_text())
    host, disk = config["tiers"]
    # Sizes for a test machine; the host tier writes back, so that what reaches the disk
    # at stop is what the stop flushed.
    host.update(capacity="64MiB", write_policy="write_back")
    disk["capacity"] = "1GiB"
    (context / "server.yaml").write_text(yaml.safe_dump(config))
    (context / "token").write_text(TOKEN_A + "\n")
    with podman.lock():
        base = f"--build-arg=KVSTORE_IMAGE={image}"
        build(podman, context / "systemd.Containerfile", context, SYSTEMD_IMAGE, base)
    port = free_port()
    name = f"kvstore-systemd-{uuid.uuid4().hex[:8]}"
    # systemd sets up each unit's sandbox (ProtectSystem=, PrivateTmp=, ...) with mount
    # namespaces: a privileged container lets it, as a host does.
    run = ["--privileged", "--systemd=always", "-p", f"{HOST}:{port}:7070", SYSTEMD_IMAGE]
    podman("run", "-d", "--name", name, *run)

    def systemctl(*args: str, check: bool = True) -> str:
        done = podman("exec", name, "systemctl", *args, "--no-pager", check=check)
        return done.stdout.strip()

    def journal() -> str:
        return podman("exec", name, "journalctl", "-u", "kvstore", "--no-pager", check=False).stdout

    def blocks() -> int:
        find = "find /var/lib/kvstore -name '*.kvb' | wc -l"
        return int(podman("exec", name, "sh", "-c", find).stdout)

    try:
        wait_until(lambda: systemctl("is-system-running", check=False) in ("running", "degraded"))
        systemctl("start", "kvstore")
        wait_healthy_in(podman, name, journal)
        keys, kv = put_chunks(remote(f"{HOST}:{port}", token=TOKEN_A), "under-systemd")
        assert read_chunks(remote(f"{HOST}:{port}", token=TOKEN_A), keys)[0] == CHUNKS

        rotate = f"printf '{TOKEN_B}\\n' > /etc/kvstore/token"
        podman("exec", name, "sh", "-c", rotate)
        systemctl("reload", "kvstore")  # ExecReload: SIGHUP
        wait_until(lambda: "reloaded tenants and tokens" in journal(), journal)
        with pytest.raises(AccessDeniedError):
            KVStore(LAYOUT, remote(f"{HOST}:{port}", token=TOKEN_A)).close()
        found, got, _ = read_chunks(remote(f"{HOST}:{port}", token=TOKEN_B), keys)
        assert found == CHUNKS and got is not None and torch.equal(got, kv)

        assert blocks() == 0, "write_back: the blocks are in memory only"
        systemctl("stop", "kvstore")  # KillSignal: SIGTERM, drain and flush
        status = systemctl("show", "kvstore", "-p", "Result", "-p", "ExecMainStatus")
        assert sorted(status.splitlines()) == ["ExecMainStatus=0", "Result=success"], journal()
        assert blocks() == CHUNKS, journal()

        systemctl("start", "kvstore")
        wait_healthy_in(podman, name, journal)
        found, got, _ = read_chunks(remote(f"{HOST}:{port}", token=TOKEN_B), keys)
        assert found == CHUNKS and got is not None and torch.equal(got, kv)
    finally:
        podman("rm", "-f", "-v", name, check=False)


def wait_healthy_in(podman: Podman, container: str, context: Callable[[], str]) -> None:
    """Until the server's /healthz (loopback in the container, as server.yaml has it) is ok."""
    probe = "import urllib.request as u; u.urlopen('http://127.0.0.1:9090/healthz', timeout=2)"
    wait_until(
        lambda: podman("exec", container, "python3", "-c", probe, check=False).returncode == 0,
        context,
        timeout=120,
    )


def wait_until(
    condition: Callable[[], bool], context: Callable[[], str] = lambda: "", timeout: float = 60
) -> None:
    """Until ``condition()``; AssertionError with ``context()`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, context()
        time.sleep(0.5)
