"""Speed probes: a few small background reads of one block that measure its tier for
restore planning, when its estimate is stale (so a tier the plans priced out is found
again once it got faster) or when a local disk holds blocks from an earlier run. Each
size is read a few times and the fastest kept: noise (other work on the
cores, the GIL) only adds time, so no probe waits for a quiet machine
(:func:`~kvstore.restore.speeds.fastest_reads`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvstore.config import RestoreConfig
from kvstore.datapath.mover import Mover
from kvstore.datapath.reader import Reader
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.restore import PROBE_LAYERS, fastest_reads

__all__ = ["SpeedProbes", "declares_speed"]


def declares_speed(config: object, restore: RestoreConfig, tier_id: str) -> bool:
    """Whether the config declares a tier's read speed: ``restore.tier_speeds`` names it,
    or its ``read_gbps`` / ``read_latency_ms`` differ from its kind's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    return restore.declared_speed(tier_id) is not None or any(
        name in defaults and getattr(config, name) != defaults[name]
        for name in ("read_gbps", "read_latency_ms")
    )


class SpeedProbes:
    """Queues probes on the manager's mover; each reads through its reader."""

    def __init__(
        self, layout: KVLayout, reader: Reader, mover: Mover, restore: RestoreConfig
    ) -> None:
        self.layout = layout
        self.reader = reader
        self.mover = mover
        self.restore = restore

    def probe(self, key: BlockKey) -> bool:
        """Read ``key`` in the background to measure the tier of its fastest copy; False
        if ``key`` is not stored or a probe of that tier is queued or running already
        (one at a time: a second would only load the tier, and the link, with the same
        figures). The tier's estimate starts over from what the probe read unless reads
        measured it meanwhile (then the probe's figures join theirs)."""
        where = self.reader.books.queries.where(key)
        if not where:
            return False
        return self.mover.submit(lambda: self._run(key), key=("probe", where[0]))

    def probe_tier(self, keys: Sequence[BlockKey], level: int) -> bool:
        """Probe tier ``level`` with the first of ``keys`` whose fastest copy it holds,
        found by asking that tier in the background (a plan that did not ask a slow tier
        keeps its round trip off the caller's path); False if a probe of it is queued or
        running already."""
        keys = list(keys)
        others = ~(1 << level)

        def job() -> None:
            self.reader.finder.discover(keys, skip=others)
            where = self.reader.books.queries.where
            key = next((k for k in keys if where(k)[:1] == [level]), None)
            if key is not None:
                self._run(key)

        return self.mover.submit(job, key=("probe", level))

    def _run(self, key: BlockKey) -> None:
        books, io = self.reader.books, self.reader.io
        where = books.queries.where(key)
        samples = self._fastest_reads(key) if where else None
        if samples is not None and books.queries.where(key)[:1] == where[:1]:
            io.probed(where[0], samples)  # else gone, failed or moved: not that tier's

    def _fastest_reads(self, key: BlockKey) -> list[tuple[float, float]] | None:
        layout, io = self.layout, self.reader.io
        out = torch.zeros(layout.block_shape, dtype=layout.dtype)  # touched: no first-touch
        # One layer and a few; the whole block where those took about as long (a link's
        # latency hiding its bandwidth), as the loads of such a tier read a block a call.
        sizes = sorted({1, min(PROBE_LAYERS, layout.num_layers), layout.num_layers})

        def read(layers: int) -> bool:
            span = (0, layers) if layers < layout.num_layers else None
            return bool(self.reader.load([key], [out[:layers]], span, True).count)

        with io.unobserved():
            return fastest_reads(read, sizes, layout.layer_nbytes, until_seen=True)

    def probe_at_open(self) -> int:
        """Probe each tier of this machine below memory that holds blocks from an earlier
        run while its speed is its kind's guess, so the first restore after a restart
        plans with what the tier does; how many probes were queued. Only with planning
        on and a declared prefill speed (a learned one is unknown after a restart: the
        first restores load every chunk and measure the tier as they do)."""
        restore, io, queries = self.restore, self.reader.io, self.reader.books.queries
        declared = restore.prefill_table is not None or restore.prefill_tokens_per_s is not None
        if not (restore.planning and declared):
            return 0
        speeds, ids = io.speeds_now(), io.tier_ids()
        unmeasured = {
            level
            for level, tier in enumerate(io.tiers)
            if tier.device is None
            and tier.local
            and speeds[level].source == "configured"
            and not declares_speed(tier.config, restore, ids[level])
        }
        queued = 0
        for key in queries.stored_keys(local=True) if unmeasured else ():
            where = queries.where(key)
            if where and where[0] in unmeasured:
                unmeasured.discard(where[0])
                queued += self.probe(key)
                if not unmeasured:
                    break
        return queued
