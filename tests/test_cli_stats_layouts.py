"""``kvstore stats`` reports every layout its config's disk tiers hold -- a store's own
and a kvstore-server's, per namespace -- and writes nothing: the directory tree is the
same, byte for byte and timestamp for timestamp, after it ran."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from kvstore import KVLayout, KVStore
from kvstore.cli.kvserver import KVStoreServerProcess, server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.testing.conformance import make_keys

#: Not Llama-3-8B (the layout flags' default): 32 KiB chunks, 36 KiB block files.
TOY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.float16)
TOY_FLAGS = ["--layers", "4", "--kv-heads", "2", "--head-dim", "64"]
TOY_FLAGS += ["--block-tokens", "16", "--dtype", "float16"]
KVSTORE = str(Path(sys.executable).with_name("kvstore"))


def kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``kvstore`` console script, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [KVSTORE, *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def tree(root: Path) -> dict[str, tuple[str, int, str]]:
    """Every path under ``root``: its kind, modification time and (files) content hash."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = ("d" if path.is_dir() else "f", st.st_mtime_ns, digest)
    return out


def store_config(tmp_path: Path) -> Path:
    path = tmp_path / "store.yaml"
    disk = {"kind": "disk", "path": str(tmp_path / "kvcache"), "capacity": "1GiB"}
    path.write_text(yaml.safe_dump({"tiers": [{"kind": "host", "capacity": "64MiB"}, disk]}))
    return path


def fill(config: Path, layout: KVLayout, tokens: int) -> list[bytes]:
    with KVStore(layout, str(config)) as store:
        keys = store.hash_tokens(list(range(tokens)), namespace="toy-model")
        kv = torch.randn(layout.tensor_shape(len(keys))).to(layout.dtype)
        assert store.put(keys, kv) == len(keys)
    return keys


def test_stats_finds_a_layout_other_than_the_default_and_writes_nothing(tmp_path: Path) -> None:
    config = store_config(tmp_path)
    fill(config, TOY, 96)  # 6 chunks
    before = tree(tmp_path / "kvcache")

    plain = kvstore("stats", "--config", str(config))  # no layout flags at all
    assert plain.returncode == 0, plain.stderr
    assert f"layout {TOY.fingerprint_hex}: 6 blocks stored (4 layers, 32.00 KiB a chunk" in (
        plain.stdout
    )
    # 1 GiB of 36 KiB block files (the 32 KiB chunk and its 4 KiB header): 29,127.
    assert "disk            6 / 29,127 blocks, 216.00 KiB / 1.00 GiB" in plain.stdout
    assert "host            0 / 2,048 blocks, 0 B / 64.00 MiB" in plain.stdout

    named = kvstore("stats", "--config", str(config), *TOY_FLAGS, "--json")
    assert named.returncode == 0, named.stderr
    report = json.loads(named.stdout)
    [store] = report["stores"]
    assert store["fingerprint"] == TOY.fingerprint_hex and store["blocks"] == 6
    assert store["layout"] == TOY.describe() and report["notes"] == []
    disk = store["tiers"][1]
    assert disk["unit_nbytes"] == 36 * 1024 and disk["bytes"] == 6 * 36 * 1024
    assert disk["capacity_blocks"] == 2**30 // (36 * 1024)
    assert tree(tmp_path / "kvcache") == before


def test_stats_says_which_layouts_are_on_disk_when_the_flags_name_another(tmp_path: Path) -> None:
    config = store_config(tmp_path)
    fill(config, TOY, 32)
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16)
    fill(config, other, 48)
    before = tree(tmp_path / "kvcache")

    default = kvstore("stats", "--config", str(config), "--layers", "32")  # Llama-3-8B
    assert default.returncode == 0, default.stderr
    llama = KVLayout(32, 8, 128).fingerprint_hex
    assert f"note: layout {llama} (the layout flags) has no blocks on disk; on disk: " in (
        default.stdout
    )
    assert f"layout {TOY.fingerprint_hex} (2 blocks, 4 layers)" in default.stdout
    assert f"layout {other.fingerprint_hex} (3 blocks, 2 layers)" in default.stdout
    assert f"layout {llama}: 0 blocks stored" in default.stdout

    only = kvstore("stats", "--config", str(config), "--layout", other.fingerprint_hex[:6])
    assert only.returncode == 0, only.stderr
    assert f"layout {other.fingerprint_hex}: 3 blocks stored" in only.stdout
    assert TOY.fingerprint_hex not in only.stdout

    wrong = kvstore("stats", "--config", str(config), "--layout", "ffffffff")
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("kvstore: error: --layout ffffffff: no such layout on disk")
    assert wrong.stderr.count("\n") == 1 and TOY.fingerprint_hex in wrong.stderr
    assert tree(tmp_path / "kvcache") == before


def test_stats_with_an_empty_or_missing_disk_creates_nothing(tmp_path: Path) -> None:
    config = store_config(tmp_path)
    result = kvstore("stats", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert f"note: no blocks on disk ({tmp_path / 'kvcache'})" in result.stdout
    assert "disk            0 / " in result.stdout
    assert not (tmp_path / "kvcache").exists()


def test_stats_on_a_server_config_reports_each_namespace_and_writes_nothing(
    tmp_path: Path,
) -> None:
    work = tmp_path / "server"
    with KVStoreServerProcess(server_test_config(work), work) as server:
        for namespace, n in (("team-a", 4), ("team-b", 2)):
            options = ClientOptions(server.address, namespace=namespace)
            with Client(TOY, options) as client:
                data = [torch.randn(TOY.block_shape).to(TOY.dtype) for _ in range(n)]
                assert all(client.put(make_keys(n, salt=n), data))
    cache = work / "disk"  # the server flushed to its disk tier as it stopped
    before = tree(cache)

    result = kvstore("stats", "--config", str(work / "server.yaml"))
    assert result.returncode == 0, result.stderr
    assert f"namespace team-a, layout {TOY.fingerprint_hex}: 4 blocks stored" in result.stdout
    assert f"namespace team-b, layout {TOY.fingerprint_hex}: 2 blocks stored" in result.stdout
    as_json = kvstore("stats", "--config", str(work / "server.yaml"), *TOY_FLAGS, "--json")
    stores = {s["namespace"]: s for s in json.loads(as_json.stdout)["stores"]}
    assert sorted(stores) == ["team-a", "team-b"] and stores["team-a"]["blocks"] == 4
    assert stores["team-a"]["layout"] == TOY.describe()
    assert not (cache / "kvstore-v1").exists()  # no stray directory of the default layout
    assert tree(cache) == before
