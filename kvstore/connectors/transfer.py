"""Worker-side transfers: load planned chunks into an engine's paged cache, save new ones.

Engine-independent: a :class:`TransferWorker` takes :class:`~kvstore.connectors.plan.TransferSpec`
lists and a :class:`~kvstore.connectors.paged.PagedKV`, and talks to a
:class:`~kvstore.store.KVStore`. The vLLM connector calls it from its hooks, in
this order each step: :meth:`~TransferWorker.start_load` before the forward
pass; per attention layer :meth:`~TransferWorker.wait_layer` (before it runs)
and :meth:`~TransferWorker.save_layer` (after); then
:meth:`~TransferWorker.finish_load`, :meth:`~TransferWorker.finish_save` and
:meth:`~TransferWorker.take_load_errors` (under speculative decoding, before the
draft's layers run: their loaded KV is put in place then, ``LayerGroups.late``).

Two modes, same hooks:

- ``layerwise`` (default): loads are ``KVStore.prefetch`` handles that bring
  every block's layer ``i`` before layer ``i+1``, so layer ``i`` is scattered
  into the paged cache (``wait_layer``) while later layers are still
  arriving; saves go out with ``KVStore.put_layer`` as each layer is computed,
  except the last layer, which is held back until the step's loads are known
  good (a block becomes visible only with all its layers: a step whose load
  failed never publishes KV computed over garbage).
- ``sync``: ``get_prefix`` / ``put`` of whole chunks, in batches bounded by
  ``staging_bytes``, at the start and at the end of the step.

A load planned as ``whole`` (the engine's asynchronous loads, which vLLM
needs for models with several KV cache groups) is done at once in
:meth:`~TransferWorker.start_load` and reported per request by
:meth:`~TransferWorker.take_transfer_results`.

Layers may belong to different KV cache groups (full attention, sliding
window), each with its own block ids; blocks a sliding-window group freed are
the engine's null block: never written on load, and a chunk with any of them is
never saved (its KV is gone), so a stored prefix always has its whole window.

Nothing here raises into the engine: a miss, a block that fails verification
or any error while loading makes the affected engine blocks *load errors*
(or the request a failed load), which the engine recomputes; a failing save
is counted and dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstore.connectors.flusher import Flusher, flush_counted
from kvstore.connectors.paged import LayerGroups, PagedKV
from kvstore.connectors.plan import TransferSpec
from kvstore.connectors.settings import FLUSH_POLICIES, ConnectorSettings, Counters
from kvstore.datapath.contracts import PrefetchHandle
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.restore import LoadSample
from kvstore.store import KVStore

__all__ = ["LayerGroups", "TransferWorker"]  # LayerGroups: re-exported from paged

log = logging.getLogger(__name__)


@dataclass
class _Load:
    """A layerwise load in flight: its prefetch handle and the layers scattered so far."""

    spec: TransferSpec
    handle: PrefetchHandle
    scattered: dict[int, int] = field(default_factory=dict)  # layer -> token end scattered
    #: (group, start, end) -> whole kernel pages of those tokens, or None (see PagedKV.pages)
    pages: dict[tuple[int, int, int], torch.Tensor | None] = field(default_factory=dict)
    waited_s: float = 0.0  # the engine's seconds in this load's call, layers and end


@dataclass
class _Save:
    """One request's chunks to save this step: their keys and page slots per group."""

    keys: list[BlockKey]
    slots: dict[int, torch.Tensor]
    failed: bool = False
    #: Per group, the whole kernel pages of the tokens (None: move token by token).
    pages: dict[int, torch.Tensor | None] = field(default_factory=dict)


