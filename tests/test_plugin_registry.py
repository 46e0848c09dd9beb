"""The generic plug-in registry (:mod:`kvstore.runtime.registry`) and the registries built on it:
a duplicate name is refused unless ``clobber=True``, the view cannot be changed, a lazy
target is imported on first use (with its install hint when that fails), and a policy
from an installed package's ``kvstore.policies`` entry point works from a YAML config."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import KVStore
from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy
from kvstore.runtime.registry import Registry
from kvstore.testing.data import random_blocks, small_layout
from kvstore.tiers import TIERS

LAYOUT = small_layout()


class Thing:
    """A plug-in of the test registry's kind."""


class OtherThing(Thing):
    """Another one."""


def things() -> Registry[type[Thing]]:
    return Registry(
        "thing", "kvstore.test-things", lambda obj: isinstance(obj, type) and issubclass(obj, Thing)
    )


@pytest.fixture(autouse=True)
def fresh_registries() -> Iterator[None]:
    with TIERS.scoped(), POLICIES.scoped():
        yield


def test_a_duplicate_name_is_refused_unless_clobber_and_the_refusal_changes_nothing() -> None:
    registry = things()
    registry.register("a", Thing)
    with pytest.raises(ConfigError, match=r"thing 'a' is registered already.*clobber=True"):
        registry.register("a", OtherThing)
    assert registry.load("a") is Thing
    registry.register("a", f"{__name__}:Thing")  # the same plug-in, spelled lazily: no clash
    registry.register("a", OtherThing, clobber=True)
    assert registry.load("a") is OtherThing


def test_a_lazy_target_is_imported_on_first_use_and_a_missing_module_names_the_hint() -> None:
    registry = things()
    registry.register("lazy", f"{__name__}:OtherThing")
    assert not registry.view["lazy"].loaded
    assert registry.load("lazy") is OtherThing
    assert registry.view["lazy"].loaded
    registry.register("gone", "no_such_module_here:Thing", install_hint="pip install gone")
    with pytest.raises(ConfigError, match=r"'gone' needs a missing dependency.*pip install gone"):
        registry.load("gone")
    registry.register("wrong", f"{__name__}:LAYOUT")
    with pytest.raises(ConfigError, match="is not a thing"):
        registry.load("wrong")


@pytest.mark.parametrize(
    ("name", "target", "message"),
    [
        ("", Thing, "non-empty string"),
        ("b", "no colon", "package.module:ClassName"),
        ("b", int, "not a thing plug-in"),
    ],
)
def test_a_bad_registration_is_one_error_and_registers_nothing(
    name: str, target: object, message: str
) -> None:
    registry = things()
    with pytest.raises(ConfigError, match=message):
        registry.register(name, target)  # type: ignore[arg-type]
    assert registry.names() == []


def test_the_view_is_read_only() -> None:
    for registry in (things(), TIERS, POLICIES):
        with pytest.raises(TypeError):
            registry.view["x"] = None  # type: ignore[index]
        with pytest.raises(TypeError):
            del registry.view["lru"]  # type: ignore[attr-defined]
        with pytest.raises(AttributeError):
            registry.view = {}  # type: ignore[misc]
    assert {"host", "disk", "s3", "redis", "remote"} <= set(TIERS.view)
    assert {"lru", "s3fifo", "arc"} <= set(POLICIES.view)


def test_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown thing 'x'; known: a"):
        registry = things()
        registry.register("a", Thing)
        registry.load("x")


def test_scoped_undoes_registrations() -> None:
    with POLICIES.scoped():
        POLICIES.register("gone", LRUPolicy)
        assert isinstance(make_policy("gone"), LRUPolicy)
    assert "gone" not in POLICIES


class NewestFirst(LRUPolicy):
    """Evicts the block stored last (the opposite of LRU's choice)."""

    name = "newest"

    def candidates(self):  # type: ignore[no-untyped-def]
        return reversed(list(super().candidates()))


def test_a_policy_registered_from_outside_the_package_works_from_yaml(tmp_path: Path) -> None:
    POLICIES.register("newest", f"{__name__}:NewestFirst")
    path = tmp_path / "store.yaml"
    capacity = 2 * LAYOUT.block_nbytes
    path.write_text(f"tiers:\n  - {{kind: host, capacity: {capacity}, policy: newest}}\n")
    with KVStore(LAYOUT, path) as store:
        keys = store.hash_tokens(range(3 * LAYOUT.block_tokens), "m")
        store.put(keys[:2], random_blocks(LAYOUT, 2))
        store.evict(1)
        assert store.engine.datapath.exists(keys[:2]) == [True, False]


POLICY_PLUGIN = """
from kvstore.policy import LRUPolicy


class Backwards(LRUPolicy):
    name = "backwards"

    def candidates(self):
        return reversed(list(super().candidates()))
"""


def installed(site: Path, dist: str, entry_points: str, module: str, source: str) -> None:
    """A package ``dist`` installed under ``site``: its dist-info and one module."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    (site / f"{module}.py").write_text(source)


def test_a_policy_from_an_installed_packages_entry_point_works_from_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    installed(
        site,
        "backwards_policy",
        "[kvstore.policies]\nbackwards = backwards_policy:Backwards\n",
        "backwards_policy",
        POLICY_PLUGIN,
    )
    monkeypatch.syspath_prepend(str(site))
    assert "backwards" not in POLICIES  # read on the first lookup of an unknown name only
    path = tmp_path / "store.yaml"
    capacity = 2 * LAYOUT.block_nbytes
    path.write_text(f"tiers:\n  - {{kind: host, capacity: {capacity}, policy: backwards}}\n")
    with KVStore(LAYOUT, path) as store:
        keys = store.hash_tokens(range(3 * LAYOUT.block_tokens), "m")
        store.put(keys[:2], random_blocks(LAYOUT, 2))
        store.evict(1)
        assert store.engine.datapath.exists(keys[:2]) == [True, False]
    assert issubclass(POLICIES.load("backwards"), EvictionPolicy)


def test_an_entry_point_that_is_neither_a_plugin_nor_a_function_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    installed(
        site,
        "odd_policy",
        "[kvstore.policies]\nodd = odd_policy:VALUE\n",
        "odd_policy",
        "VALUE = 3\n",
    )
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(
        ConfigError, match=r"eviction policy plugin 'odd' \(odd_policy:VALUE\).*neither"
    ):
        StoreConfig.from_dict({"tiers": [{"kind": "host", "policy": "nosuch"}]}, environ={})


def test_the_store_finds_the_cluster_tier_through_its_registry_entry() -> None:
    """The store names the cluster's peer tier (it does not import the cluster package,
    which builds on the store), and ``cluster`` stays reserved among the tier kinds."""
    from kvstore.cluster.tier import ClusterTier
    from kvstore.config.kinds import PEER_TIER, peer_tier_class

    assert not PEER_TIER.loaded
    assert peer_tier_class() is ClusterTier
    assert "cluster" not in TIERS.names()
    with pytest.raises(ConfigError, match="reserved"):
        TIERS.register("cluster", "kvstore.tiers.host:HostTier")
