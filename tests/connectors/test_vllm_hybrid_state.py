"""Hybrid models' recurrent state (Mamba2, gated delta-net) without vLLM: the geometry read
from plain specs named as vLLM names them, the fingerprint every state group's spec goes
into, and state blocks saved at a step's chunk boundary and loaded into the block vLLM
allocated. Whole models run in test_vllm_hybrid.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore import KVLayout, KVStore
from kvstore.config import StoreConfig
from kvstore.connectors.plan import Found, Planner, Scheduled, TransferSpec
from kvstore.connectors.settings import Counters
from kvstore.connectors.transfer import TransferWorker
from kvstore.connectors.vllm_geometry import EngineGeometry
from kvstore.connectors.vllm_hybrid import StateLookup, StateTransfer, state_key, state_layout
from kvstore.connectors.vllm_state import StateGroup
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey, Namespace, chain_keys, tokens_to_bytes

N, C = 4, 8  # engine block tokens, chunk tokens


class FullAttentionSpec:
    def __init__(self) -> None:
        self.block_size, self.num_kv_heads, self.head_size = N, 2, 8
        self.dtype = torch.bfloat16


class MambaSpec:
    def __init__(self, shapes: Any = ((3, 16), (2, 4, 4)), dtypes: Any = None, **kw: Any) -> None:
        self.block_size = N
        self.shapes = shapes
        self.dtypes = dtypes or (torch.bfloat16, torch.float32)
        self.mamba_type = "mamba2"
        self.mamba_cache_mode = "align"
        self.__dict__.update(kw)


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def geometry(*mamba: MambaSpec, model_id: str | None = None) -> EngineGeometry:
    model = Obj(model="org/m", revision=None, dtype=torch.bfloat16, quantization=None)
    config = Obj(
        model_config=model, parallel_config=Obj(tensor_parallel_size=1, pipeline_parallel_size=1)
    )
    groups = [Obj(kv_cache_spec=FullAttentionSpec(), layer_names=["l.3"])]
    groups += [Obj(kv_cache_spec=m, layer_names=[f"l.{i}"]) for i, m in enumerate(mamba)]
    return EngineGeometry.from_vllm(config, Obj(kv_cache_groups=groups), model_id)


def test_state_groups_are_served_and_every_spec_is_in_the_keys() -> None:
    geo = geometry(MambaSpec(), MambaSpec())
    assert geo.serves and len(geo.states) == 2 and geo.layer_names == ("l.3",)
    assert geo.describe() == (
        "kvstore serves 1 full-attention layers, 2 mamba2 state layers (2 tensors, 224 bytes"
        " each) in 3 KV cache groups"
    )
    ids = {geo.model_id}
    for other in (
        MambaSpec(shapes=((3, 16), (2, 4, 5))),  # a shape
        MambaSpec(dtypes=(torch.float32, torch.float32)),  # a dtype
        MambaSpec(shapes=((16, 3), (2, 4, 4))),  # the same bytes, another shape
        MambaSpec(mamba_type="gdn_attention"),  # the kind
    ):
        ids.add(geometry(MambaSpec(), other).model_id)
        ids.add(geometry(MambaSpec(), other, model_id="mine").model_id)
    assert len(ids) == 9  # every change of any group, with or without a given model id
    assert geometry(MambaSpec(), MambaSpec()).model_id == geo.model_id


def test_state_vllm_does_not_keep_per_block_is_not_served_and_says_why() -> None:
    geo = geometry(MambaSpec(mamba_cache_mode="none"))
    assert not geo.serves
    assert "mamba_cache_mode 'align'; this engine runs 'none'" in geo.describe()
    assert "recomputed" in geo.describe()
    assert not geometry(MambaSpec(block_size=2 * N)).serves
    with pytest.raises(ConfigError, match="one dtype per state tensor"):
        StateGroup.from_spec(0, ("m",), MambaSpec(dtypes=(torch.float32,)))


def keys_of(tokens: list[int]) -> list[BlockKey]:
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_tokens=C)
    full = len(tokens) // C * C
    return chain_keys(tokens_to_bytes(tokens, limit=full), C, Namespace("m", layout).seed)


class StateEngine:
    """Two state groups (1 and 2) of one layer each: vLLM's raw ``[B, 1, 1, page]`` pages."""

    def __init__(self, states: tuple[StateGroup, ...], blocks: int = 10) -> None:
        self.caches = {
            name: torch.zeros(blocks, 1, 1, 256, dtype=torch.int8)
            for g in states
            for name in g.layer_names
        }

    def compute(self, block: int) -> None:
        for cache in self.caches.values():
            cache[block] = torch.randint(-128, 127, cache[block].shape, dtype=torch.int8)


