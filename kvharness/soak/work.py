"""The operations of the memory soak (:mod:`kvharness.soak.run`), and what they check.

Every block's bytes follow from its key (:func:`block_bytes`), so each read is checked
without keeping the data: a block reported found must be byte-exact (``wrong_bytes``),
a miss is allowed (the tiers are full and evict all the time). :class:`Gate` lets the
sampler and the restarter stop every worker between two operations;
:class:`StoreWork` drives one :class:`~kvstore.KVStore` from threads, :class:`ClientWork`
one kvstore-server client from a thread, :func:`vanisher_main` is a client process the
soak kills in the middle of a transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence

import torch

from kvharness.chaos.events import chunk_tokens
from kvstore.client import Client, ClientOptions
from kvstore.errors import BlockNotFoundError, CapacityError, KVStoreError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.store import KVStore

__all__ = [
    "LAYOUT",
    "ClientWork",
    "Gate",
    "Keys",
    "StoreWork",
    "Tally",
    "block_bytes",
    "block_for",
    "vanisher_main",
    "wrong_bytes",
]

#: 32 KiB blocks: small tiers hold few of them, so every tier evicts and demotes often.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.bfloat16)
_FILL = 0xA5  # destinations start as this byte: a block reported found but never written shows
_RECENT = 4096  # chains remembered for reads (bounded: the soak's own memory stays flat)


def block_bytes(key: BlockKey, nbytes: int = LAYOUT.block_nbytes) -> torch.Tensor:
    """The ``nbytes`` bytes block ``key`` holds (uint8): a 64-byte digest of the key
    repeated, each repetition plus its index, so a block moved, shifted or mixed with
    another key's shows as wrong bytes."""
    digest = bytearray(hashlib.blake2b(bytes(key), digest_size=64).digest())
    pattern = torch.frombuffer(digest, dtype=torch.uint8)
    reps = nbytes // 64
    offsets = torch.arange(reps, dtype=torch.int32).remainder(256).to(torch.uint8)
    return pattern.repeat(reps) + offsets.repeat_interleave(64)


