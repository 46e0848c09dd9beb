"""KVStore's public face: the documented list of names, every type they return exported
by ``kvstore``, the engine side behind one protocol-typed object, and the deprecated
names that warn and still do what they did."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore
from kvstore import ChunkTokens, EngineSide, InvalidInputError, KVLayout, KVStore
from kvstore.testing.data import random_blocks

ROOT = Path(__file__).resolve().parents[1]

#: What a user calls: docs/architecture.md, "The public face".
FACE = {
    "namespace",
    "hash_tokens",
    "engine_keys",
    "lookup",
    "put",
    "get",
    "get_prefix",
    "put_layer",
    "abort_layers",
    "prefetch",
    "plan",
    "hint",
    "pin",
    "delete",
    "evict",
    "stored_keys",
    "clear",
    "flush",
    "drain",
    "stats",
    "close",
    "closed",
    "engine",
}

#: Kept one release; each warns DeprecationWarning naming its replacement.
DEPRECATED = {
    "contains": "lookup",
    "exists": "engine.datapath.exists",
    "persist": "flush",
    "warm": "hint",
    "datapath": "engine.datapath",
    "note_tokens": "engine.note_tokens",
    "note_prefill_step": "engine.note_prefill_step",
    "waited": "engine.waited",
    "planned_load": "engine.planned_load",
    "observe_loads": "engine.observe_loads",
    "read_totals": "engine.read_totals",
    "observe_reads": "engine.observe_reads",
    "restore_speeds": "engine.restore_speeds",
    "lend": "engine.lend",
    "begin_put": "engine.begin_put",
    "reencrypt": "engine.reencrypt",
}


def public_names(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_kvstore_has_exactly_the_documented_face_and_the_deprecated_names() -> None:
    assert public_names(KVStore) == FACE | set(DEPRECATED)
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## The public face", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", section))
    assert named >= FACE, FACE - named
    assert set(DEPRECATED) <= named, set(DEPRECATED) - named


def kvstore_classes(hint: Any) -> set[type]:
    """The classes of kvstore's own that a type hint names, at any depth."""
    found: set[type] = set()
    origin = typing.get_origin(hint)
    if origin is not None:
        if isinstance(origin, type) and origin.__module__.startswith("kvstore"):
            found.add(origin)
        for arg in typing.get_args(hint):
            found |= kvstore_classes(arg)
    elif isinstance(hint, type) and hint.__module__.startswith("kvstore"):
        found.add(hint)
    return found


def callables_of(cls: type) -> dict[str, Any]:
    out = {}
    for name in public_names(cls):
        member = getattr(cls, name)
        out[name] = member.fget if isinstance(member, property) else member
    return out


@pytest.mark.parametrize("cls", [KVStore, EngineSide])
def test_every_type_a_public_method_returns_is_exported_by_kvstore(cls: type) -> None:
    # Names the modules import only for type checking resolve through kvstore's exports
    # alone: a returned type kvstore does not export fails here.
    exported = {name: getattr(kvstore, name) for name in kvstore.__all__}
    checked = 0
    for name, fn in callables_of(cls).items():
        hints = typing.get_type_hints(fn, localns=exported)
        assert "return" in hints, f"{cls.__name__}.{name} has no return annotation"
        for found in kvstore_classes(hints["return"]):
            assert getattr(kvstore, found.__name__, None) is found, (
                f"{cls.__name__}.{name} returns {found.__module__}.{found.__name__}, "
                "which kvstore does not export"
            )
            checked += 1
    assert checked >= 4  # the walk saw kvstore's own types (RestorePlan, Pin, Loan, ...)


def test_tier_configs_of_every_listed_kind_are_exported() -> None:
    for name in ("HostTierConfig", "DeviceTierConfig", "DiskTierConfig", "S3TierConfig"):
        assert name in kvstore.__all__ and getattr(kvstore, name).kind


