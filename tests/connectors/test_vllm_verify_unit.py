"""Shadow verification without vLLM (kvstore/connectors/verify.py): which requests are
sampled, how a stored block is compared with its recompute, and what a mismatch does to
the store, the counters and the log. Real stores on disk, real paged caches; the whole
path in real vLLM is test_vllm_verify.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout, KVStore
from kvstore.connectors.paged import PagedKV, PageMap
from kvstore.connectors.plan import Found, Planner, Scheduled, TransferSpec
from kvstore.connectors.settings import ConnectorSettings, Counters
from kvstore.connectors.transfer import TransferWorker
from kvstore.connectors.verify import (
    TOLERANCES,
    ShadowSampler,
    ShadowVerifier,
    chunk_differences,
    namespace_label,
    sampled,
)
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey, Namespace, chain_keys, tokens_to_bytes

H, D, N, C = 2, 8, 4, 8  # heads, head_dim, engine block tokens, chunk tokens
LAYERS = 2
BF16 = torch.bfloat16
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=H, head_dim=D, block_tokens=C)
NS = Namespace("test-model", LAYOUT, tp_rank=0, tp_size=1)


def keys_of(tokens: list[int]) -> list[BlockKey]:
    full = len(tokens) // C * C
    return chain_keys(tokens_to_bytes(tokens, limit=full), C, NS.seed)


class Engine:
    """Paged caches of two layers (K and V side by side in each token's row)."""

    def __init__(self, blocks: int = 16) -> None:
        self.caches = [torch.zeros(blocks, H, N, 2 * D, dtype=BF16) for _ in range(LAYERS)]
        self.paged = PagedKV(self.caches, PageMap.joined_last(N, D), N)

    def compute(self, ids: list[int], kv: torch.Tensor) -> None:
        """Write ``kv`` (kvstore's layout) as the tokens of blocks ``ids``."""
        for layer in range(LAYERS):
            slots = self.paged.slots(ids, 0, kv.shape[2])
            self.paged.scatter(layer, slots, kv[layer])


def worker(tmp_path: Path, engine: Engine) -> TransferWorker:
    store = KVStore(LAYOUT, {"tiers": [{"kind": "disk", "path": str(tmp_path / "d")}]})
    w = TransferWorker(store, 0, N, ConnectorSettings())
    w.register(engine.paged)
    return w


def step(
    w: TransferWorker,
    saves: list[TransferSpec],
    verifier: ShadowVerifier | None = None,
    marked: dict[str, str] | None = None,
) -> None:
    """One engine step's save hooks in vLLM's order, verification where the connector
    calls it (discover before the forward pass, check before the saves complete)."""
    if verifier is not None:
        verifier.discover(saves, marked or {})
    w.start_load([])
    for layer in range(LAYERS):
        w.wait_layer(layer)
        w.save_layer(layer, saves)
    if verifier is not None:
        verifier.check(saves, marked or {})
    w.finish_save(saves)


def random_kv(chunks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.tensor_shape(chunks), generator=gen).to(BF16)


# -- sampling ------------------------------------------------------------------------------
def test_sampling_is_deterministic_per_request_id_and_seed() -> None:
    ids = [f"req-{i}" for i in range(2000)]
    picked = [r for r in ids if sampled(r, 0.25, seed=7)]
    assert picked == [r for r in ids if sampled(r, 0.25, seed=7)]  # the same every time
    assert 400 < len(picked) < 600  # about a quarter
    assert picked != [r for r in ids if sampled(r, 0.25, seed=8)]  # the seed changes which
    assert all(sampled(r, 1) for r in ids[:50])  # rate 1: every request
    assert not any(sampled(r, 0) for r in ids[:50])  # rate 0: off


def test_sampler_marks_only_hits_and_ships_them_with_their_saves() -> None:
    counters = Counters("scheduler")
    sampler = ShadowSampler(1.0, counters)
    sampler.mark("hit", 3, NS)
    sampler.mark("hit", 3, NS)  # vLLM asks again for a waiting request: counted once
    sampler.mark("miss", 0, NS)
    saves = [TransferSpec(r, {0: []}, 0, 0, 8, ([1, 2],)) for r in ("hit", "miss")]
    assert sampler.for_saves(saves) == {"hit": namespace_label(NS)}
    assert counters.snapshot() == {"verify_sampled_requests": 1, "verify_sampled_chunks": 3}
    sampler.finished("hit")
    assert sampler.for_saves(saves) == {}


def test_namespace_label_names_the_model_layout_and_rank_never_the_salt() -> None:
    label = namespace_label(Namespace("m", LAYOUT, tp_rank=1, tp_size=2, salt="secret"))
    assert label == f"model=m layout={LAYOUT.fingerprint_hex} tp=1/2 salted"
    assert "secret" not in label


# -- settings ------------------------------------------------------------------------------
def test_verify_settings_default_and_checks() -> None:
    assert ConnectorSettings.from_extra({}).verify_sample_rate == 0.001
    ok = ConnectorSettings.from_extra({"verify_sample_rate": 0, "verify_tolerance": 0.2})
    assert (ok.verify_sample_rate, ok.verify_tolerance) == (0, 0.2)
    for bad in (1.5, -0.1, "often", True, float("nan")):
        with pytest.raises(ConfigError, match="verify_sample_rate: expected a number from 0"):
            ConnectorSettings.from_extra({"verify_sample_rate": bad})
    for bad in (0, -1, "loose", float("inf")):
        with pytest.raises(ConfigError, match="verify_tolerance: expected a number > 0"):
            ConnectorSettings.from_extra({"verify_tolerance": bad})


# -- the planner ---------------------------------------------------------------------------
def test_a_sampled_hit_is_a_miss_whose_stored_chunks_are_saved_again() -> None:
    keys = {0: keys_of(list(range(40)))}  # 5 chunks

    def planner() -> Planner:
        return Planner(C, N, lambda t, a, s: keys, lambda k, p, c: Found(4, 4))

    served = planner()
    assert served.match("r", list(range(40)), 0) == 32
    verified = planner()
    assert verified.match("r", list(range(40)), 0, verify=True) == 0  # nothing loaded
    plan = verified.step([Scheduled("r", (list(range(1, 11)),), True, 0, 40)])
    assert plan.loads == []
    (save,) = plan.saves
    # Every full chunk, the stored ones included: the workers compare those.
    assert (save.first_chunk, len(save.keys[0])) == (0, 5)
    (normal,) = served.step([Scheduled("r", (list(range(1, 11)),), True, 0, 40)]).saves
    assert normal.first_chunk == 4  # served: only the chunk not stored is saved


# -- comparing -----------------------------------------------------------------------------
def test_chunk_differences_are_per_chunk_and_relative_to_the_layer_scale() -> None:
    fresh = random_kv(3, 1).float()
    assert chunk_differences(fresh, fresh.clone(), C) == [0.0, 0.0, 0.0]
    scaled = fresh * 1000  # relative: the same rounding noise at any magnitude
    noisy = scaled.clone()
    for layer in range(LAYERS):  # 1% of the layer's largest value in that chunk
        noisy[layer, :, C : 2 * C] += 0.01 * scaled[layer, :, C : 2 * C].abs().amax()
    diffs = chunk_differences(scaled, noisy, C)
    assert diffs[0] == 0 and diffs[2] == 0 and diffs[1] == pytest.approx(0.01, rel=1e-3)
    other = random_kv(3, 2).float()
    assert min(chunk_differences(fresh, other, C)) > 0.5  # another prompt's KV
    broken = fresh.clone()
    broken[1, 0, 2 * C + 3, 0, 0] = float("nan")
    assert chunk_differences(fresh, broken, C)[2] == float("inf")


def test_bf16_rounding_of_a_recompute_passes_the_bf16_tolerance() -> None:
    exact = random_kv(2, 3).float() * 3
    recomputed = (exact * (1 + 2**-8)).to(BF16)  # one bf16 step off, everywhere
    assert max(chunk_differences(exact.to(BF16), recomputed, C)) < TOLERANCES[BF16] / 4


# -- the worker side -----------------------------------------------------------------------
def test_a_planted_block_is_caught_quarantined_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine()
    w = worker(tmp_path, engine)
    a_keys, b_keys = keys_of(list(range(32))), keys_of(list(range(100, 132)))
    ids = list(range(1, 9))
    kv_a, kv_b = random_kv(4, 10), random_kv(4, 11)
    for keys, kv in ((a_keys, kv_a), (b_keys, kv_b)):
        engine.compute(ids, kv)
        step(w, [TransferSpec("store", {0: keys}, 0, 0, 32, (ids,))])
    # B's chunk 2 under A's key of chunk 2, through the store API (a changed layout).
    w.store.delete([a_keys[2]])
    w.store.put([a_keys[2]], kv_b[:, :, 2 * C : 3 * C])
    counters = Counters("worker")
    verifier = ShadowVerifier(w, counters)
    engine.compute(ids, kv_a)  # the engine recomputes A
    save = TransferSpec("a", {0: a_keys}, 0, 0, 32, (ids,))
    with caplog.at_level(logging.INFO, logger="vllm.kvstore.connectors.verify"):
        step(w, [save], verifier, {"a": "model=test-model"})
        step(w, [save], verifier, {"a": "model=test-model"})  # asked again: no new line
    got = counters.snapshot()
    assert got["verify_checked_chunks"] == 4 + 3  # the quarantined key is not checked again
    assert got["verify_matched_chunks"] == 3 + 3
    assert got["verify_mismatched_chunks"] == 1 and got["verify_quarantined_chunks"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert a_keys[2].hex() in warnings[0] and "namespace model=test-model" in warnings[0]
    # Gone from the store, never saved again, and a load of it is refused (recomputed).
    assert w.store.engine.datapath.exists(a_keys) == [True, True, False, True]
    load = TransferSpec("again", {0: a_keys[:2] + a_keys[2:3]}, 0, 0, 24, (ids,))
    w.start_load([load])
    for layer in range(LAYERS):
        w.wait_layer(layer)
    assert w.take_load_errors() == set(ids[:6])
    w.close()


def test_a_failing_check_is_counted_and_never_raises(tmp_path: Path) -> None:
    engine = Engine()
    w = worker(tmp_path, engine)
    keys = keys_of(list(range(16)))
    engine.compute([1, 2, 3, 4], random_kv(2, 5))
    step(w, [TransferSpec("s", {0: keys}, 0, 0, 16, ([1, 2, 3, 4],))])
    w.close()  # a closed store raises on every call
    counters = Counters("worker")
    spec = TransferSpec("r", {0: keys}, 0, 0, 16, ([1, 2, 3, 4],))
    ShadowVerifier(w, counters).check([spec], {"r": "model=m"})
    assert counters.snapshot() == {"verify_errors": 1}


def test_blocks_another_process_stored_after_the_worker_opened_are_compared(
    tmp_path: Path,
) -> None:
    """The scheduler finds them on the shared disk; the worker's index has not seen them."""
    engine = Engine()
    w = worker(tmp_path, engine)
    a_keys, ids = keys_of(list(range(32))), list(range(1, 9))
    kv_a, kv_b = random_kv(4, 20), random_kv(4, 21)
    planted = kv_a.clone()
    planted[:, :, 3 * C :] = kv_b[:, :, 3 * C :]  # chunk 3 holds another prompt's KV
    config = {"tiers": [{"kind": "disk", "path": str(tmp_path / "d")}]}
    with KVStore(LAYOUT, config) as other:  # another engine process, same disk
        assert other.put(a_keys, planted) == 4
    counters = Counters("worker")
    engine.compute(ids, kv_a)
    step(
        w,
        [TransferSpec("a", {0: a_keys}, 0, 0, 32, (ids,))],
        ShadowVerifier(w, counters),
        {"a": "model=test-model"},
    )
    got = counters.snapshot()
    assert got["verify_checked_chunks"] == 4 and got["verify_mismatched_chunks"] == 1
    assert w.store.engine.datapath.exists(a_keys) == [True, True, True, False]
    w.close()
