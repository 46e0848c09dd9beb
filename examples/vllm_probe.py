"""KV probes for the vLLM examples and tests: connectors that record the engine's KV bytes.

At the step a request's prefill ends, after every forward of that step (the target
model's and a speculative draft's), a probe hashes each full block of the prompt
in every layer of every KV cache group and appends one JSON line to a file in
``$KV_PROBE_DIR`` (one file per worker process)::

    {"req": id, "prompt_tokens": n, "first_computed": tokens cached when it was first
     scheduled, "groups": {group: {"kind": spec class, "block_size": b,
     "block_bytes": bytes hashed per block and layer, "page_bytes": the spec's page,
     "layers": {layer: [sha256 prefix of each block, or null where vLLM holds no block]}}}}

A state group's (Mamba2, gated delta-net) hash covers the block's states only, cut
from vLLM's spec, not the page's padding (:class:`KVProbe`).

- ``ProbeConnector`` does nothing else: no lookups, loads or saves. It is the
  do-nothing connector a kvstore hit is compared against (vLLM configures its CPU
  threads the same way whenever a connector is attached, so the two runs compute
  with the same number of threads, and it supports vLLM's hybrid KV cache manager,
  so the KV cache groups are the same too).
- ``KVStoreProbeConnector`` is kvstore's connector with the probe: the blocks a
  hit loaded and the blocks a miss computed (and saved) can be compared byte for
  byte, group by group and layer by layer.

``examples/vllm_offline.py --probe-dir DIR`` attaches one of them. Imported by vLLM's
engine processes (the driver puts this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from kvstore.connectors import KVStoreConnector

PROBE_DIR_ENV = "KV_PROBE_DIR"  # not KVSTORE_*: those are store settings


class ProbeMetadata(KVConnectorMetadata):
    """The prefills that end this step (the do-nothing connector's only metadata)."""

    def __init__(self, probes: list[dict[str, Any]]) -> None:
        self.probes = probes


class PrefillTracker:
    """Scheduler side: each request's block ids per group, and the step its prefill ends.

    The ids a step's prefill ends with are those vLLM's KV cache manager holds for the
    request in that step, where the connector was given the manager: vLLM frees blocks
    while a request runs (a sliding window's blocks behind the window, in
    ``mamba_cache_mode="align"`` a state group's every state block but the last ones)
    and puts its null block (0) in their place; the ids the scheduler's outputs gave out
    (the fallback) still name the freed blocks, which may hold another group's or
    position's bytes by then.
    """

    def __init__(self) -> None:
        self.reqs: dict[str, dict[str, Any]] = {}

    def step(self, so: Any, manager: Any = None) -> list[dict[str, Any]]:
        """The requests whose prompt is fully computed by the step ``so`` schedules
        (``manager``: vLLM's KV cache manager, see the class doc)."""
        counts = so.num_scheduled_tokens
        ending = []
        for r in so.scheduled_new_reqs:
            prompt = len(r.prompt_token_ids or [])
            blocks = [list(ids) for ids in r.block_ids]
            state = {"prompt": prompt, "blocks": blocks, "first": r.num_computed_tokens}
            self.reqs[r.req_id] = state
            if r.num_computed_tokens < prompt <= r.num_computed_tokens + counts.get(r.req_id, 0):
                ending.append(r.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    state["blocks"] = [list(ids) for ids in new_ids]
                else:
                    for group, ids in zip(state["blocks"], new_ids, strict=False):
                        group.extend(ids)
            done = cached.num_computed_tokens[i]
            if done < state["prompt"] <= done + counts.get(req_id, 0):
                ending.append(req_id)
        out = [
            {
                "req": req_id,
                "prompt_tokens": self.reqs[req_id]["prompt"],
                "first_computed": self.reqs[req_id]["first"],
                "blocks": held_blocks(manager, req_id, self.reqs[req_id]["blocks"]),
            }
            for req_id in ending
        ]
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        return out


def held_blocks(manager: Any, req_id: str, given: list[list[int]]) -> list[list[int]]:
    """The request's block ids per group as vLLM's KV cache manager holds them now, or
    ``given`` (the ids the scheduler gave out) without a manager."""
    if manager is None:
        return [list(g) for g in given]
    return [list(g) for g in manager.get_block_ids(req_id)]


class KVProbe:
    """Worker side: hash the prompt's blocks in the paged caches and append them to a file.

    It reads vLLM's caches as vLLM 0.32 registers them with a KV connector (every layer's
    block ``b`` is row ``b`` of dimension 0), not as kvstore does:

    - an attention layer: ``[num_blocks * k, heads, tokens, C]``, ``k`` kernel blocks per
      block where the backend splits blocks (else 1); a block's hash covers its ``k``
      rows, every byte of them (K and V of its tokens);
    - a state layer (``MambaSpec``: Mamba2, gated delta-net): ``[num_blocks, 1, 1, C]``
      int8, each block's states (e.g. conv, then SSM / recurrent) packed from its start in
      the order of the spec's ``shapes`` and ``dtypes`` (``MambaBase.bind_kv_cache``). A
      block's hash covers those states' bytes, cut from the spec, and nothing after them:
      the padding of a page raised to the attention page's size (``page_size_padded``) is
      not state. At registration each state's offset is checked against the layer's own
      views (what its kernels read), where the engine has bound them.
    """

    def __init__(self, kv_cache_config: Any) -> None:
        self.config = kv_cache_config
        self.caches: dict[str, torch.Tensor] = {}
        directory = os.environ.get(PROBE_DIR_ENV)
        self.path = Path(directory) / f"probe-{os.getpid()}.jsonl" if directory else None

    def register(self, kv_caches: dict[str, torch.Tensor], layers: Any = None) -> None:
        """Keep the caches; ``layers`` (the engine's static forward context, by layer name)
        lets each state layer's cut be checked against the layer's own state views."""
        self.caches = dict(kv_caches)
        for group in self.config.kv_cache_groups:
            spec = group.kv_cache_spec
            if not is_state_spec(spec):
                continue
            for name in group.layer_names:
                cache = self.caches.get(name)
                if isinstance(cache, torch.Tensor):
                    check_state_cut(name, cache, spec, None if layers is None else layers.get(name))

    def record(self, probes: list[dict[str, Any]]) -> None:
        """Hash and write each ended prefill of ``probes``."""
        if self.path is None or not probes:
            return
        lines = [json.dumps(self._hashes(p)) for p in probes]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in lines))

    def _hashes(self, probe: dict[str, Any]) -> dict[str, Any]:
        groups: dict[str, Any] = {}
        num_blocks = int(self.config.num_blocks)
        for index, group in enumerate(self.config.kv_cache_groups):
            spec = group.kv_cache_spec
            size = int(spec.block_size)
            ids = probe["blocks"][index] if index < len(probe["blocks"]) else []
            full = min(probe["prompt_tokens"] // size, len(ids))
            layers, nbytes = {}, 0
            for name in sorted(group.layer_names):
                cache = self.caches.get(name)
                if not isinstance(cache, torch.Tensor):
                    continue
                block = block_reader(cache, spec, num_blocks)
                hashes = []
                for b in ids[:full]:
                    if not b:  # vLLM's null block: it holds nothing there
                        hashes.append(None)
                        continue
                    parts = block(b)
                    nbytes = sum(p.numel() for p in parts)
                    h = hashlib.sha256()
                    for part in parts:
                        h.update(part.numpy().tobytes())
                    hashes.append(h.hexdigest()[:24])
                layers[name] = hashes
            groups[str(index)] = {
                "kind": type(spec).__name__,
                "block_size": size,
                "block_bytes": nbytes,  # bytes hashed per block and layer (0: none held)
                "page_bytes": int(spec.page_size_bytes),
                "layers": layers,
            }
        out = {k: v for k, v in probe.items() if k != "blocks"}
        out["groups"] = groups
        return out


def is_state_spec(spec: Any) -> bool:
    """A recurrent-state spec (vLLM's ``MambaSpec``: Mamba, Mamba2, gated delta-net...)."""
    return hasattr(spec, "shapes") and hasattr(spec, "dtypes")


def state_cuts(spec: Any) -> list[tuple[int, int]]:
    """(offset, bytes) of each state of a block, from the spec's shapes and dtypes."""
    cuts, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        cuts.append((offset, nbytes))
        offset += nbytes
    return cuts


def block_rows(cache: torch.Tensor, num_blocks: int) -> int:
    """Rows of dimension 0 per block (kernel blocks per block: 1 unless split)."""
    rows = int(cache.shape[0])
    if rows < num_blocks or rows % num_blocks:
        raise ValueError(f"a cache of shape {tuple(cache.shape)} for {num_blocks} blocks")
    return rows // num_blocks


def block_reader(cache: torch.Tensor, spec: Any, num_blocks: int) -> Any:
    """``read(b)``: the byte tensors hashed for block ``b`` of one layer's cache."""
    k = block_rows(cache, num_blocks)
    if not is_state_spec(spec):
        return lambda b: [cache[b * k : (b + 1) * k].contiguous().view(torch.uint8).reshape(-1)]
    cuts = state_cuts(spec)
    if k != 1 or cache[0].numel() * cache.element_size() < sum(n for _, n in cuts):
        raise ValueError(f"a state cache of shape {tuple(cache.shape)} for {spec}")

    def read(b: int) -> list[torch.Tensor]:
        row = cache[b].reshape(-1).view(torch.uint8)
        return [row[o : o + n] for o, n in cuts]

    return read


def check_state_cut(name: str, cache: torch.Tensor, spec: Any, layer: Any) -> None:
    """The spec's cut of a state block starts where the layer's own state views do
    (checked on block 1; nothing to check where the layer's views are not bound)."""
    views = getattr(layer, "kv_cache", None)
    if not isinstance(views, (tuple, list)) or len(views) != len(spec.shapes):
        return
    for (offset, _), view in zip(state_cuts(spec), views, strict=True):
        if not isinstance(view, torch.Tensor) or view.shape[0] < 2:
            return
        if view[1].data_ptr() != cache[1].data_ptr() + offset:
            raise RuntimeError(f"the probe's cut of {name}'s state block is not its layer's")


def forward_context(vllm_config: Any) -> Any:
    """The engine's layers by name (None where there is no such config)."""
    return getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)


