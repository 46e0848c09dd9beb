"""Blocks arriving at the blocking client: inline blocks read off the socket straight
into the caller's tensors and verified a group at a time (:func:`receive`,
:class:`Arrival`), shared-memory slots seen as tensors (:func:`slot_tensor`) and
copied out of shared memory a batch at a time (:func:`copy_from_shm`).

Apart from :mod:`kvstore.client.sync` because this is the byte-level half of a GET
(and of a shared-memory PUT): it knows the wire's block format and the
connection's scatter reads, and nothing of the pool, the retries or the breaker.
"""

from __future__ import annotations

import array
import logging
from collections.abc import Sequence

import torch

from kvstore.client.connection import Connection
from kvstore.copies import engine_for, plain_bytes
from kvstore.errors import CorruptBlockError, LayoutMismatchError, ProtocolError
from kvstore.format import layer_pieces, verify_layers
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.native import memcopy
from kvstore.wire import Mapping as ShmMapping
from kvstore.wire import pieces_of, read_header, wire_nbytes

__all__ = ["RECV_GROUP", "Arrival", "copy_from_shm", "receive", "slot_tensor"]

# The client's logger: a damaged block is said where it always was.
log = logging.getLogger("kvstore.client.sync")
#: Bytes read before the blocks read are verified (puts send groups of this size too).
RECV_GROUP = 4 * 1024**2


class Arrival:
    """One inline block on its way in: where its header and bytes go, then the check."""

    def __init__(
        self,
        key: BlockKey,
        out: torch.Tensor,
        target: torch.Tensor,
        pieces: list[list[memoryview]],
        head: bytearray,
    ) -> None:
        self.key, self.out, self.target, self.pieces, self.head = key, out, target, pieces, head
        self.views = [memoryview(head), *(p.cast("B") for layer in pieces for p in layer)]
        self.nbytes = sum(v.nbytes for v in self.views)

    @classmethod
    def prepare(
        cls, layout: KVLayout, key: BlockKey, out: torch.Tensor, layers: tuple[int, int] | None
    ) -> Arrival:
        """Buffers for ``key``'s header and bytes: ``out`` itself, or a host buffer."""
        head = bytearray(wire_nbytes(layout, layers) - _span_nbytes(layout, layers))
        pieces = layer_pieces(out)
        target = out
        if pieces is None:  # a GPU tensor or an odd view: through a host buffer
            target = torch.empty(tuple(out.shape), dtype=layout.dtype)
            pieces = pieces_of(target)
        return cls(key, out, target, pieces, head)

    def finish(self, layout: KVLayout, layers: tuple[int, int] | None) -> bool | None:
        """Verify what arrived; copy it out of a host buffer; None if damaged."""
        try:
            header = read_header(self.head, layout, self.key)
            verify_layers(header, self.pieces, layers[0] if layers is not None else 0)
        except (CorruptBlockError, LayoutMismatchError) as exc:
            log.warning("kvstore client: block %s arrived damaged: %s", self.key.hex(), exc)
            return None
        if self.target is not self.out:
            engine_for(self.out.device).copy_all([(self.out, self.target)])
        return True


def receive(
    conn: Connection,
    layout: KVLayout,
    keys: list[BlockKey],
    outs: list[torch.Tensor],
    idxs: list[int],
    layers: tuple[int, int] | None,
) -> list[bool | None]:
    """The inline blocks ``idxs``, in order: each one's header, then its bytes straight
    into ``outs[i]`` (a host buffer for GPU or odd views), by scatter reads of a few
    MiB at a time, each group verified before the next is read -- so the server
    refills the socket while this thread checks (None: arrived damaged)."""
    done: list[bool | None] = []
    group: list[Arrival] = []
    size = 0
    for i in idxs:
        group.append(Arrival.prepare(layout, keys[i], outs[i], layers))
        size += group[-1].nbytes
        if size >= RECV_GROUP:
            done += _receive_group(conn, layout, group, layers)
            group, size = [], 0
    return done + _receive_group(conn, layout, group, layers)


def _receive_group(
    conn: Connection, layout: KVLayout, group: list[Arrival], layers: tuple[int, int] | None
) -> list[bool | None]:
    if not group:
        return []
    conn.recv_scatter([view for arrival in group for view in arrival.views])
    return [arrival.finish(layout, layers) for arrival in group]


def slot_tensor(
    mapping: ShmMapping,
    layout: KVLayout,
    offset: int,
    shape: Sequence[int],
    nbytes: int | None = None,
) -> torch.Tensor:
    """The block (or layers) at ``offset`` in shared memory, as a tensor of ``shape``."""
    size = layout.block_nbytes if nbytes is None else nbytes
    return mapping.slot(offset, size).view(layout.dtype).view(*shape)


def copy_from_shm(
    mapping: ShmMapping, layout: KVLayout, pairs: Sequence[tuple[torch.Tensor, int]], span: int
) -> None:
    """Copy ``span`` bytes at each ``(out, offset)``'s offset in shared memory into ``out``.

    Plain contiguous host ``outs`` (what an engine's connector and the benchmarks pass)
    go to C in one call made from addresses: a slot tensor per block and the copy
    engine's checks of each pair cost ~30 us a block in Python under load, a sixth of
    the copy of a 1 MiB block. Anything else goes through the copy engine.
    """
    table = _direct_table(mapping, pairs, span)
    if table is not None:
        memcopy.copy_regions(table, torch.get_num_threads())
        return
    engine_for("cpu").copy_all(
        [(out, slot_tensor(mapping, layout, offset, out.shape, span)) for out, offset in pairs]
    )


def _direct_table(
    mapping: ShmMapping, pairs: Sequence[tuple[torch.Tensor, int]], span: int
) -> array.array[int] | None:
    """(dst, src, nbytes) address triples for ``pairs``; None where a plain memcpy would
    not do what ``copy_`` does (no compiled helper, an output that is not ``span``
    plain bytes of host memory, outputs that overlap)."""
    if memcopy is None or not pairs:
        return None
    size = mapping.tensor.numel()
    base = mapping.tensor.data_ptr()
    table = array.array("Q")
    ends: list[tuple[int, int]] = []
    for out, offset in pairs:
        if offset < 0 or offset + span > size:
            raise ProtocolError(f"shared-memory range {offset}+{span} outside the segment")
        if not plain_bytes(out) or out.numel() * out.element_size() != span:
            return None
        table.extend((out.data_ptr(), base + offset, span))
        ends.append((out.data_ptr(), out.data_ptr() + span))
    ends.sort()
    if any(ends[i][1] > ends[i + 1][0] for i in range(len(ends) - 1)):
        return None
    return table


def _span_nbytes(layout: KVLayout, layers: tuple[int, int] | None) -> int:
    first, last = layers if layers is not None else (0, layout.num_layers)
    return (last - first) * layout.layer_nbytes
