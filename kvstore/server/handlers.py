"""The data requests of kvstore-server: PUT, RESERVE/COMMIT, GET/RELEASE, the key queries
and HINT.

Bytes never take a detour through a buffer of the server's own where a tier
can hold them directly:

- PUT reserves each new block's slot first (``KVStore.engine.begin_put``), then
  receives its bytes straight into that slot, verifies every layer against
  the block's header, and only then commits it (visible to lookups). A block
  that fails verification is dropped and answered CORRUPT; nothing else
  changes.
- GET lends the blocks (``KVStore.engine.lend``: pinned, not copied) and sends
  each from the memory that holds it; blocks only a disk holds are read
  (verified) into a staging buffer first. With shared memory, a same-host
  client is told where each block lies instead, copies it itself, and sends
  RELEASE; an unreleased loan ends with its lease or the connection.
- RESERVE/COMMIT is PUT through shared memory: the client copies into the
  slots it was given, then COMMIT publishes them (blocks the host tier could
  not take come inline in COMMIT's payload, verified like PUT's).

Each handler is handed the connection as a :class:`~kvstore.server.session.Session`
(what a handler may use of it), so this module never imports the connection's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.datapath.contracts import Loan, PendingPut
from kvstore.errors import CorruptBlockError, InvalidInputError, LayoutMismatchError, ProtocolError
from kvstore.hints import HintAnswer, parse_hint
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.server.channel import Buffer
from kvstore.server.session import Refused, Reservation, Session
from kvstore.server.staging import StagingPool
from kvstore.server.stores import HostedStore
from kvstore.wire import (
    Flag,
    Frame,
    HeaderCache,
    Op,
    SlotStatus,
    Status,
    decode_commit_request,
    decode_count,
    decode_get_request,
    decode_hint_request,
    decode_keys,
    decode_tokens,
    decode_u64,
    encode_count,
    encode_get_reply,
    encode_json,
    encode_put_reply,
    encode_reserve_reply,
    encode_span,
    read_header,
    verify_span,
    wire_nbytes,
)

if TYPE_CHECKING:
    from kvstore.store import KVStore
    from kvstore.tiers import SharedSegment

__all__ = [
    "CONCURRENT",
    "abort_all",
    "commit",
    "expire_reservations",
    "hold_dropped",
    "note_tokens",
    "put",
    "release",
]

log = logging.getLogger(__name__)


# -- PUT ---------------------------------------------------------------------
async def put(conn: Session, frame: Frame, meta: bytes) -> None:
    """Receive whole blocks into reserved slots, verify, commit."""
    hosted = conn.store
    each = wire_nbytes(hosted.layout)
    try:
        keys = decode_keys(meta, 0, conn.ctx.server.max_batch_blocks)
        if frame.payload_len != len(keys) * each:
            raise ProtocolError(
                f"PUT of {len(keys)} blocks needs {len(keys) * each} payload bytes, "
                f"got {frame.payload_len}"
            )
    except ProtocolError:
        await conn.chan.discard(frame.payload_len, conn.deadline(frame.payload_len))
        raise
    await _acquire(conn, frame.payload_len)
    try:
        pending = await conn.run(hosted.store.engine.begin_put, keys)
        try:
            got = await _receive_blocks(conn, frame, pending.views)
        except BaseException:
            await conn.run(pending.abort)
            raise
    finally:
        await conn.ctx.budget.release(frame.payload_len)
    statuses = await _commit(conn, frame, pending, got)
    await conn.reply(frame, encode_put_reply(statuses))


async def _acquire(conn: Session, nbytes: int) -> None:
    if not await conn.ctx.budget.acquire(nbytes, conn.deadline()):
        raise _busy(nbytes)


def _busy(nbytes: int) -> Exception:
    return Refused(Status.BUSY, f"{nbytes} payload bytes do not fit in flight now; retry")


async def _receive_blocks(
    conn: Session, frame: Frame, views: list[torch.Tensor | None]
) -> list[bytes | None]:
    """Receive each block's header, and its bytes into its view (dropped where None).

    Returns the headers of the blocks received into a view (None elsewhere).
    """
    layout = conn.store.layout
    size = wire_nbytes(layout) - layout.block_nbytes
    deadline = conn.deadline(frame.payload_len)
    headers: list[bytes | None] = []
    for view in views:
        head = await conn.chan.recv(size, deadline)
        if view is None:
            await conn.chan.discard(layout.block_nbytes, deadline)
            headers.append(None)
            continue
        await conn.chan.recv_into(_bytes_of(view), deadline)
        headers.append(head)
    return headers


def _bytes_of(view: torch.Tensor) -> memoryview:
    return memoryview(view.view(torch.uint8).reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]


async def _commit(
    conn: Session, frame: Frame, pending: PendingPut, arrived: list[bytes | None]
) -> list[int]:
    """Verify what arrived, commit the good blocks, persist if asked; per-key statuses."""
    hosted = conn.store
    statuses = await conn.run(_verify_and_commit, hosted, pending, arrived)
    if frame.flags & Flag.DURABLE:
        held = [k for k, s in zip(pending.keys, statuses, strict=True) if _holds(s)]
        durable = dict(
            zip(held, await conn.run(hosted.store.engine.datapath.persist, held), strict=True)
        )
        statuses = [
            s | SlotStatus.DURABLE if durable.get(k) else s
            for k, s in zip(pending.keys, statuses, strict=True)
        ]
    corrupt = statuses.count(SlotStatus.CORRUPT)
    if corrupt:
        conn.ctx.metrics.add("blocks_corrupt_received", corrupt)
    conn.ctx.metrics.add("blocks_stored", sum(1 for s in statuses if s & 0x7F == SlotStatus.STORED))
    return statuses


def _holds(status: int) -> bool:
    return status in (SlotStatus.STORED, SlotStatus.PRESENT)


def _verify_and_commit(
    hosted: HostedStore, pending: PendingPut, arrived: list[bytes | None]
) -> list[int]:
    """On a worker thread: check each block, commit the good ones, report per key.

    ``arrived[i]``: the wire header of a block received over the socket
    (verified here, then kept for sending the block later), ``b""`` for one the
    client wrote through shared memory, None for one that did not come (its room
    is given back).
    """
    store = hosted.store
    ok: list[bool] = []
    verdict: list[int] = []
    for key, view, head in zip(pending.keys, pending.views, arrived, strict=True):
        good, status = view is not None and head is not None, SlotStatus.STORED
        if view is None:
            status = SlotStatus.PRESENT
        elif head is None:
            status = SlotStatus.MISS
        elif head:
            try:
                verify_span(read_header(head, store.layout, key), view)
            except (CorruptBlockError, LayoutMismatchError) as exc:
                log.warning("dropping block %s from a client: %s", key.hex(), exc)
                good, status = False, SlotStatus.CORRUPT
        ok.append(good)
        verdict.append(status)
        if good and head:
            hosted.headers.put(key, head)
        elif good:
            hosted.headers.drop(key)
    pending.commit(ok)
    return [
        v if v != SlotStatus.STORED or store.engine.datapath.contains(k) else SlotStatus.MISS
        for k, v in zip(pending.keys, verdict, strict=True)
    ]


# -- RESERVE / COMMIT (puts through shared memory) ----------------------------
async def reserve(conn: Session, frame: Frame, meta: bytes) -> None:
    """Room for new blocks: a shared-memory offset each, or INLINE (send in COMMIT)."""
    hosted = conn.store
    keys = decode_keys(meta, 0, conn.ctx.server.max_batch_blocks)
    await _expire_abandoned(conn)
    if len(conn.reservations) >= conn.ctx.server.max_inflight_requests:
        raise Refused(Status.BUSY, "too many reservations waiting for COMMIT")
    pending = await conn.run(hosted.store.engine.begin_put, keys)
    segment = hosted.segment
    slots: list[tuple[int, int]] = []
    for view in pending.views:
        offset = None if view is None or segment is None else segment.offset_of(view)
        if view is None:
            slots.append((SlotStatus.PRESENT, 0))
        elif offset is None:
            slots.append((SlotStatus.INLINE, 0))
        else:
            slots.append((SlotStatus.SHM, offset))
    ident = next(conn.ids)
    conn.reservations[ident] = Reservation(pending, slots, conn.loop.time())
    await conn.reply(frame, encode_reserve_reply(ident, slots))


async def commit(conn: Session, frame: Frame, meta: bytes) -> None:
    """Publish a reservation: shared-memory blocks as written, inline ones received."""
    layout = conn.store.layout
    each = wire_nbytes(layout)
    try:
        ident, written = decode_commit_request(meta, conn.ctx.server.max_batch_blocks)
        await _expire_abandoned(conn)
        res = conn.reservations.get(ident)
        if res is None:
            await _late_commit(conn, ident)
            raise ProtocolError(
                f"no reservation {ident} on this connection (a reservation not committed "
                f"within server.io_timeout_s, {conn.ctx.server.io_timeout_s:g} s, is dropped)"
            )
        if len(written) != len(res.slots):
            raise ProtocolError(f"COMMIT lists {len(written)} keys, RESERVE had {len(res.slots)}")
        inline = [i for i, (s, _) in enumerate(res.slots) if s == SlotStatus.INLINE and written[i]]
        if frame.payload_len != len(inline) * each:
            raise ProtocolError(f"COMMIT needs {len(inline) * each} payload bytes")
    except ProtocolError:
        await conn.chan.discard(frame.payload_len, conn.deadline(frame.payload_len))
        raise
    del conn.reservations[ident]
    pending = res.pending
    try:
        views = [pending.views[i] if i in inline else None for i in range(len(written))]
        got = await _receive_blocks(conn, frame, [v for v in views if v is not None])
    except BaseException:
        await conn.run(pending.abort)
        raise
    arrived: list[bytes | None] = [None] * len(written)
    heads = iter(got)
    for i, (status, _) in enumerate(res.slots):
        if status == SlotStatus.SHM and written[i]:
            arrived[i] = b""
        elif i in inline:
            arrived[i] = next(heads)
    await conn.reply(frame, encode_put_reply(await _commit(conn, frame, pending, arrived)))


def expire_reservations(conn: Session, older_than: float) -> dict[int, PendingPut]:
    """Forget reservations made before ``older_than`` (loop time); their puts, by id."""
    old = [k for k, r in conn.reservations.items() if r.created < older_than]
    return {k: conn.reservations.pop(k).pending for k in old}


async def _expire_abandoned(conn: Session) -> None:
    """Drop the reservations of this connection that waited longer than
    ``server.io_timeout_s`` for their COMMIT: a client that reserves and never commits
    (a bug, or a crash of the thread that wrote the shared memory) would otherwise keep
    them until it disconnects. Asked at each RESERVE and COMMIT, so a client that goes
    on working drops them; one that goes quiet is cut off at ``idle_timeout_s``. Their
    slots are held until the writer is done (:func:`hold_dropped`)."""
    older_than = conn.loop.time() - conn.ctx.server.io_timeout_s
    dropped = expire_reservations(conn, older_than)
    if dropped:
        conn.ctx.metrics.add("reservations_expired", len(dropped))
        await hold_dropped(conn, dropped)


async def hold_dropped(conn: Session, dropped: dict[int, PendingPut]) -> None:
    """Reservations dropped before their COMMIT (by id): their slots stay reserved
    until their writer is known to be done (:mod:`kvstore.server.orphans`), unless it
    has exited already or never mapped the shared memory through this connection
    (aborted now)."""
    held = conn.ctx.held
    if held is None or not conn.attached:  # a client that never mapped them writes none
        done = list(dropped.values())
    else:
        done = held.hold({(conn.serial, i): p for i, p in dropped.items()}, conn.writer)
        conn.ctx.metrics.gauge("reservations_held", len(dropped) - len(done))
    if done:
        await conn.run(abort_all, done)


async def _late_commit(conn: Session, ident: int) -> None:
    """A COMMIT of a dropped reservation: its copies have ended, so its held slots go
    back now (the COMMIT itself is refused)."""
    pending = None if conn.ctx.held is None else conn.ctx.held.release((conn.serial, ident))
    if pending is not None:
        conn.ctx.metrics.gauge("reservations_held", -1)
        await conn.run(pending.abort)


def abort_all(pending: Sequence[PendingPut]) -> None:
    """Abort each put (on a worker thread: it frees slots under the store's locks)."""
    for put in pending:
        put.abort()


# -- GET / RELEASE --------------------------------------------------------------
async def get(conn: Session, frame: Frame, meta: bytes) -> None:
    """Send blocks (or layer ranges) from the memory holding them, or their places in
    shared memory; misses are marked, never an error."""
    hosted = conn.store
    layout = hosted.layout
    keys, layers = decode_get_request(meta, layout.num_layers, conn.ctx.server.max_batch_blocks)
    shared = bool(frame.flags & Flag.SHM) and hosted.segment is not None
    if len(conn.loans) >= conn.ctx.server.max_inflight_requests:
        shared = False  # this client holds enough loans already: send bytes instead
    # The budget first, for every block as if inline (the excess goes back at once):
    # lending and reading are then one worker call, so a loan never waits for a
    # worker while it pins blocks -- workers may all be in deletes waiting for exactly
    # those pins to drop, a stall until the lease ends.
    held = len(keys) * wire_nbytes(layout, layers)
    await _acquire(conn, held)
    staged: list[torch.Tensor] = []
    loan: Loan | None = None
    kept = False
    try:
        lent, slots, parts = await conn.run(
            _lend_and_read, conn.ctx.staging, hosted, (keys, layers, shared), staged
        )
        loan = lent
        inline = [i for i, (s, _) in enumerate(slots) if s == SlotStatus.INLINE]
        nbytes = len(inline) * wire_nbytes(layout, layers)
        await conn.ctx.budget.release(held - nbytes)
        held = nbytes
        lease = 0
        if any(s == SlotStatus.SHM for s, _ in slots):
            lease = next(conn.ids)
            conn.loans[lease] = lent
            kept = True
        payload = [p for i in inline for p in parts[i]]
        await conn.reply(frame, encode_get_reply(lease, slots), payload)
        conn.ctx.metrics.add("blocks_served", sum(1 for s, _ in slots if s != SlotStatus.MISS))
    finally:
        conn.ctx.staging.give(layout, staged)
        await conn.ctx.budget.release(held)
        if loan is not None and not kept:
            loan.release()  # on the loop: see release()


def _lend_and_read(
    staging: StagingPool,
    hosted: HostedStore,
    request: tuple[list[BlockKey], tuple[int, int] | None, bool],
    staged: list[torch.Tensor],
) -> tuple[Loan, list[tuple[int, int]], dict[int, list[Buffer]]]:
    """On a worker thread: lend ``request``'s keys (and its layers; shared memory or
    not), then read the blocks to send inline (see :func:`_inline_parts`). Returns the
    loan, each key's slot (INLINE ones that failed to read marked MISS) and the parts."""
    keys, layers, shared = request
    loan = hosted.store.engine.lend(keys)
    try:
        slots = _slots(loan, hosted.segment if shared else None, layers)
        inline = [i for i, (s, _) in enumerate(slots) if s == SlotStatus.INLINE]
        parts = _inline_parts(staging, hosted.headers, loan, (inline, layers), staged)
    except BaseException:
        loan.release()
        raise
    for i in inline:
        if i not in parts:
            slots[i] = (SlotStatus.MISS, 0)
    return loan, slots, parts


def _slots(
    loan: Loan, segment: SharedSegment | None, layers: tuple[int, int] | None
) -> list[tuple[int, int]]:
    """Per key: MISS, SHM at an offset, or INLINE."""
    first, last = layers if layers is not None else (0, None)
    slots: list[tuple[int, int]] = []
    for found, view in zip(loan.found, loan.views, strict=True):
        offset = None
        if view is not None and segment is not None:
            # A whole block needs no slice (a new tensor each: ~8 us a block under load).
            offset = segment.offset_of(view if layers is None else view[first:last])
        if not found:
            slots.append((SlotStatus.MISS, 0))
        elif offset is not None:
            slots.append((SlotStatus.SHM, offset))
        else:
            slots.append((SlotStatus.INLINE, 0))
    return slots


def _inline_parts(
    staging: StagingPool,
    headers: HeaderCache,
    loan: Loan,
    what: tuple[list[int], tuple[int, int] | None],
    staged: list[torch.Tensor],
) -> dict[int, list[Buffer]]:
    """On a worker thread: wire header and bytes of each inline block (``what``: which,
    and their layers), read into staging buffers (appended to ``staged``) where no
    memory tier holds it; headers come from ``headers`` where known."""
    inline, layers = what
    layout = loan.layout
    first, last = layers if layers is not None else (0, layout.num_layers)
    blocks: dict[int, torch.Tensor] = {}
    for i in inline:
        view = loan.views[i]
        blocks[i] = view if view is not None else staging.take(layout)
        if view is None:
            staged.append(blocks[i])
    unread = [i for i in inline if loan.views[i] is None]
    if unread:  # one batch per tier for every block memory does not hold
        ok = loan.read_many(unread, [blocks[i][first:last] for i in unread], layers)
        for i, good in zip(unread, ok, strict=True):
            if not good:
                del blocks[i]
    parts: dict[int, list[Buffer]] = {}
    for i, block in blocks.items():
        key = loan.keys[i]
        known = headers.get(key)
        header, pieces = encode_span(key, layout, block, layers, known)
        if known is None and layers is None:
            headers.put(key, header)
        parts[i] = [header, *pieces]
    return parts


async def release(conn: Session, frame: Frame, meta: bytes) -> None:
    """End a loan of shared-memory blocks (the client has copied them).

    On the loop, not a worker thread: unpinning is a short critical section, and
    workers may all be waiting for exactly these pins to drop (an eviction or a
    delete of a lent block), so a release queued behind them would deadlock.
    """
    loan = conn.loans.pop(decode_u64(meta), None)
    if loan is not None:
        loan.release()
    await conn.reply(frame)


# -- queries ------------------------------------------------------------------
async def exists(conn: Session, frame: Frame, meta: bytes) -> None:
    """One byte per key: 1 if stored."""
    store = conn.store.store
    keys = decode_keys(meta, 0, conn.ctx.server.max_batch_blocks)
    found = await conn.run(store.engine.datapath.exists, keys)
    await conn.reply(frame, encode_count(len(keys)) + bytes(found))


async def lookup(conn: Session, frame: Frame, meta: bytes) -> None:
    """How many leading keys are stored; blocks only shared tiers hold (a peer, S3) are
    confirmed with them first, so a node never claims what it can no longer load."""
    store = conn.store.store
    keys = decode_keys(meta, 0, conn.ctx.server.max_batch_blocks)
    found = await conn.run(functools.partial(store.lookup, keys, recheck=True))
    await conn.reply(frame, encode_count(found))


async def delete(conn: Session, frame: Frame, meta: bytes) -> None:
    """Delete keys from every tier of this namespace's store."""
    store = conn.store.store
    keys = decode_keys(meta, 0, conn.ctx.server.max_batch_blocks)
    wanted = set(keys)
    lent = [
        lease
        for lease, loan in conn.loans.items()
        if any(found and key in wanted for key, found in zip(loan.keys, loan.found, strict=True))
    ]
    if lent:
        # A delete waits for the blocks' readers. Here the reader is this very client,
        # which waits for the answer before it releases: a deadlock until the lease
        # expires, holding a worker thread all along. Refused at once instead.
        raise Refused(
            Status.BUSY,
            f"this connection holds lease {lent[0]} on a block it deletes: RELEASE it first",
        )
    await conn.reply(frame, encode_count(await conn.run(store.delete, keys)))


async def note_tokens(conn: Session, frame: Frame, meta: bytes) -> None:
    """Which tokens some chunks hold (for this server's KV events): checked, then
    recorded by the namespace's store; a malformed request changes nothing."""
    store = conn.store.store
    try:
        block_tokens, parent, keys = decode_tokens(meta, conn.ctx.server.max_batch_blocks)
        if block_tokens != conn.store.layout.block_tokens:
            raise ProtocolError(
                f"TOKENS of {block_tokens}-token chunks; this store's chunks have "
                f"{conn.store.layout.block_tokens}"
            )
        if frame.payload_len != 4 * block_tokens * len(keys):
            raise ProtocolError(
                f"TOKENS of {len(keys)} chunks needs {4 * block_tokens * len(keys)} token "
                f"bytes, got {frame.payload_len}"
            )
    except ProtocolError:
        await conn.chan.discard(frame.payload_len, conn.deadline(frame.payload_len))
        raise
    data = await conn.chan.recv(frame.payload_len, conn.deadline(frame.payload_len))
    tokens = ChunkTokens(tuple(keys), data, parent, block_tokens)
    await conn.run(store.engine.note_tokens, tokens)
    await conn.reply(frame, encode_count(len(keys)))


async def list_keys(conn: Session, frame: Frame, meta: bytes) -> None:
    """Up to ``limit`` stored keys of this namespace's store, as the payload."""
    store = conn.store.store
    limit = min(decode_count(meta), conn.ctx.server.max_frame_bytes // 16)
    keys = await conn.run(store.stored_keys)
    await conn.reply(frame, encode_count(min(limit, len(keys))), [b"".join(keys[:limit])])


async def hint(conn: Session, frame: Frame, meta: bytes) -> None:
    """A session hint (retain, demote, prefetch) for this namespace's store, answered
    with its :class:`~kvstore.hints.HintAnswer`. A hint whose fields do not make one is
    answered ``rejected`` with why and changes nothing; a meta that does not decode is
    a BAD_REQUEST like any other."""
    fields, keys = decode_hint_request(meta, conn.ctx.server.max_batch_blocks)
    answer = await conn.run(_apply_hint, conn.store.store, fields, keys)
    conn.ctx.metrics.add(f"hints_{answer.status}")
    await conn.reply(frame, encode_json(answer.as_dict()))


def _apply_hint(
    store: KVStore, fields: dict[str, object], keys: list[BlockKey] | None
) -> HintAnswer:
    """On a worker thread: parse the hint's fields, then hand it to the store."""
    parsed, session, problem = parse_hint(fields)
    if parsed is None:
        return HintAnswer("rejected", f"malformed hint: {problem}")
    try:
        return store.hint(
            keys,
            session=session,
            retain_s=parsed.retain_s,
            priority=parsed.priority,
            prefetch=parsed.prefetch,
            demote=parsed.demote,
        )
    except InvalidInputError as exc:  # no keys and no session, say
        return HintAnswer("rejected", f"malformed {exc}")


Handler = Callable[[Session, Frame, bytes], Awaitable[None]]
#: Requests served beside the reader, several at once per connection.
CONCURRENT: dict[int, Handler] = {
    Op.GET: get,
    Op.RESERVE: reserve,
    Op.EXISTS: exists,
    Op.LOOKUP: lookup,
    Op.DELETE: delete,
    Op.LIST: list_keys,
    Op.HINT: hint,
}
