"""StoreConfig: dicts, YAML, KVSTORE_* environment; every bad key is named in the error."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from kvstore.config import (
    DeviceTierConfig,
    DiskTierConfig,
    HostTierConfig,
    StoreConfig,
    TierConfig,
    default_cache_dir,
    format_size,
    parse_size,
    tier_config_class,
)
from kvstore.errors import ConfigError

GiB = 1024**3
MiB = 1024**2

TWO_TIERS = {
    "tiers": [
        {"kind": "host", "capacity": "1GiB"},
        {"kind": "device", "device": "cuda:0", "capacity": "2GiB"},
    ]
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No test here may see a developer's KVSTORE_* variables."""
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)


def from_dict(data, **env):
    return StoreConfig.from_dict(data, environ=env)


def raises_at(path: str):
    """ConfigError whose message names ``path``."""
    return pytest.raises(ConfigError, match=re.escape(path))


# -- sizes ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        (0, 0),
        (1024, 1024),
        (4096.0, 4096),
        ("4096", 4096),
        ("512MiB", 512 * MiB),
        ("512 MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("  3m ", 3 * MiB),
        ("2GiB", 2 * GiB),
        ("2G", 2 * GiB),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("100k", 100 * 1024),
        ("100K", 100 * 1024),
        ("100kb", 100_000),
        ("100KiB", 100 * 1024),
        ("0.5k", 512),
        ("10b", 10),
        ("10B", 10),
        ("1T", 1024**4),
        ("1TB", 10**12),
        ("2tib", 2 * 1024**4),
        ("7MB", 7_000_000),
    ],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes
    assert isinstance(parse_size(text), int)


@pytest.mark.parametrize(
    "bad",
    [
        "lots",
        "",
        "1e3",
        "-1",
        "-1GiB",
        "1.5.5",
        "10 XB",
        "GiB",
        "1 2",
        True,
        False,
        None,
        [1],
        -1,
        1.5,
        float("inf"),
        float("nan"),
        -2.0,
    ],
)
def test_parse_size_rejects(bad):
    with raises_at("tiers[3].capacity"):
        parse_size(bad, "tiers[3].capacity")


def test_parse_size_is_exact_for_integer_strings():
    assert parse_size("9007199254740993") == 9007199254740993


@pytest.mark.parametrize("text", ["1.5", "0.1b", "2.5B"])
def test_parse_size_rejects_fractional_bytes_like_floats(text):
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (5 * 1024**5, "5120.00 TiB"),
    ],
)
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


# -- dicts and defaults ---------------------------------------------------------------
def test_defaults():
    cfg = from_dict({})
    assert cfg == StoreConfig() == StoreConfig.default(environ={})
    tier, disk = cfg.tiers
    assert type(tier) is HostTierConfig and tier.kind == "host"
    assert tier.capacity == 4 * GiB
    assert (tier.high_watermark, tier.low_watermark) == (0.9, 0.7)
    assert tier.pinned is None
    assert type(disk) is DiskTierConfig and disk.capacity == 32 * GiB
    assert disk.path == default_cache_dir()
    assert DeviceTierConfig().device == "cuda:0"
    assert TierConfig().capacity == 0


def test_from_dict_two_tiers():
    cfg = from_dict(TWO_TIERS)
    host, dev = cfg.tiers
    assert type(host) is HostTierConfig and host.capacity == GiB
    assert type(dev) is DeviceTierConfig and dev.capacity == 2 * GiB and dev.device == "cuda:0"
    assert (dev.high_watermark, dev.low_watermark) == (0.9, 0.7)


def test_from_dict_every_field():
    cfg = from_dict(
        {
            "tiers": [
                {
                    "kind": "host",
                    "capacity": 123456,
                    "high_watermark": "0.8",
                    "low_watermark": 0,
                    "pinned": "no",
                },
                {"kind": "device", "device": "cpu", "capacity": "1MiB", "high_watermark": 1},
            ]
        }
    )
    host, dev = cfg.tiers
    assert host == HostTierConfig(
        capacity=123456, high_watermark=0.8, low_watermark=0.0, pinned=False
    )
    assert dev == DeviceTierConfig(capacity=MiB, device="cpu", high_watermark=1.0)


