"""The workload of a chaos soak, and what it checks (see :mod:`kvharness.chaos.run`).

Every block's bytes follow from its key (:func:`block_for`), so any read is checked
without keeping the data: a block returned as found must be byte-exact, a miss is
allowed. :class:`Ledger` remembers which keys were put and which reached S3;
:class:`Tally` counts everything; :class:`Workload` runs the operations from a few
threads; :class:`Tracker` asks the bucket which blocks arrived; :func:`final_check`
reads every block that reached S3 back through the nodes at the end.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvharness.chaos.cluster import LAYOUT, SoakCluster
from kvharness.chaos.events import chunk_tokens
from kvstore.errors import BlockNotFoundError, KVStoreError
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from kvharness.chaos.config import SoakConfig

__all__ = [
    "OPS",
    "Ledger",
    "Outcome",
    "Tally",
    "Tracker",
    "Workload",
    "block_for",
    "final_check",
]

#: Operation kinds and their relative odds (member operations only with members).
OPS: tuple[tuple[str, float], ...] = (
    ("put", 3.0),
    ("node_get", 3.0),
    ("member_get", 1.5),
    ("member_prefetch", 1.5),
    ("lookup", 1.0),
)
_HOT_KEYS = 4
_SAMPLES = 10
#: A key put is looked for in the bucket for this long; later it counts as never arrived
#: (its node was killed before the write-through), unless the final probe finds it.
_TRACK_S = 60.0
#: Counters of the nodes' cluster and S3 tiers summed over the run (restarts included).
_NODE_COUNTERS = (
    "cluster.fetched",
    "cluster.hot",
    "cluster.fetch_failures",
    "cluster.peer_errors",
    "cluster.stale_hints",
    "s3.corrupt",
    "s3.errors",
    "s3.misses",
)


def block_for(key: BlockKey) -> torch.Tensor:
    """The bytes block ``key`` holds: normal values from a generator seeded by the key."""
    gen = torch.Generator().manual_seed(int.from_bytes(bytes(key)[:7], "little"))
    return torch.randn(LAYOUT.block_shape, generator=gen).to(LAYOUT.dtype)


def _sentinel(shape: Sequence[int]) -> torch.Tensor:
    """A destination filled with 0xA5 bytes: a block reported found but never written
    into it shows up as wrong bytes."""
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.full((numel * LAYOUT.dtype.itemsize,), 0xA5, dtype=torch.uint8)
    return raw.view(LAYOUT.dtype).reshape(tuple(shape))


def _diff(got: torch.Tensor, want: torch.Tensor) -> int:
    """Bytes that differ between two tensors of one shape and dtype."""
    a = got.contiguous().view(torch.uint8).flatten()
    b = want.contiguous().view(torch.uint8).flatten()
    return int((a != b).sum())


class Tally:
    """Thread-safe counters named ``group.kind``, and a few text samples per topic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._samples: dict[str, list[str]] = {}

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        if n:
            with self._lock:
                self._counts[name] += n

    def sample(self, topic: str, text: str) -> None:
        """Keep ``text`` as an example of ``topic`` (the first few only)."""
        with self._lock:
            rows = self._samples.setdefault(topic, [])
            if len(rows) < _SAMPLES:
                rows.append(text)

    def total(self, group: str) -> int:
        """The sum of the counters of ``group``."""
        return sum(self.group(group).values())

    def group(self, group: str) -> dict[str, int]:
        """The counters ``group.*``, by kind."""
        with self._lock:
            items = list(self._counts.items())
        pre = group + "."
        return {k[len(pre) :]: v for k, v in sorted(items) if k.startswith(pre)}

    def samples(self) -> dict[str, list[str]]:
        """The samples kept, by topic."""
        with self._lock:
            return {topic: list(rows) for topic, rows in self._samples.items()}


