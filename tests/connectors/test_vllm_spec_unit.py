"""Speculative decoding without vLLM: the draft's layers read from the engine's config, and
their loaded KV put in place after the engine took the step's load errors (vLLM runs the
draft's forward after the target's, and takes load errors in between). Whole models run
in test_vllm_spec.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from test_vllm_groups import BF16, GROUPS, HybridEngine, keys_of, store

from kvstore.connectors.plan import TransferSpec
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.transfer import LayerGroups, TransferWorker
from kvstore.connectors.vllm_geometry import EngineGeometry

TABLES = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 1, 2, 3, 4, 5])


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FullAttentionSpec:
    def __init__(self) -> None:
        self.block_size, self.num_kv_heads, self.head_size = 4, 2, 8
        self.dtype = BF16


def geometry(draft: str | None, layers: int = 3) -> EngineGeometry:
    model = Obj(model="org/m", revision=None, dtype=BF16, quantization=None)
    model.get_total_num_hidden_layers = lambda: 2
    spec = None
    if draft is not None:
        spec = Obj(draft_model_config=Obj(model=draft, revision=None), method="eagle")
    config = Obj(
        model_config=model,
        parallel_config=Obj(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=spec,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    groups = [Obj(kv_cache_spec=FullAttentionSpec(), layer_names=names)]
    return EngineGeometry.from_vllm(config, Obj(kv_cache_groups=groups), None)


def test_the_drafts_layers_follow_the_targets_and_the_draft_is_in_the_keys() -> None:
    plain, eagle, other = geometry(None, 2), geometry("org/eagle"), geometry("org/eagle2")
    assert plain.draft_layers == () and plain.draft_indices() == frozenset()
    assert eagle.draft_layers == ("model.layers.2.self_attn.attn",)
    assert eagle.draft_indices() == frozenset({2})
    assert eagle.describe() == (
        "kvstore serves 3 full-attention layers (1 of them the speculative draft's)"
    )
    # Another draft of the same shape holds other KV in its layer: other keys.
    assert len({plain.model_id, eagle.model_id, other.model_id}) == 3
    assert eagle.model_id == geometry("org/eagle").model_id


def saved(tmp_path: Path) -> tuple[torch.Tensor, list[Any]]:
    """A 32-token prompt computed and stored by one engine (every layer, each hook)."""
    producer = HybridEngine()
    kv = producer.compute(TABLES, 32)
    keys = keys_of(list(range(32)))
    w = TransferWorker(store(tmp_path), 0, 4, ConnectorSettings())
    w.register(producer.paged, GROUPS)
    save = [TransferSpec("r", {0: keys}, 0, 0, 32, TABLES)]
    w.start_load([])
    for layer in range(3):
        w.wait_layer(layer)
        w.save_layer(layer, save)
    w.finish_save(save)
    w.close()
    return kv, keys


def load_in_vllms_spec_order(
    tmp_path: Path, keys: list[Any], late: frozenset[int]
) -> tuple[HybridEngine, TransferWorker, set[int], torch.Tensor]:
    """vLLM's order under speculative decoding: the target's layers (0, 1) with their
    hooks, the load errors taken, then the draft's layer 2, then the step's end.
    Returns what the draft's layer held when its forward began."""
    consumer = HybridEngine()
    w = TransferWorker(store(tmp_path), 0, 4, ConnectorSettings())
    w.register(consumer.paged, LayerGroups(GROUPS.of_layer, GROUPS.sliding, late=late))
    w.start_load([TransferSpec("r", {0: keys}, 0, 0, 31, TABLES)])
    for layer in (0, 1):
        w.wait_layer(layer)
        w.save_layer(layer, [])
    errors = w.take_load_errors()
    at_draft = consumer.read(2, TABLES[0], 0, 31)  # the draft's forward reads this
    w.wait_layer(2)
    w.save_layer(2, [])
    w.finish_save([])
    return consumer, w, errors, at_draft


def test_the_drafts_loaded_kv_is_in_place_before_the_draft_runs(tmp_path: Path) -> None:
    kv, keys = saved(tmp_path)
    consumer, w, errors, at_draft = load_in_vllms_spec_order(tmp_path, keys, frozenset({2}))
    assert errors == set()
    assert torch.equal(at_draft, kv[2, :, :31])
    for layer in (0, 2):
        assert torch.equal(consumer.read(layer, TABLES[0], 0, 31), kv[layer, :, :31])
    assert torch.equal(consumer.read(1, TABLES[1], 0, 31), kv[1, :, :31])
    counts = w.counters.snapshot()
    assert counts["load_tokens"] == 31 and counts["load_late_layers"] == 1
    assert counts.get("load_failed_tokens", 0) == 0
    w.close()


def test_a_layer_not_known_to_run_late_is_still_a_load_error(tmp_path: Path) -> None:
    """Without the draft's layer marked late, a layer that missed its hook before the
    errors were taken is reported (vLLM recomputes), never silently filled in."""
    _, keys = saved(tmp_path)
    _, w, errors, at_draft = load_in_vllms_spec_order(tmp_path, keys, frozenset())
    assert errors == set(range(1, 9)) and at_draft.abs().sum() == 0
    assert w.counters.snapshot()["load_failed_tokens"] == 31
    w.close()