@pytest.mark.parametrize(
    ("value", "pinned"),
    [
        (True, True),
        ("yes", True),
        ("on", True),
        ("1", True),
        (False, False),
        ("no", False),
        ("0", False),
        (None, None),
        ("auto", None),
        ("", None),
    ],
)
def test_pinned_values(value, pinned):
    assert from_dict({"tiers": [{"kind": "host", "pinned": value}]}).tiers[0].pinned is pinned


def test_host_prefault_defaults_on_and_parses_flags(monkeypatch):
    assert from_dict({}).tiers[0].prefault is True
    assert from_dict({"tiers": [{"kind": "host", "prefault": "no"}]}).tiers[0].prefault is False
    monkeypatch.setenv("KVSTORE_HOST_PREFAULT", "false")
    assert StoreConfig.from_dict({}).tiers[0].prefault is False


@pytest.mark.parametrize("value", ["maybe", 2, None])
def test_bad_prefault_values_name_the_key(value):
    with raises_at("tiers[0].prefault"):
        from_dict({"tiers": [{"kind": "host", "prefault": value}]})


def test_disk_page_cache_keeps_by_default_and_follows_o_direct(monkeypatch):
    def disk(**fields):
        return from_dict({"tiers": [{"kind": "disk", **fields}]}).tiers[0]

    assert disk().page_cache == "keep" and not disk().bypass_page_cache
    assert disk(page_cache="bypass").bypass_page_cache
    with pytest.warns(
        DeprecationWarning, match=r"tiers\[0\]\.o_direct: true is deprecated.*page_cache: bypass"
    ):
        assert disk(o_direct=True).page_cache == "bypass"  # the older spelling
    with pytest.warns(DeprecationWarning):
        assert disk(o_direct=True, page_cache="bypass").bypass_page_cache
    with pytest.warns(DeprecationWarning):
        plain = from_dict({"tiers": [{"kind": "disk", "o_direct": True}]}).to_dict()
    assert plain["tiers"][0]["page_cache"] == "bypass"
    with pytest.warns(DeprecationWarning):
        assert from_dict(plain).to_dict() == plain
    monkeypatch.setenv("KVSTORE_DISK_PAGE_CACHE", "bypass")
    assert StoreConfig.from_dict({}).tiers[1].page_cache == "bypass"


@pytest.mark.parametrize(
    ("fields", "path", "needle"),
    [
        ({"page_cache": "drop"}, "tiers[0].page_cache", "use keep"),
        ({"page_cache": 1}, "tiers[0].page_cache", "non-empty string"),
        ({"page_cache": ""}, "tiers[0].page_cache", "non-empty string"),
        ({"page_cache": "keep", "o_direct": True}, "tiers[0].o_direct", "contradicts"),
    ],
)
def test_bad_page_cache_values_are_clear(fields, path, needle):
    with pytest.raises(ConfigError, match=re.escape(path)) as info:
        from_dict({"tiers": [{"kind": "disk", **fields}]})
    assert needle in str(info.value)


@pytest.mark.parametrize("value", ["never", "maybe", 2, 1.0])
def test_bad_pinned_values(value):
    with raises_at("tiers[0].pinned"):
        from_dict({"tiers": [{"kind": "host", "pinned": value}]})


def test_to_dict_round_trip():
    cfg = from_dict(
        {
            "tiers": [
                {"kind": "device", "device": "cuda:1", "capacity": "3GiB", "low_watermark": 0.5},
                {"kind": "host", "capacity": "1.5GB", "pinned": True},
                {"kind": "host", "capacity": 4096, "high_watermark": 1.0, "low_watermark": 0.0},
            ]
        }
    )
    plain = cfg.to_dict()
    assert plain["tiers"][0] == {
        "kind": "device",
        "capacity": 3 * GiB,
        "high_watermark": 0.9,
        "low_watermark": 0.5,
        "policy": "lru",
        "write_policy": "write_back",
        "promote_after": 2,
        "admit_after": 0,
        "read_gbps": 300.0,
        "read_latency_ms": 0.01,
        "device": "cuda:1",
    }
    assert plain["tiers"][1]["kind"] == "host" and plain["tiers"][1]["pinned"] is True
    assert from_dict(plain) == cfg
    # and through YAML text
    assert from_dict(yaml.safe_load(yaml.safe_dump(plain))) == cfg
    assert json.loads(json.dumps(plain)) == plain


