"""Speed probes: background reads that measure a tier's read speed for restore planning
(a stale estimate refreshed; a local disk found holding blocks at open, measured before the
first restore after a restart weighs it)."""

from __future__ import annotations

import dataclasses

import torch

from kvstore.config import RestoreConfig
from kvstore.datapath.books import Books
from kvstore.datapath.mover import Mover
from kvstore.datapath.reader import Reader
from kvstore.datapath.tierio import TierIO
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout

__all__ = ["PROBE_LAYER_CALLS", "SpeedProbes", "declares_speed"]

#: Calls of one layer a probe makes before reading its block whole.
PROBE_LAYER_CALLS = 4


def declares_speed(config: object) -> bool:
    """Whether a tier's config sets ``read_gbps`` or ``read_latency_ms`` to other than its
    kind's default (a value equal to the default counts as the default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    return any(
        name in defaults and getattr(config, name) != defaults[name]
        for name in ("read_gbps", "read_latency_ms")
    )


class SpeedProbes:
    """Queues probes on the manager's mover; reads through its reader (so a probe is
    timed by :class:`~kvstore.datapath.tierio.TierIO` like any read)."""

    def __init__(
        self, layout: KVLayout, reader: Reader, mover: Mover, restore: RestoreConfig
    ) -> None:
        self.layout = layout
        self.reader = reader
        self.mover = mover
        self.restore = restore
        self.books: Books = reader.books
        self.io: TierIO = reader.io

    def probe(self, key: BlockKey) -> bool:
        """Read ``key`` into scratch memory in the background, refreshing its tier's read
        speed; False if a probe of it is queued already. It reads as restores do: a few
        calls of one layer, then the whole block, so that the estimate's fit tells the
        tier's latency a call from its bandwidth (a local disk under O_DIRECT: 6-7 ms a
        call of one layer of many blocks, measured on an H200 machine)."""
        shape, dtype = self.layout.block_shape, self.layout.dtype
        layers = min(PROBE_LAYER_CALLS, self.layout.num_layers)

        def read() -> None:
            out = torch.empty(shape, dtype=dtype)
            for layer in range(layers if self.layout.num_layers > 1 else 0):
                self.reader.load([key], [out[layer : layer + 1]], (layer, layer + 1), True)
            self.reader.load([key], [out], None, True)

        return self.mover.submit(read, key=("probe", key))

    def probe_at_open(self) -> int:
        """Probe (:meth:`probe`) each tier of this machine below memory that holds blocks
        from an earlier run while its read speed is still its kind's default guess, so that
        the first restore after a restart plans with what the tier does; how many probes
        were queued. A speed the config declares for the tier stands until the workload's
        own reads measure it (an operator may declare a disk as slow as it is under load).
        Only where planning is on with a declared prefill speed: a learned one is
        unknown after a restart, so the first restores load every chunk, measuring the
        tier as they do."""
        restore = self.restore
        declared = restore.prefill_table is not None or restore.prefill_tokens_per_s is not None
        if not (restore.planning and declared):
            return 0
        speeds = self.io.speeds_now()
        unmeasured = {
            level
            for level, tier in enumerate(self.io.tiers)
            if tier.device is None
            and tier.local
            and speeds[level].source == "configured"
            and not declares_speed(tier.config)
        }
        queued = 0
        for key in self.books.queries.stored_keys(local=True) if unmeasured else ():
            where = self.books.queries.where(key)
            if where and where[0] in unmeasured:
                unmeasured.discard(where[0])
                queued += self.probe(key)
                if not unmeasured:
                    break
        return queued
