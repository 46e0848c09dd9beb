"""KVSTORE_* variables override a config file, never an explicit dict.

A dict handed to ``StoreConfig.from_dict`` / ``StoreConfig.load`` / ``KVStore(layout, {...})``
is what the program asked for: the process's variables only fill the keys it leaves unset,
and each one whose key the dict gives is named in a warning. A YAML file (``--config``,
``$KVSTORE_CONFIG``), what ``kvstore-server`` reads, is overridden by them as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kvstore import KVLayout, KVStore
from kvstore.config import HostTierConfig, StoreConfig

GiB = 1024**3
MiB = 1024**2


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here may see a developer's KVSTORE_* variables."""
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)


def shadow_warnings(record: list[warnings.WarningMessage]) -> dict[str, str]:
    """``{variable: message}`` of the warnings that a dict kept a variable out."""
    out = {}
    for w in record:
        text = str(w.message)
        if "not applied: the config dict gives" in text:
            out[text.split()[0]] = text
    return out


def test_env_overrides_a_yaml_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "store.yaml"
    path.write_text("tiers: [{kind: host, capacity: 2GiB}]\nprefetch: {threads: 3}\n")
    monkeypatch.setenv("KVSTORE_HOST_CAPACITY", "1GiB")
    monkeypatch.setenv("KVSTORE_PREFETCH_THREADS", "5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file is overridden without a word
        for config in (StoreConfig.from_yaml(path), StoreConfig.load(path)):
            assert config.tiers[0].capacity == GiB and config.prefetch.threads == 5
        monkeypatch.setenv("KVSTORE_CONFIG", str(path))
        assert StoreConfig.load().tiers[0].capacity == GiB


def test_env_never_overrides_an_explicit_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    data = {"tiers": [{"kind": "host", "capacity": "2GiB"}], "prefetch": {"threads": 3}}
    monkeypatch.setenv("KVSTORE_HOST_CAPACITY", "1GiB")  # the dict gives it: kept out
    monkeypatch.setenv("KVSTORE_PREFETCH_THREADS", "5")  # likewise
    monkeypatch.setenv("KVSTORE_HOST_PREFAULT", "false")  # unset in the dict: filled
    monkeypatch.setenv("KVSTORE_PREFETCH_POLICY", "best_effort")  # likewise
    monkeypatch.setenv("KVSTORE_LEASE_S", "2.5")  # likewise
    for load in (StoreConfig.from_dict, StoreConfig.load):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            config = load(data)
        assert config.tiers == (HostTierConfig(capacity=2 * GiB, prefault=False),)
        assert (config.prefetch.threads, config.prefetch.policy) == (3, "best_effort")
        assert config.lease_s == 2.5
        said = shadow_warnings(record)
        assert sorted(said) == ["KVSTORE_HOST_CAPACITY", "KVSTORE_PREFETCH_THREADS"]
        assert "gives tiers[0].capacity" in said["KVSTORE_HOST_CAPACITY"]
        assert "gives prefetch.threads" in said["KVSTORE_PREFETCH_THREADS"]


def test_env_tiers_do_not_replace_a_dicts_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TIERS", "[{kind: host, capacity: 1GiB}]")
    with pytest.warns(UserWarning, match="KVSTORE_TIERS is set but not applied"):
        config = StoreConfig.from_dict({"tiers": [{"kind": "host", "capacity": "2GiB"}]})
    assert config.tiers == (HostTierConfig(capacity=2 * GiB),)
    # a dict that gives no tiers takes the variable's, and is not warned about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert StoreConfig.from_dict({"lease_s": 3}).tiers == (HostTierConfig(capacity=GiB),)


def test_a_typo_in_a_variable_is_still_an_error_beside_a_dict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_HOTS_CAPACITY", "1GiB")
    with pytest.raises(Exception, match="KVSTORE_HOTS_CAPACITY: unknown setting"):
        StoreConfig.from_dict({"tiers": [{"kind": "host"}]})


def test_an_environ_argument_still_overrides_a_dict() -> None:
    # Passing the variables explicitly asks for them, as over a file (documented).
    data = {"tiers": [{"kind": "host", "capacity": "2GiB"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = StoreConfig.from_dict(data, environ={"KVSTORE_HOST_CAPACITY": "1GiB"})
    assert config.tiers[0].capacity == GiB
    assert StoreConfig.from_dict(data, environ={}).tiers[0].capacity == 2 * GiB


def test_kvstore_with_a_dict_uses_the_dicts_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSTORE_HOST_CAPACITY", "64MiB")
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=8)
    tier = {"kind": "host", "capacity": "4MiB", "pinned": False, "prefault": False}
    with pytest.warns(UserWarning, match="KVSTORE_HOST_CAPACITY is set but not applied"):
        store = KVStore(layout, {"tiers": [tier]})
    with store:
        assert store.config.tiers[0].capacity == 4 * MiB
        assert store.stats()["tiers"][0]["capacity_bytes"] == 4 * MiB


def test_the_server_takes_env_overrides_over_its_file(tmp_path: Path) -> None:
    # The file listens on loopback (fine with no token); the variable moves it to every
    # interface, which the server refuses without a token: the variable won.
    path = tmp_path / "server.yaml"
    path.write_text("tiers: [{kind: host, capacity: 16MiB}]\nserver: {listen: '127.0.0.1:0'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), KVSTORE_SERVER_LISTEN="0.0.0.0:0")
    run = subprocess.run(
        [sys.executable, "-m", "kvstore.server.cli", "--config", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "refusing to start" in run.stderr and "0.0.0.0" in run.stderr