class TransferWorker:
    """Moves planned chunks between a :class:`KVStore` and an engine's paged cache.

    Args:
        store: the worker's store (its layout's ``block_tokens`` is the chunk size).
        rank: this worker's tensor-parallel rank (selects its keys in each spec).
        block_size: the engine's block size in tokens.
        settings: ``flush`` (when new blocks are persisted), ``transfer``
            (``layerwise``: prefetch / put_layer; ``sync``: get_prefix / put) and
            ``staging_bytes`` (the host buffer bound of the ``sync`` mode).
        counters: where the transfer metrics go.
        saves: False for a worker whose saves another worker makes (MLA under
            TP: every rank holds the same latent, rank 0 stores it).
    """

    def __init__(
        self,
        store: KVStore,
        rank: int,
        block_size: int,
        settings: ConnectorSettings | None = None,
        counters: Counters | None = None,
        saves: bool = True,
    ) -> None:
        settings = settings or ConnectorSettings()
        if settings.flush not in FLUSH_POLICIES:
            raise ConfigError(
                f"flush: use one of {', '.join(FLUSH_POLICIES)}, got {settings.flush!r}"
            )
        self.store = store
        self.layout = store.layout
        self.rank = rank
        self.block_size = block_size
        self.flush = settings.flush
        self.layerwise = settings.transfer == "layerwise"
        self.counters = counters or Counters("worker")
        self.saves = saves
        self.paged: PagedKV | None = None
        self.groups = LayerGroups()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._batch = max(1, settings.staging_bytes // self.layout.block_nbytes)
        self._buffer: torch.Tensor | None = None
        self._errors: set[int] = set()
        self._load_failed = False
        self._loads: list[_Load] = []
        self._saves: list[_Save] | None = None
        self._layers_put: set[int] = set()
        self._flusher = Flusher(store, self.counters) if self.flush == "background" else None
        #: Per tier id, what planned loads cost the engine since the last take.
        self._load_samples: dict[str, LoadSample] = {}
        #: Keys shadow verification found holding other KV (verify.py): never loaded or saved.
        self.quarantined: set[BlockKey] = set()

    def register(self, paged: PagedKV, groups: LayerGroups | None = None) -> None:
        """Attach the engine's paged caches (one per layer of our layout) and their groups."""
        if paged.num_layers != self.layout.num_layers:
            raise ConfigError(
                f"the engine has {paged.num_layers} KV cache layers, the layout "
                f"{self.layout.num_layers}"
            )
        groups = groups or LayerGroups()
        if groups.of_layer and len(groups.of_layer) != paged.num_layers:
            raise ConfigError("every KV cache layer needs its group")
        self.paged, self.groups = paged, groups

    def _slots(self, spec: TransferSpec, start: int, end: int, group: int = 0) -> torch.Tensor:
        assert self.paged is not None
        base = spec.block_offset * self.block_size
        return self.paged.slots(spec.block_ids[group], start - base, end - base)

    def _present(self, spec: TransferSpec, start: int, end: int, group: int) -> torch.Tensor | None:
        """Offsets of tokens ``[start, end)`` the group holds (None: all of them)."""
        if group not in self.groups.sliding:
            return None
        assert self.paged is not None
        base = spec.block_offset * self.block_size
        return self.paged.present(spec.block_ids[group], start - base, end - base)

    def _scatter_range(
        self,
        layer: int,
        spec: TransferSpec,
        tokens: tuple[int, int],
        src: torch.Tensor,
        pages: dict[tuple[int, int, int], torch.Tensor | None] | None = None,
    ) -> None:
        """Write ``src`` ``[kv, end - start, heads, D]`` as tokens ``[start, end)`` of
        ``layer``, skipping tokens whose block its group has freed (a sliding window).
        ``pages`` caches the whole pages of a range between layers (a layerwise load)."""
        assert self.paged is not None
        start, end = tokens
        group = self.groups.group(layer)
        keep = self._present(spec, start, end, group)
        if keep is None and pages is not None:
            where = (group, start, end)
            if where not in pages:
                base = spec.block_offset * self.block_size
                ids = spec.block_ids[group]
                pages[where] = self.paged.pages(ids, start - base, end - base)
            if pages[where] is not None:
                self.paged.scatter(layer, torch.empty(0), src, pages[where])
                return
        slots = self._slots(spec, start, end, group)
        if keep is not None:
            slots, src = slots[keep], src[:, keep]
            self.counters.add("load_layer_tokens_outside_window", end - start - len(keep))
        if len(slots):
            self.paged.scatter(layer, slots, src)

    def _staging(self, chunks: int) -> torch.Tensor:
        """A host buffer of ``layout.tensor_shape(chunks)``, reused between calls."""
        if self._buffer is None:
            shape = self.layout.tensor_shape(self._batch)
            self._buffer = torch.empty(shape, dtype=self.layout.dtype)
        return self._buffer[:, :, : chunks * self.layout.block_tokens]

    # -- load path ------------------------------------------------------------
    def start_load(self, loads: Sequence[TransferSpec]) -> None:
        """Start (layerwise) or do (sync) this step's loads, before the forward pass."""
        self.finish_load()  # a previous step's loads, if its finish was skipped
        self._load_failed = False
        for spec in loads:
            self.counters.add("load_requests")
            if spec.whole:
                self._finished.add(spec.req_id)  # failed or not, the engine stops waiting
            keys = spec.keys.get(self.rank)
            if keys is None or self.paged is None or not self.quarantined.isdisjoint(keys):
                self._fail(spec, spec.token_start)
                continue
            try:
                with self.counters.timed("load_seconds"):
                    if self.layerwise and not spec.whole:
                        # The engine waits for the call too (it asks shared tiers which
                        # blocks they hold: a round trip to a bucket).
                        began = time.perf_counter()
                        handle = self.store.prefetch(keys, out=self._load_buffer(len(keys)))
                        called_s = time.perf_counter() - began
                        self._loads.append(_Load(spec, handle, waited_s=called_s))
                    else:
                        start = time.perf_counter()
                        self._load_sync(spec, keys)
                        elapsed = time.perf_counter() - start  # the engine waits it all
                        self._timed(spec, elapsed)
                        self._waited(spec, elapsed)
            except Exception:  # never break generation: the engine recomputes
                log.exception("kvstore: loading request %s failed", spec.req_id)
                self._fail(spec, spec.token_start)

    def _load_buffer(self, chunks: int) -> torch.Tensor | None:
        """Where a layerwise load lands: on the engine's GPU when its caches are there
        (the copies run as DMA and each layer is waited for on the GPU), else a new
        host tensor made by the store."""
        assert self.paged is not None
        if self.paged.device.type != "cuda":
            return None
        shape = self.layout.tensor_shape(chunks)
        return torch.empty(shape, dtype=self.layout.dtype, device=self.paged.device)

    def _load_sync(self, spec: TransferSpec, keys: list[BlockKey]) -> None:
        c = self.layout.block_tokens
        for offset in range(0, len(keys), self._batch):
            batch = keys[offset : offset + self._batch]
            chunk0 = spec.first_chunk + offset
            staging = self._staging(len(batch))
            n = self.store.get_prefix(batch, staging, plan=False)  # the scheduler planned
            lo, hi = max(spec.token_start, chunk0 * c), min(spec.token_end, (chunk0 + n) * c)
            if hi > lo:
                a, b = lo - chunk0 * c, hi - chunk0 * c
                for layer in range(self.layout.num_layers):
                    self._scatter_range(layer, spec, (lo, hi), staging[layer, :, a:b])
                self.counters.add("load_chunks", n)
                self.counters.add("load_tokens", hi - lo)
            if n < len(batch):
                self._fail(spec, max(spec.token_start, hi))
                return

    def wait_layer(self, layer: int) -> None:
        """Layer ``layer`` is about to run: put its loaded KV in place first."""
        self.counters.add("layers_waited")
        if not 0 <= layer < self.layout.num_layers:
            return
        for load in self._loads:
            if layer not in load.scattered:
                self._scatter_layer(load, layer)

    def _scatter_layer(self, load: _Load, layer: int) -> None:
        """Put layer ``layer`` of a layerwise load in place (what arrived of it)."""
        began = time.perf_counter()
        try:
            # On a GPU the engine's stream waits for the layer's copies there; the
            # thread only waits until they are queued (valid_blocks is final then).
            load.handle.wait_layer_on(layer)
            end = self._valid_end(load)
            start = load.spec.token_start
            if end > start and load.handle.out is not None:
                lo = start - load.spec.first_chunk * self.layout.block_tokens
                src = load.handle.out[layer, :, lo : lo + end - start]
                self._scatter_range(layer, load.spec, (start, end), src, load.pages)
            load.scattered[layer] = end
        except Exception:  # the layer stays unscattered: finish_load reports it
            log.exception("kvstore: loading layer %d failed", layer)
        load.waited_s += time.perf_counter() - began  # the engine waited: wait and scatter

    def _valid_end(self, load: _Load) -> int:
        valid = load.spec.first_chunk + load.handle.valid_blocks
        return min(load.spec.token_end, valid * self.layout.block_tokens)

    def finish_load(self) -> None:
        """After the forward pass: whatever did not reach every layer is a load error.
        A speculative draft's layers (``LayerGroups.late``) run after the engine took
        the errors: their KV is put in place here, before their forward reads it."""
        for load in self._loads:
            spec = load.spec
            for layer in sorted(self.groups.late - load.scattered.keys()):
                self.counters.add("load_late_layers")
                self._scatter_layer(load, layer)
            try:
                began = time.perf_counter()
                load.handle.wait()
                load.waited_s += time.perf_counter() - began
                end = self._valid_end(load)
            except Exception:
                log.exception("kvstore: loading request %s failed", spec.req_id)
                end = spec.token_start
            # A layer never scattered (or scattered before its blocks failed) means the
            # forward pass ran on KV that is not the stored one: recompute from there.
            for layer in range(self.layout.num_layers):
                end = min(end, load.scattered.get(layer, spec.token_start))
            c = self.layout.block_tokens
            self._timed(spec, load.handle.load_s)
            self._waited(spec, load.waited_s)
            self.counters.add("load_tokens", max(0, end - spec.token_start))
            self.counters.add("load_chunks", max(0, -(-(end - spec.first_chunk * c) // c)))
            if end < spec.token_end:
                self._fail(spec, end)
        self._loads = []

    def _timed(self, spec: TransferSpec, actual_s: float | None) -> None:
        """A planned load's expected seconds against what it took (the counters show a
        wrong estimate: ``restore_planned_s`` / ``restore_actual_s``)."""
        if spec.planned_s is not None and actual_s is not None:
            self.counters.add("restores_timed")
            self.counters.add("restore_planned_s", spec.planned_s)
            self.counters.add("restore_actual_s", actual_s)

    def _waited(self, spec: TransferSpec, waited_s: float) -> None:
        """The engine waited ``waited_s`` for ``spec``'s planned load (in ``wait_layer``:
        vLLM's ``wait_for_layer_load``): what that cost each tier, by the plan's model."""
        scale = spec.planned.scale(waited_s) if spec.planned is not None else None
        if spec.planned is None or scale is None:
            return
        for tier, sample in spec.planned.samples(scale).items():
            had = self._load_samples.get(tier)
            self._load_samples[tier] = sample if had is None else had + sample

    def take_load_samples(self) -> dict[str, LoadSample]:
        """Per tier id, what planned loads cost the engine since the last call."""
        samples, self._load_samples = self._load_samples, {}
        return samples

    def _fail(self, spec: TransferSpec, from_token: int) -> None:
        """Tokens ``[from_token, token_end)`` of ``spec`` did not load: report their blocks
        (or, for a whole load, the request: the engine recomputes it from its start)."""
        self.counters.add("load_failed_requests")
        self.counters.add("load_failed_tokens", spec.token_end - from_token)
        if spec.whole:
            # That request computes nothing this step, so this step's saves stay good.
            self._failed.add(spec.req_id)
            return
        blocks = spec.blocks_of(from_token, spec.token_end, self.block_size)
        self._errors.update(blocks)
        self._load_failed = True
        self.counters.add("load_failed_blocks", len(blocks))

    def whole_load_failed(self, req_id: str) -> bool:
        """Whether a whole load of ``req_id`` failed since the results were last taken."""
        return req_id in self._failed

    def fail_load(self, spec: TransferSpec) -> None:
        """Report ``spec``'s load failed (something beside its KV did not load)."""
        self._fail(spec, spec.token_start)

    def take_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (the engine recomputes them)."""
        self.finish_load()
        errors, self._errors = self._errors, set()
        return errors

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """Requests whose whole load ended since the last call: (all of them, the failed)."""
        finished, failed = self._finished, self._failed
        self._finished, self._failed = set(), set()
        return finished, failed

    # -- save path ------------------------------------------------------------
    def save_layer(self, layer: int, saves: Sequence[TransferSpec]) -> None:
        """Layer ``layer`` of this step is computed: send it out (layerwise mode).

        The last layer waits for :meth:`finish_save`, which publishes the
        blocks only if no load of this step failed.
        """
        self.counters.add("layers_saved")
        if not self.layerwise or not saves or layer == self.layout.num_layers - 1:
            return
        if not self.saves:
            return
        if not 0 <= layer < self.layout.num_layers or layer in self._layers_put:
            return
        if self._saves is None:
            self._saves = self._prepare(saves)
        self._put_layer(layer, self._saves)
        self._layers_put.add(layer)

    def _prepare(self, saves: Sequence[TransferSpec]) -> list[_Save]:
        """Each spec's chunks not stored yet, with the page slots of their tokens per group."""
        out = []
        c = self.layout.block_tokens
        groups = self.groups.used()
        for spec in saves:
            self.counters.add("save_requests")
            keys = spec.keys.get(self.rank, [])
            todo = [
                i
                for i, key in enumerate(keys)
                if key not in self.quarantined and not self.store.engine.datapath.contains(key)
            ]
            self.counters.add("save_chunks_present", len(keys) - len(todo))
            if not todo or self.paged is None:
                continue
            spans = [((spec.first_chunk + i) * c, (spec.first_chunk + i + 1) * c) for i in todo]
            whole = [
                i
                for i, span in zip(todo, spans, strict=True)
                if all(self._present(spec, *span, g) is None for g in groups)
            ]
            # A chunk whose window blocks were freed has lost its KV: never stored.
            self.counters.add("save_chunks_freed", len(todo) - len(whole))
            if not whole:
                continue
            slots = {
                g: torch.cat([self._slots(spec, *spans[todo.index(i)], g) for i in whole])
                for g in groups
            }
            self._note_tokens(spec, keys, whole)
            pages = {
                g: self._whole_pages(spec, [spans[todo.index(i)] for i in whole], g) for g in groups
            }
            out.append(_Save([keys[i] for i in whole], slots, pages=pages))
        return out

    def _whole_pages(
        self, spec: TransferSpec, spans: list[tuple[int, int]], group: int
    ) -> torch.Tensor | None:
        """The kernel pages of the tokens of ``spans``, in order, if they are whole pages."""
        assert self.paged is not None
        base = spec.block_offset * self.block_size
        found = []
        for start, end in spans:
            pages = self.paged.pages(spec.block_ids[group], start - base, end - base)
            if pages is None:
                return None
            found.append(pages)
        return torch.cat(found) if found else None

    def _note_tokens(self, spec: TransferSpec, keys: list[BlockKey], whole: list[int]) -> None:
        """Tell the store (a kvstore-server behind it publishes KV events) the tokens of
        the chunks about to be saved, in runs of consecutive chunks."""
        if spec.token_ids is None or spec.parents is None:
            return
        c = self.layout.block_tokens
        runs: list[list[int]] = []
        for i in whole:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = keys[run[0] - 1] if run[0] else spec.parents.get(self.rank)
            tokens = spec.token_ids[run[0] * c : (run[-1] + 1) * c]
            try:
                self.store.engine.note_tokens(
                    ChunkTokens.of([keys[i] for i in run], tokens, parent, c)
                )
            except Exception:  # events are best effort: never an engine error
                log.exception("kvstore: noting the tokens of request %s failed", spec.req_id)

    def _gather(self, layer: int, save: _Save) -> torch.Tensor:
        """Layer ``layer`` of the save's tokens in our layout, on the caches' device: on a
        GPU the gather is a kernel on the engine's stream (a snapshot in stream order,
        so the engine may reuse the blocks in later steps), and ``put_layer`` of it
        returns at once while the copy to host memory runs in the background."""
        assert self.paged is not None
        kv = torch.empty(
            self.layout.layer_shape(len(save.keys)),
            dtype=self.layout.dtype,
            device=self.paged.device,
        )
        group = self.groups.group(layer)
        self.paged.gather(layer, save.slots[group], kv, save.pages.get(group))
        return kv

    def _put_layer(self, layer: int, saves: list[_Save]) -> int:
        completed = 0
        for save in saves:
            if save.failed:
                continue
            try:
                with self.counters.timed("save_seconds"):
                    kv = self._gather(layer, save)  # a fresh tensor: the store may keep it
                    completed += self.store.put_layer(save.keys, layer, kv, donate=True)
            except Exception:  # a failed save is a future miss, never an engine error
                log.exception("kvstore: saving layer %d failed", layer)
                self.counters.add("save_errors")
                save.failed = True
        return completed

    def finish_save(self, saves: Sequence[TransferSpec]) -> None:
        """Complete this step's saves, unless one of its loads failed; then flush per policy."""
        self.finish_load()
        prepared, self._saves = self._saves, None
        layers_put, self._layers_put = self._layers_put, set()
        if self._load_failed:
            # A failed load leaves garbage KV in this step's blocks, and every token
            # computed after it attended to it: publish nothing from this step. Layers
            # already sent never complete their blocks; give their room back now.
            self._load_failed = False
            dropped = sum(len(s.keys.get(self.rank, ())) for s in saves)
            self.counters.add("save_chunks_dropped", dropped)
            for save in prepared or ():
                self.store.abort_layers(save.keys)
            return
        if not saves or not self.saves:
            return
        if self.layerwise:
            todo = prepared if prepared is not None else self._prepare(saves)
            stored = 0
            for layer in range(self.layout.num_layers):
                if layer not in layers_put:  # the held-back last layer, or a missed hook
                    stored += self._put_layer(layer, todo)
            self.counters.add("save_chunks_stored", stored)
            self.counters.add("save_chunks_not_stored", sum(len(s.keys) for s in todo) - stored)
        else:
            stored = sum(self._save_sync(spec) for spec in saves)
        if stored:
            self._persist()

    def save_finished(self, specs: Sequence[TransferSpec]) -> set[str]:
        """Save finished requests' output chunks from the blocks the engine kept for it;
        the ids of the requests done, saved or not (a failed save is a future miss, and
        the engine must get its blocks back either way)."""
        if not specs:
            return set()
        if self.saves and self.paged is not None:
            chunks = sum(self._save_sync(spec) for spec in specs if not spec.tail)
            tails = sum(self._save_tail(spec) for spec in specs if spec.tail)
            self.counters.add("output_chunks_stored", chunks)
            self.counters.add("tail_chunks_stored", tails)
            if chunks or tails:
                self._persist()
        return {spec.req_id for spec in specs}

    def _save_tail(self, spec: TransferSpec) -> int:
        """Store a tail block (:attr:`TransferSpec.tail`): its chunk's first tokens, up to
        ``spec.token_end``, and zeros after them; 1 if stored now."""
        keys = spec.keys.get(self.rank)
        if (
            not keys
            or keys[-1] in self.quarantined
            or self.store.engine.datapath.contains(keys[-1])
        ):
            return 0
        assert self.paged is not None
        n = spec.token_end - spec.token_start
        staging = self._staging(1)
        staging.zero_()
        for layer in range(self.layout.num_layers):
            slots = self._slots(spec, spec.token_start, spec.token_end, self.groups.group(layer))
            self.paged.gather(layer, slots, staging[layer, :, :n])
        try:
            with self.counters.timed("save_seconds"):
                return self.store.put(keys[-1:], staging)
        except Exception:  # a failed save is a future miss, never an engine error
            log.exception("kvstore: saving the tail of request %s failed", spec.req_id)
            self.counters.add("save_errors")
            return 0

    def _save_sync(self, spec: TransferSpec) -> int:
        prepared = self._prepare([spec])
        if not prepared:
            return 0
        save, stored = prepared[0], 0
        c = self.layout.block_tokens
        for offset in range(0, len(save.keys), self._batch):
            keys = save.keys[offset : offset + self._batch]
            staging = self._staging(len(keys))
            span = slice(offset * c, (offset + len(keys)) * c)
            assert self.paged is not None
            for layer in range(self.layout.num_layers):
                slots = save.slots[self.groups.group(layer)][span]
                self.paged.gather(layer, slots, staging[layer])
            try:
                with self.counters.timed("save_seconds"):
                    done = self.store.put(keys, staging)
            except Exception:  # a failed save is a future miss, never an engine error
                log.exception("kvstore: saving request %s failed", spec.req_id)
                self.counters.add("save_errors")
                return stored
            stored += done
            self.counters.add("save_chunks_stored", done)
            self.counters.add("save_chunks_not_stored", len(keys) - done)
        return stored

    def _persist(self) -> None:
        """Make new blocks visible to other processes (the scheduler's store) per the policy."""
        if self.flush == "step":
            flush_counted(self.store, self.counters, "flush")
        elif self._flusher is not None:
            self._flusher.request()

    def close(self) -> None:
        """Stop the background flusher and close the store (which flushes)."""
        self.finish_load()
        if self._flusher is not None:
            self._flusher.stop()
        flush_counted(self.store, self.counters, "flush at shutdown")  # close() would anyway
        self.store.close()
