"""Hybrid models' recurrent state (Mamba2, gated delta-net) stored per chunk, beside its KV.

A prefix of a hybrid model resumes only with the attention KV of all its tokens
*and* the recurrent state after its last token. vLLM's ``mamba_cache_mode="align"``
keeps that state per block: the state after ``(p + 1) * block_size`` tokens
sits in block ``p`` of the state group's (position-indexed) block table, and a
request that resumes at ``T`` tokens reads its state from block ``T / block_size - 1``.

kvstore does the same per chunk: after a step that ends on a chunk boundary,
the workers save every state layer's bytes of that boundary's block as one
*state block* (:class:`StateTransfer`), keyed by the chunk's attention key (so
it inherits the namespace: model, every group's spec, TP rank, adapter, salt)
hashed with the state layout's fingerprint. The scheduler serves the longest
stored prefix whose last chunk has its state (:class:`StateLookup`), never the
whole prompt (the engine computes its last token itself, and a hit must end on a
block boundary); the load writes the state into the block vLLM allocated there.

State blocks live in a second :class:`~kvstore.store.KVStore` on the store's
shared tiers (disk, Redis, S3...; its own layout directory on disk), so they take
no host memory of their own: one "layer" per state layer, one "token" per chunk,
the layer's state as raw bytes (padded to the largest layer).

Engine-independent: vLLM's state caches are passed in as per-layer
``[num_blocks, ...]`` byte pages (the raw ``[B, 1, 1, page]`` int8 views vLLM
registers for its Mamba layers, each block's states packed at its start).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import torch
import xxhash

from kvstore.config import StoreConfig
from kvstore.connectors.paged import NULL_BLOCK
from kvstore.connectors.plan import TransferSpec
from kvstore.connectors.settings import Counters
from kvstore.connectors.transfer import TransferWorker
from kvstore.connectors.vllm_state import StateGroup
from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.layout import KVLayout
from kvstore.store import KVStore

__all__ = ["StateLookup", "StateTransfer", "state_key", "state_layout"]

log = logging.getLogger(f"vllm.{__name__}")


def state_layout(states: Sequence[StateGroup]) -> KVLayout:
    """The layout of one state block: every state layer's bytes, one "token" per chunk."""
    layers = sum(len(g.layer_names) for g in states)
    width = max(g.layer_nbytes for g in states)
    return KVLayout(
        num_layers=layers,
        num_kv_heads=1,
        head_dim=width,
        block_tokens=1,
        dtype=torch.uint8,
        kv_factor=1,
    )


def state_key(key: BlockKey, layout: KVLayout) -> BlockKey:
    """The state block's key of the chunk whose attention key is ``key``."""
    return BlockKey(xxhash.xxh3_128_digest(layout.fingerprint + b"state" + key)[:KEY_BYTES])


