"""The vLLM connector's engine-independent logic, without vLLM: page layout conversion,
chunk and prefix arithmetic, step plans, and worker transfers against a real KVStore.

The same conversions are checked against vLLM's own CPU cache-write kernels in
test_vllm_kernels.py (run inside .venv-vllm).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvstore import ConfigError, InvalidInputError, KVLayout, KVStore, StoreConfig
from kvstore.connectors.paged import PagedKV, PageMap
from kvstore.connectors.plan import (
    Found,
    Planner,
    Scheduled,
    TransferSpec,
    chunk_tokens_for,
    matched_tokens,
)
from kvstore.connectors.settings import ConnectorSettings, Counters, shared_tiers_config
from kvstore.connectors.speeds import EngineSpeeds, loads_as_counters
from kvstore.connectors.transfer import TransferWorker
from kvstore.keys import BlockKey, Namespace, chain_keys, tokens_to_bytes
from kvstore.restore.stats import PlannedLoad

H, D, N = 2, 16, 8  # heads, head_dim, engine block (page) size in tokens


# -- fake attention kernels: how real backends pack a (block, head) page --------------
def _page(cache: torch.Tensor, block: int, head: int) -> torch.Tensor:
    return cache[block, head].reshape(-1)


def joined_writer(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """GPU backends: row t of a page is K[t] then V[t]."""
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, cache.shape[2])
        cache[b, :, o, :D] = k[i]
        cache[b, :, o, D:] = v[i]


def cpu_vec_writer(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """vLLM's CPU "vec" kernel: K transposed ([D, N]) then V ([N, D]) in each page."""
    n = cache.shape[2]
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, n)
        for h in range(cache.shape[1]):
            page = _page(cache, b, h)
            page[torch.arange(D) * n + o] = k[i, h]
            page[n * D + o * D + torch.arange(D)] = v[i, h]


