"""deploy/kubernetes: every object is valid against the Kubernetes API's schema (offline,
strict: an unknown field fails), the objects agree with each other and with the image,
and the server config the ConfigMap carries runs as the DaemonSet runs it.

The schemas are those of Kubernetes 1.30 and 1.37, the kinds the manifests use
(kubernetes_schemas/, made by kubernetes_schemas/vendor.py from kubernetes-validate).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import yaml
from deploy_clients import CHUNKS, put_chunks, read_chunks, remote, wait_healthy

from kvstore.cli.servers import HOST, free_port
from kvstore.config import StoreConfig, parse_size

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "kubernetes_schemas"
DASHBOARD = REPO / "docs" / "grafana" / "kvstore-dashboard.json"
IMAGE_UID = 10001  # deploy/Dockerfile's USER


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


OBJECTS = {
    path.name: load(path.name)
    for path in sorted(MANIFESTS.glob("*.yaml"))
    if path.name != "kustomization.yaml"
}


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for docs in OBJECTS.values()
        for doc in docs
        if doc["kind"] == kind and name in (None, doc["metadata"]["name"])
    ]
    assert len(found) == 1, f"{kind} {name}: {len(found)} objects"
    return found[0]


DAEMONSET = one("DaemonSet")
POD = DAEMONSET["spec"]["template"]["spec"]
SERVER = next(c for c in POD["containers"] if c["name"] == "kvstore-server")
CONFIG = yaml.safe_load(one("ConfigMap", "kvstore-config")["data"]["server.yaml"])


def validator(version_file: Path, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schemas = json.loads(version_file.read_text())
    name = f"{api_version}/{kind}"
    assert name in schemas["kinds"], (
        f"no schema for {name} in {version_file.name}: run {SCHEMAS.name}/vendor.py"
    )
    schema = {**schemas["kinds"][name], "$defs": schemas["$defs"]}
    return jsonschema.Draft202012Validator(schema)


VERSIONS = sorted(SCHEMAS.glob("v*.json"))


@pytest.mark.parametrize("version", VERSIONS, ids=lambda p: p.stem)
@pytest.mark.parametrize("manifest", sorted(OBJECTS))
def test_manifest_is_valid_against_the_kubernetes_schema(manifest: str, version: Path) -> None:
    for doc in OBJECTS[manifest]:
        check = validator(version, doc["apiVersion"], doc["kind"])
        errors = [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in check.iter_errors(doc)
        ]
        assert not errors, f"{manifest} ({doc['kind']}) against {version.stem}:\n" + "\n".join(
            errors
        )


def test_schema_check_finds_a_misspelt_field_and_a_wrong_type() -> None:
    check = validator(VERSIONS[0], "apps/v1", "DaemonSet")
    typo = json.loads(json.dumps(DAEMONSET))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    assert any("imagePulPolicy" in e.message for e in check.iter_errors(typo))
    wrong = json.loads(json.dumps(DAEMONSET))
    wrong["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "7070"
    assert list(check.iter_errors(wrong))


def test_kustomization_lists_every_object_and_generates_the_token_secret() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    # secret.yaml is for `kubectl apply -f`; kustomize makes the Secret from a token file.
    assert sorted(kustomization["resources"]) == sorted(set(OBJECTS) - {"secret.yaml"})
    (generated,) = kustomization["secretGenerator"]
    token_volume = next(v for v in POD["volumes"] if "secret" in v)
    assert generated["name"] == token_volume["secret"]["secretName"]
    assert generated["name"] == one("Secret")["metadata"]["name"]
    key = token_volume["secret"]["items"][0]["key"]
    assert generated["files"] == [f"{key}=kvstore.token"] and key in one("Secret")["stringData"]
    assert generated["options"]["disableNameSuffixHash"] is True
    images = {image["name"] for image in kustomization["images"]}
    assert {c["image"].split(":")[0] for c in POD["containers"] + POD["initContainers"]} == images


def mount(volume: str) -> str:
    (path,) = [m["mountPath"] for m in SERVER["volumeMounts"] if m["name"] == volume]
    return str(path)


def volume(name: str) -> dict[str, Any]:
    (found,) = [v for v in POD["volumes"] if v["name"] == name]
    return found


def test_daemonset_mounts_what_the_config_names() -> None:
    config_path = SERVER["command"][SERVER["command"].index("--config") + 1]
    assert os.path.dirname(config_path) == mount("config")
    assert volume("config")["configMap"]["name"] == "kvstore-config"
    assert os.path.basename(config_path) in one("ConfigMap", "kvstore-config")["data"]
    token = volume("token")["secret"]
    assert CONFIG["server"]["token_file"] == f"{mount('token')}/{token['items'][0]['path']}"
    disk = next(t for t in CONFIG["tiers"] if t["kind"] == "disk")
    assert disk["path"].startswith(mount("data") + "/")
    assert volume("data")["hostPath"]["type"] == "DirectoryOrCreate"
    assert os.path.dirname(CONFIG["server"]["unix_socket"]) == mount("socket")
    assert volume("socket")["hostPath"]["path"] == mount("socket")  # engines mount the same
    # The init container hands both host directories to the server's user.
    (init,) = POD["initContainers"]
    assert {m["mountPath"] for m in init["volumeMounts"]} == {mount("data"), mount("socket")}
    assert f"chown {IMAGE_UID}:{IMAGE_UID}" in " ".join(init["command"])


def test_daemonset_probes_scrape_and_runs_as_the_image_user() -> None:
    ports = {p["name"]: p["containerPort"] for p in SERVER["ports"]}
    assert CONFIG["server"]["metrics_listen"] == f"0.0.0.0:{ports['metrics']}"
    assert CONFIG["server"]["listen"] == f"0.0.0.0:{ports['kvstore']}"
    notes = DAEMONSET["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(ports["metrics"])
    assert notes["prometheus.io/path"] == "/metrics"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert SERVER[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    security = SERVER["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == IMAGE_UID
    assert security["readOnlyRootFilesystem"] is True
    assert POD["terminationGracePeriodSeconds"] >= CONFIG["server"]["drain_timeout_s"] + 30
    labels = DAEMONSET["spec"]["template"]["metadata"]["labels"]
    assert DAEMONSET["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_namespace_admits_the_hostpath_volumes() -> None:
    assert any("hostPath" in v for v in POD["volumes"])
    labels = one("Namespace")["metadata"]["labels"]
    # Pod Security "baseline" and "restricted" refuse hostPath volumes.
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_memory_limit_covers_every_store_the_config_allows() -> None:
    host = next(t for t in CONFIG["tiers"] if t["kind"] == "host")
    need = CONFIG["server"]["max_stores"] * parse_size(host["capacity"])
    limit = SERVER["resources"]["limits"]["memory"]
    assert re.fullmatch(r"\d+Gi", limit), limit
    assert int(limit[:-2]) * 2**30 >= need + 2**30, (limit, need)
    assert SERVER["resources"]["requests"] == SERVER["resources"]["limits"]


def test_service_reaches_the_pod_on_the_callers_node() -> None:
    service = one("Service")
    labels = DAEMONSET["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    named = {p["name"] for p in SERVER["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == named


def test_grafana_configmap_carries_the_dashboard_as_it_is() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_grafana_configmap", REPO / "scripts" / "gen_grafana_configmap.py"
    )
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (MANIFESTS / "grafana-dashboard.yaml").read_text()
    assert text == gen.render(DASHBOARD.read_text()), (
        "deploy/kubernetes/grafana-dashboard.yaml is stale: "
        "run python scripts/gen_grafana_configmap.py"
    )
    configmap = one("ConfigMap", "kvstore-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (data,) = configmap["data"].values()
    assert json.loads(data) == json.loads(DASHBOARD.read_text())


def env_of_pod(pod_ip: str, node_name: str) -> dict[str, str]:
    """The server container's environment as the kubelet makes it (fieldRefs filled in,
    ``$(VAR)`` references expanded)."""
    fields = {"status.podIP": pod_ip, "spec.nodeName": node_name}
    env: dict[str, str] = {}
    for var in SERVER["env"]:
        if "valueFrom" in var:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
    return env


@pytest.fixture
def pod_root() -> Iterator[Path]:
    base = Path(f"/tmp/kvk8s-{os.getpid()}-{time.monotonic_ns() % 10**6}")  # short: a socket
    base.mkdir()
    yield base
    shutil.rmtree(base, ignore_errors=True)


def pod_config(root: Path, token: str) -> tuple[Path, int, int]:
    """The ConfigMap's server.yaml with each mount under ``root`` (the token Secret's
    file holding ``token``), loopback ports, and a host tier for a test machine."""
    text = one("ConfigMap", "kvstore-config")["data"]["server.yaml"]
    for name in ("token", "data", "socket", "config"):
        (root / name).mkdir()
        text = text.replace(mount(name) + "/", f"{root / name}/")
    config = yaml.safe_load(text)
    config["tiers"][0]["capacity"] = "64MiB"
    config["tiers"][1]["capacity"] = "1GiB"
    port, metrics = free_port(), free_port()
    config["server"].update(listen=f"{HOST}:{port}", metrics_listen=f"{HOST}:{metrics}")
    Path(config["server"]["token_file"]).write_text(token + "\n")
    path = root / "config" / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port, metrics


def run_server(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [f"{sys.prefix}/bin/{SERVER['command'][0]}", *SERVER["command"][1:]]
    argv[argv.index("--config") + 1] = str(config)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.Popen(
        argv, env={**clean, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_configmap_config_runs_as_the_daemonset_runs_it(pod_root: Path) -> None:
    config, port, metrics = pod_config(pod_root, "k8s-test-token-0123456789abcdef")
    env = env_of_pod(HOST, "node-1")
    assert env["KVSTORE_CLUSTER_ADVERTISE"] == f"{HOST}:7070"
    loaded = StoreConfig.from_dict(yaml.safe_load(config.read_text()), environ=env)
    assert loaded.cluster.node_id == "node-1"  # a cluster: section would take it
    server = run_server(config, env)
    try:
        wait_healthy(f"http://{HOST}:{metrics}/healthz", 120)
        over_socket = remote(
            f"unix:{pod_root}/socket/kvstore.sock", token_file=f"{pod_root}/token/kvstore-token"
        )
        keys, kv = put_chunks(over_socket, "k8s")
        found, got, stats = read_chunks(over_socket, keys)
        assert found == CHUNKS and got is not None and torch.equal(got, kv)
        assert stats["shm_blocks"] > 0  # an engine on the node: shared memory
        over_tcp = remote(f"{HOST}:{port}", token_file=f"{pod_root}/token/kvstore-token")
        assert read_chunks(over_tcp, keys)[0] == CHUNKS
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=120)
    assert server.returncode == 0, out


def test_secret_placeholder_is_a_token_the_server_refuses(pod_root: Path) -> None:
    placeholder = one("Secret")["stringData"]["token"]
    config, _, _ = pod_config(pod_root, placeholder)
    server = run_server(config, env_of_pod(HOST, "node-1"))
    out, _ = server.communicate(timeout=120)
    assert server.returncode == 2
    assert "a token must have at least 16 characters" in out