def test_config_is_frozen():
    cfg = from_dict(TWO_TIERS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tiers[0].capacity = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tiers = ()  # type: ignore[misc]


# -- errors name the key ----------------------------------------------------------------
def with_tier1(**changes):
    tiers = [dict(t) for t in TWO_TIERS["tiers"]]
    tiers[1].update(changes)
    return {"tiers": tiers}


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"tierz": []}, "tierz"),
        ({"tiers": [], "extra": 1}, "extra"),
        ({"tiers": "host"}, "tiers"),
        ({"tiers": {"kind": "host"}}, "tiers"),
        ({"tiers": []}, "tiers"),
        (with_tier1(bogus=1), "tiers[1].bogus"),
        (with_tier1(Capacity=1), "tiers[1].Capacity"),
        (with_tier1(pinned=True), "tiers[1].pinned"),  # a host field on a device tier
        (with_tier1(kind="nvme"), "tiers[1].kind"),
        (with_tier1(kind=None), "tiers[1].kind"),
        ({"tiers": [{"kind": "host"}, {"capacity": 10}]}, "tiers[1].kind"),
        (with_tier1(capacity=0), "tiers[1].capacity"),
        (with_tier1(capacity="0GiB"), "tiers[1].capacity"),
        (with_tier1(capacity=-1), "tiers[1].capacity"),
        (with_tier1(capacity="-1GiB"), "tiers[1].capacity"),
        (with_tier1(capacity="lots"), "tiers[1].capacity"),
        (with_tier1(capacity=None), "tiers[1].capacity"),
        (with_tier1(high_watermark=1.5), "tiers[1].high_watermark"),
        (with_tier1(high_watermark=0), "tiers[1].high_watermark"),
        (with_tier1(high_watermark="nan"), "tiers[1].high_watermark"),
        (with_tier1(high_watermark="high"), "tiers[1].high_watermark"),
        (with_tier1(high_watermark=True), "tiers[1].high_watermark"),
        (with_tier1(high_watermark=[0.9]), "tiers[1].high_watermark"),
        (with_tier1(low_watermark=0.9), "tiers[1].low_watermark"),  # == high
        (with_tier1(low_watermark=0.95), "tiers[1].low_watermark"),  # > high
        (with_tier1(high_watermark=0.5, low_watermark=0.6), "tiers[1].low_watermark"),
        (with_tier1(low_watermark=-0.1), "tiers[1].low_watermark"),
        (with_tier1(device=""), "tiers[1].device"),
        (with_tier1(device=3), "tiers[1].device"),
        (with_tier1(device="not-a-device"), "tiers[1].device"),
        ({"tiers": [{"kind": "host"}, "device"]}, "tiers[1]"),
        ({"tiers": [{"kind": "host"}, ["device"]]}, "tiers[1]"),
        ({"tiers": [{"kind": "host"}, None]}, "tiers[1]"),
    ],
)
def test_bad_values_name_the_key(data, path):
    with raises_at(path):
        from_dict(data)


@pytest.mark.parametrize("bad", [[], "tiers: []", None, 5])
def test_config_must_be_a_mapping(bad):
    with pytest.raises(ConfigError, match="config"):
        StoreConfig.from_dict(bad, environ={})


def test_direct_construction_is_validated():
    with raises_at("tiers"):
        StoreConfig(tiers=())
    with raises_at("tiers[1]"):
        StoreConfig(tiers=(HostTierConfig(), {"kind": "host"}))  # type: ignore[arg-type]
    with raises_at("tiers[0].capacity"):
        StoreConfig(tiers=(HostTierConfig(capacity=0),))
    with raises_at("tiers[1].low_watermark"):
        StoreConfig(tiers=(HostTierConfig(), DeviceTierConfig(capacity=1, low_watermark=1.0)))