def tiled_writer(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """An AMX-like packing: K in [N/4][D/2][4][2] tiles, V in [D/4][N/2][4][2]."""
    n = cache.shape[2]
    d = torch.arange(D)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, n)
        k_at = (t // 4) * (D // 2 * 8) + (d // 2) * 8 + (t % 4) * 2 + d % 2
        v_at = n * D + (d // 4) * (n // 2 * 8) + (t // 2) * 8 + (d % 4) * 2 + t % 2
        for h in range(cache.shape[1]):
            page = _page(cache, b, h)
            page[k_at] = k[i, h]
            page[v_at] = v[i, h]


WRITERS = {"joined": joined_writer, "cpu_vec": cpu_vec_writer, "tiled": tiled_writer}
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def new_cache(blocks: int = 6, page: int = N, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(blocks, H, page, 2 * D, dtype=dtype)


def kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, H, D, generator=gen).to(torch.bfloat16)
    return k, v


def flat_slots(block_ids: Sequence[int], start: int, end: int, block_size: int = N) -> torch.Tensor:
    t = torch.arange(start, end)
    return torch.as_tensor(list(block_ids))[t // block_size] * block_size + t % block_size


# -- PageMap and PagedKV ----------------------------------------------------------------
@pytest.mark.parametrize("name", list(WRITERS))
def test_calibration_recovers_each_kernels_packing(name: str) -> None:
    writer = WRITERS[name]
    page_map = PageMap.calibrate(writer, new_cache(), D, torch.bfloat16)
    if name == "joined":
        expected = PageMap.joined_last(N, D)
        assert torch.equal(page_map.k_pos, expected.k_pos)
        assert torch.equal(page_map.v_pos, expected.v_pos)
    if name == "cpu_vec":
        assert torch.equal(page_map.k_pos, torch.arange(D)[None, :] * N + torch.arange(N)[:, None])


@pytest.mark.parametrize("name", list(WRITERS))
def test_gather_reads_what_the_kernel_wrote(name: str) -> None:
    writer = WRITERS[name]
    cache = new_cache()
    paged = PagedKV([cache], PageMap.calibrate(writer, cache, D, torch.bfloat16), N)
    blocks, tokens = [4, 1, 3], 21  # a request's blocks; its last block is partly filled
    k, v = kv(tokens)
    writer(k, v, cache, flat_slots(blocks, 0, tokens))
    out = torch.empty(2, tokens, H, D, dtype=torch.bfloat16)
    paged.gather(0, paged.slots(blocks, 0, tokens), out)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


@pytest.mark.parametrize("name", list(WRITERS))
def test_scatter_of_a_partial_range_equals_the_kernel_writing_it(name: str) -> None:
    writer = WRITERS[name]
    ours, theirs = new_cache(), new_cache()
    paged = PagedKV([ours], PageMap.calibrate(writer, ours, D, torch.bfloat16), N)
    blocks, start, end = [2, 5, 0], 3, 19  # starts and ends mid-block
    k, v = kv(end)
    paged.scatter(0, paged.slots(blocks, start, end), torch.stack((k[start:], v[start:])))
    writer(k[start:], v[start:], theirs, flat_slots(blocks, start, end))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", list(WRITERS))
def test_whole_pages_move_through_strided_views_of_each_packing(name: str) -> None:
    """Each packing here (rows, the CPU's transposed K, tiles) is a strided view of a page:
    whole pages gather and scatter without per-element indexing, exactly as the kernel
    packed them."""
    writer = WRITERS[name]
    cache, ours, theirs = new_cache(), new_cache(), new_cache()
    page_map = PageMap.calibrate(writer, cache, D, torch.bfloat16)
    paged, target = PagedKV([cache], page_map, N), PagedKV([ours], page_map, N)
    blocks, tokens = [4, 1, 3], 3 * N
    k, v = kv(tokens)
    writer(k, v, cache, flat_slots(blocks, 0, tokens))
    pages = paged.pages(blocks, 0, tokens)
    assert pages is not None and pages.tolist() == blocks
    out = torch.empty(2, tokens, H, D, dtype=torch.bfloat16)
    paged.gather(0, paged.slots(blocks, 0, tokens), out, pages)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)
    target.scatter(0, target.slots(blocks, 0, tokens), out, pages)
    writer(k, v, theirs, flat_slots(blocks, 0, tokens))
    assert torch.equal(ours, theirs)


def test_a_packing_no_strides_describe_moves_element_by_element() -> None:
    order = torch.randperm(N * D, generator=torch.Generator().manual_seed(3))

    def scrambled(
        k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        for i, s in enumerate(slots.tolist()):
            b, t = divmod(s, cache.shape[2])
            for h in range(cache.shape[1]):
                page = _page(cache, b, h)
                page[order[t * D + torch.arange(D)]] = k[i, h]
                page[N * D + t * D + torch.arange(D)] = v[i, h]

    cache = new_cache()
    paged = PagedKV([cache], PageMap.calibrate(scrambled, cache, D, torch.bfloat16), N)
    blocks = [2, 5]
    assert paged.pages(blocks, 0, 2 * N) is None  # no whole-page path for it
    k, v = kv(2 * N)
    scrambled(k, v, cache, flat_slots(blocks, 0, 2 * N))
    out = torch.empty(2, 2 * N, H, D, dtype=torch.bfloat16)
    paged.gather(0, paged.slots(blocks, 0, 2 * N), out)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


def test_kernel_pages_smaller_than_engine_blocks() -> None:
    # vLLM may split a 16-token scheduler block into kernel pages of 8 tokens.
    cache = new_cache(blocks=12, page=N)
    paged = PagedKV([cache], PageMap.joined_last(N, D), block_size=2 * N)
    slots = paged.slots([3, 0], 0, 32)
    assert slots[:, 0].tolist() == [6] * 8 + [7] * 8 + [0] * 8 + [1] * 8
    assert slots[:, 1].tolist() == list(range(8)) * 4


def test_paged_kv_rejects_bad_input() -> None:
    pm = PageMap.joined_last(N, D)
    with pytest.raises(InvalidInputError):
        PagedKV([], pm, N)
    with pytest.raises(InvalidInputError, match="layer 1"):
        PagedKV([new_cache(), new_cache(blocks=3)], pm, N)
    with pytest.raises(InvalidInputError, match="page map"):
        PagedKV([torch.zeros(4, H, N, 3 * D)], pm, N)
    with pytest.raises(InvalidInputError, match="multiple"):
        PagedKV([new_cache()], pm, N + 4)
    paged = PagedKV([new_cache()], pm, N)
    with pytest.raises(InvalidInputError, match="outside"):
        paged.slots([0, 1], 0, 2 * N + 1)


def test_calibration_rejects_kernels_it_cannot_map() -> None:
    def drops_one(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        joined_writer(k[:-1], v[:-1], c, s[:-1])

    def scales(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        joined_writer(k * 100, v * 100, c, s)

    def shares(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        joined_writer(k, k + v, c, s)  # V lands on K's cells too

    for kernel in (drops_one, scales, shares):
        with pytest.raises(InvalidInputError, match="calibration"):
            PageMap.calibrate(kernel, new_cache(), D, torch.bfloat16)


# -- chunk and prefix arithmetic -----------------------------------------------------------
@pytest.mark.parametrize(
    ("block", "configured", "chunk"),
    [(128, None, 256), (16, None, 256), (96, None, 288), (512, None, 512), (128, 384, 384)],
)
def test_chunk_size_is_a_multiple_of_the_engine_block(
    block: int, configured: int | None, chunk: int
) -> None:
    assert chunk_tokens_for(block, configured) == chunk


@pytest.mark.parametrize("bad", [100, 0, -128, 1.5, "256"])
def test_chunk_size_must_be_a_positive_multiple(bad: object) -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunk_tokens_for(128, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("hit_chunks", "prompt_len", "computed", "expected"),
    [
        (3, 1000, 0, 768),  # prefix ends mid-chunk: only full chunks hit
        (4, 1024, 0, 1023),  # the whole prompt hit: vLLM computes the last token
        (4, 1024, 512, 511),  # beyond vLLM's own (block-aligned) hit
        (3, 1000, 768, 0),  # vLLM already has everything we have
        (2, 1000, 640, 0),  # vLLM has more than we have
        (0, 1000, 0, 0),
        (1, 1, 0, 0),  # a one-token prompt: nothing to load
    ],
)
def test_matched_tokens(hit_chunks: int, prompt_len: int, computed: int, expected: int) -> None:
    assert matched_tokens(hit_chunks, 256, prompt_len, computed) == expected


# -- the scheduler-side planner ---------------------------------------------------------
C, BS = 32, 8  # chunk and engine block sizes in these planner tests
LAYOUT = KVLayout(num_layers=2, num_kv_heads=H, head_dim=D, block_tokens=C)


def keys_for(
    tokens: Sequence[int], adapter: str | None, salt: str | None
) -> dict[int, list[BlockKey]]:
    keys = {}
    for rank in (0, 1):
        ns = Namespace("m", LAYOUT, tp_rank=rank, tp_size=2, adapter=adapter, salt=salt)
        full = len(tokens) - len(tokens) % C
        keys[rank] = chain_keys(tokens_to_bytes(list(tokens), limit=full), C, ns.seed)
    return keys


class FakeIndex:
    """The stored keys the planner's lookup sees."""

    def __init__(self) -> None:
        self.stored: set[BlockKey] = set()
        #: Chunks a restore plan would load (None: every stored one).
        self.plan: int | None = None

    def lookup(self, keys: dict[int, list[BlockKey]], prompt_len: int, computed: int) -> Found:
        n = self.count(keys)
        if self.plan is None:
            return Found(n, n)
        planned = PlannedLoad({"s3:0": (0.01, 1e6, 1)}, 0.01, 0.2, 4)
        return Found(n, min(n, self.plan), 0.01, planned)

    def count(self, keys: dict[int, list[BlockKey]]) -> int:
        counts = []
        for ks in keys.values():
            n = 0
            while n < len(ks) and ks[n] in self.stored:
                n += 1
            counts.append(n)
        return min(counts)


def planner_with(index: FakeIndex) -> Planner:
    return Planner(C, BS, keys_for, index.lookup)


def test_planner_loads_the_hit_then_saves_new_full_chunks() -> None:
    index, tokens = FakeIndex(), list(range(100, 200))  # 100 tokens: 3 full chunks
    keys = keys_for(tokens, None, None)
    index.stored |= set(keys[0][:2]) | set(keys[1][:2])
    planner = planner_with(index)
    assert planner.match("r", tokens, 0) == 64
    planner.allocated("r", 64)
    blocks = list(range(40, 53))  # 13 blocks of 8 tokens
    plan = planner.step([Scheduled("r", (blocks,), True, 64, 36)])
    (load,) = plan.loads
    assert (load.first_chunk, load.token_start, load.token_end) == (0, 0, 64)
    assert load.keys == {0: keys[0][:2], 1: keys[1][:2]}
    assert load.block_ids == (blocks[:8],) and load.block_offset == 0
    (save,) = plan.saves  # chunk 2 is computed in this step; its tail (4 tokens) is never saved
    assert (save.first_chunk, save.token_start, save.token_end) == (2, 64, 96)
    assert save.block_ids == (blocks[8:12],) and save.block_offset == 8
    assert save.blocks_of(64, 96, BS) == blocks[8:12]
    assert not planner.step([Scheduled("r", None, False, 100, 1)])  # decode: nothing new


def test_planner_loads_what_the_restore_plan_says() -> None:
    index, tokens = FakeIndex(), list(range(100, 200))  # 3 full chunks, all stored
    keys = keys_for(tokens, None, None)
    index.stored |= set(keys[0]) | set(keys[1])
    index.plan = 1  # chunk 0 pays; 1 and 2 sit on a slow tier
    planner = planner_with(index)
    assert planner.match("r", tokens, 0) == 32
    planner.allocated("r", 32)
    blocks = list(range(40, 53))
    plan = planner.step([Scheduled("r", (blocks,), True, 32, 68)])
    (load,) = plan.loads
    assert (load.first_chunk, load.token_end, load.planned_s) == (0, 32, 0.01)
    assert load.planned is not None and load.planned.tiers == {"s3:0": (0.01, 1e6, 1)}
    assert not plan.saves  # the recomputed chunks are stored already: nothing to save


def test_planner_follows_chunked_prefill() -> None:
    planner, tokens = planner_with(FakeIndex()), list(range(130))
    assert planner.match("r", tokens, 0) == 0
    planner.allocated("r", 0)
    plan = planner.step([Scheduled("r", (list(range(6)),), True, 0, 48)])
    assert [(s.first_chunk, s.token_end) for s in plan.saves] == [(0, 32)]
    plan = planner.step([Scheduled("r", (list(range(6, 12)),), False, 48, 48)])
    assert [(s.first_chunk, s.token_end) for s in plan.saves] == [(1, 96)]
    assert plan.saves[0].block_ids == (list(range(4, 12)),)
    plan = planner.step([Scheduled("r", (list(range(12, 17)),), False, 96, 34)])
    assert [(s.first_chunk, s.token_end) for s in plan.saves] == [(3, 128)]


def test_planner_loads_from_the_engines_own_hit_mid_chunk() -> None:
    index, tokens = FakeIndex(), list(range(128))
    keys = keys_for(tokens, None, None)
    index.stored |= set(keys[0][:3]) | set(keys[1][:3])
    planner = planner_with(index)
    assert planner.match("r", tokens, 40) == 56  # vLLM has 40 tokens (5 blocks), we have 96
    planner.allocated("r", 56)
    (load,) = planner.step([Scheduled("r", (list(range(16)),), True, 96, 32)]).loads
    assert (load.first_chunk, load.token_start, load.token_end) == (1, 40, 96)
    assert load.keys[0] == keys[0][1:3]
    assert load.block_ids == (list(range(5, 12)),) and load.block_offset == 5


def test_planner_resaves_after_a_rollback() -> None:
    index, tokens = FakeIndex(), list(range(96))
    keys = keys_for(tokens, None, None)
    index.stored |= set(keys[0][:2]) | set(keys[1][:2])
    planner = planner_with(index)
    planner.allocated("r", planner.match("r", tokens, 0))
    plan = planner.step([Scheduled("r", (list(range(12)),), True, 64, 32)])
    assert [s.first_chunk for s in plan.saves] == [2]
    # The load failed at block 3: vLLM rolled back to token 24 and recomputes from there.
    plan = planner.step([Scheduled("r", None, False, 24, 72)])
    assert [(s.first_chunk, s.token_end) for s in plan.saves] == [(0, 96)]


def test_planner_resumed_request_replaces_its_blocks() -> None:
    planner, tokens = planner_with(FakeIndex()), list(range(64))
    planner.allocated("r", planner.match("r", tokens, 0))
    planner.step([Scheduled("r", ([1, 2],), True, 0, 16)])
    plan = planner.step([Scheduled("r", ([7, 8, 9, 10, 11, 12, 13, 14],), True, 0, 64)])
    assert [s.block_ids for s in plan.saves] == [([7, 8, 9, 10, 11, 12, 13, 14],)]


def test_planner_ignores_unknown_and_finished_requests() -> None:
    planner, tokens = planner_with(FakeIndex()), list(range(64))
    assert not planner.step([Scheduled("never-matched", (list(range(8)),), True, 0, 64)])
    planner.match("r", tokens, 0)
    planner.finished("r")
    assert not planner.step([Scheduled("r", (list(range(8)),), True, 0, 64)])
    assert planner.requests == {}


def test_planner_never_loads_more_than_it_found() -> None:
    index, tokens = FakeIndex(), list(range(64))
    planner = planner_with(index)
    planner.match("r", tokens, 0)
    planner.allocated("r", 40)  # the engine asks for more than the lookup returned
    assert not planner.step([Scheduled("r", (list(range(8)),), True, 40, 24)]).loads


def test_planner_skips_specs_the_engine_gave_too_few_blocks_for() -> None:
    planner, tokens = planner_with(FakeIndex()), list(range(64))
    planner.match("r", tokens, 0)
    assert not planner.step([Scheduled("r", ([0, 1],), True, 0, 64)]).saves
    plan = planner.step([Scheduled("r", ([2, 3, 4, 5, 6, 7],), False, 64, 1)])
    assert [s.first_chunk for s in plan.saves] == [0]  # saved once the blocks are known


def test_keys_differ_by_rank_adapter_and_salt() -> None:
    tokens = list(range(64))
    plain, lora, salted = (
        keys_for(tokens, None, None),
        keys_for(tokens, "a", None),
        keys_for(tokens, None, "tenant"),
    )
    all_keys = [k for ks in (plain, lora, salted) for rank in ks.values() for k in rank]
    assert len(set(all_keys)) == len(all_keys) == 12


# -- worker transfers against a real store ------------------------------------------------
LAYERS = 3
WLAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_tokens=2 * N)


def store_config(tmp_path: Path) -> dict[str, object]:
    return {
        "tiers": [
            {"kind": "host", "capacity": 64 * WLAYOUT.block_nbytes},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB"},
        ]
    }


class Engine:
    """A fake engine worker: paged caches per layer, filled by the CPU 'vec' kernel."""

    def __init__(self, blocks: int = 16) -> None:
        self.caches = [new_cache(blocks) for _ in range(LAYERS)]
        page_map = PageMap.calibrate(cpu_vec_writer, self.caches[0], D, torch.bfloat16)
        self.paged = PagedKV(self.caches, page_map, N)

    def compute(
        self, block_ids: list[int], tokens: int, seed: int
    ) -> list[tuple[torch.Tensor, ...]]:
        """Write KV for ``tokens`` tokens of a request, as the forward pass would."""
        per_layer = []
        for layer, cache in enumerate(self.caches):
            k, v = kv(tokens, seed * 100 + layer)
            cpu_vec_writer(k, v, cache, flat_slots(block_ids, 0, tokens))
            per_layer.append((k, v))
        return per_layer

    def read(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        out = torch.empty(LAYERS, 2, end - start, H, D, dtype=torch.bfloat16)
        for layer in range(LAYERS):
            self.paged.gather(layer, self.paged.slots(block_ids, start, end), out[layer])
        return out


@pytest.fixture(params=["layerwise", "sync"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def worker_for(
    tmp_path: Path, engine: Engine, mode: str, flush: str = "step", **kw: int
) -> TransferWorker:
    store = KVStore(WLAYOUT, store_config(tmp_path))
    settings = ConnectorSettings(flush=flush, transfer=mode, **kw)  # type: ignore[arg-type]
    worker = TransferWorker(store, rank=0, block_size=N, settings=settings)
    worker.register(engine.paged)
    return worker


def step(
    worker: TransferWorker,
    loads: Sequence[TransferSpec] = (),
    saves: Sequence[TransferSpec] = (),
    skip_wait: int | None = None,
) -> set[int]:
    """One engine step, hooks in vLLM's order; returns the blocks reported as load errors."""
    worker.start_load(list(loads))
    for layer in range(LAYERS):
        if layer != skip_wait:
            worker.wait_layer(layer)
        worker.save_layer(layer, list(saves))
    worker.finish_save(list(saves))
    return worker.take_load_errors()


def prompt_keys(tokens: Sequence[int]) -> list[BlockKey]:
    ns = Namespace("m", WLAYOUT, tp_rank=0, tp_size=1)
    c = WLAYOUT.block_tokens
    return chain_keys(tokens_to_bytes(list(tokens), limit=len(tokens) // c * c), c, ns.seed)


def spec(keys: list[BlockKey], first: int, start: int, end: int, blocks: list[int]) -> TransferSpec:
    lo = start // N
    last = -(-end // WLAYOUT.block_tokens)
    return TransferSpec("r", {0: keys[first:last]}, first, start, end, (blocks[lo:],), lo)


def test_save_then_load_into_another_engine_is_bit_exact(tmp_path: Path, mode: str) -> None:
    c = WLAYOUT.block_tokens
    tokens = list(range(70))
    blocks_a, blocks_b = [3, 9, 1, 4, 12, 0, 7, 2, 5], [8, 2, 6, 0, 11, 5, 10, 1, 3]
    keys = prompt_keys(tokens)  # 4 full chunks of 16 tokens; 6 tokens of tail get none
    producer, consumer = Engine(), Engine()
    producer.compute(blocks_a, 70, seed=1)
    saver = worker_for(tmp_path, producer, mode)
    assert step(saver, saves=[spec(keys, 0, 0, 4 * c, blocks_a)]) == set()
    assert saver.counters.snapshot()["save_chunks_stored"] == 4
    saver.close()  # a new process loads what this one left on disk
    loader = worker_for(tmp_path, consumer, mode)
    # From vLLM's own hit (20 tokens, mid-chunk) to all but the last token.
    assert step(loader, loads=[spec(keys, 1, 20, 4 * c - 1, blocks_b)]) == set()
    assert torch.equal(consumer.read(blocks_b, 20, 63), producer.read(blocks_a, 20, 63))
    assert consumer.read(blocks_b, 63, 64).abs().sum() == 0  # the engine computes that one
    assert consumer.read(blocks_b, 0, 20).abs().sum() == 0  # the engine already had those
    assert loader.counters.snapshot()["load_tokens"] == 43
    loader.close()


def test_a_planned_loads_wait_goes_back_as_what_it_cost_each_tier(
    tmp_path: Path, mode: str
) -> None:
    """The engine's wait for a planned load (in ``wait_layer``, or the whole load when it
    runs before compute) is read back through the plan's model as what the load cost its
    tier, shipped to the scheduler with the step's stats, and corrects the price the
    scheduler's store plans that tier at."""
    c = WLAYOUT.block_tokens
    keys, blocks = prompt_keys(list(range(64))), list(range(8))
    producer, consumer = Engine(), Engine()
    producer.compute(blocks, 64, seed=3)
    saver = worker_for(tmp_path, producer, mode)
    step(saver, saves=[spec(keys, 0, 0, 4 * c, blocks)])
    saver.close()
    loader = worker_for(tmp_path, consumer, mode)
    load = spec(keys, 0, 0, 4 * c - 1, blocks)
    nbytes = 4 * WLAYOUT.block_nbytes
    load.planned = PlannedLoad({"disk:0": (1e-6, nbytes, 1)}, 1e-6, 0.01, LAYERS)
    assert step(loader, loads=[load]) == set()
    samples = loader.take_load_samples()
    assert set(samples) == {"disk:0"} and loader.take_load_samples() == {}
    sample = samples["disk:0"]
    assert (sample.nbytes, sample.calls, sample.planned_s) == (nbytes, 1, 1e-6)
    assert sample.actual_s > 0
    loader.close()
    with KVStore(WLAYOUT, store_config(tmp_path / "scheduler")) as scheduler:
        EngineSpeeds(scheduler).step_ended(SimpleNamespace(data=loads_as_counters(samples)))
        disk = scheduler.stats()["tiers"][1]
        assert disk["read_correction"] != 1.0  # the engine's wait moved the price
        assert disk["read_estimate_error"] == pytest.approx(1e-6 / sample.actual_s - 1)


def test_saves_skip_chunks_already_stored(tmp_path: Path, mode: str) -> None:
    engine, blocks, keys = Engine(), list(range(8)), prompt_keys(list(range(64)))
    engine.compute(blocks, 64, seed=2)
    worker = worker_for(tmp_path, engine, mode)
    step(worker, saves=[spec(keys, 0, 0, 32, blocks)])
    step(worker, saves=[spec(keys, 0, 0, 64, blocks)])
    counts = worker.counters.snapshot()
    assert counts["save_chunks_stored"] == 4 and counts["save_chunks_present"] == 2
    worker.close()


def test_saves_tell_a_kvstore_server_their_tokens_for_its_events(mode: str) -> None:
    """With a kvstore-server behind the store, the scheduler ships each save's token ids
    (``TransferSpec.token_ids``): the server's KV events then carry them."""
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvstore.cli.kvserver import server_test_config
    from kvstore.events.format import BlockStored, decode_batch
    from kvstore.server import ServerThread

    work = tempfile.mkdtemp(prefix="kvs-tok-", dir="/tmp")
    data = server_test_config(work)
    data["events"] = {"enabled": True, "endpoint": "tcp://127.0.0.1:0", "block_size": N}
    tokens = list(range(1000, 1064))
    keys, engine, blocks = prompt_keys(tokens), Engine(), list(range(8))
    engine.compute(blocks, 64, seed=3)
    ctx = zmq.Context()
    try:
        with ServerThread(StoreConfig.from_dict(data, environ={})) as server:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(server.server.addresses["events"])
            time.sleep(0.3)  # the subscription reaches the server
            remote = {"kind": "remote", "address": server.address}
            store = KVStore(WLAYOUT, {"tiers": [remote]})
            settings = ConnectorSettings(transfer=mode)  # type: ignore[arg-type]
            worker = TransferWorker(store, rank=0, block_size=N, settings=settings)
            worker.register(engine.paged)
            first, second = spec(keys, 0, 0, 32, blocks), spec(keys, 2, 32, 64, blocks)
            first.token_ids, first.parents = tokens[:32], {0: None}
            second.token_ids, second.parents = tokens[32:], {0: keys[1]}
            step(worker, saves=[first])
            step(worker, saves=[second])
            got: list[int] = []
            while len(got) < len(tokens) and sub.poll(10_000):
                batch = decode_batch(sub.recv_multipart()[2])
                got += [t for e in batch.events if isinstance(e, BlockStored) for t in e.token_ids]
            worker.close()
            sub.close(linger=0)
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(work, ignore_errors=True)
    assert got == tokens


def test_failed_load_reports_blocks_and_drops_the_steps_saves(tmp_path: Path, mode: str) -> None:
    engine, blocks, keys = Engine(), list(range(8)), prompt_keys(list(range(64)))
    engine.compute(blocks, 64, seed=3)
    worker = worker_for(tmp_path, engine, mode)
    step(worker, saves=[spec(keys, 0, 0, 32, blocks)])
    worker.store.delete([keys[1]])  # evicted, deleted or corrupt between lookup and load
    # Chunk 0 (blocks 0-1) loads; chunk 1 on (blocks 2-7) fails and is recomputed. The
    # same step's save (computed over the garbage) must not be stored.
    errors = step(
        worker, loads=[spec(keys, 0, 0, 63, blocks)], saves=[spec(keys, 2, 32, 64, blocks)]
    )
    assert errors == {2, 3, 4, 5, 6, 7}
    counts = worker.counters.snapshot()
    assert counts["save_chunks_dropped"] == 2 and counts["save_chunks_stored"] == 2
    assert counts["load_failed_blocks"] == 6 and counts["load_failed_tokens"] == 63 - 16
    assert worker.store.lookup([keys[2]]) == 0
    assert step(worker, saves=[spec(keys, 2, 32, 64, blocks)]) == set()  # the next step saves
    assert worker.store.lookup([keys[2]]) == 1
    worker.close()


def test_corrupt_block_on_disk_is_a_load_error_not_wrong_kv(tmp_path: Path, mode: str) -> None:
    engine, blocks, keys = Engine(), list(range(8)), prompt_keys(list(range(64)))
    engine.compute(blocks, 64, seed=4)
    worker = worker_for(tmp_path, engine, mode)
    step(worker, saves=[spec(keys, 0, 0, 64, blocks)])
    worker.close()
    for path in sorted((tmp_path / "disk").rglob("*.kvb")):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    fresh = Engine()
    worker = worker_for(tmp_path, fresh, mode)
    assert step(worker, loads=[spec(keys, 0, 0, 63, blocks)]) == set(blocks)
    if mode == "sync":  # (layerwise: verified layers before the bad one may land; vLLM
        # recomputes every reported block, overwriting them)
        assert fresh.read(blocks, 0, 64).abs().sum() == 0
    worker.close()


def test_a_layer_the_engine_never_waited_for_is_a_load_error(tmp_path: Path) -> None:
    engine, blocks, keys = Engine(), list(range(8)), prompt_keys(list(range(64)))
    engine.compute(blocks, 64, seed=7)
    worker = worker_for(tmp_path, engine, "layerwise")
    step(worker, saves=[spec(keys, 0, 0, 64, blocks)])
    # The forward pass ran layer 1 on KV we never put in place: recompute everything.
    assert step(worker, loads=[spec(keys, 0, 0, 63, blocks)], skip_wait=1) == set(blocks)
    worker.close()


def test_load_without_registered_caches_fails_safe(tmp_path: Path) -> None:
    worker = TransferWorker(KVStore(WLAYOUT, store_config(tmp_path)), rank=0, block_size=N)
    keys = prompt_keys(list(range(32)))
    assert step(worker, loads=[spec(keys, 0, 0, 31, [0, 1, 2, 3])]) == {0, 1, 2, 3}
    step(worker, saves=[spec(keys, 0, 0, 32, [0, 1, 2, 3])])
    assert worker.store.lookup(keys) == 0
    worker.close()


@pytest.mark.parametrize("flush", ["step", "background", "close"])
def test_flush_policy_decides_when_other_processes_see_blocks(tmp_path: Path, flush: str) -> None:
    engine, blocks, keys = Engine(), list(range(8)), prompt_keys(list(range(64)))
    engine.compute(blocks, 64, seed=5)
    worker = worker_for(tmp_path, engine, "layerwise", flush=flush)
    step(worker, saves=[spec(keys, 0, 0, 64, blocks)])
    shared = shared_tiers_config(StoreConfig.load(store_config(tmp_path)))
    assert shared is not None and [t.kind for t in shared.tiers] == ["disk"]
    scheduler_view = KVStore(WLAYOUT, shared)  # what the scheduler process opens
    if flush == "step":
        assert scheduler_view.lookup(keys) == 4
    worker.close()  # every policy persists at close
    assert scheduler_view.lookup(keys) == 4
    scheduler_view.close()


def test_sync_staging_is_bounded_and_batches_transfers(tmp_path: Path) -> None:
    engine, blocks, keys = Engine(), list(range(8)), prompt_keys(list(range(64)))
    engine.compute(blocks, 64, seed=6)
    worker = worker_for(tmp_path, engine, "sync", staging_bytes=WLAYOUT.block_nbytes)
    step(worker, saves=[spec(keys, 0, 0, 64, blocks)])
    other = Engine()
    worker.register(other.paged)
    assert step(worker, loads=[spec(keys, 0, 0, 64, blocks)]) == set()
    assert torch.equal(other.read(blocks, 0, 64), engine.read(blocks, 0, 64))
    worker.close()


# -- settings ---------------------------------------------------------------------------
def test_settings_from_the_extra_config() -> None:
    s = ConnectorSettings.from_extra(
        {
            "transfer": "sync",
            "kvstore_config": {"tiers": [{"kind": "host"}]},
            "chunk_tokens": 512,
            "flush": "close",
            "staging_bytes": "64MiB",
            "salt": "t1",
        }
    )
    assert (s.chunk_tokens, s.flush, s.staging_bytes, s.salt) == (512, "close", 64 * 2**20, "t1")
    assert [t.kind for t in s.resolved_store_config().tiers] == ["host"]
    assert ConnectorSettings.from_extra(None).flush == "step"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"kvstore_cfg": {}}, "unknown key"),
        ({"flush": "never"}, "flush"),
        ({"transfer": "async"}, "transfer"),
        ({"chunk_tokens": "256"}, "chunk_tokens"),
        ({"model_id": ""}, "model_id"),
        ({"recompute_on_load_failure": "yes"}, "recompute"),
        ({"staging_bytes": 0}, "staging_bytes"),
        ({"kvstore_config": {"tiers": [{"kind": "tape"}]}}, "tape"),
    ],
)
def test_bad_settings_are_clear_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorSettings.from_extra(extra).resolved_store_config()


def test_memory_only_config_has_no_shared_view() -> None:
    assert shared_tiers_config(StoreConfig.load({"tiers": [{"kind": "host"}]})) is None


def test_counters_deltas_and_files(tmp_path: Path) -> None:
    counters = Counters("worker")
    counters.add("a", 2)
    assert counters.take_delta() == {"a": 2}
    assert counters.take_delta() == {}
    counters.add("a")
    counters.write(str(tmp_path))
    (path,) = tmp_path.glob("kvstore-worker-*.json")
    assert '"a": 3' in path.read_text()
    counters.write(str(tmp_path / "file"))  # a directory that cannot exist: logged, not raised