def test_the_engine_side_is_one_object_typed_by_its_protocol(store: KVStore) -> None:
    hints = typing.get_type_hints(KVStore.engine.fget)  # type: ignore[attr-defined]
    assert hints["return"] is EngineSide
    assert store.engine is store.engine
    assert store.engine.datapath.layout == store.layout
    assert public_names(type(store.engine)) == public_names(EngineSide)


def stored(store: KVStore, layout: KVLayout, n: int = 3) -> list[Any]:
    keys = store.hash_tokens(range(n * layout.block_tokens), "face")
    assert store.put(keys, random_blocks(layout, n, seed=5)) == n
    return keys


def deprecated(name: str) -> Any:
    return pytest.warns(DeprecationWarning, match=rf"KVStore\.{name}\b.*deprecated")


def test_twins_warn_and_answer_as_before(store: KVStore, layout: KVLayout) -> None:
    keys = stored(store, layout)
    other = store.hash_tokens(range(layout.block_tokens), "elsewhere")
    with deprecated("contains"):
        assert store.contains(keys[0]) and store.lookup(keys[:1]) == 1
    with deprecated("contains"):
        assert not store.contains(other[0])
    with deprecated("exists"):
        assert store.exists([*keys, *other]) == [True, True, True, False]
    with deprecated("warm"):
        assert store.warm([*keys, *other]) == 3  # a copy queued per stored key
    with deprecated("datapath"):
        assert store.datapath is store.engine.datapath
    with deprecated("contains"), pytest.raises(InvalidInputError):
        store.contains(b"short")  # checked as before


def test_persist_is_flush_with_keys(layout: KVLayout, tmp_path: Path) -> None:
    config = {
        "tiers": [
            {"kind": "host", "capacity": 16 * layout.block_nbytes},
            {"kind": "disk", "path": str(tmp_path), "capacity": 16 * layout.block_nbytes},
        ]
    }
    with KVStore(layout, config) as store:
        keys = stored(store, layout, 4)
        missing = store.hash_tokens(range(layout.block_tokens), "elsewhere")
        with deprecated("persist"):
            assert store.persist([*keys[:2], *missing]) == [True, True, False]
        assert store.flush(keys[2:]) == 2
        assert all(1 in store.engine.datapath.where(k) for k in keys)


def test_moved_plumbing_warns_and_does_what_the_engine_side_does(
    store: KVStore, layout: KVLayout
) -> None:
    keys = stored(store, layout)
    plan = store.plan(keys, prompt_tokens=len(keys) * layout.block_tokens)
    engine = store.engine
    same_answer = {
        "read_totals": (),
        "restore_speeds": (),
        "planned_load": (plan,),
        "reencrypt": (),
    }
    for name, args in same_answer.items():
        with deprecated(name):
            assert getattr(store, name)(*args) == getattr(engine, name)(*args)
    with deprecated("note_prefill_step"):
        store.note_prefill_step(512, 0.05)
    with deprecated("waited"):
        store.waited(plan, 0.0)
    with deprecated("observe_loads"):
        store.observe_loads({})
    with deprecated("observe_reads"):
        store.observe_reads(engine.read_totals())
    with deprecated("note_tokens"):
        store.note_tokens(
            ChunkTokens.of(
                keys, list(range(len(keys) * layout.block_tokens)), None, layout.block_tokens
            )
        )
    with deprecated("note_tokens"), pytest.raises(InvalidInputError, match="ChunkTokens"):
        store.note_tokens("not tokens")  # type: ignore[arg-type]
    with deprecated("lend"), store.lend(keys) as loan:
        out = torch.empty(layout.block_shape, dtype=layout.dtype)
        assert loan.read_into(0, out)
    with deprecated("lend"), pytest.raises(InvalidInputError, match="lease_s"):
        store.lend(keys, lease_s=0)
    fresh = store.hash_tokens(range(layout.block_tokens), "fresh")
    with deprecated("begin_put"), store.begin_put(fresh) as pending:
        assert pending.commit() == 1
    assert store.lookup(fresh) == 1
