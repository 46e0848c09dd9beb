"""KV probes for the vLLM examples and tests: connectors that record the engine's KV bytes.

At the step a request's prefill ends, after every forward of that step (the target
model's and a speculative draft's), a probe hashes each full block of the prompt
in every layer of every KV cache group and appends one JSON line to a file in
``$KV_PROBE_DIR`` (one file per worker process)::

    {"req": id, "prompt_tokens": n, "first_computed": tokens cached when it was first
     scheduled, "groups": {group: {"kind": spec class, "block_size": b,
     "layers": {layer: [sha256 prefix of each block, or null where vLLM holds no block]}}}}

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
import os
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

from kvstore.connectors.vllm import KVStoreConnector

PROBE_DIR_ENV = "KV_PROBE_DIR"  # not KVSTORE_*: those are store settings


class ProbeMetadata(KVConnectorMetadata):
    """The prefills that end this step (the do-nothing connector's only metadata)."""

    def __init__(self, probes: list[dict[str, Any]]) -> None:
        self.probes = probes


class PrefillTracker:
    """Scheduler side: each request's block ids per group, and the step its prefill ends."""

    def __init__(self) -> None:
        self.reqs: dict[str, dict[str, Any]] = {}

    def step(self, so: Any) -> list[dict[str, Any]]:
        """The requests whose prompt is fully computed by the step ``so`` schedules."""
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
                "blocks": [list(g) for g in self.reqs[req_id]["blocks"]],
            }
            for req_id in ending
        ]
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        return out


class KVProbe:
    """Worker side: hash the prompt's blocks in the paged caches and append them to a file."""

    def __init__(self, kv_cache_config: Any) -> None:
        self.config = kv_cache_config
        self.caches: dict[str, torch.Tensor] = {}
        directory = os.environ.get(PROBE_DIR_ENV)
        self.path = Path(directory) / f"probe-{os.getpid()}.jsonl" if directory else None

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
        for index, group in enumerate(self.config.kv_cache_groups):
            spec = group.kv_cache_spec
            size = int(spec.block_size)
            ids = probe["blocks"][index] if index < len(probe["blocks"]) else []
            full = min(probe["prompt_tokens"] // size, len(ids))
            layers = {}
            for name in sorted(group.layer_names):
                cache = self.caches.get(name)
                if isinstance(cache, torch.Tensor):
                    layers[name] = [self._block_hash(cache, b) if b else None for b in ids[:full]]
            groups[str(index)] = {"kind": type(spec).__name__, "block_size": size, "layers": layers}
        out = {k: v for k, v in probe.items() if k != "blocks"}
        out["groups"] = groups
        return out

    def _block_hash(self, cache: torch.Tensor, block: int) -> str:
        dim = list(cache.shape).index(int(self.config.num_blocks))
        data = cache.select(dim, block).contiguous().view(torch.uint8)
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:24]


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
        return ProbeMetadata(self._tracker.step(scheduler_output))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """Nothing to save: free the blocks at once."""
        return False, None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the paged caches the probe reads."""
        self._probe.caches = dict(kv_caches)

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
        meta.probes = self._tracker.step(scheduler_output)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """kvstore's registration; keep the caches for the probe."""
        super().register_kv_caches(kv_caches)
        self._probe.caches = dict(kv_caches)

    def wait_for_save(self) -> None:
        """kvstore's end of step (loads checked, saves stored), then the probe."""
        super().wait_for_save()
        self._probe.record(getattr(self._get_connector_metadata(), "probes", []))