class StateLookup:
    """The scheduler's view of the stored states (the shared tiers, read only)."""

    def __init__(self, states: Sequence[StateGroup], shared: StoreConfig, chunk_tokens: int):
        self.layout = state_layout(states)
        self.store = KVStore(self.layout, shared)
        self.chunk_tokens = chunk_tokens

    def longest(self, keys: dict[int, list[BlockKey]], stored: int, prompt_len: int) -> int:
        """The most leading chunks (at most ``stored``, whose KV every rank holds) that
        end on a stored state for every rank, short of the prompt's last token."""
        n = min(stored, (prompt_len - 1) // self.chunk_tokens)
        while n > 0:
            wanted = [state_key(ks[n - 1], self.layout) for ks in keys.values()]
            if self.store.lookup(wanted, recheck=True) == len(wanted):
                return n
            n -= 1
        return 0

    def close(self) -> None:
        """Close the store."""
        self.store.close()


class StateTransfer:
    """A worker's state saves and loads (see the module doc).

    Args:
        states: the engine's recurrent-state groups.
        config: the worker's store config (the attention store's tiers).
        rank: which keys of a spec are this worker's.
        block_size: the engine's block size (state and attention alike).
        counters: where the transfer counts go.
        audit_dir: with it, each saved and loaded state block's digests per group go
            to ``<audit_dir>/kvstore-state-<pid>.jsonl`` (tests compare them).
    """

    def __init__(
        self,
        states: Sequence[StateGroup],
        config: StoreConfig,
        rank: int,
        block_size: int,
        counters: Counters,
        audit_dir: str | None = None,
    ) -> None:
        self.states = tuple(states)
        self.layout = state_layout(states)
        self.store = KVStore(self.layout, config)
        self.rank = rank
        self.block_size = block_size
        self.counters = counters
        self._audit = (
            os.path.join(audit_dir, f"kvstore-state-{os.getpid()}.jsonl") if audit_dir else None
        )
        self._pages: list[torch.Tensor] = []  # per state layer: [num_blocks, page bytes]

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Attach vLLM's state caches: per layer, each block's bytes as one row."""
        pages = []
        for g in self.states:
            for name in g.layer_names:
                cache = kv_caches.get(name)
                if cache is None:
                    raise ConfigError(f"vLLM registered no state cache for layer {name}")
                rows = cache.view(cache.shape[0], -1).view(torch.uint8)
                if rows.shape[1] < g.layer_nbytes:
                    raise ConfigError(
                        f"state cache of {name}: {rows.shape[1]} bytes a block, the spec "
                        f"needs {g.layer_nbytes}"
                    )
                pages.append(rows)
        self._pages = pages

    def _blocks(self, spec: TransferSpec) -> list[int] | None:
        """Per state group, the block holding the state at ``spec.token_end`` (None: a
        group has none there)."""
        position = spec.token_end // self.block_size - 1 - spec.block_offset
        out = []
        for g in self.states:
            ids = spec.block_ids[g.index] if g.index < len(spec.block_ids) else []
            if not 0 <= position < len(ids) or ids[position] == NULL_BLOCK:
                return None
            out.append(ids[position])
        return out

    def _layers(self, blocks: list[int]) -> list[tuple[StateGroup, int, int]]:
        """(group, our layer, engine block) of every state layer."""
        out, layer = [], 0
        for g, block in zip(self.states, blocks, strict=True):
            for _ in g.layer_names:
                out.append((g, layer, block))
                layer += 1
        return out

    def load_all(self, loads: Sequence[TransferSpec], worker: TransferWorker) -> None:
        """After ``worker`` loaded this step's whole loads: their states, or the request
        fails (vLLM recomputes it). A hybrid's loads are always whole (several groups)."""
        for spec in loads:
            if worker.whole_load_failed(spec.req_id):
                continue
            if not spec.whole or not self.load(spec):
                worker.fail_load(spec)

    def save_all(self, saves: Sequence[TransferSpec], flush: bool) -> None:
        """After ``saves``' KV: the states at their ends (``flush``: visible at once)."""
        saved = sum(self.save(spec) for spec in saves)
        if saved and flush:
            self.flush()

    def save(self, spec: TransferSpec) -> bool:
        """Store the state at the end of ``spec``'s last chunk, if this step ended there
        (only then does vLLM's block hold exactly that state)."""
        keys = spec.keys.get(self.rank)
        if not keys or spec.step_end != spec.token_end or not self._pages:
            return False
        blocks = self._blocks(spec)
        if blocks is None:
            self.counters.add("state_save_no_block")
            return False
        key = state_key(keys[-1], self.layout)
        if self.store.engine.datapath.contains(key):
            return True
        block = torch.zeros(self.layout.tensor_shape(1), dtype=torch.uint8)
        for g, layer, b in self._layers(blocks):
            block[layer, 0, 0, 0, : g.layer_nbytes] = self._pages[layer][b, : g.layer_nbytes]
        try:
            stored = self.store.put([key], block) == 1
        except Exception:  # a failed save is a future miss, never an engine error
            log.exception("kvstore: saving the state of request %s failed", spec.req_id)
            stored = False
        self.counters.add("state_saved_blocks" if stored else "state_save_errors")
        if stored:
            self._record("save", key, block)
        return stored

    def load(self, spec: TransferSpec) -> bool:
        """Write the state at ``spec.token_end`` into the blocks vLLM allocated there."""
        keys = spec.keys.get(self.rank)
        blocks = self._blocks(spec)
        if not keys or blocks is None or not self._pages:
            self.counters.add("state_load_errors")
            return False
        key = state_key(keys[-1], self.layout)
        try:
            block = self.store.get([key])
        except Exception:  # the engine recomputes the request
            log.exception("kvstore: loading the state of request %s failed", spec.req_id)
            block = None
        if block is None or block.shape[2] != 1:
            self.counters.add("state_load_errors")
            return False
        for g, layer, b in self._layers(blocks):
            self._pages[layer][b, : g.layer_nbytes] = block[layer, 0, 0, 0, : g.layer_nbytes]
        self.counters.add("state_loaded_blocks")
        # What the engine now holds, read back from its blocks.
        check = torch.zeros_like(block)
        for g, layer, b in self._layers(blocks):
            check[layer, 0, 0, 0, : g.layer_nbytes] = self._pages[layer][b, : g.layer_nbytes]
        self._record("load", key, check)
        return True

    def _record(self, op: str, key: BlockKey, block: torch.Tensor) -> None:
        """Audit one state block: its bytes' digest per group (``audit_dir`` only)."""
        if self._audit is None:
            return
        digests, layer = {}, 0
        for g in self.states:
            part = block[layer : layer + len(g.layer_names)].contiguous()
            digests[str(g.index)] = xxhash.xxh3_64_hexdigest(part.numpy().tobytes())
            layer += len(g.layer_names)
        line = json.dumps({"op": op, "key": key.hex(), "groups": digests})
        try:
            os.makedirs(os.path.dirname(self._audit), exist_ok=True)
            with open(self._audit, "a") as f:
                f.write(line + "\n")
        except OSError as exc:  # auditing must never break serving
            log.warning("kvstore: cannot write %s: %s", self._audit, exc)

    def flush(self) -> None:
        """Make saved states visible to the scheduler (other processes)."""
        try:
            self.store.flush()
        except Exception:
            log.exception("kvstore: flushing states failed")
            self.counters.add("flush_errors")

    def close(self) -> None:
        """Close the store (flushing it)."""
        self.store.close()
