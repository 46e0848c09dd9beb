"""Owner accounting across stores that share tiers (kvstore.datapath.quota): limits hold under
concurrent puts, and a flooding owner cannot evict a quiet one within its share."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import KVStore
from kvstore.datapath.quota import Quota, QuotaLedger
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import small_layout

LAYOUT = small_layout()
BLOCK = LAYOUT.block_nbytes
HOST = {"tiers": [{"kind": "host", "capacity": "1MiB"}]}
POOL = 40 * BLOCK


def kv(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.tensor_shape(n), generator=gen).to(LAYOUT.dtype)


@pytest.fixture
def stores() -> Iterator[list[KVStore]]:
    made: list[KVStore] = []
    yield made
    for store in made:
        store.close()


def seated(made: list[KVStore], ledger: QuotaLedger, owner: str) -> KVStore:
    store = KVStore(LAYOUT, HOST)
    made.append(store)
    room = store.engine.datapath.books.room
    room.use_quota(ledger.hook(owner, room.levels, BLOCK))
    return store


def test_a_limit_holds_under_concurrent_puts(stores: list[KVStore]) -> None:
    ledger = QuotaLedger({"host": POOL}, {("t", "host"): Quota(share=8 * BLOCK, limit=24 * BLOCK)})
    a, b = seated(stores, ledger, "t"), seated(stores, ledger, "t")
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], ledger.used("host", "t"))

    def flood(store: KVStore, salt: int) -> None:
        for i in range(30):
            store.put(make_keys(4, salt=salt * 1000 + i), kv(4, seed=i))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=flood, args=(s, n + 1)) for n, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    held = len(a.engine.datapath) + len(b.engine.datapath)
    assert peak[0] <= 24 * BLOCK  # room reserved included, at every moment watched
    assert held * BLOCK == ledger.used("host", "t") <= 24 * BLOCK
    figures = ledger.figures()["t"]
    assert figures["tiers"]["host"]["blocks"] == held
    assert figures["tiers"]["host"]["limit"] == 24 * BLOCK


def test_a_flood_does_not_evict_a_quiet_owner_within_its_share(stores: list[KVStore]) -> None:
    quotas = {
        ("quiet", "host"): Quota(share=20 * BLOCK, limit=POOL),
        ("noisy", "host"): Quota(share=10 * BLOCK, limit=POOL),
    }
    ledger = QuotaLedger({"host": POOL}, quotas)
    quiet, noisy = seated(stores, ledger, "quiet"), seated(stores, ledger, "noisy")
    mine = make_keys(16, salt=1)
    assert quiet.put(mine, kv(16, seed=1)) == 16
    for i in range(60):  # 240 unique blocks, six times the pool
        noisy.put(make_keys(4, salt=100 + i), kv(4, seed=i))
    assert quiet.lookup(mine) == 16
    assert ledger.used("host") <= POOL
    assert (
        len(noisy.engine.datapath) <= 40 - 16
    )  # it yields to the pool, keeping at least its share
    assert len(noisy.engine.datapath) >= 10
    more = make_keys(4, salt=2)  # the quiet owner grows to its share whatever the flood did
    assert quiet.put(more, kv(4, seed=2)) == 4
    assert quiet.lookup(mine + more) == 20


def test_a_store_over_its_limit_with_nothing_to_evict_refuses(stores: list[KVStore]) -> None:
    ledger = QuotaLedger({"host": POOL}, {("t", "host"): Quota(share=0, limit=8 * BLOCK)})
    a, b = seated(stores, ledger, "t"), seated(stores, ledger, "t")
    assert a.put(make_keys(8, salt=1), kv(8, seed=1)) == 8
    assert b.put(make_keys(4, salt=2), kv(4, seed=2)) == 0  # t's bytes are all in a
    assert ledger.figures()["t"]["refused"] == 4
    assert a.put(make_keys(4, salt=3), kv(4, seed=3)) == 4  # a evicts its own
    assert ledger.used("host", "t") == 8 * BLOCK


def test_a_quiet_owners_growth_is_pressure_that_reclaims_an_idle_floods_blocks(
    stores: list[KVStore],
) -> None:
    """An owner that flooded past its share and went idle shrinks only when asked: the
    quiet owner's puts within its share take the pool past its capacity (pressure), and
    the reclaim plan takes the overflow from the flood's stores, never below its share."""
    quotas = {
        ("quiet", "host"): Quota(share=20 * BLOCK, limit=POOL),
        ("noisy", "host"): Quota(share=10 * BLOCK, limit=POOL),
    }
    ledger = QuotaLedger({"host": POOL}, quotas)
    woken: list[int] = []
    ledger.on_pressure = lambda: woken.append(1)
    quiet = seated(stores, ledger, "quiet")
    noisy = [seated(stores, ledger, "noisy"), seated(stores, ledger, "noisy")]
    assert noisy[0].put(make_keys(24, salt=1), kv(24, seed=1)) == 24
    assert noisy[1].put(make_keys(12, salt=2), kv(12, seed=2)) == 12  # 36 of 40
    assert not woken and ledger.reclaims() == []
    assert quiet.put(make_keys(16, salt=3), kv(16, seed=3)) == 16  # the pool: 52 of 40
    assert woken
    with ledger.lock:
        plans = ledger.reclaims()
    assert sum(p.blocks for p in plans) == 12  # the pool's overflow, all of it noisy's
    assert {p.hook.owner for p in plans} == {"noisy"} and {p.tier for p in plans} == {0}
    assert plans[0].blocks >= plans[-1].blocks  # the bigger store gives first
    for plan in plans:
        store = next(
            s for s in noisy if s.engine.datapath.books.room.levels[0] is plan.hook.levels[0]
        )
        assert len(store.evict(plan.blocks, plan.tier)) == plan.blocks
    assert ledger.used("host") == POOL
    assert ledger.reclaims() == []
    assert quiet.lookup(make_keys(16, salt=3)) == 16