class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
    """The do-nothing connector (never a hit, never a save) with the KV probe."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._tracker = PrefillTracker()
        self._probe = KVProbe(kv_cache_config)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """No external hits."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Nothing to load."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The prefills this step ends, for the workers' probe."""
        return ProbeMetadata(self._tracker.step(scheduler_output, self._kv_cache_manager))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Nothing to save: free the blocks at once."""
        return False, None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the paged caches the probe reads."""
        self._probe.register(kv_caches, forward_context(self._vllm_config))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to load."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing to save."""

    def wait_for_save(self) -> None:
        """End of the step (after the draft's forward too): record the ended prefills."""
        meta = self._get_connector_metadata()
        self._probe.record(getattr(meta, "probes", []))


class KVStoreProbeConnector(KVStoreConnector):
    """kvstore's connector, and the KV probe after each step's loads and saves."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._tracker = PrefillTracker()
        self._probe = KVProbe(kv_cache_config)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """kvstore's step plan, and the prefills this step ends."""
        meta = super().build_connector_meta(scheduler_output)
        meta.probes = self._tracker.step(scheduler_output, self._kv_cache_manager)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """kvstore's registration; keep the caches for the probe."""
        super().register_kv_caches(kv_caches)
        self._probe.register(kv_caches, forward_context(self._vllm_config))

    def wait_for_save(self) -> None:
        """kvstore's end of step (loads checked, saves stored), then the probe."""
        super().wait_for_save()
        self._probe.record(getattr(self._get_connector_metadata(), "probes", []))
