"""Tier kinds of one's own: ``register_tier`` makes a kind usable from a config dict or
YAML file, with the settings its options class declares; a name registered already is
refused unless ``replace=True`` (for eviction policies too, ``register_policy``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvstore import KVStore
from kvstore.config import HostTierConfig, StoreConfig, TierConfig, parse_size, tier_kinds
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.policy import POLICIES, LRUPolicy, make_policy, register_policy
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers import TIERS, register_tier, registered_kinds, tier_class
from kvstore.tiers.host import HostTier

LAYOUT = small_layout()


@pytest.fixture(autouse=True)
def fresh_registries() -> Iterator[None]:
    """Each test registers into copies, so no kind or policy outlives it."""
    with TIERS.scoped(), POLICIES.scoped():
        yield


@dataclass(frozen=True)
class LabelledConfig(HostTierConfig):
    """Host memory plus two settings of its own (what the docs tell a user to write)."""

    kind: ClassVar[str] = "labelled"
    label: str = "plain"
    spare: int = field(default=0, metadata={"parse": parse_size})

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.label == "bad":
            raise ConfigError(f"{path}.label: 'bad' is not allowed")


class LabelledTier(HostTier):
    """A host tier that keeps its config (the registered options) for the test to see."""


def roundtrip(store: KVStore, n: int = 3) -> None:
    keys = store.hash_tokens(range(n * LAYOUT.block_tokens), "m")
    kv = random_blocks(LAYOUT, n)
    assert store.put(keys, kv) == n
    assert store.lookup(keys) == n
    assert torch.equal(store.get(keys), kv)


def test_a_host_tier_registered_as_mem2_opens_from_a_config_dict_and_a_yaml_file(
    tmp_path: Path,
) -> None:
    register_tier("mem2", "kvstore.tiers.host:HostTier", options=HostTierConfig)
    assert "mem2" in registered_kinds()
    tier = {"kind": "mem2", "capacity": 8 * LAYOUT.block_nbytes, "prefault": False}
    with KVStore(LAYOUT, {"tiers": [tier]}) as store:
        assert isinstance(store.engine.datapath.tiers[0], HostTier)
        assert store.config.tiers[0].kind == "mem2"
        assert isinstance(store.config.tiers[0], HostTierConfig)  # the host tier's settings
        roundtrip(store)
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - {kind: mem2, capacity: 64KiB, prefault: false}\n")
    with KVStore(LAYOUT, path) as store:
        assert store.config.tiers[0].capacity == 64 * 1024
        assert store.config.to_dict()["tiers"][0]["kind"] == "mem2"
        roundtrip(store)


def test_a_registered_kind_reads_its_own_settings_from_yaml_and_the_environment(
    tmp_path: Path,
) -> None:
    register_tier("labelled", f"{__name__}:LabelledTier", options=LabelledConfig)
    path = tmp_path / "store.yaml"
    path.write_text(
        "tiers:\n  - {kind: labelled, capacity: 64KiB, label: hot, spare: 4KiB, prefault: false}\n"
    )
    with KVStore(LAYOUT, path) as store:
        tier = store.engine.datapath.tiers[0]
        assert type(tier) is LabelledTier
        assert isinstance(tier.config, LabelledConfig)
        assert (tier.config.label, tier.config.spare) == ("hot", 4096)
        roundtrip(store)
    config = StoreConfig.from_yaml(path, environ={"KVSTORE_LABELLED_SPARE": "8KiB"})
    assert isinstance(config.tiers[0], LabelledConfig)
    assert config.tiers[0].spare == 8192
    allowed = r"tiers\[0\]\.colour: unknown key; allowed keys: .*spare"
    with pytest.raises(ConfigError, match=allowed):
        StoreConfig.from_dict({"tiers": [{"kind": "labelled", "colour": "red"}]}, environ={})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.label: 'bad' is not allowed"):
        StoreConfig.from_dict({"tiers": [{"kind": "labelled", "label": "bad"}]}, environ={})


def test_a_kind_without_options_takes_the_settings_every_tier_has() -> None:
    register_tier("plain", f"{__name__}:LabelledTier")
    config = StoreConfig.from_dict({"tiers": [{"kind": "plain", "capacity": "1MiB"}]}, environ={})
    assert type(config.tiers[0]).__mro__[1] is TierConfig
    assert config.tiers[0].kind == "plain" and config.tiers[0].capacity == 1024**2
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.label: unknown key"):
        StoreConfig.from_dict({"tiers": [{"kind": "plain", "label": "x"}]}, environ={})


def test_an_unknown_kind_says_how_to_register_one() -> None:
    with pytest.raises(ConfigError, match=r"unknown tier kind 'mem2'.*register_tier"):
        StoreConfig.from_dict({"tiers": [{"kind": "mem2"}]}, environ={})


def test_registering_a_kind_twice_is_refused_unless_replace() -> None:
    register_tier("mem2", "kvstore.tiers.host:HostTier", options=HostTierConfig)
    with pytest.raises(ConfigError, match=r"'mem2' is registered already.*clobber=True"):
        register_tier("mem2", f"{__name__}:LabelledTier", options=LabelledConfig)
    assert tier_class("mem2") is HostTier  # the refused call changed nothing
    register_tier("mem2", f"{__name__}:LabelledTier", options=LabelledConfig, replace=True)
    assert tier_class("mem2") is LabelledTier
    config = StoreConfig.from_dict({"tiers": [{"kind": "mem2", "label": "x"}]}, environ={})
    assert isinstance(config.tiers[0], LabelledConfig) and config.tiers[0].kind == "mem2"


def test_a_built_in_kind_is_refused_and_replace_keeps_its_settings() -> None:
    with pytest.raises(ConfigError, match="'host' is registered already"):
        register_tier("host", f"{__name__}:LabelledTier")
    register_tier("host", f"{__name__}:LabelledTier", replace=True)  # options kept
    tier = {"kind": "host", "capacity": 8 * LAYOUT.block_nbytes, "prefault": False}
    with KVStore(LAYOUT, {"tiers": [tier]}) as store:
        assert type(store.engine.datapath.tiers[0]) is LabelledTier
        assert type(store.config.tiers[0]) is HostTierConfig
        roundtrip(store)


@pytest.mark.parametrize(
    ("kind", "target", "options", "message"),
    [
        ("Mem_2", "kvstore.tiers.host:HostTier", None, "lowercase letters and digits"),
        ("mem2", "kvstore.tiers.host.HostTier", None, "package.module:ClassName"),
        ("mem2", "kvstore.tiers.host:HostTier", dict, "dataclass subclassing TierConfig"),
        ("cluster", "kvstore.tiers.host:HostTier", None, "reserved"),
    ],
    ids=["bad name", "no colon", "options not a TierConfig", "cluster is reserved"],
)
def test_a_bad_registration_is_one_clear_error_and_registers_nothing(
    kind: str, target: str, options: type | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        register_tier(kind, target, options=options)  # type: ignore[arg-type]
    assert kind not in registered_kinds()
    assert kind not in tier_kinds()


def test_a_registered_class_that_is_not_there_is_a_config_error() -> None:
    register_tier("ghost", f"{__name__}:NoSuchTier")
    with pytest.raises(ConfigError, match=r"'ghost'.* has no NoSuchTier"):
        KVStore(LAYOUT, {"tiers": [{"kind": "ghost", "capacity": "1MiB"}]})


def test_registering_a_policy_name_twice_is_refused_unless_replace() -> None:
    class Other(LRUPolicy):
        name = "lru"

    with pytest.raises(ConfigError, match=r"'lru' is registered already.*clobber=True"):
        register_policy(Other)
    assert type(make_policy("lru")) is LRUPolicy  # the refused call changed nothing
    assert register_policy(LRUPolicy) is LRUPolicy  # the same class again: nothing to refuse

    @register_policy(replace=True)
    class Replacement(LRUPolicy):
        name = "lru"

    assert type(make_policy("lru")) is Replacement
    with pytest.raises(ConfigError, match="needs a name"):

        @register_policy
        class Nameless(LRUPolicy):
            name = ""


def test_a_store_evicts_with_a_registered_policy() -> None:
    layout = LAYOUT

    @register_policy
    class NewestFirst(LRUPolicy):
        """Evicts the block stored last (the opposite of LRU's choice)."""

        name = "newest"

        def candidates(self) -> Iterator[BlockKey]:
            return reversed(list(super().candidates()))

    config = {"tiers": [{"kind": "host", "capacity": 2 * layout.block_nbytes, "policy": "newest"}]}
    with KVStore(layout, config) as store:
        keys = store.hash_tokens(range(3 * layout.block_tokens), "m")
        store.put(keys[:2], random_blocks(layout, 2))
        store.evict(1)
        assert store.engine.datapath.exists(keys[:2]) == [True, False]


PLUGIN = """
from dataclasses import dataclass
from typing import ClassVar

from kvstore.config import HostTierConfig
from kvstore.tiers import register_tier
from kvstore.tiers.host import HostTier


@dataclass(frozen=True)
class PluggedConfig(HostTierConfig):
    kind: ClassVar[str] = "plugged"
    label: str = "plain"


class PluggedTier(HostTier):
    pass


def register():
    register_tier("plugged", "plugged_tiers:PluggedTier", options=PluggedConfig)
"""


def test_a_tier_kind_from_an_installed_packages_entry_point_opens_from_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package installed beside kvstore declares a ``kvstore.tiers`` entry point; a YAML
    config names its kind, and the plugin registers it the first time it is named."""
    site = tmp_path / "site"
    (site / "plugged_tiers-1.0.dist-info").mkdir(parents=True)
    (site / "plugged_tiers-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: plugged-tiers\nVersion: 1.0\n"
    )
    (site / "plugged_tiers-1.0.dist-info" / "entry_points.txt").write_text(
        "[kvstore.tiers]\nplugged = plugged_tiers:register\n"
    )
    (site / "plugged_tiers.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(site))
    assert "plugged" not in registered_kinds()
    path = tmp_path / "store.yaml"
    path.write_text("tiers:\n  - {kind: plugged, capacity: 64KiB, prefault: false, label: hot}\n")
    with KVStore(LAYOUT, path) as store:
        assert store.config.tiers[0].kind == "plugged"
        assert type(store.config.tiers[0]).__name__ == "PluggedConfig"
        assert store.config.tiers[0].label == "hot"  # type: ignore[attr-defined]
        assert type(store.engine.datapath.tiers[0]).__name__ == "PluggedTier"
        roundtrip(store)
    assert "plugged" in registered_kinds()
    assert TIERS.view["plugged"].options.__name__ == "PluggedConfig"


def test_a_plugin_that_fails_to_register_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    (site / "broken_tiers-1.0.dist-info").mkdir(parents=True)
    (site / "broken_tiers-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-tiers\nVersion: 1.0\n"
    )
    (site / "broken_tiers-1.0.dist-info" / "entry_points.txt").write_text(
        "[kvstore.tiers]\nbroken = broken_tiers:register\n"
    )
    (site / "broken_tiers.py").write_text("def register():\n    raise RuntimeError('no luck')\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(
        ConfigError, match=r"tier plugin 'broken' \(broken_tiers:register\).*no luck"
    ):
        StoreConfig.from_dict({"tiers": [{"kind": "nosuch"}]}, environ={})
    with pytest.raises(ConfigError, match="unknown tier kind 'nosuch'"):  # tried once only
        StoreConfig.from_dict({"tiers": [{"kind": "nosuch"}]}, environ={})