def test_tier_config_class():
    assert tier_config_class("host") is HostTierConfig
    assert tier_config_class("device") is DeviceTierConfig
    with raises_at("tiers[2].kind"):
        tier_config_class("s3x", "tiers[2].kind")


# -- YAML files --------------------------------------------------------------------------
def test_from_yaml(tmp_path):
    path = tmp_path / "store.yaml"
    path.write_text(
        "tiers:\n"
        "  - kind: host\n"
        "    capacity: 512MiB\n"
        "    high_watermark: 0.95\n"
        "    low_watermark: 0.5\n"
        "  - kind: device\n"
        "    device: cuda:0\n"
        "    capacity: 2GiB\n"
    )
    cfg = StoreConfig.from_yaml(path, environ={})
    assert cfg == StoreConfig.from_yaml(str(path), environ={})
    host, dev = cfg.tiers
    assert host == HostTierConfig(capacity=512 * MiB, high_watermark=0.95, low_watermark=0.5)
    assert dev == DeviceTierConfig(capacity=2 * GiB, device="cuda:0")


def test_from_yaml_empty_file_is_default(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert StoreConfig.from_yaml(path, environ={}) == StoreConfig()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("tiers: [\n", "not valid YAML"),
        ("tiers:\n  - kind: host\n   capacity: 1\n", "not valid YAML"),
        ("- kind: host\n", "expected a mapping"),
        ("tiers:\n  - kind: host\n    capacity: lots\n", "tiers[0].capacity"),
        ("tiers:\n  - kind: host\n    capacty: 1GiB\n", "tiers[0].capacty"),
    ],
)
def test_from_yaml_invalid(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with raises_at(needle):
        StoreConfig.from_yaml(path, environ={})


def test_from_yaml_invalid_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tiers: [\n")
    with raises_at(str(path)):
        StoreConfig.from_yaml(path, environ={})


def test_from_yaml_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with raises_at(str(path)):
        StoreConfig.from_yaml(path, environ={})
    with pytest.raises(ConfigError):
        StoreConfig.from_yaml(tmp_path, environ={})  # a directory


# -- environment overrides -----------------------------------------------------------------
def test_env_field_override():
    cfg = from_dict(
        TWO_TIERS,
        KVSTORE_HOST_CAPACITY="8GiB",
        KVSTORE_HOST_HIGH_WATERMARK="0.95",
        KVSTORE_HOST_LOW_WATERMARK="0.1",
        KVSTORE_HOST_PINNED="false",
        KVSTORE_DEVICE_DEVICE="cuda:3",
        KVSTORE_DEVICE_CAPACITY="1024",
    )
    host, dev = cfg.tiers
    assert host == HostTierConfig(8 * GiB, 0.95, 0.1, pinned=False)
    assert dev == DeviceTierConfig(1024, device="cuda:3")


def test_env_override_does_not_mutate_the_input():
    data = json.loads(json.dumps(TWO_TIERS))
    snapshot = json.loads(json.dumps(data))
    from_dict(data, KVSTORE_HOST_CAPACITY="8GiB")
    assert data == snapshot


def test_env_overrides_only_the_first_tier_of_a_kind():
    data = {"tiers": [{"kind": "host", "capacity": "1GiB"}, {"kind": "host", "capacity": "2GiB"}]}
    first, second = from_dict(data, KVSTORE_HOST_CAPACITY="3GiB").tiers
    assert (first.capacity, second.capacity) == (3 * GiB, 2 * GiB)


def test_env_override_of_the_default_tier():
    assert from_dict({}, KVSTORE_HOST_CAPACITY="1GiB").tiers == (
        HostTierConfig(capacity=GiB),
        DiskTierConfig(),
    )
    assert from_dict({}, KVSTORE_DISK_PATH="/x").tiers[1] == DiskTierConfig(path="/x")
    assert StoreConfig.default(environ={"KVSTORE_HOST_CAPACITY": "2GiB"}).tiers[0].capacity == (
        2 * GiB
    )


def test_env_tiers_json_replaces_the_list():
    tiers = [{"kind": "device", "device": "cpu", "capacity": "1MiB"}, {"kind": "host"}]
    cfg = from_dict(TWO_TIERS, KVSTORE_TIERS=json.dumps(tiers))
    assert cfg.tiers == (DeviceTierConfig(capacity=MiB, device="cpu"), HostTierConfig())


def test_env_tiers_yaml_and_field_override_combine():
    cfg = from_dict({}, KVSTORE_TIERS="- {kind: host, capacity: 1GiB}", KVSTORE_HOST_CAPACITY="5k")
    assert cfg.tiers == (HostTierConfig(capacity=5 * 1024),)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVSTORE_FOO": "1"}, "KVSTORE_FOO"),
        ({"KVSTORE_HOST": "1"}, "KVSTORE_HOST"),
        ({"KVSTORE_": "1"}, "KVSTORE_"),
        ({"KVSTORE_NVME_CAPACITY": "1GiB"}, "KVSTORE_NVME_CAPACITY"),
        ({"KVSTORE_DEVICE_CAPACITY": "1GiB"}, "KVSTORE_DEVICE_CAPACITY"),  # no device tier
        ({"KVSTORE_HOST_CAPACITY": "lots"}, "tiers[0].capacity"),
        ({"KVSTORE_HOST_BOGUS": "1"}, "tiers[0].bogus"),
        ({"KVSTORE_HOST_LOW_WATERMARK": "0.95"}, "tiers[0].low_watermark"),
        ({"KVSTORE_TIERS": "[{kind: host"}, "KVSTORE_TIERS"),
        ({"KVSTORE_TIERS": "[]"}, "tiers"),
        ({"KVSTORE_TIERS": '[{"kind": "nvme"}]'}, "tiers[0].kind"),
        ({"KVSTORE_TIERS": '{"kind": "host"}'}, "tiers"),
    ],
)
def test_env_errors_name_the_variable_or_key(env, needle):
    with raises_at(needle):
        StoreConfig.from_dict({}, environ=env)