def test_a_reclaim_never_takes_an_owner_below_its_share(stores: list[KVStore]) -> None:
    quotas = {
        ("a", "host"): Quota(share=30 * BLOCK, limit=POOL),
        ("b", "host"): Quota(share=10 * BLOCK, limit=POOL),
    }
    ledger = QuotaLedger({"host": POOL}, quotas)
    a, b = seated(stores, ledger, "a"), seated(stores, ledger, "b")
    assert b.put(make_keys(14, salt=1), kv(14, seed=1)) == 14  # 4 past its share
    assert a.put(make_keys(30, salt=2), kv(30, seed=2)) == 30  # within its share: 44 of 40
    plans = ledger.reclaims()
    assert [(p.hook.owner, p.blocks) for p in plans] == [("b", 4)]
    ledger.set_quotas({**quotas, ("b", "host"): Quota(share=12 * BLOCK, limit=POOL)})
    assert [(p.hook.owner, p.blocks) for p in ledger.reclaims()] == [("b", 2)]  # its new share


def test_demotions_count_against_the_owner_in_the_tier_they_land_in(
    stores: list[KVStore], tmp_path: Path
) -> None:
    """Blocks evicted from host memory to a real disk tier reserve their room there through
    the owner's quota: they count in its disk bytes, and its disk limit holds for them."""
    quotas = {("t", "disk"): Quota(share=0, limit=6 * BLOCK)}
    ledger = QuotaLedger({"host": POOL, "disk": 100 * BLOCK}, quotas)
    config = {
        "tiers": [
            {"kind": "host", "capacity": 40 * BLOCK},
            {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": 100 * BLOCK},
        ]
    }
    store = KVStore(LAYOUT, config)
    stores.append(store)
    room = store.engine.datapath.books.room
    room.use_quota(ledger.hook("t", room.levels, BLOCK))
    keys = make_keys(10, salt=1)
    assert store.put(keys, kv(10, seed=1)) == 10
    assert store.drain(10)
    assert (ledger.used("host", "t"), ledger.used("disk", "t")) == (10 * BLOCK, 0)
    store.evict(4, tier=0)  # demoted: they land on the disk, under t's disk quota
    assert store.drain(10)
    assert (ledger.used("host", "t"), ledger.used("disk", "t")) == (6 * BLOCK, 4 * BLOCK)
    store.evict(4, tier=0)  # 4 more: past the disk limit, t's oldest disk blocks make way
    assert store.drain(10)
    assert (ledger.used("host", "t"), ledger.used("disk", "t")) == (2 * BLOCK, 6 * BLOCK)
    assert ledger.figures()["t"]["tiers"]["disk"] == {
        "bytes": 6 * BLOCK,
        "blocks": 6,
        "share": 0,
        "limit": 6 * BLOCK,
    }
    assert store.lookup(keys) == 0  # the first chunk was among those that went
