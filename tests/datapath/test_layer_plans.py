"""Per-request plans of layerwise writes and loads (issue 54: per-call costs on the engine's
thread): a prefill's put_layer calls reuse the runs of slots made on its first layer (one
copy a layer over adjacent slots), prefetches of memory-tier blocks stack their views once,
and every shape a plan cannot merge still lands byte for byte."""

from __future__ import annotations

import torch

from kvstore import KVStore
from kvstore.datapath.layerwrites import LayerWrites, WritePlan
from kvstore.runtime.memory import SlabAllocator
from kvstore.testing.data import host_config, random_blocks, small_layout

LAYOUT = small_layout(num_layers=4)


def layer_writes(store: KVStore) -> LayerWrites:
    return store._manager.layer_writes  # the plan lives here (tests may look inside)


def prefill(store: KVStore, keys: list[bytes], kv: torch.Tensor) -> list[int]:
    return [store.put_layer(keys, layer, kv[layer]) for layer in range(LAYOUT.num_layers)]


def keys_of(store: KVStore, n: int, salt: int = 0) -> list[bytes]:
    return store.hash_tokens([salt * 100_000 + t for t in range(n * LAYOUT.block_tokens)], "t")


def test_a_prefill_into_adjacent_slots_is_one_copy_a_layer_from_one_plan() -> None:
    kv = random_blocks(LAYOUT, 6)
    with KVStore(LAYOUT, host_config(LAYOUT, 16)) as store:
        keys = keys_of(store, 6)
        writes = layer_writes(store)
        store.put_layer(keys, 0, kv[0])
        plan = writes._last
        assert isinstance(plan, WritePlan)
        assert len(plan.runs) == 1 and plan.runs[0].slots is not None  # 6 slots, one view
        for layer in range(1, LAYOUT.num_layers - 1):
            store.put_layer(keys, layer, kv[layer])
            assert writes._last is plan  # made once per request, not per layer
        assert store.put_layer(keys, LAYOUT.num_layers - 1, kv[-1]) == 6
        assert writes._last is None  # the request completed: its plan is let go
        assert torch.equal(store.get(keys), kv)


def test_keys_stored_already_are_skipped_and_the_rest_land_right() -> None:
    kv = random_blocks(LAYOUT, 5, seed=3)
    with KVStore(LAYOUT, host_config(LAYOUT, 16)) as store:
        keys = keys_of(store, 5)
        store.put([keys[1], keys[3]], torch.cat([kv[:, :, 8:16], kv[:, :, 24:32]], dim=2))
        assert prefill(store, keys, kv)[-1] == 3
        assert torch.equal(store.get(keys), kv)


def test_scattered_slots_and_sources_from_separate_tensors_still_land_byte_for_byte() -> None:
    kv = random_blocks(LAYOUT, 4, seed=5)
    with KVStore(LAYOUT, host_config(LAYOUT, 12)) as store:
        filler = keys_of(store, 8, salt=1)
        store.put(filler, random_blocks(LAYOUT, 8, seed=6))
        store.delete(filler[1::2])  # free slots 1, 3, 5, 7: not adjacent
        keys = keys_of(store, 4)
        step = LAYOUT.block_tokens
        for layer in range(LAYOUT.num_layers):  # each block's source its own tensor
            srcs = [kv[layer][:, i * step : (i + 1) * step].clone() for i in range(4)]
            store._manager.write_layer(keys, layer, srcs)
        plan_runs = layer_writes(store)._last
        assert plan_runs is None  # completed
        assert torch.equal(store.get(keys), kv)


def test_several_layers_at_once_merge_per_run_as_the_saver_queues_them() -> None:
    kv = random_blocks(LAYOUT, 3, seed=7)
    with KVStore(LAYOUT, host_config(LAYOUT, 8)) as store:
        keys = keys_of(store, 3)
        writes = layer_writes(store)
        step = LAYOUT.block_tokens
        items = [
            (layer, [kv[layer][:, i * step : (i + 1) * step] for i in range(3)])
            for layer in range(LAYOUT.num_layers)
        ]
        parts, pairs, follow = writes.start_layers(keys, items)
        assert len(pairs) == LAYOUT.num_layers  # one copy a layer, the blocks stacked
        for dst, src in pairs:
            dst.copy_(src)
        assert writes.end_layers(parts, list(range(LAYOUT.num_layers)), follow, None) == 3
        assert torch.equal(store.get(keys), kv)


def test_prefetch_of_memory_blocks_in_scattered_slots_lands_every_layer() -> None:
    kv = random_blocks(LAYOUT, 5, seed=9)
    with KVStore(LAYOUT, host_config(LAYOUT, 12)) as store:
        filler = keys_of(store, 6, salt=2)
        store.put(filler, random_blocks(LAYOUT, 6, seed=10))
        store.delete(filler[::2])
        keys = keys_of(store, 5)
        store.put(keys, kv)
        out = torch.zeros_like(kv)
        handle = store.prefetch(keys, out)
        for layer in range(LAYOUT.num_layers):
            assert handle.wait_layer(layer, timeout=10)
        assert handle.wait(10) and torch.equal(out, kv)


def test_slots_freed_together_come_back_ascending() -> None:
    slab = SlabAllocator(8, 64)
    try:
        taken = slab.alloc(6)
        slab.free(taken[1:5])
        assert slab.alloc(4) == [1, 2, 3, 4]  # adjacent again: one strided copy over them
    finally:
        slab.close()


def test_block_views_with_autograd_are_slices_that_take_in_place_copies() -> None:
    layout = LAYOUT
    with KVStore(layout, host_config(layout, 4)) as store:
        keys = keys_of(store, 2)
        store.put(keys, random_blocks(layout, 2))
        base = torch.zeros(layout.tensor_shape(2), requires_grad=True)
        out = base.clone().to(layout.dtype)  # tracked by autograd: unbind views refuse copy_
        got = store.get(keys, out=out)
        assert torch.equal(got.detach(), store.get(keys))
