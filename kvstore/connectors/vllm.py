"""vLLM KV connector: prefix KV from kvstore, bit-identical to recomputing it.

Load it with::

    KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.connectors.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvstore_config": {...} or "store.yaml"},
    )

vLLM makes one instance per role, in different processes that share no
memory. The **worker** instance (one per GPU/CPU worker) owns the store that
holds the KV: it loads planned chunks into vLLM's paged cache before the
forward pass and saves newly computed full chunks after it. The **scheduler**
instance opens the same config's *shared* tiers (disk, S3, ...) for lookups
only, so it sees what any worker -- in this process tree or an earlier one --
stored. Workers persist new blocks at the end of each step that saved some
(``flush: step``), so the next step's lookups see them.

Keys are kvstore's chained xxh3 keys over the prompt's token ids in a
namespace of the model (id, revision, dtype, quantization), the KV layout and
the TP rank: identical in every process and after restarts, never shared
between models, ranks, LoRA adapters or cache salts.

Models: full attention, MLA (one latent per token, stored once for every TP
rank and readable at any TP size) and sliding-window layers, alone or mixed under
vLLM's hybrid KV cache manager (the connector declares ``SupportsHMA``); see
:mod:`kvstore.connectors.vllm_geometry`. With several KV cache groups, loads are
vLLM's *asynchronous* kind: planned when vLLM allocates the request's blocks,
done whole by the workers before the request computes, and reported per request
(vLLM cannot take per-block failures when block ids repeat across groups).
Hybrids' recurrent state (Mamba2, gated delta-net) is stored per chunk beside
its KV when vLLM keeps it per block (``mamba_cache_mode="align"``;
:mod:`kvstore.connectors.vllm_hybrid`). A model with layers whose state kvstore
does not store is served no prefix at all, as the start-up log says. A speculative
draft's layers (EAGLE, MTP) are stored and loaded with the target's, the draft in the keys.

KV events: with ``events: {enabled: true}`` in the store config, the scheduler
reports the chunks kvstore holds for this engine through ``take_events()``, and
vLLM's own publisher (``--kv-events-config``) carries them beside its GPU blocks
(:mod:`kvstore.connectors.vllm_events`; docs/events.md).

Failures never fail a request: a block that is missing or fails verification
when a worker reads it is reported through ``get_block_ids_with_load_errors``
and vLLM recomputes it (the connector switches vLLM's
``kv_load_failure_policy`` to ``recompute`` unless
``recompute_on_load_failure`` is false). Counters go to
``get_kv_connector_stats`` and, with ``stats_dir``, to JSON files.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.config import EventsConfig, StoreConfig
from kvstore.connectors.hints import PARAM, apply_hints, finish_with_hint
from kvstore.connectors.paged import LayerGroups, PagedKV
from kvstore.connectors.plan import (
    FinishedOutput,
    Found,
    Planner,
    StepPlan,
    chunk_tokens_for,
)
from kvstore.connectors.settings import ConnectorSettings, Counters, shared_tiers_config
from kvstore.connectors.speeds import EngineSpeeds, ReadDeltas, loads_as_counters
from kvstore.connectors.tails import Tail, find_tail
from kvstore.connectors.transfer import TransferWorker
from kvstore.connectors.verify import ShadowSampler, ShadowVerifier, VerifyPromMetrics
from kvstore.connectors.vllm_events import ConnectorEvents
from kvstore.connectors.vllm_geometry import EngineGeometry
from kvstore.connectors.vllm_hybrid import StateLookup, StateTransfer
from kvstore.connectors.vllm_requests import finished_output, groups, scheduled_requests
from kvstore.connectors.vllm_runtime import page_map_of, parallel_ranks
from kvstore.connectors.vllm_stats import KVStoreConnectorStats
from kvstore.datapath.contracts import Medium
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey, Namespace, chain_keys, tokens_to_bytes
from kvstore.store import KVStore

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["EngineGeometry", "KVStoreConnector", "KVStoreConnectorMetadata"]

# Under vLLM's logger, so start-up lines (what is served, what is recomputed) show with
# vLLM's own output.
log = logging.getLogger(f"vllm.{__name__}")


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers for one step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """A ``KVConnectorBase_V1`` backed by a :class:`~kvstore.store.KVStore` (see module doc)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(transfer_config.kv_connector_extra_config)
        self.geometry = EngineGeometry.from_vllm(
            vllm_config, kv_cache_config, self.settings.model_id
        )
        self.chunk_tokens = chunk_tokens_for(self.geometry.block_size, self.settings.chunk_tokens)
        self.layout = self.geometry.layout(self.chunk_tokens)
        self._layer_index = {name: i for i, name in enumerate(self.geometry.layer_names)}
        self._namespaces: dict[tuple[int | None, str | None, str | None, int], Namespace] = {}
        # kv_producer saves and never loads (a prefill pool), kv_consumer loads and never
        # saves (a decode pool), kv_both does both.
        self._loads = bool(transfer_config.is_kv_consumer)
        self._saves = bool(transfer_config.is_kv_producer)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self.counters = Counters("scheduler" if is_scheduler else "worker")
        self._lookup_store: KVStore | None = None
        self._worker: TransferWorker | None = None
        # Hybrid models: their recurrent state per chunk (vllm_hybrid.py).
        self._state_lookup: StateLookup | None = None
        self._states: StateTransfer | None = None
        self._verifier: ShadowVerifier | None = None
        self._sampler = ShadowSampler(self.settings.verify_sample_rate, self.counters)
        self._reads: ReadDeltas | None = None  # a worker's tier reads, for the scheduler
        self._speeds = EngineSpeeds(None)
        self._events: ConnectorEvents | None = None
        self._prompts: dict[str, Any] = {}  # request -> prompt token ids, for events
        # A kvstore-server (or cluster) behind the store: saves carry their tokens to it.
        self._ship_tokens = False
        if is_scheduler:
            self._init_scheduler(transfer_config)
        else:
            self._init_worker()
        log.info(
            "kvstore connector (%s): chunk %d tokens, layout %s, model %s",
            self.counters.role,
            self.chunk_tokens,
            self.layout.describe(),
            self.geometry.model_id,
        )
        if self.geometry.serves:
            log.info("%s", self.geometry.describe())
        else:
            log.warning("%s", self.geometry.describe())

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a dropped save is only a future miss."""
        return False

    # -- keys -------------------------------------------------------------------
    def _namespace(
        self, rank: int | None, adapter: str | None, salt: str | None, stage: int = 0
    ) -> Namespace:
        """Per TP rank for sharded KV; ``rank`` None (no TP in the namespace) when every
        rank holds the same KV (MLA), so one copy serves any rank of any TP size. Under
        pipeline parallelism each stage keys its own layers."""
        ident = (rank, adapter, salt, stage)
        ns = self._namespaces.get(ident)
        if ns is None:
            full_salt = "|".join(s for s in (self.settings.salt, salt) if s) or None
            pp = self.geometry.pp_size
            ns = Namespace(
                model=self.geometry.model_id + (f"|pp{stage}/{pp}" if pp > 1 else ""),
                layout=self.layout,
                tp_rank=rank,
                tp_size=None if rank is None else self.geometry.tp_size,
                adapter=adapter,
                salt=full_salt,
            )
            self._namespaces[ident] = ns
        return ns

    def _keys_for(
        self, token_ids: Sequence[int], adapter: str | None, salt: str | None
    ) -> dict[int, list[BlockKey]]:
        full = len(token_ids) - len(token_ids) % self.chunk_tokens
        data = tokens_to_bytes(token_ids, limit=full)
        out = {}
        for stage in range(self.geometry.pp_size):
            ranks = [None] if self.geometry.replicated else range(self.geometry.tp_size)
            for rank in ranks:
                seed = self._namespace(rank, adapter, salt, stage).seed
                out[self._key_index(stage, rank or 0)] = chain_keys(data, self.chunk_tokens, seed)
        return out

    def _key_index(self, stage: int, tp_rank: int) -> int:
        """Which keys of a spec a worker moves: one set per (stage, TP rank), or per stage
        when every TP rank holds the same KV."""
        if self.geometry.replicated:
            return stage
        return stage * self.geometry.tp_size + tp_rank

    # -- scheduler side -----------------------------------------------------------
    def _init_scheduler(self, transfer_config: Any) -> None:
        if self.settings.recompute_on_load_failure:
            # Every block kvstore fails to deliver can be recomputed: make vLLM do that
            # rather than fail the request (its default). Read right after we return.
            transfer_config.kv_load_failure_policy = "recompute"
        config = self.settings.resolved_store_config()
        self._ship_tokens = config.cluster.enabled or any(t.kind == "remote" for t in config.tiers)
        shared = shared_tiers_config(config)
        if shared is None:
            log.warning(
                "kvstore: the store config has no shared tier (disk, s3, redis); the "
                "scheduler cannot see what workers store, so there will be no hits"
            )
        else:
            self._lookup_store = KVStore(self.layout, shared)
            if self.geometry.states and self.geometry.serves:
                self._state_lookup = StateLookup(self.geometry.states, shared, self.chunk_tokens)
            if config.events.enabled:
                self._init_events(config.events, shared)
        # Tails are looked for where asking costs a stat(): shared tiers all local disks.
        local = shared is not None and all(t.kind == "disk" for t in shared.tiers)
        tails = self._find_tail if self._outputs_saved() and local else None
        self._planner = Planner(
            self.chunk_tokens, self.geometry.block_size, self._keys_for, self._lookup, tails
        )
        self._speeds = EngineSpeeds(self._lookup_store)

    def _init_events(self, events: EventsConfig, shared: StoreConfig) -> None:
        """Report the chunks kvstore holds in vLLM's KV events, in the engine's blocks;
        after a restart, again every chunk the journal knows and the store still holds."""
        assert self._lookup_store is not None
        first = shared.tiers[0].kind
        medium = Medium.DISK if first == "disk" else Medium.SHARED
        events = dataclasses.replace(events, block_size=self.geometry.block_size)
        self._events = ConnectorEvents(self.chunk_tokens, events, medium)
        announced = self._events.restore(self._lookup_store.engine.datapath.exists)
        log.info("kvstore: KV events on (%s); %d chunks announced again", medium.name, announced)

    def _lookup(self, keys: dict[int, list[BlockKey]], prompt_len: int, computed: int) -> Found:
        """What is stored for every rank, and how much of it pays to load (the restore
        plan: the shared tiers' speeds as the workers measure them against the engine's
        prefill speed; loads overlap compute layer by layer unless they are whole)."""
        store = self._lookup_store
        if store is None or not keys:
            return Found(0, 0)
        first = min(keys)
        # Workers evict from the shared tiers this scheduler only reads: plan() confirms.
        overlap = not self.geometry.per_request_loads
        plan = store.plan(
            keys[first], prompt_tokens=prompt_len, computed_tokens=computed, overlap=overlap
        )
        stored = plan.stored
        for rank, ks in keys.items():
            if rank != first:
                stored = min(stored, store.lookup(ks, recheck=True))
        if self._events is not None:
            self._events.gone(keys[first][stored:])
        load = min(plan.load, stored)
        if self._state_lookup is not None:  # a hybrid's hit ends on a stored state
            stored = self._state_lookup.longest(keys, stored, prompt_len)
            load = self._state_lookup.longest(keys, min(load, stored), prompt_len)
        if load < stored:
            self.counters.add("plan_recompute_requests")
            self.counters.add("plan_recompute_tokens", (stored - load) * self.chunk_tokens)
        # Chunks left on slow shared tiers: plan() warms them (copies them up the shared
        # tiers, e.g. from S3 to disk) for the next request.
        planned = store.engine.planned_load(plan) if load == plan.load > plan.first else None
        return Found(stored, load, plan.load_s if load > plan.first else None, planned)

    def _announce(self, req_id: str, chunks: int) -> None:
        """The store holds the first ``chunks`` chunks of request ``req_id``'s prompt."""
        state = self._planner.requests.get(req_id)
        prompt = self._prompts.get(req_id)
        if self._events is None or state is None or prompt is None or not state.keys:
            return
        keys = state.keys[min(state.keys)][:chunks]
        self._events.held(keys, prompt[: len(keys) * self.chunk_tokens])

    def _attach_tokens(self, save: Any) -> None:
        """A kvstore-server behind the store publishes events: ship the chunks' tokens."""
        prompt = self._prompts.get(save.req_id)
        state = self._planner.requests.get(save.req_id)
        if prompt is None or state is None:
            return
        n = len(next(iter(save.keys.values())))
        c, first = self.chunk_tokens, save.first_chunk
        save.token_ids = list(prompt[first * c : (first + n) * c])
        save.parents = {r: ks[first - 1] if first else None for r, ks in state.keys.items()}

    def take_events(self) -> list[Any]:
        """KV events of the chunks kvstore stored or lost since the last call, as vLLM's
        ``BlockStored`` / ``BlockRemoved`` (its publisher sends them with its own)."""
        if self._events is None:
            return []
        from vllm.distributed import kv_events

        out = []
        for event in self._events.take():
            cls = getattr(kv_events, type(event).__name__)
            out.append(cls(**{f: getattr(event, f) for f in event.__struct_fields__}))
        return out

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens of the prompt beyond ``num_computed_tokens`` stored in kvstore, and whether
        they load asynchronously (models with several KV cache groups: see the worker side)."""
        self.counters.add("lookup_requests")
        tokens = request.prompt_token_ids
        if tokens is None or getattr(request, "mm_features", None) or not self.geometry.serves:
            # Prompt embeddings or images: the token ids alone do not determine the KV; or
            # some layers' state is not stored, so no prefix can be served.
            self.counters.add("lookup_skipped")
            return 0, False
        lora = getattr(request, "lora_request", None)
        adapter = lora.lora_name if lora is not None else None
        salt = getattr(request, "cache_salt", None)
        # Shadow verification: a sampled hit is recomputed and compared, not served.
        verify = self._loads and self._sampler.sampled(request.request_id)
        try:
            matched = self._planner.match(
                request.request_id, tokens, num_computed_tokens, adapter, salt, verify
            )
        except Exception:  # a broken lookup is a miss, never a failed request
            log.exception("kvstore: lookup failed for request %s", request.request_id)
            self.counters.add("lookup_errors")
            return 0, False
        if self._events is not None:
            self._prompts[request.request_id] = tokens
            self._announce(
                request.request_id, self._planner.requests[request.request_id].stored_chunks
            )
        if not self._loads:
            return 0, False
        if verify:
            ns = self._namespace(None if self.geometry.replicated else 0, adapter, salt)
            stored = self._planner.requests[request.request_id].stored_chunks
            self._sampler.mark(request.request_id, stored, ns)
        if matched:
            self.counters.add("lookup_hit_requests")
            self.counters.add("lookup_hit_tokens", matched)
        return matched, bool(matched) and self.geometry.per_request_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the token range to load once vLLM allocated blocks for it.

        With several KV cache groups the load is asynchronous in vLLM's terms: planned
        here with the request's blocks, done whole by the next step's workers, and
        reported per request (vLLM cannot map per-block failures back to requests when
        block ids repeat across groups).
        """
        if self.geometry.per_request_loads and num_external_tokens > 0:
            block_ids = groups(blocks.get_block_ids())
            self._planner.allocated(request.request_id, num_external_tokens, block_ids)
        else:
            self._planner.allocated(request.request_id, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        """A step ended: learn from it (the engine's prefill speed, the tiers' read speeds
        the workers measured); a failed whole load: vLLM recomputes the request, never
        offer it a hit again."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self.counters.add("load_failed_requests_seen")
            self._planner.load_failed(req_id)
        if self._lookup_store is not None:
            self._speeds.step_ended(getattr(connector_output, "kv_connector_stats", None))

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        """Plan this step's loads and saves from what vLLM scheduled."""
        plan = self._planner.step(scheduled_requests(scheduler_output))
        self._speeds.step_started(scheduler_output.total_num_scheduled_tokens, bool(plan.loads))
        if not self._saves or not self.geometry.serves:
            plan.saves = []
        for save in plan.saves:  # saved by the workers within this step
            self._announce(save.req_id, save.first_chunk + len(next(iter(save.keys.values()))))
            if self._ship_tokens:
                self._attach_tokens(save)
        if plan:
            self.counters.add("planned_loads", len(plan.loads))
            self.counters.add("planned_saves", len(plan.saves))
        # Written as things happen: vLLM may kill this process without calling shutdown().
        if plan or scheduler_output.scheduled_new_reqs:
            self.counters.write(self.settings.stats_dir)
        plan.verify = self._sampler.for_saves(plan.saves)
        return KVStoreConnectorMetadata(plan)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (its session hint, if any, goes to the stores, and the
        answer back with its output). Prompt saves are synchronous; the blocks are kept
        (True) only while the workers save the chunks its output completed."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` for vLLM's hybrid KV cache manager (every group)."""
        output = self._finished_output(request, block_ids)
        state = self._planner.requests.get(request.request_id)
        keep, answer = finish_with_hint(
            self._planner, request, self._lookup_store, self.counters, output
        )
        if keep and output is not None and state is not None and self._events is not None:
            # Announced as the step's prompt saves are: when planned (the next step's).
            keys = state.keys[min(state.keys)]  # the output's chain now (Planner.finished)
            self._events.held(keys, output.tokens[: len(keys) * self.chunk_tokens])
        self._prompts.pop(request.request_id, None)
        self._sampler.finished(request.request_id)
        return keep, answer

    def _finished_output(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> FinishedOutput | None:
        """What of a finished request's output to save (``save_outputs``): models whose
        every layer is plain attention (a window's or a state's blocks at the output's
        end, or a draft's, are not this simple)."""
        needs_hint = self.settings.save_outputs == "hinted"
        params = getattr(request, "kv_transfer_params", None)
        if not self._outputs_saved() or (needs_hint and not (params and PARAM in params)):
            return None  # (a request without a hint: nothing to copy on this path)
        return finished_output(request, block_ids, needs_hint=needs_hint)

    def _outputs_saved(self) -> bool:
        """Whether finished requests' outputs (and their tails) may be saved here."""
        g = self.geometry
        return self.settings.save_outputs != "never" and g.plain and self._saves and g.serves

    def _find_tail(
        self, keys: dict[int, list[BlockKey]], tokens: Sequence[int], loaded: int
    ) -> Tail | None:
        """A stored tail after the ``loaded`` chunks of ``tokens`` (tails.py), asked of
        the shared tiers' local disks (each of at most three lengths, a file check)."""
        store = self._lookup_store
        if store is None:
            return None
        sizes = (self.chunk_tokens, self.geometry.block_size)
        return find_tail(
            lambda key: store.engine.datapath.exists([key])[0], keys, tokens, loaded, sizes
        )

    # -- worker side ----------------------------------------------------------------
    def _init_worker(self) -> None:
        rank, stage = parallel_ranks()
        # The scheduler reports the engine's KV events; a worker's store publishes none.
        config = self.settings.resolved_store_config()
        store = KVStore(self.layout, dataclasses.replace(config, events=EventsConfig()))
        # MLA: every rank holds the same latent; the keys have no rank and rank 0 saves.
        self._worker = TransferWorker(
            store,
            self._key_index(stage, rank),
            self.geometry.block_size,
            self.settings,
            self.counters,
            saves=rank == 0 or not self.geometry.replicated,
        )
        self._reads = ReadDeltas(store)
        if self.geometry.states and self.geometry.serves:
            # States go to the shared tiers only: no second host-memory reservation.
            states, tiers = self.geometry.states, shared_tiers_config(config) or config
            self._states = StateTransfer(
                states,
                tiers,
                rank,
                self.geometry.block_size,
                self.counters,
                audit_dir=self.settings.stats_dir,
            )
        self._verifier = ShadowVerifier(self._worker, self.counters, self.settings.verify_tolerance)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attach vLLM's per-layer paged caches, and learn how the kernel packs a page."""
        assert self._worker is not None
        missing = [n for n in self.geometry.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing[:3]}")
        caches = [kv_caches[name] for name in self.geometry.layer_names]
        if self.geometry.replicated:  # MLA: [blocks, block_size, latent] -> one "head"
            caches = [c.unsqueeze(1) if c.dim() == 3 else c for c in caches]
        page_map = page_map_of(self._vllm_config, self.geometry, caches[0])
        groups = LayerGroups(
            tuple(self.geometry.layer_groups()),
            self.geometry.sliding_groups(),
            late=self.geometry.draft_indices(),
        )
        self._worker.register(PagedKV(caches, page_map, self.geometry.block_size), groups)
        if self._states is not None:
            self._states.register(kv_caches)
        log.info(
            "kvstore: registered %d KV caches of shape %s (%s)",
            len(caches),
            tuple(caches[0].shape),
            caches[0].dtype,
        )

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVStoreConnectorMetadata) else StepPlan()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start loading this step's planned chunks (before the forward pass)."""
        assert self._worker is not None and self._verifier is not None
        plan = self._plan()
        self._verifier.discover(plan.saves, plan.verify)
        self._worker.start_load(plan.loads)
        if self._states is not None:
            self._states.load_all(plan.loads, self._worker)
        apply_hints(self._worker.store, self._worker.rank, plan.hints, self.counters)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The layer is about to run: put its loaded KV in the paged cache."""
        assert self._worker is not None
        self._worker.wait_layer(self._layer_index.get(layer_name, -1))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """The layer ran: its new KV is in the paged cache; send it out."""
        assert self._worker is not None
        self._worker.save_layer(self._layer_index.get(layer_name, -1), self._plan().saves)

    def wait_for_save(self) -> None:
        """End of the step: check this step's loads, complete its saves, flush."""
        assert self._worker is not None and self._verifier is not None
        plan = self._plan()
        self._verifier.check(plan.saves, plan.verify)  # first: a quarantined chunk is not saved
        self._worker.finish_save(plan.saves)
        if self._states is not None and self._worker.saves:
            self._states.save_all(plan.saves, flush=self.settings.flush == "step")
        if plan:
            self.counters.add("steps_with_transfers")
            self.counters.write(self.settings.stats_dir)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests' output saves, done now; whole loads (several KV cache
        groups) end here."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished requests whose output chunks this step saved (vLLM frees their blocks),
        whole loads that ended this step, and which of them failed (vLLM recomputes those)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        sent = self._worker.save_finished(self._plan().finishing)
        if sent:
            self.counters.write(self.settings.stats_dir)
        finished, failed = self._worker.take_transfer_results()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=finished, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose planned load failed this step; vLLM recomputes them."""
        return self._worker.take_load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """The counters that changed since the last call (vLLM logs and aggregates them);
        from a worker, also its tier reads and what its planned loads cost each tier (the
        scheduler's store prices the tiers by them)."""
        delta = self.counters.take_delta()
        if self._reads is not None and self._worker is not None:
            delta.update(self._reads.take())
            delta.update(loads_as_counters(self._worker.take_load_samples()))
        return KVStoreConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVStoreConnectorStats | None:
        """Rebuild stats sent from the workers."""
        return KVStoreConnectorStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Shadow verification's counters in vLLM's ``/metrics`` (``vllm:kvstore_verify_*``)."""
        return VerifyPromMetrics(metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Close the store (flushing memory-only blocks to disk) and write the counters."""
        if self._worker is not None:
            self._worker.close()
        for state_store in (self._states, self._state_lookup):
            if state_store is not None:
                state_store.close()
        if self._lookup_store is not None:
            self._lookup_store.close()
        if self._events is not None:
            self._events.close()
        self.counters.write(self.settings.stats_dir)
