"""Models beyond one full-attention KV cache group, without vLLM: several groups with their
own block tables (full attention beside a sliding window), MLA's single latent, and
whole (asynchronous, per-request) loads. The geometry read from vLLM's specs is tested
in test_vllm_kernels.py; whole models run in test_vllm_models.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore import KVLayout, KVStore
from kvstore.connectors.paged import NULL_BLOCK, PagedKV, PageMap
from kvstore.connectors.plan import Found, Planner, Scheduled, TransferSpec
from kvstore.connectors.settings import ConnectorSettings
from kvstore.connectors.transfer import LayerGroups, TransferWorker
from kvstore.keys import BlockKey, Namespace, chain_keys, tokens_to_bytes

H, D, N, C = 2, 8, 4, 8  # heads, head_dim, engine block tokens, chunk tokens
BF16 = torch.bfloat16
# Layers 0 and 2 are full attention (group 0), layer 1 slides (group 1).
GROUPS = LayerGroups((0, 1, 0), frozenset({1}))
LAYOUT = KVLayout(num_layers=3, num_kv_heads=H, head_dim=D, block_tokens=C)


def keys_of(tokens: list[int], layout: KVLayout = LAYOUT) -> list[BlockKey]:
    ns = Namespace("m", layout)
    full = len(tokens) // C * C
    return chain_keys(tokens_to_bytes(tokens, limit=full), C, ns.seed)


def store(tmp_path: Path, layout: KVLayout = LAYOUT) -> KVStore:
    return KVStore(layout, {"tiers": [{"kind": "disk", "path": str(tmp_path / "d")}]})


class HybridEngine:
    """Paged caches of 3 layers; each layer's tokens live in its group's blocks."""

    def __init__(self, blocks: int = 12) -> None:
        self.caches = [torch.zeros(blocks, H, N, 2 * D, dtype=BF16) for _ in range(3)]
        self.paged = PagedKV(self.caches, PageMap.joined_last(N, D), N)

    def compute(self, tables: tuple[list[int], ...], tokens: int) -> torch.Tensor:
        """Fill every token's KV (random); blocks that are NULL_BLOCK stay untouched."""
        kv = torch.randn(3, 2, tokens, H, D).to(BF16)
        for layer in range(3):
            ids = tables[GROUPS.group(layer)]
            for t in range(tokens):
                if ids[t // N] != NULL_BLOCK:
                    b, o = ids[t // N], t % N
                    self.caches[layer][b, :, o, :D] = kv[layer, 0, t]
                    self.caches[layer][b, :, o, D:] = kv[layer, 1, t]
        return kv

    def read(self, layer: int, ids: list[int], start: int, end: int) -> torch.Tensor:
        out = torch.empty(2, end - start, H, D, dtype=BF16)
        self.paged.gather(layer, self.paged.slots(ids, start, end), out)
        return out


def worker(tmp_path: Path, engine: HybridEngine, transfer: str = "layerwise") -> TransferWorker:
    w = TransferWorker(store(tmp_path), 0, N, ConnectorSettings(transfer=transfer))
    w.register(engine.paged, GROUPS)
    return w


def run_step(
    w: TransferWorker, loads: list[TransferSpec], saves: list[TransferSpec], layers: int = 3
) -> set[int]:
    """One engine step, hooks in vLLM's order; the blocks reported as load errors."""
    w.start_load(loads)
    for layer in range(layers):
        w.wait_layer(layer)
        w.save_layer(layer, saves)
    w.finish_save(saves)
    return w.take_load_errors()


def test_a_chunk_whose_window_blocks_were_freed_is_never_saved(tmp_path: Path) -> None:
    tokens, engine = list(range(32)), HybridEngine()
    # (block ids are only unique within a group)
    full, slide = [1, 2, 3, 4, 5, 6, 7, 8], [NULL_BLOCK, NULL_BLOCK, 9, 10, 11, 1, 2, 3]
    engine.compute((full, slide), 32)
    keys = keys_of(tokens)
    w = worker(tmp_path, engine)
    save = TransferSpec("r", {0: keys}, 0, 0, 32, (full, slide))
    assert run_step(w, [], [save]) == set()
    counts = w.counters.snapshot()
    # Chunk 0 (tokens 0-7) lost its sliding-window blocks: not stored; chunks 1-3 are.
    assert counts["save_chunks_freed"] == 1 and counts["save_chunks_stored"] == 3
    assert w.store.lookup(keys) == 0  # a prefix never starts past a gap...
    assert w.store.engine.datapath.exists(keys) == [
        False,
        True,
        True,
        True,
    ]  # ...whose window is gone
    w.close()


def test_load_writes_the_window_only_where_the_group_holds_blocks(tmp_path: Path) -> None:
    tokens, producer = list(range(32)), HybridEngine()
    tables = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 1, 2, 3, 4, 5])
    kv = producer.compute(tables, 32)
    keys = keys_of(tokens)
    w = worker(tmp_path, producer)
    run_step(w, [], [TransferSpec("r", {0: keys}, 0, 0, 32, tables)])
    w.close()
    consumer = HybridEngine()
    # The consumer's sliding group freed the blocks of tokens 0-19 (outside its window).
    window = [NULL_BLOCK] * 5 + [6, 7, 8]
    load_tables = ([3, 4, 5, 6, 7, 8, 9, 10], window)
    w = worker(tmp_path, consumer)
    load = TransferSpec("r", {0: keys}, 0, 0, 31, load_tables)
    assert run_step(w, [load], []) == set()
    assert torch.equal(consumer.read(0, load_tables[0], 0, 31), kv[0, :, :31])
    assert torch.equal(consumer.read(2, load_tables[0], 0, 31), kv[2, :, :31])
    assert torch.equal(consumer.read(1, window, 20, 31), kv[1, :, 20:31])
    assert consumer.caches[1][NULL_BLOCK].abs().sum() == 0  # the null block is never written
    w.close()