class Ledger:
    """Which keys were put (by index), which are stored, which reached S3."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._lock = threading.Lock()
        self._next = 0
        self._put_at: dict[int, float] = {}  # every key a put was tried for
        self._stored: list[int] = []  # keys a put reported stored
        self._runs: list[tuple[int, ...]] = []  # whole puts reported stored (chains)
        self._reached: set[int] = set()
        self._hot: list[int] = []
        self._hot_at = 0.0
        self._ever_hot: set[int] = set()  # for the diagnosis of a block gone from S3

    def key(self, i: int) -> BlockKey:
        """The key of block ``i`` of this soak (distinct per seed)."""
        raw = hashlib.blake2b(f"{self._seed}:{i}".encode(), digest_size=16).digest()
        return BlockKey(raw)

    def keys(self, idx: Sequence[int]) -> list[BlockKey]:
        """The keys of blocks ``idx``."""
        return [self.key(i) for i in idx]

    def allocate(self, n: int) -> list[int]:
        """``n`` new block indices, recorded as put from now on."""
        with self._lock:
            idx = list(range(self._next, self._next + n))
            self._next += n
            now = time.monotonic()
            self._put_at.update((i, now) for i in idx)
        return idx

    def stored(self, idx: Sequence[int], ok: Sequence[bool]) -> None:
        """A put of ``idx`` answered ``ok``."""
        done = [i for i, good in zip(idx, ok, strict=True) if good]
        with self._lock:
            self._stored.extend(done)
            if len(done) == len(idx):
                self._runs.append(tuple(idx))

    def pick(self, rng: random.Random, n: int, hot: float, period: float) -> list[int]:
        """Up to ``n`` stored blocks: from the hot set with odds ``hot``, else any."""
        with self._lock:
            if not self._stored:
                return []
            if time.monotonic() - self._hot_at > period:  # cool the old set, heat a new one
                self._hot = rng.sample(self._stored, min(_HOT_KEYS, len(self._stored)))
                self._hot_at = time.monotonic()
                self._ever_hot.update(self._hot)
            pool = self._hot if rng.random() < hot else self._stored
            return rng.sample(pool, min(n, len(pool)))

    def pick_run(self, rng: random.Random) -> list[int]:
        """The blocks of one whole put (a chain, as a prompt's chunks are)."""
        with self._lock:
            return list(rng.choice(self._runs)) if self._runs else []

    def unconfirmed(self, limit: int | None = None, track_s: float | None = _TRACK_S) -> list[int]:
        """Put blocks not yet seen in the bucket (put within ``track_s``), oldest first."""
        now = time.monotonic()
        with self._lock:
            idx = [
                i
                for i, at in self._put_at.items()
                if i not in self._reached and (track_s is None or now - at < track_s)
            ]
        return idx[:limit]

    def confirm(self, idx: Sequence[int]) -> None:
        """Blocks ``idx`` were seen in the bucket."""
        with self._lock:
            self._reached.update(idx)

    def reached(self) -> list[int]:
        """Every block seen in the bucket."""
        with self._lock:
            return sorted(self._reached)

    def was_hot(self, i: int) -> bool:
        """Whether block ``i`` was ever in the hot set (replicas were likely made)."""
        with self._lock:
            return i in self._ever_hot

    def attempted_count(self) -> int:
        """Blocks a put was tried for."""
        with self._lock:
            return len(self._put_at)

    def stored_count(self) -> int:
        """Blocks a put reported stored."""
        with self._lock:
            return len(self._stored)


def check(tally: Tally, where: str, key: BlockKey, got: torch.Tensor) -> None:
    """Count the bytes of ``got`` (block ``key``, returned as found) that are wrong."""
    wrong = _diff(got, block_for(key))
    if wrong:
        tally.add(f"wrong_bytes.{where.split(':')[0]}", wrong)
        tally.sample("wrong", f"{where} key {bytes(key).hex()}: {wrong} bytes differ")


class Workload:
    """Operations from ``config.workers`` threads, each with its own seeded generator."""

    def __init__(
        self, cluster: SoakCluster, config: SoakConfig, ledger: Ledger, tally: Tally
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.ledger = ledger
        self.tally = tally
        ops: dict[str, Callable[[random.Random], None]] = {
            "put": self._put,
            "node_get": self._node_get,
            "member_get": self._member_get,
            "member_prefetch": self._member_prefetch,
            "lookup": self._lookup,
        }
        chosen = [(n, w) for n, w in OPS if cluster.members or not n.startswith("member")]
        self._ops = [ops[n] for n, _ in chosen]
        self._names = [n for n, _ in chosen]
        self._weights = [w for _, w in chosen]

    def threads(self, stop: threading.Event) -> list[threading.Thread]:
        """The worker threads (not started)."""
        return [
            threading.Thread(
                target=self._loop,
                args=(stop, random.Random(f"{self.config.seed}:worker:{n}")),
                name=f"chaos-worker-{n}",
            )
            for n in range(self.config.workers)
        ]

    def _loop(self, stop: threading.Event, rng: random.Random) -> None:
        while not stop.is_set():
            (i,) = rng.choices(range(len(self._ops)), self._weights)
            name = self._names[i]
            try:
                self._ops[i](rng)
            except KVStoreError as exc:  # a node or Redis down, S3 failing: allowed
                self.tally.add(f"errors.{name}")
                self.tally.sample(f"errors.{name}", f"{type(exc).__name__}: {exc}"[:300])
            except Exception as exc:  # anything else is a bug in what the soak drives
                self.tally.add(f"unexpected.{name}")
                self.tally.sample("unexpected", f"{name}: {type(exc).__name__}: {exc}"[:300])
            self.tally.add(f"ops.{name}")

    def _pick(self, rng: random.Random, n: int) -> list[int]:
        return self.ledger.pick(rng, n, self.config.hot_fraction, self.config.hot_period_s)

    def _put(self, rng: random.Random) -> None:
        """New blocks through a random node (whether it is up or not)."""
        node = rng.choice(self.cluster.names)
        idx = self.ledger.allocate(rng.randint(1, 4))
        keys = self.ledger.keys(idx)
        client = self.cluster.client(node)
        client.note_tokens(chunk_tokens(keys, idx[0], LAYOUT.block_tokens))  # for its events
        ok = client.put(keys, [block_for(k) for k in keys])
        self.ledger.stored(idx, ok)
        self.tally.add("misses.put", ok.count(False))

    def _node_get(self, rng: random.Random) -> None:
        """Stored blocks (hot ones often) through a random node."""
        node = rng.choice(self.cluster.names)
        keys = self.ledger.keys(self._pick(rng, rng.randint(1, 4)))
        if not keys:
            return
        outs = [_sentinel(LAYOUT.block_shape) for _ in keys]
        ok = self.cluster.client(node).get(keys, outs)
        for key, out, found in zip(keys, outs, ok, strict=True):
            if found:
                check(self.tally, f"node_get:{node}", key, out)
        self.tally.add("misses.node_get", ok.count(False))

    def _member_get(self, rng: random.Random) -> None:
        """A whole put (a chain) through a member: ``get`` (all or a miss) or the prefix
        it can load (``get_prefix``)."""
        store = rng.choice(self.cluster.members)
        keys = self.ledger.keys(self.ledger.pick_run(rng))
        if not keys:
            return
        out = _sentinel(LAYOUT.tensor_shape(len(keys)))
        if rng.random() < 0.5:
            n = store.get_prefix(keys, out)
        else:
            try:
                store.get(keys, out)
                n = len(keys)
            except BlockNotFoundError:  # a block is missing: the get loads nothing
                n = 0
        self._check_prefix("member_get", keys, out, n)

    def _member_prefetch(self, rng: random.Random) -> None:
        """A chain prefetched layer by layer through a member."""
        store = rng.choice(self.cluster.members)
        keys = self.ledger.keys(self.ledger.pick_run(rng))
        if not keys:
            return
        handle = store.prefetch(keys, _sentinel(LAYOUT.tensor_shape(len(keys))))
        n = handle.result()
        handle.wait(30.0)  # the copy in flight ends before the buffer is read or dropped
        assert handle.out is not None
        self._check_prefix("member_prefetch", keys, handle.out, n)

    def _check_prefix(self, op: str, keys: list[BlockKey], out: torch.Tensor, n: int) -> None:
        if not 0 <= n <= len(keys):
            self.tally.add(f"unexpected.{op}")
            self.tally.sample("unexpected", f"{op}: a prefix of {n} of {len(keys)} blocks")
            return
        step = LAYOUT.block_tokens
        for i in range(n):
            check(self.tally, op, keys[i], out[:, :, i * step : (i + 1) * step])
        self.tally.add(f"misses.{op}", len(keys) - n)

    def _lookup(self, rng: random.Random) -> None:
        """A lookup of a chain through a node or a member: only its range is checked."""
        keys = self.ledger.keys(self.ledger.pick_run(rng))
        if not keys:
            return
        if self.cluster.members and rng.random() < 0.5:
            n = rng.choice(self.cluster.members).lookup(keys)
        else:
            n = self.cluster.client(rng.choice(self.cluster.names)).lookup(keys)
        if not 0 <= n <= len(keys):
            self.tally.add("unexpected.lookup")
            self.tally.sample("unexpected", f"lookup: {n} of {len(keys)} blocks")


class Tracker:
    """Asks the bucket directly which put blocks arrived; sums the nodes' counters."""

    def __init__(self, cluster: SoakCluster, ledger: Ledger, tally: Tally) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.tally = tally
        self._last: dict[str, dict[str, int]] = {}

    def run(self, stop: threading.Event, every: float = 0.5) -> None:
        """Until ``stop``: probe every ``every`` seconds, sample counters every 4th time."""
        beat = 0
        while not stop.wait(every):
            self.probe(limit=512)
            if beat % 4 == 0:
                self.sample_counters()
            beat += 1
        self.sample_counters()

    def probe(self, limit: int | None, track_s: float | None = _TRACK_S) -> None:
        """Mark the blocks the bucket holds now (up to ``limit`` of those not seen yet)."""
        idx = self.ledger.unconfirmed(limit, track_s)
        if not idx:
            return
        try:
            found = self.cluster.on_s3(self.ledger.keys(idx))
        except KVStoreError as exc:  # the direct endpoint never fails; if it does, say so
            self.tally.sample("probe", f"{type(exc).__name__}: {exc}"[:300])
            return
        self.ledger.confirm([i for i, ok in zip(idx, found, strict=True) if ok])

    def sample_counters(self) -> None:
        """Add what each live node's counters grew by (a restart starts them at 0)."""
        for name in self.cluster.running():
            try:
                now = self.cluster.node_counters(name)
            except KVStoreError:
                continue
            last = self._last.get(name, {})
            for counter in _NODE_COUNTERS:
                value = now.get(counter, 0)
                before = last.get(counter, 0)
                self.tally.add(f"node.{counter}", value - before if value >= before else value)
            self._last[name] = now


@dataclass(frozen=True)
class Outcome:
    """The end of a soak: blocks seen in the bucket, gone from it, unreadable."""

    reached: int
    deleted: int
    lost: int


def final_check(cluster: SoakCluster, ledger: Ledger, tally: Tally) -> Outcome:
    """After the faults: which blocks reached S3, which left it, which no node can read."""
    tracker = Tracker(cluster, ledger, tally)
    tracker.probe(limit=None, track_s=None)  # whatever arrived late counts too
    tracker.sample_counters()
    reached = ledger.reached()
    keys = ledger.keys(reached)
    present = cluster.on_s3(keys, confirm=3)
    gone = [i for i, ok in zip(reached, present, strict=True) if not ok]
    lost = set(unreadable(cluster, keys, tally))
    for i in gone:
        # Whether the block was hot (so replicas of it were made and dropped) and
        # whether it is lost too point at the code path that deleted it.
        hot = "hot" if ledger.was_hot(i) else "never hot"
        key = ledger.key(i)
        tally.add(f"diagnosis.deleted_{hot.replace(' ', '_')}")
        tally.sample(
            "deleted_from_s3", f"{bytes(key).hex()} ({hot}{', lost' if key in lost else ''})"
        )
    if lost:  # still in the bucket after the reads? (a read that deletes it: no)
        after = cluster.on_s3(list(lost), confirm=3)
        tally.add("diagnosis.lost_gone_from_s3_while_read", after.count(False))
    for key in lost:
        tally.sample("lost", bytes(key).hex())
        _trace_lost(cluster, key, tally)
    return Outcome(reached=len(reached), deleted=len(gone), lost=len(lost))


def _trace_lost(cluster: SoakCluster, key: BlockKey, tally: Tally) -> None:
    """What each node's log said about a lost block (the next one to chase it starts
    from there): the last lines naming its key, and the node's S3 tier counters."""
    name = bytes(key).hex()
    for node, proc in cluster.procs.items():
        lines = [ln for ln in proc.log_tail(1 << 22).splitlines() if name in ln]
        tally.sample("lost_trace", f"{node}: {len(lines)} log lines; last: {lines[-3:]}"[:1000])
        try:
            stores = cluster.client(node).server_stats()["stores"]
        except KVStoreError as exc:
            tally.sample("lost_trace", f"{node}: no stats ({exc})"[:300])
            continue
        s3 = [t for st in stores for t in st.get("tiers", []) if t.get("kind") == "s3"]
        tally.sample("lost_trace", f"{node}: s3 tier {s3}"[:1000])


def unreadable(cluster: SoakCluster, keys: list[BlockKey], tally: Tally) -> list[BlockKey]:
    """The ``keys`` no node returns: each node in turn gets the rest in batches, then one
    by one (a node looks a batch up only to its first unknown key). Every block returned
    is checked as in the workload."""
    names = cluster.names
    with ThreadPoolExecutor(len(names)) as pool:  # first pass: a share per node, at once
        shares = [keys[i :: len(names)] for i in range(len(names))]
        parts = pool.map(
            lambda i: _read_through(cluster, names[i], shares[i], 64, tally), range(len(names))
        )
        rest = [key for part in parts for key in part]
    for batch in (64, 1, 1):  # the last pass confirms (a read may time out under load)
        for name in names:
            rest = _read_through(cluster, name, rest, batch, tally)
    return rest


def _read_through(
    cluster: SoakCluster, name: str, keys: list[BlockKey], batch: int, tally: Tally
) -> list[BlockKey]:
    """Read ``keys`` through node ``name``; the ones it did not return."""
    client = cluster.client(name)
    missed: list[BlockKey] = []
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        outs = [_sentinel(LAYOUT.block_shape) for _ in part]
        try:
            ok = client.get(part, outs)
        except KVStoreError as exc:
            tally.sample("final_errors", f"{name}: {type(exc).__name__}: {exc}"[:300])
            ok = [False] * len(part)
        for key, out, found in zip(part, outs, ok, strict=True):
            if found:
                check(tally, f"final:{name}", key, out)
            else:
                missed.append(key)
    return missed