def config(tmp_path: Path) -> StoreConfig:
    return StoreConfig.load({"tiers": [{"kind": "disk", "path": str(tmp_path / "d")}]})


def transfer(tmp_path: Path, states: tuple[StateGroup, ...], engine: StateEngine) -> StateTransfer:
    t = StateTransfer(states, config(tmp_path), 0, N, Counters("worker"), str(tmp_path / "a"))
    t.register(engine.caches)
    return t


def test_states_saved_at_a_step_boundary_load_into_the_block_vllm_allocated(
    tmp_path: Path,
) -> None:
    states = geometry(MambaSpec(), MambaSpec()).states
    tokens, producer = list(range(24)), StateEngine(states)
    keys = keys_of(tokens)
    t = transfer(tmp_path, states, producer)
    attention = [1, 2, 3, 4, 5, 6]
    # Align mode: position p holds the state after (p + 1) * N tokens; only the state
    # after 16 tokens is held (in block 7), the rest is null (0).
    table = [0, 0, 0, 7, 0, 0]
    producer.compute(7)
    chunk0 = TransferSpec("r", {0: keys[:1]}, 0, 0, 8, (attention, table, table))
    chunk0.step_end = 12  # the step ended mid-chunk: no state of this boundary
    assert not t.save(chunk0)
    chunk1 = TransferSpec("r", {0: keys[:2]}, 0, 0, 16, (attention, table, table))
    chunk1.step_end = 16
    assert t.save(chunk1)
    chunk2 = TransferSpec("r", {0: keys[2:3]}, 2, 16, 24, (attention, table, table))
    chunk2.step_end = 24  # block 5 is null: vLLM keeps no state there
    assert not t.save(chunk2)
    assert t.counters.snapshot()["state_save_no_block"] == 1
    t.close()

    lookup = StateLookup(states, config(tmp_path), C)
    assert lookup.longest({0: keys}, stored=3, prompt_len=24) == 2
    # 16 tokens: the state at 16 ends the prompt (never served whole), none at 8.
    assert lookup.longest({0: keys}, stored=3, prompt_len=16) == 0
    assert lookup.longest({0: keys}, stored=1, prompt_len=24) == 0
    lookup.close()

    consumer = StateEngine(states)
    t = transfer(tmp_path, states, consumer)
    spec = TransferSpec(
        "a", {0: keys[:2]}, 0, 0, 16, ([5, 6, 7, 8], [0, 0, 0, 3], [0, 0, 0, 4]), whole=True
    )
    assert t.load(spec)
    for name, cache in consumer.caches.items():
        group = 1 if name == "l.0" else 2
        block = 3 if group == 1 else 4
        assert torch.equal(cache[block, 0, 0, :224], producer.caches[name][7, 0, 0, :224])
    lines = (tmp_path / "a").glob("kvstore-state-*.jsonl")
    records = [r for path in lines for r in path.read_text().splitlines()]
    saved = [r for r in records if '"save"' in r]
    loaded = [r for r in records if '"load"' in r]
    assert len(saved) == 1 and loaded == [saved[0].replace('"save"', '"load"')]
    t.close()


def test_a_missing_state_fails_the_whole_load(tmp_path: Path) -> None:
    states = geometry(MambaSpec()).states
    keys = keys_of(list(range(16)))
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_tokens=C)
    w = TransferWorker(KVStore(layout, config(tmp_path)), 0, N)
    t = transfer(tmp_path, states, StateEngine(states))
    spec = TransferSpec("a", {0: keys}, 0, 0, 16, ([1, 2, 3, 4], [0, 5]), whole=True)
    t.load_all([spec], w)
    assert w.take_transfer_results() == (set(), {"a"})
    assert t.counters.snapshot()["state_load_errors"] == 1
    assert state_key(keys[0], state_layout(states)) != keys[0]
    t.close()
    w.close()


def test_planner_tells_the_workers_where_each_step_ended() -> None:
    keys = keys_of(list(range(24)))

    def lookup(k: object, n: int, c: int) -> Found:
        return Found(0, 0)

    p = Planner(C, N, lambda t, a, s: {0: keys}, lookup)
    p.match("r", list(range(24)), 0)
    plan = p.step([Scheduled("r", ([1, 2, 3, 4, 5, 6],), True, 0, 12)])
    assert [(s.token_end, s.step_end) for s in plan.saves] == [(8, 12)]
    plan = p.step([Scheduled("r", None, False, 12, 4)])
    assert [(s.token_end, s.step_end) for s in plan.saves] == [(16, 16)]