def test_whole_loads_report_per_request(tmp_path: Path) -> None:
    tokens, producer = list(range(24)), HybridEngine()
    tables = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 1])
    kv = producer.compute(tables, 24)
    keys = keys_of(tokens)
    w = worker(tmp_path, producer)
    run_step(w, [], [TransferSpec("r", {0: keys}, 0, 0, 24, tables)])
    w.store.delete([keys[2]])
    w.close()
    consumer = HybridEngine()
    other = keys_of(list(range(100, 108)))
    consumer.compute(([10, 11], [10, 11]), 8)  # another request, computing this step
    w = worker(tmp_path, consumer)
    good = TransferSpec("a", {0: keys[:2]}, 0, 0, 16, ([2, 3, 4, 5], [6, 7, 8, 9]), whole=True)
    bad = TransferSpec("b", {0: keys}, 0, 0, 23, ([1, 2, 3, 4, 5, 6],) * 2, whole=True)
    save = TransferSpec("c", {0: other}, 0, 0, 8, ([10, 11], [10, 11]))
    errors = run_step(w, [good, bad], [save])
    assert errors == set()  # no per-block errors: vLLM takes these per request
    assert w.take_transfer_results() == ({"a", "b"}, {"b"})
    assert w.take_transfer_results() == (set(), set())
    assert torch.equal(consumer.read(1, [6, 7, 8, 9], 0, 16), kv[1, :, :16])
    # The failed request computed nothing this step: the other request's save lands.
    assert w.store.lookup(other) == 1
    w.close()


def test_planner_plans_whole_loads_at_allocation_and_recomputes_after_a_failure() -> None:
    stored: set[BlockKey] = set()

    def keys_for(t: object, a: object, s: object) -> dict[int, list[BlockKey]]:
        return {0: keys_of(list(t))}  # type: ignore[call-overload]

    def lookup(keys: dict[int, list[BlockKey]], prompt_len: int, computed: int) -> Found:
        n = 0
        while n < len(keys[0]) and keys[0][n] in stored:
            n += 1
        return Found(n, n)

    tokens = list(range(40))
    stored.update(keys_of(tokens)[:4])
    planner = Planner(C, N, keys_for, lookup)
    assert planner.match("r", tokens, 0) == 32
    tables = (list(range(1, 11)), [0, 0, 0, 0, 5, 6, 7, 8, 9, 10])
    planner.allocated("r", 32, tables)
    (load,) = planner.step([]).loads  # the next step's workers load it, before it computes
    assert load.whole and (load.token_start, load.token_end) == (0, 32)
    assert load.block_ids == (tables[0][:8], tables[1][:8])
    # Loaded: vLLM schedules it computed up to the hit; only the new chunk is saved.
    plan = planner.step([Scheduled("r", tables, True, 32, 8)])
    assert not plan.loads and [(s.first_chunk, s.token_end) for s in plan.saves] == [(4, 40)]
    # A failed whole load: vLLM recomputes from token 0 and kvstore offers no hit again.
    planner.load_failed("r")
    assert planner.match("r", tokens, 0) == 0
    plan = planner.step([Scheduled("r", tables, True, 0, 40)])
    assert [(s.first_chunk, s.token_end) for s in plan.saves] == [(0, 40)]


def test_mla_latent_round_trip_and_only_rank_zero_saves(tmp_path: Path) -> None:
    width = 24
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=width, block_tokens=C, kv_factor=1)
    caches = [torch.zeros(8, 1, N, width, dtype=BF16) for _ in range(2)]
    paged = PagedKV(caches, PageMap.latent(N, width), N)
    latent = torch.randn(2, 1, 16, 1, width).to(BF16)
    ids = [3, 1, 5, 2]
    for layer in range(2):
        paged.scatter(layer, paged.slots(ids, 0, 16), latent[layer])
    keys = keys_of(list(range(16)), layout)
    save = TransferSpec("r", {0: keys}, 0, 0, 16, (ids,))
    other_rank = TransferWorker(store(tmp_path, layout), 0, N, saves=False)
    other_rank.register(paged)
    run_step(other_rank, [], [save], 2)
    assert other_rank.store.lookup(keys) == 0  # rank 1 never stores what rank 0 stores
    other_rank.close()
    rank0 = TransferWorker(store(tmp_path, layout), 0, N)
    rank0.register(paged)
    run_step(rank0, [], [save], 2)
    rank0.close()
    fresh = [torch.zeros(8, 1, N, width, dtype=BF16) for _ in range(2)]
    loader = TransferWorker(store(tmp_path, layout), 0, N)
    loader.register(PagedKV(fresh, PageMap.latent(N, width), N))
    run_step(loader, [TransferSpec("r", {0: keys}, 0, 0, 15, ([6, 7, 0, 4],))], [], 2)
    out = torch.empty(1, 15, 1, width, dtype=BF16)
    loader.paged.gather(1, loader.paged.slots([6, 7, 0, 4], 0, 15), out)  # type: ignore[union-attr]
    assert torch.equal(out[0], latent[1, 0, :15])
    loader.close()
