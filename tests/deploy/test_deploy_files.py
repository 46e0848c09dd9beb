"""deploy/Dockerfile and deploy/compose, checked without a container runtime: what the
image is built from, that its config, ports and health check agree, and that the compose
cluster is `kvstore local-cluster`'s. (test_deploy_containers.py builds and runs them.)"""

from __future__ import annotations

import fnmatch
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from kvstore.cli.local_cluster import BUCKET, LocalClusterSettings
from kvstore.cli.servers import DUMMY_AWS_ENV, HOST, free_port
from kvstore.config import StoreConfig

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "deploy" / "Dockerfile").read_text()
IMAGE_CONFIG = yaml.safe_load((REPO / "deploy" / "container" / "server.yaml").read_text())
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
NODE = yaml.safe_load((COMPOSE_DIR / "node.yaml").read_text())


def instructions(name: str) -> list[str]:
    """The arguments of every ``name`` instruction (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(name + " ")]


def arg_default(name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in instructions("ARG") if a.startswith(name + "=")]
    return value


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or a parent wins."""
    parts = path.split("/")
    verdict = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        regex = fnmatch.translate(pattern).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            verdict = not negated
    return verdict


def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = [
        source
        for args in instructions("COPY")
        if not args.startswith("--from")
        for source in args.split()[:-1]
    ]
    assert copied, "no COPY from the build context"
    for source in copied:
        assert (REPO / source).exists(), source
        assert not ignored(source, patterns), f"{source} is excluded by .dockerignore"
        for path in (REPO / source).rglob("*.py") if (REPO / source).is_dir() else []:
            assert not ignored(str(path.relative_to(REPO)), patterns), path
    for path in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", ".deploy-cache/x"):
        assert ignored(path, patterns), f"{path} would be sent to the builder"
    for path in REPO.glob("kvstore/*.so"):  # built for this machine, not the image
        assert ignored(str(path.relative_to(REPO)), patterns), path


def test_torch_is_the_cpu_build_of_the_release_setup_pins() -> None:
    assert arg_default("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    assert any('"torch==${TORCH_VERSION}+cpu"' in run for run in instructions("RUN"))
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert f'"torch=={arg_default("TORCH_VERSION")}"' in setup
    # Debian 12's python3 is 3.11: the local CPU wheel the tests build with is cp311.
    assert arg_default("BASE_IMAGE") == "debian:bookworm-slim"


def test_image_user_config_ports_and_health_check_agree() -> None:
    (user,) = instructions("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit(), user  # numeric: runAsNonRoot
    server = IMAGE_CONFIG["server"]
    metrics_port = server["metrics_listen"].rsplit(":", 1)[1]
    (health,) = instructions("HEALTHCHECK")
    assert f"http://127.0.0.1:{metrics_port}/healthz" in health
    (exposed,) = instructions("EXPOSE")
    assert set(exposed.split()) == {server["listen"].rsplit(":", 1)[1], metrics_port}
    (volumes,) = instructions("VOLUME")
    data, run = yaml.safe_load(volumes)
    disk = next(t for t in IMAGE_CONFIG["tiers"] if t["kind"] == "disk")
    assert disk["path"].startswith(data + "/")
    assert os.path.dirname(server["unix_socket"]) == run
    assert server["token_file"] == "/run/secrets/kvstore-token"  # where Compose puts secrets
    assert any("/etc/kvstore/server.yaml" in copy for copy in instructions("COPY"))
    (cmd,) = instructions("CMD")
    assert yaml.safe_load(cmd) == ["kvstore-server", "--config", "/etc/kvstore/server.yaml"]
    StoreConfig.from_dict(IMAGE_CONFIG, environ={}).server.validate("server")


def node_env(node: str) -> dict[str, str]:
    service = COMPOSE["services"][node]
    return {k: str(v) for k, v in service["environment"].items()}


def test_compose_cluster_is_the_local_cluster() -> None:
    settings = LocalClusterSettings()
    nodes = [name for name, s in COMPOSE["services"].items() if "KVSTORE_IMAGE" in s["image"]]
    assert len(nodes) == settings.nodes and set(COMPOSE["services"]) == {"redis", "s3", *nodes}
    host, disk, s3 = NODE["tiers"]
    assert (host["kind"], host["capacity"]) == ("host", settings.host_capacity)
    assert (disk["kind"], disk["capacity"]) == ("disk", settings.disk_capacity)
    assert host["write_policy"] == disk["write_policy"] == "write_through"
    assert (s3["kind"], s3["bucket"], s3["region"]) == ("s3", BUCKET, "us-east-1")
    assert COMPOSE["services"]["s3"]["environment"]["BUCKET"] == BUCKET
    assert NODE["cluster"]["heartbeat_s"] == settings.heartbeat_s
    assert NODE["cluster"]["redis_url"].startswith("redis://redis:")
    assert s3["endpoint_url"] == "http://s3:5000"
    for node in nodes:
        service = COMPOSE["services"][node]
        env = node_env(node)
        config = StoreConfig.from_dict(NODE, environ=env)
        assert config.cluster.node_id == node
        assert config.cluster.advertise == f"{node}:{NODE['server']['listen'].rsplit(':')[1]}"
        assert "./node.yaml:/etc/kvstore/server.yaml:ro" in service["volumes"]
        assert service["secrets"] == ["kvstore-token"]
        assert NODE["server"]["token_file"] == "/run/secrets/kvstore-token"
        assert set(service["depends_on"]) == {"redis", "s3"}
        published = [p.rsplit(":", 1)[1] for p in service["ports"]]
        assert sorted(published) == ["7070", "9090"]


def test_compose_s3_script_serves_the_bucket_and_stops_on_sigterm() -> None:
    port = free_port()
    env = {**os.environ, **DUMMY_AWS_ENV, "S3_HOST": HOST, "S3_PORT": str(port), "BUCKET": BUCKET}
    proc = subprocess.Popen(
        [sys.executable, str(COMPOSE_DIR / "s3.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, lines = f"port {port} with bucket {BUCKET}", []
        while not lines or (ready not in lines[-1] and lines[-1] and len(lines) < 20):
            lines.append(proc.stdout.readline())  # moto's own lines come first
        assert ready in lines[-1], lines
        client = s3_client(port)
        assert BUCKET in [b["Name"] for b in client.list_buckets()["Buckets"]]
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - start < 10  # as PID 1, not after the grace period
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def s3_client(port: int) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=f"http://{HOST}:{port}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


@pytest.mark.parametrize(
    "path", ["deploy/compose/kvstore.token", "deploy/kubernetes/kvstore.token"]
)
def test_token_files_users_write_are_kept_out_of_git(path: str) -> None:
    done = subprocess.run(
        ["git", "check-ignore", "-q", path], cwd=REPO, capture_output=True, check=False
    )
    assert done.returncode == 0, f"{path} is not git-ignored"