@pytest.mark.parametrize("value", ["5", "", "null", "true"])
def test_env_tiers_scalar_is_a_config_error(value):
    with pytest.raises(ConfigError, match="tiers"):
        StoreConfig.from_dict({}, environ={"KVSTORE_TIERS": value})


def test_env_override_with_non_list_tiers_is_a_config_error():
    with raises_at("tiers"):
        StoreConfig.from_dict({"tiers": 5}, environ={"KVSTORE_HOST_CAPACITY": "1GiB"})


def test_other_env_variables_are_ignored():
    env = {"PATH": "/bin", "KVSTOREFOO": "1", "kvstore_host_capacity": "1", "MY_KVSTORE_X": "1"}
    assert from_dict(TWO_TIERS, **env) == from_dict(TWO_TIERS)


def test_kvstore_config_variable_is_not_an_override():
    # KVSTORE_CONFIG names the base file for load(); from_dict ignores it.
    assert from_dict({}, KVSTORE_CONFIG="/does/not/exist.yaml") == StoreConfig()


def test_empty_environ_disables_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTORE_HOST_CAPACITY", "1GiB")
    monkeypatch.setenv("KVSTORE_FOO", "would be an error")
    path = tmp_path / "c.yaml"
    path.write_text("tiers: [{kind: host, capacity: 2GiB}]\n")
    assert StoreConfig.from_dict({}, environ={}).tiers[0].capacity == 4 * GiB
    assert StoreConfig.default(environ={}) == StoreConfig()
    assert StoreConfig.from_yaml(path, environ={}).tiers[0].capacity == 2 * GiB
    # ... while the default environ is os.environ
    with raises_at("KVSTORE_FOO"):
        StoreConfig.from_dict({})
    monkeypatch.delenv("KVSTORE_FOO")
    assert StoreConfig.from_dict({}).tiers[0].capacity == GiB
    assert StoreConfig.from_yaml(path).tiers[0].capacity == GiB
    assert StoreConfig.default().tiers[0].capacity == GiB