def block_for(key: BlockKey, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """Block ``key`` as a tensor of ``layout.block_shape``."""
    raw = block_bytes(key, layout.block_nbytes)
    return raw.view(layout.dtype).reshape(layout.block_shape)


def sentinel(shape: Sequence[int], layout: KVLayout = LAYOUT) -> torch.Tensor:
    """A destination of ``shape`` filled with 0xA5 bytes."""
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.full((numel * layout.dtype.itemsize,), _FILL, dtype=torch.uint8)
    return raw.view(layout.dtype).reshape(tuple(shape))


def wrong_bytes(key: BlockKey, got: torch.Tensor) -> int:
    """Bytes of ``got`` (block ``key``, returned as found) that differ from its bytes."""
    have = got.contiguous().view(torch.uint8).flatten()
    return int((have != block_bytes(key, have.numel())).sum())


class Tally:
    """Thread-safe counters, and a few example messages per topic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        if n:
            with self._lock:
                self.counts[name] += n

    def note(self, topic: str, text: str) -> None:
        """Keep ``text`` as one of the first few examples of ``topic``."""
        with self._lock:
            rows = self.examples.setdefault(topic, [])
            if len(rows) < 5:
                rows.append(text[:300])

    def snapshot(self) -> dict[str, object]:
        """Counters and examples, JSON-friendly."""
        with self._lock:
            return {"counts": dict(sorted(self.counts.items())), "examples": dict(self.examples)}


class Gate:
    """Workers pass one operation at a time; :meth:`closed` waits until none is inside
    and keeps them out (a sample, a store restart) until the block ends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closers = 0
        self._inside = 0

    @contextlib.contextmanager
    def passage(self) -> Iterator[None]:
        """One worker operation."""
        with self._cond:
            while self._closers:
                self._cond.wait()
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """No operation runs inside this block."""
        with self._cond:
            self._closers += 1
            while self._inside:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closers -= 1
                self._cond.notify_all()


class Keys:
    """The soak's keys: new chains on demand, a bounded memory of recent ones."""

    def __init__(self, seed: str) -> None:
        self._seed = seed
        self._lock = threading.Lock()
        self._next = 0
        self._recent: deque[list[BlockKey]] = deque(maxlen=_RECENT)

    def new(self, n: int) -> list[BlockKey]:
        """``n`` keys never used before (remembered once :meth:`stored`)."""
        with self._lock:
            first, self._next = self._next, self._next + n
        return [
            BlockKey(hashlib.blake2b(f"{self._seed}:{i}".encode(), digest_size=16).digest())
            for i in range(first, first + n)
        ]

    def stored(self, keys: list[BlockKey]) -> None:
        """Remember ``keys`` (a chain) for later reads."""
        with self._lock:
            self._recent.append(keys)

    def pick(self, rng: random.Random) -> list[BlockKey]:
        """A recent chain (recent ones more often), or [] before the first put."""
        with self._lock:
            if not self._recent:
                return []
            back = min(len(self._recent) - 1, int(rng.expovariate(1 / 64)))
            return list(self._recent[-1 - back])


Op = Callable[[random.Random], None]


def _run_ops(
    name: str,
    ops: dict[str, tuple[Op, float]],
    gate: Gate,
    stop: threading.Event,
    rng: random.Random,
    tally: Tally,
) -> None:
    """Until ``stop``: a random operation at a time, each through ``gate``; an exception
    is an error of the soak (counted with an example), never the end of the worker."""
    names = list(ops)
    weights = [w for _, w in ops.values()]
    while not stop.is_set():
        (op,) = rng.choices(names, weights)
        with gate.passage():
            if stop.is_set():
                break
            try:
                ops[op][0](rng)
            except Exception as exc:  # any failure is what the soak counts
                kind = "errors" if isinstance(exc, KVStoreError) else "unexpected"
                tally.add(f"{kind}.{name}.{op}")
                tally.note(f"{kind}.{name}.{op}", f"{type(exc).__name__}: {exc}")
        tally.add(f"ops.{name}.{op}")


class StoreWork:
    """Mixed operations on one embedded store (``self.store``, replaced on a restart)."""

    def __init__(self, store: KVStore, keys: Keys, tally: Tally) -> None:
        self.store = store
        self.keys = keys
        self.tally = tally
        self.ops: dict[str, tuple[Op, float]] = {
            "put": (self._put, 3.0),
            "get": (self._get, 3.0),
            "get_prefix": (self._get_prefix, 1.5),
            "prefetch": (self._prefetch, 1.5),
            "put_layer": (self._put_layer, 1.5),
            "hint": (self._hint, 0.7),
            "lease": (self._lease, 0.7),
            "lend": (self._lend, 0.7),
            "evict": (self._evict, 0.3),
            "lookup": (self._lookup, 1.0),
        }

    def run(self, gate: Gate, stop: threading.Event, rng: random.Random) -> None:
        """A worker thread's loop."""
        _run_ops("store", self.ops, gate, stop, rng, self.tally)

    def _check(self, op: str, keys: Sequence[BlockKey], out: torch.Tensor, n: int) -> None:
        step = LAYOUT.block_tokens
        for i in range(n):
            bad = wrong_bytes(keys[i], out[:, :, i * step : (i + 1) * step])
            if bad:
                self.tally.add("wrong_bytes", bad)
                self.tally.note("wrong_bytes", f"store {op} {bytes(keys[i]).hex()}: {bad}")
        self.tally.add(f"blocks_read.store.{op}", n)
        self.tally.add(f"misses.store.{op}", len(keys) - n)

    def _put(self, rng: random.Random) -> None:
        keys = self.keys.new(rng.randint(1, 4))
        kv = torch.cat([block_for(k) for k in keys], dim=2)
        if self.store.put(keys, kv) == len(keys):
            self.keys.stored(keys)

    def _get(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            out = sentinel(LAYOUT.tensor_shape(len(keys)))
            try:
                self.store.get(keys, out)
            except BlockNotFoundError:  # evicted from every tier: all or nothing
                self._check("get", keys, out, 0)
                return
            self._check("get", keys, out, len(keys))

    def _get_prefix(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            out = sentinel(LAYOUT.tensor_shape(len(keys)))
            self._check("get_prefix", keys, out, self.store.get_prefix(keys, out, plan=False))

    def _prefetch(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            handle = self.store.prefetch(keys, sentinel(LAYOUT.tensor_shape(len(keys))))
            n = handle.result()
            handle.wait(30.0)  # the copies in flight end before the buffer is read
            assert handle.out is not None
            self._check("prefetch", keys, handle.out, n)

    def _put_layer(self, rng: random.Random) -> None:
        """New blocks layer by layer; one time in four the writer stops half-way, and
        the unfinished blocks must expire after the store's lease."""
        keys = self.keys.new(rng.randint(1, 3))
        blocks = [block_for(k) for k in keys]
        abandon = rng.random() < 0.25
        last = rng.randrange(LAYOUT.num_layers - 1) if abandon else LAYOUT.num_layers - 1
        done = 0
        for layer in range(last + 1):
            done = self.store.put_layer(keys, layer, torch.cat([b[layer] for b in blocks], dim=1))
        if abandon:
            self.tally.add("layer_writes_abandoned")
        elif done == len(keys):
            self.keys.stored(keys)

    def _hint(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            kind = rng.choice(("retain", "demote", "prefetch"))
            self.store.hint(
                keys,
                retain_s=2.0 if kind == "retain" else None,
                demote=kind == "demote",
                prefetch=kind == "prefetch",
            )

    def _lease(self, rng: random.Random) -> None:
        """A pin never released: its lease must end by itself."""
        keys = self.keys.pick(rng)
        if keys:
            self.store.pin(keys, lease_s=0.5)

    def _lend(self, rng: random.Random) -> None:
        """A loan read in place and released, or forgotten (its lease ends it)."""
        keys = self.keys.pick(rng)
        if not keys:
            return
        loan = self.store.engine.lend(keys, lease_s=0.5)
        outs = [sentinel(LAYOUT.block_shape) for _ in keys]
        idx = [i for i, found in enumerate(loan.found) if found]
        for i, ok in zip(idx, loan.read_many(idx, [outs[i] for i in idx]), strict=True):
            if ok:
                self._check("lend", [keys[i]], outs[i], 1)
        if rng.random() < 0.5:
            loan.release()

    def _evict(self, rng: random.Random) -> None:
        tier = rng.randrange(len(self.store.engine.datapath.tiers))
        try:
            self.store.evict(rng.randint(1, 4), tier)
        except CapacityError:  # fewer unpinned blocks than asked (a tier just emptied)
            self.tally.add("evictions_refused")

    def _lookup(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys and not 0 <= self.store.lookup(keys) <= len(keys):
            self.tally.add("unexpected.store.lookup")


class ClientWork:
    """Mixed operations of one kvstore-server client (its own connections); a share
    ``tokens`` of its puts first tell the server their chunks' (made-up) tokens, so the
    server's KV events announce those chunks."""

    def __init__(
        self, options: ClientOptions, keys: Keys, tally: Tally, tokens: float = 0.0
    ) -> None:
        self.client = Client(LAYOUT, options)
        self.keys = keys
        self.tally = tally
        self.tokens = tokens
        self.ops: dict[str, tuple[Op, float]] = {
            "put": (self._put, 3.0),
            "get": (self._get, 3.0),
            "get_layers": (self._get_layers, 1.0),
            "lookup": (self._lookup, 1.0),
            "hint": (self._hint, 0.5),
            "delete": (self._delete, 0.3),
        }

    def run(self, gate: Gate, stop: threading.Event, rng: random.Random) -> None:
        """A client thread's loop; the client is closed when it ends."""
        try:
            _run_ops("client", self.ops, gate, stop, rng, self.tally)
        finally:
            # Copies out of shared memory that outlasted their loan (asked again): a
            # starved client; each would have been another block's bytes without it.
            self.tally.add("client.shm_late", self.client.stats["shm_late"])
            self.client.close()

    def _put(self, rng: random.Random) -> None:
        keys = self.keys.new(rng.randint(1, 8))
        if self.tokens and rng.random() < self.tokens:
            self.client.note_tokens(chunk_tokens(keys, rng.randrange(1 << 24), LAYOUT.block_tokens))
            self.tally.add("puts_with_tokens")
        ok = self.client.put(keys, [block_for(k) for k in keys])
        if all(ok):
            self.keys.stored(keys)
        self.tally.add("misses.client.put", ok.count(False))

    def _get(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            outs = [sentinel(LAYOUT.block_shape) for _ in keys]
            found = self.client.get(keys, outs)
            self._check("get", keys, outs, found)

    def _get_layers(self, rng: random.Random) -> None:
        """A layer range of each block (what a layerwise engine reads)."""
        keys = self.keys.pick(rng)
        if not keys:
            return
        first = rng.randrange(LAYOUT.num_layers)
        last = rng.randint(first + 1, LAYOUT.num_layers)
        shape = (last - first, *LAYOUT.block_shape[1:])
        outs = [sentinel(shape) for _ in keys]
        found = self.client.get(keys, outs, layers=(first, last))
        for key, out, ok in zip(keys, outs, found, strict=True):
            if ok:
                want = block_for(key)[first:last].contiguous().view(torch.uint8).flatten()
                bad = int((out.contiguous().view(torch.uint8).flatten() != want).sum())
                self._wrong("get_layers", key, bad)
        self.tally.add("blocks_read.client.get_layers", found.count(True))
        self.tally.add("misses.client.get_layers", found.count(False))

    def _check(
        self, op: str, keys: list[BlockKey], outs: list[torch.Tensor], found: list[bool]
    ) -> None:
        for key, out, ok in zip(keys, outs, found, strict=True):
            if ok:
                self._wrong(op, key, wrong_bytes(key, out))
        self.tally.add(f"blocks_read.client.{op}", found.count(True))
        self.tally.add(f"misses.client.{op}", found.count(False))

    def _wrong(self, op: str, key: BlockKey, bad: int) -> None:
        if bad:
            self.tally.add("wrong_bytes", bad)
            self.tally.note("wrong_bytes", f"client {op} {bytes(key).hex()}: {bad}")

    def _lookup(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys and not 0 <= self.client.lookup(keys) <= len(keys):
            self.tally.add("unexpected.client.lookup")

    def _hint(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            demote = rng.random() < 0.5
            self.client.hint(keys, retain_s=None if demote else 2.0, demote=demote)

    def _delete(self, rng: random.Random) -> None:
        keys = self.keys.pick(rng)
        if keys:
            self.client.delete(keys[-1:])


def vanisher_main(argv: Sequence[str] | None = None) -> None:
    """A client process the soak kills mid-transfer: ``ADDRESS SHM SEED``. It says
    ``ready`` on stdout once connected, then puts and gets large batches until killed."""
    address, shm, seed = argv if argv is not None else sys.argv[1:4]
    options = ClientOptions(address=address, shared_memory=shm == "1", retry_interval=0.05)
    client = Client(LAYOUT, options)
    keys = Keys(f"vanish:{seed}")
    rng = random.Random(seed)
    client.ping()
    print("ready", flush=True)
    while True:
        chain = keys.new(rng.randint(16, 48))
        client.put(chain, [block_for(k) for k in chain])
        client.get(chain, [sentinel(LAYOUT.block_shape) for _ in chain])
