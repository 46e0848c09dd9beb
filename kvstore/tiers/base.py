"""The tier interface: one medium, whole blocks in and out, no policy.

A tier stores blocks of one :class:`~kvstore.layout.KVLayout` under 16-byte
keys. It does not decide what to keep: the block manager tells it what to
put, read and delete, and keeps its own index of which tier holds what.

Blocks cross this interface as tensors of ``layout.block_shape`` (any
strides, any device): ``put`` copies *from* such views, ``get`` copies
*into* them, optionally only a range of layers (``layers=(first, last)``
gives views of shape ``(last - first, *block_shape[1:])``). Batches are
lists so a tier can pipeline them (one disk round trip or one network round
trip for the batch, not one per block).

Failures: a batch method returns one bool per key (True: stored / read and
verified) so that one bad block costs one miss, not the batch. A tier raises
:class:`~kvstore.errors.TierError` only when the whole medium is unusable.
It never hands back bytes that failed verification.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvstore.config import TierConfig
from kvstore.errors import ConfigError
from kvstore.format import BlockEncoding, decode_seconds_per_byte
from kvstore.hints import Hint
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.layout import KVLayout

__all__ = ["LayerRange", "Tier"]

#: ``(first, last)``: layers ``first <= l < last``; None means all layers.
LayerRange = tuple[int, int] | None


class Tier(ABC):
    """One storage medium holding blocks of a single layout.

    Subclasses implement the five abstract primitives; the rest has working
    defaults. Concurrency: every method may be called from many threads at
    once. The manager never deletes a key while a ``get`` of it is in flight
    (it pins blocks while reading them).
    """

    #: The ``kind`` name in the config's tier list.
    kind: str = ""
    #: True if blocks survive the process (the manager re-indexes them on open).
    persistent: bool = False
    #: True if other processes may add blocks while we run (the manager asks the
    #: tier about keys its index lacks before calling them misses).
    shared: bool = False
    #: True for media of this machine (memory, local disks): a cluster node
    #: publishes the blocks it holds in these. False for S3, Redis, a server.
    local: bool = True
    #: False for a tier whose blocks the manager must not copy up on reads by
    #: itself (another node's blocks: the cluster decides where copies go).
    promotable: bool = True
    #: The :class:`~kvstore.format.sealing.BlockCipher` sealing what this tier stores
    #: (encryption at rest, set by :meth:`encrypt_with`); None: blocks are stored plain.
    cipher: Any = None

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        #: The lossy encoding this tier stores blocks in (its ``encoding:``; None: the
        #: layout's bytes). A layout it cannot encode is a ConfigError here, at open.
        self.encoding: BlockEncoding | None = None
        if config.encodable:  # the disk, Redis and S3 configs: encoding and group_size
            self.encoding = BlockEncoding.parse(
                getattr(config, "encoding", "none"), getattr(config, "group_size", 0)
            )
            if self.encoding is not None:
                self.encoding.check(layout)

    def stored_bytes(self) -> tuple[float, float]:
        """What a read of this tier moves and costs per byte of the layout's: the bytes
        stored per byte (below 1 for an encoded tier) and the seconds a byte takes to
        decode (measured on this machine once per encoding and layout; 0 unencoded).
        Restore planning prices the tier's reads with them."""
        if self.encoding is None:
            return 1.0, 0.0
        stored = self.encoding.layer_nbytes(self.layout) / self.layout.layer_nbytes
        return stored, decode_seconds_per_byte(self.encoding, self.layout)

    def encrypt_with(self, cipher: Any) -> None:
        """Seal every block stored from now on with ``cipher`` (a
        :class:`~kvstore.format.sealing.BlockCipher`), and open only sealed ones; set before
        the store indexes the tier. Tiers that keep blocks at rest override this."""
        raise ConfigError(f"the {self.kind} tier does not encrypt (it is not at rest)")

    def stale_keys(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Of ``keys``, just read, those sealed under a key that is no longer the
        active one (the re-encryption rewrites them); none for a plain tier."""
        if self.cipher is None:
            return []
        return [BlockKey(k) for k in self.cipher.take_stale(keys)]

    # -- sizes --------------------------------------------------------------
    def blocks_in(self, capacity: int, unit: int | None = None, what: str = "block") -> int:
        """How many blocks of ``unit`` bytes (``layout.block_nbytes`` by default) fit in
        ``capacity`` bytes; :class:`~kvstore.errors.ConfigError` if not even one does.
        The one capacity check every tier makes when it opens."""
        unit = self.layout.block_nbytes if unit is None else unit
        blocks = capacity // unit
        if blocks < 1:
            raise ConfigError(
                f"{self.kind} tier capacity {capacity} bytes is smaller than one {what} "
                f"({unit} bytes for this layout); give the tier a capacity of at least that"
            )
        return blocks

    @property
    @abstractmethod
    def capacity_blocks(self) -> int:
        """How many blocks this tier can hold."""

    @property
    def device(self) -> torch.device | None:
        """Where this tier's bytes live, for memory tiers; None otherwise."""
        return None

    # -- the primitives -----------------------------------------------------
    @abstractmethod
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]``; True where stored (or already present)."""

    @abstractmethod
    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
    ) -> list[bool]:
        """Copy each stored block (or its ``layers``) into ``outs[i]``; False = miss."""

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove ``keys``; absent keys are ignored."""

    @abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` this tier holds."""

    @abstractmethod
    def stored_keys(self) -> Iterator[BlockKey]:
        """Every key held now (used to rebuild the index of a persistent tier)."""

    # -- hooks with defaults ------------------------------------------------
    def view(self, key: BlockKey) -> torch.Tensor | None:
        """Zero-copy view of a stored block, for memory tiers; None if not possible.

        The view stays valid only while the block is pinned by the manager.
        """
        return None

    def reserve(self, keys: Sequence[BlockKey]) -> list[torch.Tensor | None]:
        """Two-step store, step 1: room for ``keys``, as writable block views to fill
        (e.g. layer by layer as prefill produces them); None where the tier cannot
        hand out its memory -- the default, for media that are not memory.

        Reserved keys are invisible until :meth:`commit`. Like every tier call,
        ``reserve``, ``commit`` and ``abort`` run with the books' lock released
        (through :class:`~kvstore.datapath.tierio.TierIO`), so they may take time.
        """
        return [None] * len(keys)

    def commit(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Two-step store, step 2: publish reserved, now filled, ``keys``."""
        return [False] * len(keys)

    def abort(self, keys: Sequence[BlockKey]) -> None:
        """Give back the room reserved for ``keys`` (nothing to do by default)."""

    def note_tokens(self, tokens: ChunkTokens) -> None:
        """Which tokens the chunks ``tokens.keys`` hold, told before they are put, for
        the KV events of whatever stands behind the tier (a kvstore-server publishes
        them). Nothing to do by default: the tier stores bytes, not tokens."""

    def hint(self, keys: Sequence[BlockKey], hint: Hint) -> None:
        """A session hint for ``keys``, which this tier holds, passed on to whatever
        stands behind it (a kvstore-server retains, demotes or prefetches them in its
        own tiers). Nothing to do by default: the store's own eviction honours it."""

    def stats(self) -> dict[str, Any]:
        """Tier-specific counters (I/O errors, bytes on disk, ...)."""
        return {}

    def refusal(self) -> str | None:
        """Why some of this tier's blocks cannot be read now because a server refuses
        the token (one line naming it), for a tier that turns such refusals into misses
        itself instead of raising :class:`~kvstore.errors.AccessDeniedError` (the
        cluster tier, whose peers each answer for themselves); None otherwise."""
        return None

    def prepare_close(self) -> None:
        """The store is closing: what it writes from now on (the flush of blocks only
        memory holds) is not read back by this process. Nothing to do by default."""

    def close(self) -> None:
        """Release the medium's resources. Idempotent."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} kind={self.kind} capacity_blocks={self.capacity_blocks}>"