# -- load() ------------------------------------------------------------------------------
def test_load_from_kvstore_config(monkeypatch, tmp_path):
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - kind: host\n    capacity: 256MiB\n")
    monkeypatch.setenv("KVSTORE_CONFIG", str(path))
    assert StoreConfig.load().tiers == (HostTierConfig(capacity=256 * MiB),)
    assert StoreConfig.load(None) == StoreConfig.load()
    # env field overrides still apply on top of the file
    monkeypatch.setenv("KVSTORE_HOST_HIGH_WATERMARK", "0.8")
    assert StoreConfig.load().tiers == (HostTierConfig(capacity=256 * MiB, high_watermark=0.8),)


def test_load_without_env_is_default():
    assert StoreConfig.load() == StoreConfig()


def test_load_missing_kvstore_config_file(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSTORE_CONFIG", str(tmp_path / "missing.yaml"))
    with raises_at("missing.yaml"):
        StoreConfig.load()


def test_load_sources(tmp_path):
    cfg = from_dict(TWO_TIERS)
    assert StoreConfig.load(cfg) is cfg
    assert StoreConfig.load(TWO_TIERS) == cfg
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(TWO_TIERS))
    assert StoreConfig.load(path) == cfg
    assert StoreConfig.load(str(path)) == cfg


# -- imports -----------------------------------------------------------------------------------
_IMPORT_PROBE = """
import json, sys
heavy = ("torch", "boto3", "botocore", "redis")
out = {}
import kvstore
out["import kvstore"] = [m for m in heavy if m in sys.modules]
import kvstore.errors
import kvstore.config
out["import kvstore.config"] = [m for m in heavy if m in sys.modules]
cfg = kvstore.StoreConfig.from_dict(
    {"tiers": [{"kind": "host", "capacity": "1GiB"}]}, environ={}
)
out["host config"] = [m for m in heavy if m in sys.modules]
print(json.dumps(out))
"""


def test_imports_are_light():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "import kvstore": [],
        "import kvstore.config": [],
        "host config": [],
    }


def test_sections_and_scalars():
    cfg = from_dict(
        {
            "replication": {"hot_threshold": 3, "half_life_s": 10},
            "prefetch": {"policy": "timeout", "timeout_base_s": 1.5},
            "lease_s": 5,
            "mover_threads": 3,
        }
    )
    assert cfg.replication.hot_threshold == 3 and cfg.replication.half_life_s == 10.0
    assert cfg.prefetch.policy == "timeout" and cfg.prefetch.deadline_s(10_000) == 2.5
    assert cfg.prefetch.deadline_s(10**9) == cfg.prefetch.timeout_max_s
    assert (cfg.lease_s, cfg.mover_threads) == (5.0, 3)
    assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"replication": {"hot": 1}}, "replication.hot"),
        ({"replication": {"max_copies": 0}}, "replication.max_copies"),
        ({"prefetch": {"policy": "eager"}}, "prefetch.policy"),
        ({"prefetch": {"threads": 0}}, "prefetch.threads"),
        ({"lease_s": -1}, "lease_s"),
        ({"tiers": [{"kind": "host", "write_policy": "sometimes"}]}, "tiers[0].write_policy"),
        ({"tiers": [{"kind": "host", "promote_after": -1}]}, "tiers[0].promote_after"),
        ({"tiers": [{"kind": "host", "policy": "mru"}]}, "tiers[0].policy"),
    ],
)
def test_bad_section_values_name_the_key(data, path):
    with pytest.raises(ConfigError, match=re.escape(path)):
        from_dict(data)


def test_env_overrides_sections_and_scalars():
    env = {
        "KVSTORE_REPLICATION_HOT_THRESHOLD": "5",
        "KVSTORE_PREFETCH_POLICY": "best_effort",
        "KVSTORE_LEASE_S": "2.5",
        "KVSTORE_HOST_WRITE_POLICY": "write_through",
    }
    cfg = StoreConfig.default(environ=env)
    assert cfg.replication.hot_threshold == 5
    assert cfg.prefetch.policy == "best_effort"
    assert cfg.lease_s == 2.5
    assert cfg.tiers[0].write_policy == "write_through"
