"""KVStore: the public entry point.

>>> layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=256)
>>> with KVStore(layout) as store:                      # embedded default config
...     keys = store.hash_tokens(token_ids, namespace="llama-3-8b@rev")
...     n = store.lookup(keys)                          # leading chunks stored
...     store.put(keys, kv)                             # kv: layout.tensor_shape(len(keys))
...     out = store.get(keys[:n])                       # tensor_shape(n); less past a bad block

Every argument is checked before anything changes: bad input raises an
:class:`~kvstore.errors.InvalidInputError` (or a subclass) and leaves the
store as it was. A failing tier shows up as a miss, never as wrong data.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.config import StoreConfig
from kvstore.datapath import (
    BlockManager,
    DataPath,
    Engine,
    EngineSide,
    Hinting,
    Loan,
    PendingPut,
    Pin,
    PrefetchHandle,
)
from kvstore.errors import ClosedError, InvalidInputError
from kvstore.hints import Hint, HintAnswer, checked_hint
from kvstore.keys import (
    BlockKey,
    ChunkTokens,
    Namespace,
    chain_keys,
    check_keys,
    engine_keys,
    tokens_to_bytes,
)
from kvstore.layout import KVLayout
from kvstore.restore import LoadSample, PlannedLoad, RestorePlan, Restoring, restore_request
from kvstore.runtime import close_at_exit, cuda_available, forget, trim_heap, warn_renamed
from kvstore.tiers import open_tiers
from kvstore.tiers.base import Tier

if TYPE_CHECKING:
    from kvstore.events import EventPublisher, StoreEventsOwner

__all__ = ["KVStore"]

ConfigSource = StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None


class KVStore:
    """A tiered, content-addressed store of KV-cache blocks for one layout.

    Args:
        layout: the KV geometry every block of this store has.
        config: a :class:`StoreConfig`, a config dict, a YAML path, or None
            for ``$KVSTORE_CONFIG`` / the embedded default (one host tier).
        tiers: ready-made :class:`~kvstore.tiers.base.Tier` objects, fastest
            first, used instead of building the config's tiers (custom media,
            fault injection). The store closes them on :meth:`close`.
        clock: seconds, for leases and heat decay (replays and tests inject one).
        events: a KV-event publisher to share (a server's, for all its stores);
            None: the store opens its own when the config's ``events`` says so.

    Thread-safe: any number of threads may call any method at once.
    """

    def __init__(
        self,
        layout: KVLayout,
        config: ConfigSource = None,
        *,
        tiers: Sequence[Tier] | None = None,
        clock: Callable[[], float] = time.monotonic,
        events: EventPublisher | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidInputError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.config = StoreConfig.load(config)
        opened = open_tiers(layout, self.config, tiers)
        try:
            self._manager = BlockManager(layout, opened.tiers, self.config, clock)
        except BaseException:
            for tier in opened.tiers:
                tier.close()
            raise
        # The restorer and the hint service, through their protocols: what the store asks
        # of them (the manager builds both over its own pieces).
        self._restorer: Restoring = self._manager.restorer
        self._hints: Hinting = self._manager.hinter
        if opened.encrypted and self.config.encryption.reencrypt:
            self._manager.reencrypt()  # blocks under older keys: rewritten in the background
        self._namespaces: dict[str, Namespace] = {}
        self._events: StoreEventsOwner | None = None
        if self.config.events.enabled or events is not None:
            try:
                self._events = _open_events(self._manager, self.config, events)
            except BaseException:
                self._manager.close()
                raise
        self._engine: EngineSide = Engine(self._manager, self._restorer, self._note_event_tokens)
        close_at_exit(self)  # a store left open is flushed when the process exits

    # -- keys ---------------------------------------------------------------
    def namespace(self, model: str, **extra: Any) -> Namespace:
        """A :class:`Namespace` for ``model`` in this store's layout.

        ``extra`` may set ``tp_rank``, ``tp_size``, ``adapter`` and ``salt``.
        """
        return Namespace(model=model, layout=self.layout, **extra)

    def _resolve_namespace(self, namespace: str | Namespace) -> Namespace:
        if isinstance(namespace, Namespace):
            namespace.check_layout(self.layout)
            return namespace
        if isinstance(namespace, str):
            ns = self._namespaces.get(namespace)
            if ns is None:
                ns = self._namespaces.setdefault(namespace, self.namespace(namespace))
            return ns
        raise InvalidInputError(
            f"namespace must be a model id string or a Namespace, got {type(namespace).__name__}"
        )

    def hash_tokens(
        self,
        token_ids: Any,
        namespace: str | Namespace,
        parent: bytes | None = None,
    ) -> list[BlockKey]:
        """One key per *full* chunk of ``token_ids`` (a trailing partial chunk gets none).

        ``token_ids``: a list, numpy array or 1-D tensor of ints. ``namespace``:
        a model id (``"llama-3-8b@rev"``) or a :class:`Namespace`. ``parent``:
        the key of the chunk just before ``token_ids``, to continue a chain
        (e.g. a new turn appended to a conversation already hashed).
        """
        ns = self._resolve_namespace(namespace)
        if parent is not None:
            parent = check_keys([parent], "parent")[0]
        full = None
        if isinstance(token_ids, (list, tuple)):
            # Convert only the full chunks; the tail is checked, not converted.
            full = len(token_ids) - len(token_ids) % self.layout.block_tokens
        data = tokens_to_bytes(token_ids, limit=full)
        return chain_keys(data, self.layout.block_tokens, ns.seed if parent is None else parent)

    def engine_keys(self, hashes: Iterable[Any], namespace: str | Namespace) -> list[BlockKey]:
        """Keys for an engine's own block hashes (bytes, str or int), namespaced."""
        return engine_keys(hashes, self._resolve_namespace(namespace))

    # -- blocks -------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey], *, recheck: bool = False) -> int:
        """Number of leading ``keys`` stored: the prefix hit, in chunks.

        ``recheck=True`` confirms blocks that only shared tiers hold (a disk
        directory, Redis, S3) with those tiers before counting them: another
        process may have evicted them. A scheduler that only looks up, while
        workers write and evict, wants this; it costs an existence check per
        such block.
        """
        return self._manager.lookup(check_keys(keys), recheck=recheck)

    def put(
        self,
        keys: Sequence[BlockKey],
        kv: torch.Tensor,
        *,
        tokens: Any = None,
        parent: BlockKey | None = None,
        donate: bool = False,
    ) -> int:
        """Store the KV of ``len(keys)`` chunks; ``kv`` has ``layout.tensor_shape(len(keys))``.

        Returns how many of ``keys`` are stored afterwards (keys already
        stored count, and are not rewritten). Fewer means the tiers had no
        room that could be freed (every block pinned).

        ``tokens`` (optional): the token ids of exactly these chunks, and
        ``parent`` the key of the chunk before ``keys[0]`` (None: the prompt's
        first chunk), so that KV events (docs/events.md) carry them: routers
        such as Dynamo's and llm-d's index prompts by their tokens. For the
        suffix after a hit of ``n`` chunks: ``put(keys[n:], kv, tokens=
        token_ids[n * bt : len(keys) * bt], parent=keys[n - 1] if n else None)``.

        From a CUDA tensor, with ``saves.mode: async`` (the default), the save
        runs in the background (:mod:`kvstore.datapath.saves`): ``kv`` is snapshotted on
        the caller's stream into a GPU staging ring and the call returns in
        microseconds with ``len(keys)``; the blocks become visible when their
        copies land (``drain()`` waits; a block that finds no room is counted
        in ``blocks_not_stored``). The caller may reuse ``kv`` at once; with
        ``donate=True`` it promises never to touch ``kv`` again, and no
        snapshot is taken (the store holds the tensor until its copies land).
        """
        checked = check_keys(keys)
        self.layout.check_tensor(kv, len(checked))
        if tokens is not None:
            self._engine.note_tokens(
                ChunkTokens.of(checked, tokens, parent, self.layout.block_tokens)
            )
        elif parent is not None:
            raise InvalidInputError("parent: given without tokens")
        if kv.is_cuda and self.config.saves.mode == "async":
            return self._manager.save(checked, kv, donate)
        return self._manager.put(checked, self._chunks(kv, len(checked)))

    def get(
        self,
        keys: Sequence[BlockKey],
        out: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The KV of ``keys``: a new tensor of ``layout.tensor_shape(m)`` on ``device``
        (default: the CPU, pinned where CUDA exists, so its ``.cuda()`` runs at link
        speed). ``m`` is ``len(keys)`` unless a block fails to load (damaged or gone:
        then forgotten and counted in ``copies_lost``; or its tier is down): the result
        ends before it (``m = layout.tokens_to_blocks(result.shape[2])``), a miss.

        With ``out`` (cpu or cuda): fills and returns it, all or nothing (a buffer
        cannot shrink; :meth:`get_prefix` fills what loads and says how much). Raises
        :class:`~kvstore.errors.BlockNotFoundError` for a key not stored when the call
        starts, and with ``out`` for a block that fails to load.
        """
        checked = check_keys(keys)
        if out is not None and device is not None:
            raise InvalidInputError("get: give out or device, not both")
        target = self._target(out, len(checked), device)
        n = self._manager.get(checked, self._chunks(target, len(checked)), partial=out is None)
        if n == len(checked):
            return target
        # Copy out what loaded: a view would keep the failed block's bytes reachable.
        loaded = self._target(None, n, device)
        return loaded.copy_(target[:, :, : n * self.layout.block_tokens])

    def get_prefix(
        self,
        keys: Sequence[BlockKey],
        out: torch.Tensor,
        *,
        prompt_tokens: int | None = None,
        plan: bool = True,
    ) -> int:
        """Load the leading stored chunks of ``keys`` worth loading into ``out``; return
        how many.

        That is the longest stored prefix, or with restore planning on (the default)
        and a known prefill speed, the part of it that :meth:`plan` expects to load
        faster than it recomputes (for a prompt of ``prompt_tokens``); ``plan=False``
        loads the longest stored prefix whatever it costs (a caller that planned).
        Never raises for a miss: a block that is absent or fails verification ends
        the prefix. ``out`` past the returned prefix is unspecified.
        """
        checked = check_keys(keys)
        target = self._target(out, len(checked))
        chunks = self._chunks(target, len(checked))
        if not plan:
            return self._manager.get(checked, chunks, prefix=True)
        restore = self.plan(checked, prompt_tokens=prompt_tokens)
        if restore.load == 0:
            return 0
        mark = self._restorer.load_started()
        n = self._manager.get(checked[: restore.load], chunks[: restore.load], prefix=True)
        if n == restore.load:  # planned against actual load seconds, in all and per tier
            self._restorer.loaded(restore, mark)
        return n

    # -- restore planning ----------------------------------------------------
    def plan(
        self,
        keys: Sequence[BlockKey],
        *,
        prompt_tokens: int | None = None,
        computed_tokens: int = 0,
        overlap: bool = False,
        chunk_tokens: int | None = None,
    ) -> RestorePlan:
        """How many leading chunks of ``keys`` are worth loading, and what that costs.

        Weighs each stored chunk's tier at its live read speed against the engine's
        prefill speed (``restore.prefill_table`` / ``prefill_tokens_per_s``, or
        learned: ``engine.note_prefill_step``) for a prompt of ``prompt_tokens`` whose
        first ``computed_tokens`` the engine already holds; ``overlap``: the load runs
        layer by layer under compute; ``chunk_tokens``: the tokens a block holds where
        the layout does not say (an engine's opaque pages). Chunks it leaves on slow
        tiers are copied up in the background (``restore.warm``). See
        :mod:`kvstore.restore`.
        """
        checked = check_keys(keys)
        request = restore_request(prompt_tokens, computed_tokens, overlap, chunk_tokens)
        return self._restorer.plan(checked, request)

    # -- session hints -------------------------------------------------------
    def hint(
        self,
        keys: Sequence[BlockKey] | None = None,
        *,
        session: str | None = None,
        retain_s: float | None = None,
        priority: int = 0,
        prefetch: bool = False,
        demote: bool = False,
    ) -> HintAnswer:
        """Tell the store what a session's next turn needs (see :mod:`kvstore.hints`).

        ``keys`` (or, alone, ``session``: the keys of that session's last hint):
        ``retain_s`` keeps their blocks that long, eviction in every tier taking
        them last (lowest ``priority``, 0-100, first); ``demote`` copies them down to
        the first persistent tier and frees their room in memory (the session went
        idle); ``prefetch`` copies them into the fastest tier in the background (its
        next turn is near). Returns the answer: accepted, clipped or rejected, and
        why. Malformed arguments raise :class:`InvalidInputError`, changing nothing.
        """
        checked = check_keys(keys) if keys is not None else None
        hint = checked_hint(
            checked is not None, session, Hint(retain_s, priority, prefetch, demote)
        )
        return self._hints.apply(checked, session, hint)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys`` from every tier; return how many were stored."""
        return self._manager.delete(check_keys(keys))

    def evict(self, n: int, tier: int = 0) -> list[BlockKey]:
        """Evict exactly ``n`` unpinned blocks from tier ``tier`` (demoting them), or none."""
        if not isinstance(n, int) or n < 0:
            raise InvalidInputError(f"n must be an int >= 0, got {n!r}")
        count = len(self._manager.tiers)
        if not isinstance(tier, int) or not 0 <= tier < count:
            raise InvalidInputError(f"tier must be in [0, {count}), got {tier!r}")
        return self._manager.evict(tier, n)

    # -- layer by layer, in the background -----------------------------------
    def prefetch(
        self,
        keys: Sequence[BlockKey],
        out: torch.Tensor | None = None,
        *,
        order: str = "layer",
        layers_per_step: int | None = None,
    ) -> PrefetchHandle:
        """Start loading the stored prefix of ``keys`` into ``out`` in the background.

        ``out`` (cpu or cuda; a new CPU tensor if None) has
        ``layout.tensor_shape(len(keys))`` and is ``handle.out``. With
        ``order="layer"`` every block's layer ``i`` arrives before any layer
        ``i+1`` (``handle.wait_layer(i)``); with ``order="block"`` whole
        blocks arrive in order (``handle.blocks_ready``). ``handle.result()``
        applies the configured policy (best_effort, wait_complete, timeout).
        """
        if order not in ("layer", "block"):
            raise InvalidInputError(f"order must be 'layer' or 'block', got {order!r}")
        step = (
            layers_per_step if layers_per_step is not None else self.config.prefetch.layers_per_step
        )
        if order == "block":
            step = max(1, step)
        if not isinstance(step, int) or step < 1:
            raise InvalidInputError(f"layers_per_step must be an int >= 1, got {step!r}")
        checked = check_keys(keys)
        target = self._target(out, len(checked))
        handle = self._manager.prefetch(checked, self._chunks(target, len(checked)), order, step)
        handle.out = target
        return handle

    def put_layer(
        self, keys: Sequence[BlockKey], layer: int, kv_layer: torch.Tensor, *, donate: bool = False
    ) -> int:
        """Store layer ``layer`` of ``len(keys)`` blocks, as prefill produces it.

        ``kv_layer`` has shape ``(kv_factor, n * block_tokens, num_kv_heads,
        head_dim)``. A block becomes visible to :meth:`lookup` when all its
        layers have arrived; returns how many blocks this call completed.
        Keys already stored are skipped. An unfinished block is dropped
        after ``lease_s`` without a new layer. From a CUDA tensor the save runs
        in the background, as for :meth:`put` (the call returns ``len(keys)``
        queued at once; blocks become visible when their last layer lands;
        ``donate`` as for :meth:`put`).
        """
        checked = check_keys(keys)
        layout = self.layout
        if not isinstance(layer, int) or not 0 <= layer < layout.num_layers:
            raise InvalidInputError(f"layer must be in [0, {layout.num_layers}), got {layer!r}")
        layout.check_layer(kv_layer, len(checked))
        if kv_layer.is_cuda and self.config.saves.mode == "async":
            return self._manager.save_layer(checked, layer, kv_layer, donate)
        srcs = _blocks_of(kv_layer, 1, len(checked), layout.block_tokens)
        return self._manager.write_layer(checked, layer, srcs)

    def abort_layers(self, keys: Sequence[BlockKey]) -> int:
        """Give up the unfinished layerwise writes of ``keys`` (e.g. after a failed
        step) so their room is freed now rather than when they expire."""
        return self._manager.abort_layers(check_keys(keys))

    def stored_keys(self, *, rescan: bool = False) -> list[BlockKey]:
        """The keys stored. ``rescan=True`` first lists the persistent tiers again,
        to include what other processes stored since this store opened."""
        if rescan:
            self._manager.rescan()
        return self._manager.stored_keys()

    def clear(self) -> int:
        """Delete every block of this layout from every tier (including blocks other
        processes stored in shared ones); return how many were deleted."""
        deleted = self._manager.delete(self.stored_keys(rescan=True))
        if self._events is not None:
            self._events.cleared()
        return deleted

    def pin(self, keys: Sequence[BlockKey], lease_s: float | None = None) -> Pin:
        """Pin the stored prefix of ``keys`` against eviction and deletion.

        The pin is a lease: it ends on ``release()`` or after ``lease_s``
        seconds (``config.lease_s`` by default), so a forgotten pin cannot hold
        memory forever. Use it as a context manager.
        """
        if lease_s is not None and (not isinstance(lease_s, (int, float)) or lease_s <= 0):
            raise InvalidInputError(f"lease_s must be > 0, got {lease_s!r}")
        return self._manager.hold(check_keys(keys), lease_s)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until background saves from GPU tensors land and background moves
        (write-through, promotion, eviction) finish; False on timeout."""
        return self._manager.drain(timeout)

    def _note_event_tokens(self, tokens: ChunkTokens) -> None:
        if self._events is not None:  # None after close: the book is gone
            self._events.note(tokens)

    def _chunks(self, kv: torch.Tensor, n: int) -> list[torch.Tensor]:
        return _blocks_of(kv, 2, n, self.layout.block_tokens)

    def _target(
        self, out: torch.Tensor | None, n: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        if out is not None:
            return self.layout.check_tensor(out, n, what="out")
        shape, dtype = self.layout.tensor_shape(n), self.layout.dtype
        if device is not None:
            try:
                where = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise InvalidInputError(f"device: {exc}") from None
            if where.type not in ("cpu", "cuda"):
                raise InvalidInputError(f"device: use cpu or cuda, got {where}")
            if where.type == "cuda":
                return torch.empty(shape, dtype=dtype, device=where)
        # Pinned where CUDA exists: torch caches pinned blocks, and a .cuda() of a
        # pageable result runs at a tenth of the link (it stages through a bounce buffer).
        return torch.empty(shape, dtype=dtype, pin_memory=cuda_available())

    # -- state --------------------------------------------------------------
    @property
    def engine(self) -> EngineSide:
        """This store's engine side (:class:`~kvstore.datapath.contracts.EngineSide`):
        what the connectors, the server, a cluster node and the CLI ask of it beyond the
        public face (the data path, restore feedback, KV-event tokens, loans, in-place
        puts, re-encryption)."""
        return self._engine

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier usage as a JSON-friendly dict."""
        counters, tiers = self._manager.report()
        lookups = counters["lookup_blocks_hit"] + counters["lookup_blocks_missed"]
        write_s, read_s = counters["write_seconds"], counters["read_seconds"]
        return {
            "layout": self.layout.describe(),
            "block_nbytes": self.layout.block_nbytes,
            "blocks": len(self._manager),
            "lookup_hit_rate": counters["lookup_blocks_hit"] / lookups if lookups else 0.0,
            "write_gbps": counters["bytes_written"] / write_s / 1e9 if write_s else 0.0,
            "read_gbps": counters["bytes_read"] / read_s / 1e9 if read_s else 0.0,
            **counters,
            "tiers": tiers,
            "restore": self._restorer.snapshot(),
            "hints": self._hints.snapshot(),
            **({"events": self._events.source.stats()} if self._events is not None else {}),
        }

    def flush(self, keys: Sequence[BlockKey] | None = None) -> int:
        """Copy blocks that only memory tiers hold into the first persistent tier.

        Without ``keys``: every such block, after background saves and moves finish
        (:meth:`drain`); returns how many blocks were written. :meth:`close` flushes
        too. With ``keys``: those of ``keys`` now; returns how many of them a
        persistent tier holds afterwards.
        """
        if keys is None:
            return self._manager.flush()
        return sum(self._manager.persist(check_keys(keys)))

    def close(self) -> None:
        """Flush to persistent tiers, finish operations in flight, release every tier.

        Idempotent. A store still open when the interpreter exits is closed then.
        """
        forget(self)
        events, self._events = self._events, None
        try:
            if events is not None:
                events.close()
        finally:
            self._manager.close()
            trim_heap()  # what this store's threads freed goes back to the OS

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._manager.closed

    def __enter__(self) -> KVStore:
        if self.closed:
            raise ClosedError("the store is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = ",".join(t.kind for t in self._manager.tiers)
        layout = self.layout.fingerprint_hex
        return f"<KVStore tiers={kinds} blocks={len(self._manager)} layout={layout}>"

    # -- deprecated names, kept one release: each warns and does what it did --------
    def contains(self, key: BlockKey) -> bool:
        """Deprecated: ``lookup([key]) == 1``."""
        warn_renamed("KVStore.contains(key)", "KVStore.lookup([key]) == 1")
        return self._manager.contains(check_keys([key], "key")[0])

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Deprecated: :meth:`lookup` (a prefix) or ``engine.datapath.exists``."""
        warn_renamed("KVStore.exists", "KVStore.lookup or KVStore.engine.datapath.exists")
        return self._manager.exists(check_keys(keys))

    def persist(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Deprecated: :meth:`flush` with ``keys``."""
        warn_renamed("KVStore.persist(keys)", "KVStore.flush(keys)")
        return self._manager.persist(check_keys(keys))

    def warm(self, keys: Sequence[BlockKey]) -> int:
        """Deprecated: ``hint(keys, prefetch=True)``."""
        warn_renamed("KVStore.warm(keys)", "KVStore.hint(keys, prefetch=True)")
        checked = check_keys(keys)
        stored = [k for k, ok in zip(checked, self._manager.exists(checked), strict=True) if ok]
        return self._manager.copy_up(stored) if stored else 0

    @property
    def datapath(self) -> DataPath:
        """Deprecated: ``engine.datapath``."""
        warn_renamed("KVStore.datapath", "KVStore.engine.datapath")
        return self._engine.datapath

    def note_tokens(self, tokens: ChunkTokens) -> None:
        """Deprecated: ``engine.note_tokens``, or ``put(..., tokens=...)``."""
        warn_renamed("KVStore.note_tokens", "KVStore.engine.note_tokens")
        self._engine.note_tokens(tokens)

    def note_prefill_step(self, tokens: int, seconds: float) -> None:
        """Deprecated: ``engine.note_prefill_step``."""
        warn_renamed("KVStore.note_prefill_step", "KVStore.engine.note_prefill_step")
        self._engine.note_prefill_step(tokens, seconds)

    def waited(self, plan: RestorePlan, waited_s: float) -> None:
        """Deprecated: ``engine.waited``."""
        warn_renamed("KVStore.waited", "KVStore.engine.waited")
        self._engine.waited(plan, waited_s)

    def planned_load(self, plan: RestorePlan) -> PlannedLoad[str]:
        """Deprecated: ``engine.planned_load``."""
        warn_renamed("KVStore.planned_load", "KVStore.engine.planned_load")
        return self._engine.planned_load(plan)

    def observe_loads(self, loads: Mapping[str, LoadSample]) -> None:
        """Deprecated: ``engine.observe_loads``."""
        warn_renamed("KVStore.observe_loads", "KVStore.engine.observe_loads")
        self._engine.observe_loads(loads)

    def read_totals(self) -> dict[str, tuple[float, float, int]]:
        """Deprecated: ``engine.read_totals``."""
        warn_renamed("KVStore.read_totals", "KVStore.engine.read_totals")
        return self._engine.read_totals()

    def observe_reads(self, reads: Mapping[str, tuple[float, float, int]]) -> None:
        """Deprecated: ``engine.observe_reads``."""
        warn_renamed("KVStore.observe_reads", "KVStore.engine.observe_reads")
        self._engine.observe_reads(reads)

    def restore_speeds(self) -> dict[str, Any]:
        """Deprecated: ``engine.restore_speeds``."""
        warn_renamed("KVStore.restore_speeds", "KVStore.engine.restore_speeds")
        return self._engine.restore_speeds()

    def lend(self, keys: Sequence[BlockKey], lease_s: float | None = None) -> Loan:
        """Deprecated: ``engine.lend``."""
        warn_renamed("KVStore.lend", "KVStore.engine.lend")
        return self._engine.lend(keys, lease_s)

    def begin_put(self, keys: Sequence[BlockKey]) -> PendingPut:
        """Deprecated: ``engine.begin_put``."""
        warn_renamed("KVStore.begin_put", "KVStore.engine.begin_put")
        return self._engine.begin_put(keys)

    def reencrypt(self) -> int:
        """Deprecated: ``engine.reencrypt``."""
        warn_renamed("KVStore.reencrypt", "KVStore.engine.reencrypt")
        return self._engine.reencrypt()


def _open_events(
    manager: BlockManager, config: StoreConfig, publisher: EventPublisher | None
) -> StoreEventsOwner:
    """The store's KV events (imported only when used: they need pyzmq and msgspec)."""
    from kvstore.events import StoreEventsOwner

    return StoreEventsOwner(manager, config.events, publisher)


def _blocks_of(kv: torch.Tensor, dim: int, n: int, tokens: int) -> list[torch.Tensor]:
    """The views of ``n`` blocks of ``tokens`` along ``dim`` (``kv[..., i * t : (i + 1) * t]``):
    one unbind, made in C, rather than a slice per block in Python (a per-call cost of
    ``put_layer`` and ``prefetch``); slices where autograd tracks ``kv`` (it refuses
    in-place copies into the outputs of an unbind)."""
    if n == 0:
        return []
    if kv.requires_grad and torch.is_grad_enabled():
        return [kv.narrow(dim, i * tokens, tokens) for i in range(n)]
    shape = (*kv.shape[:dim], n, tokens, *kv.shape[dim + 1 :])
    return list(kv.view(shape).unbind(dim))
