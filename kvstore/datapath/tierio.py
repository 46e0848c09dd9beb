"""TierIO: every call the data path makes into a tier goes through here.

One place to time and count tier I/O (bytes and seconds read and written), to
turn a failing medium into a miss (a tier that raises reads as "not there",
writes as "not stored", and is marked down until a call that reaches the medium
succeeds again, said once in the log per outage rather than once per call; a
server that refuses the tier's token is said to refuse it, not to be away), and
to check the rule
that tier I/O never runs under the books' lock. The owners of the data path
(:mod:`kvstore.datapath.finder`, :mod:`kvstore.datapath.reader`,
:mod:`kvstore.datapath.writer`, ...) address tiers by their index, fastest first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from kvstore.errors import AccessDeniedError, ProtocolError, StoreLimitError, TierError
from kvstore.hints import Hint
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.layout import KVLayout
from kvstore.restore import LoadSample, ReadSpeed, SpeedEstimate
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["Health", "TierIO", "tier_ids"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def tier_ids(tiers: Sequence[Tier]) -> list[str]:
    """Each tier as ``kind:n`` (its kind, and how many tiers of that kind come before
    it): how processes with different tier lists, and configs, name the same tier."""
    seen: dict[str, int] = {}
    ids = []
    for tier in tiers:
        n = seen.get(tier.kind, 0)
        seen[tier.kind] = n + 1
        ids.append(f"{tier.kind}:{n}")
    return ids


class Counting(Protocol):
    """Where TierIO adds its figures (:class:`~kvstore.datapath.books.Books`)."""

    def count(self, **amounts: float) -> None:
        """Add to counters by name."""

    def held_by_me(self) -> bool:
        """True while the calling thread holds the books' lock."""


@dataclass
class Health:
    """Whether a tier answers: ``down`` from a call that raised until one that reaches the
    medium succeeds; ``refused``: why, when its server refuses the tier's token or will
    not open its store (``over_limit``: the latter, its ``server.max_stores``)."""

    down: bool = False
    errors: int = 0
    last_error: str = ""
    refused: str = ""
    over_limit: bool = False


class TierIO:
    """Calls into ``tiers`` (fastest first) for the data path; see the module docstring.

    ``_lock`` guards the health records and the read totals.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        layout: KVLayout,
        books: Counting,
        speeds: Sequence[ReadSpeed] | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.layout = layout
        self._books = books
        self._health = [Health() for _ in self.tiers]
        self._lock = threading.Lock()
        #: Each tier's live read speed (fed by every read below); none: not measured.
        self.speeds = list(speeds) if speeds is not None else []
        if self.speeds and len(self.speeds) != len(self.tiers):
            raise ValueError("one ReadSpeed per tier")
        self._reads = [(0.0, 0.0, 0) for _ in self.tiers]  # bytes, seconds, calls
        # Per thread: inside unobserved(), reads feed no speed and no read totals.
        self._quiet = threading.local()

    # -- what the tiers are -------------------------------------------------------
    def mask(self, test: Callable[[Tier], bool]) -> int:
        """Bits of the tiers ``test`` accepts."""
        return sum(1 << i for i, tier in enumerate(self.tiers) if test(tier))

    def shared_levels(self) -> list[int]:
        """Tiers other processes may add blocks to."""
        return [i for i, tier in enumerate(self.tiers) if tier.shared]

    def persistent_levels(self) -> list[int]:
        """Tiers whose blocks outlive the process."""
        return [i for i, tier in enumerate(self.tiers) if tier.persistent]

    def promotable(self, level: int) -> bool:
        """Whether blocks of tier ``level`` may be copied up by this store itself."""
        return self.tiers[level].promotable

    def host_memory(self, level: int) -> bool:
        """Whether tier ``level`` keeps its blocks in this process's host memory."""
        device = self.tiers[level].device
        return device is not None and device.type == "cpu"

    def describe(self, level: int) -> str:
        """A tier as a person knows it: its kind, and its directory where it has one."""
        tier = self.tiers[level]
        path = getattr(tier, "path", None)
        return f"the {tier.kind} tier" + (f" ({path})" if path is not None else "")

    # -- the calls ----------------------------------------------------------------
    def put(self, level: int, keys: Sequence[BlockKey], srcs: Sequence[torch.Tensor]) -> list[bool]:
        """Store blocks in tier ``level``; False for each one not stored."""
        start = time.perf_counter()
        done = self._call(level, "store", len(keys), lambda t: t.put(keys, srcs), answers=True)
        if done is None:
            return [False] * len(keys)
        elapsed = time.perf_counter() - start
        self._books.count(bytes_written=sum(done) * self.layout.block_nbytes, write_seconds=elapsed)
        return done

    def get(
        self,
        level: int,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
    ) -> list[bool] | None:
        """Read from tier ``level``; None when the medium is unavailable (it raised).
        The call's wall time is a sample of the tier's read speed."""

        def read(tier: Tier) -> list[bool]:
            return tier.get(keys, outs, layers)

        start = time.perf_counter()
        ok = self._call(level, "read", len(keys), read, answers=True)
        elapsed = time.perf_counter() - start
        if ok is None:
            return None
        nbytes = self.layout.block_nbytes
        if layers is not None:
            nbytes = (layers[1] - layers[0]) * self.layout.layer_nbytes
        self._books.count(bytes_read=sum(ok) * nbytes, read_seconds=elapsed)
        if getattr(self._quiet, "on", False):
            return ok  # timed by the caller (unobserved())
        if self.speeds:
            self.speeds[level].observe(sum(ok) * nbytes, elapsed)
        if any(ok):
            with self._lock:
                b, sec, calls = self._reads[level]
                self._reads[level] = (b + sum(ok) * nbytes, sec + elapsed, calls + 1)
        return ok

    @contextlib.contextmanager
    def unobserved(self) -> Iterator[None]:
        """Reads this thread makes inside feed no tier's speed and no read totals: their
        caller times them itself and keeps only what it trusts (:meth:`observe`)."""
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = False

    def probed(self, level: int, samples: list[tuple[float, float]]) -> None:
        """A probe's fastest ``(bytes, seconds)`` of tier ``level`` (:meth:`ReadSpeed.probed`)."""
        if self.speeds:
            self.speeds[level].probed(samples)

    def observe_loads(self, loads: dict[int, LoadSample]) -> None:
        """A restore's reads per tier level: each tier's price is corrected by what they
        cost against what its fit says (:meth:`ReadSpeed.correct`)."""
        for level, load in loads.items():
            if self.speeds and 0 <= level < len(self.speeds):
                self.speeds[level].correct(load.actual_s, load.nbytes, load.calls, load.planned_s)

    def tier_ids(self) -> list[str]:
        """Each tier's id (:func:`tier_ids`)."""
        return tier_ids(self.tiers)

    def read_totals(self) -> dict[str, tuple[float, float, int]]:
        """Per tier id, every read so far: ``(bytes, seconds, calls)`` (what a process that
        reads ships to one that plans, such as vLLM's workers to its scheduler)."""
        with self._lock:
            return dict(zip(self.tier_ids(), self._reads, strict=True))

    def observe_reads(self, reads: dict[str, tuple[float, float, int]]) -> None:
        """Feed reads another process made (``{tier id: (bytes, seconds, calls)}``) into
        the matching tiers' speeds; ids this store lacks are ignored."""
        if not self.speeds:
            return
        for level, tier_id in enumerate(self.tier_ids()):
            if tier_id in reads:
                nbytes, seconds, calls = reads[tier_id]
                self.speeds[level].observe(nbytes, seconds, int(calls))

    def levels_of(self, by_id: dict[str, T]) -> dict[int, T]:
        """``by_id`` (keyed by tier id, as another process names the tiers) keyed by this
        store's levels; ids this store lacks are dropped."""
        return {level: by_id[i] for level, i in enumerate(self.tier_ids()) if i in by_id}

    def speeds_now(self) -> list[SpeedEstimate]:
        """Every tier's read speed now (their configured figures where not kept)."""
        if self.speeds:
            return [speed.estimate() for speed in self.speeds]
        return [
            SpeedEstimate(t.config.read_gbps, t.config.read_latency_ms, "configured", 0.0, None)
            for t in self.tiers
        ]

    def speed(self, level: int) -> SpeedEstimate | None:
        """Tier ``level``'s read speed now (None where speeds are not kept)."""
        return self.speeds[level].estimate() if self.speeds else None

    def delete(self, level: int, keys: Sequence[BlockKey]) -> None:
        """Delete ``keys`` from tier ``level`` (a failure is counted and logged)."""
        if keys:
            self._call(level, "delete", len(keys), lambda t: t.delete(keys))

    def note_tokens(self, level: int, tokens: ChunkTokens) -> None:
        """Tell tier ``level`` which tokens some chunks hold (a failure is counted)."""
        self._call(level, "note tokens", len(tokens.keys), lambda t: t.note_tokens(tokens))

    def hint(self, level: int, keys: Sequence[BlockKey], hint: Hint) -> None:
        """Pass a session hint to tier ``level`` (a failure is counted and logged)."""
        if keys:
            self._call(level, "hint", len(keys), lambda t: t.hint(keys, hint))

    def contains(self, level: int, keys: Sequence[BlockKey]) -> list[bool]:
        """Which ``keys`` tier ``level`` holds (none, when it is unavailable)."""
        found = self._call(level, "check", len(keys), lambda t: t.contains(keys), answers=True)
        return [False] * len(keys) if found is None else found

    def stored_keys(self, level: int) -> list[BlockKey]:
        """Every key tier ``level`` holds (none, when it is unavailable)."""
        keys = self._call(level, "list", 0, lambda t: list(t.stored_keys()), answers=True)
        return [] if keys is None else keys

    def view(self, level: int, key: BlockKey) -> torch.Tensor | None:
        """Zero-copy view of a (pinned) block in a memory tier; None if not possible."""
        return self._call(level, "view", 1, lambda t: t.view(key))

    def source(self, level: int, key: BlockKey) -> torch.Tensor | None:
        """The bytes of a (pinned) block of tier ``level``: a view where possible, else
        read into a new host tensor; None if the tier could not produce them."""
        view = self.view(level, key)
        if view is not None:
            return view
        staging = torch.empty(self.layout.block_shape, dtype=self.layout.dtype)
        ok = self.get(level, [key], [staging])
        return staging if ok and ok[0] else None

    def reserve(self, level: int, keys: Sequence[BlockKey]) -> list[torch.Tensor | None]:
        """Two-step store, step 1: writable views of room for ``keys`` (None where the
        tier cannot hand out its memory)."""
        views = self._call(level, "reserve", len(keys), lambda t: t.reserve(keys))
        return [None] * len(keys) if views is None else views

    def commit(self, level: int, keys: Sequence[BlockKey]) -> list[bool]:
        """Two-step store, step 2: publish reserved, filled ``keys``."""
        done = self._call(level, "commit", len(keys), lambda t: t.commit(keys))
        return [False] * len(keys) if done is None else done

    def abort(self, level: int, keys: Sequence[BlockKey]) -> None:
        """Give back the room reserved for ``keys``."""
        if keys:
            self._call(level, "abort", len(keys), lambda t: t.abort(keys))

    def stats(self, level: int) -> dict[str, Any]:
        """Tier ``level``'s own figures, and whether it answers."""
        with self._lock:
            health = self._health[level]
            figures: dict[str, Any] = {"available": not health.down, "io_errors": health.errors}
            if health.refused:  # why its blocks are misses now (see the log's one warning)
                figures["refused"] = health.refused
        if self.speeds:
            figures.update(self.speeds[level].stats())
        return {**figures, **(self._call(level, "stats", 0, lambda t: t.stats()) or {})}

    def prepare_close(self) -> None:
        """Tell every tier the store is closing (a failure is logged, never raised)."""
        for level in range(len(self.tiers)):
            self._call(level, "prepare for close", 0, lambda t: t.prepare_close())

    def close(self) -> None:
        """Close every tier (a failure is logged, never raised)."""
        for level in range(len(self.tiers)):
            self._call(level, "close", 0, lambda t: t.close())

    def refused_mask(self) -> int:
        """Bits of the tiers whose server refuses this store's token now (since a call
        was refused, until one reaches the medium again): their copies cannot be read."""
        with self._lock:
            return sum(1 << level for level, h in enumerate(self._health) if h.refused)

    def refusal(self) -> str | None:
        """Why a tier cannot be read now because its server refuses this store's token
        (the first such tier's refusal, one line); None when none is refused. A get
        that fails says this rather than "not stored"."""
        with self._lock:
            refused = [health.refused for health in self._health]
        for level, why in enumerate(refused):
            why = why or self.tiers[level].refusal() or ""
            if why:
                return why
        return None

    def _call(
        self,
        level: int,
        what: str,
        count: int,
        call: Callable[[Tier], T],
        answers: bool = False,
    ) -> T | None:
        """``call(tier)``; None (counted, logged, the tier marked down) if it raised.

        ``answers``: the call reaches the medium (a put, get, check or listing), so
        its success ends an outage. Other calls (stats, a view, a hint a tier may
        drop) succeed whether the medium answers or not: they prove nothing.
        """
        assert not self._books.held_by_me(), "tier I/O under the books' lock"
        tier = self.tiers[level]
        try:
            result = call(tier)
        except Exception as exc:  # a failing tier is a miss, never a crash
            self._failed(level, what, count, exc)
            return None
        if answers and self._health[level].down:
            self._recovered(level)
        return result

    def _failed(self, level: int, what: str, count: int, exc: Exception) -> None:
        kind = self.tiers[level].kind
        # A server that refuses the token, or will not open this store (max_stores): it
        # answers, so not an outage but a setting to change, said as such.
        over = isinstance(exc, StoreLimitError)
        refused = over or isinstance(exc, AccessDeniedError)
        with self._lock:
            health = self._health[level]
            # Said once per outage, and again when its cause changes (a server that
            # was away comes back refusing the token, or the other way round).
            first = not health.down or (bool(health.refused), health.over_limit) != (refused, over)
            health.down, health.errors, health.last_error = True, health.errors + 1, str(exc)
            health.refused = str(exc) if refused else ""
            health.over_limit = over
        self._books.count(tier_errors=1)
        if refused:  # a configuration matter, not a bug: one line, no traceback
            _say_refused(kind, what, count, exc, first)
        elif not isinstance(exc, (TierError, ProtocolError)):  # a bug: always say so
            log.error("tier %s failed to %s %d blocks", kind, what, count, exc_info=exc)
        elif first:
            log.warning(
                "tier %s unavailable (%s of %d blocks): %s; its blocks are misses while it is down",
                kind,
                what,
                count,
                exc,
            )
        else:
            log.debug("tier %s still unavailable (%s): %s", kind, what, exc)

    def _recovered(self, level: int) -> None:
        with self._lock:
            health = self._health[level]
            was_down, health.down = health.down, False
            was_refused, health.refused = bool(health.refused), ""
            over_limit, health.over_limit = health.over_limit, False
        if was_down:
            again = "accepts the token again" if was_refused else "answers again"
            if over_limit:
                again = "opened this store: the server took it at last"
            log.warning("tier %s %s", self.tiers[level].kind, again)


def _say_refused(kind: str, what: str, count: int, exc: Exception, first: bool) -> None:
    """Log a server's refusal of a tier -- its token, or opening its store -- once (at
    ``first``), as the setting to change that it is; later ones at DEBUG."""
    if not first:
        log.debug("tier %s still refused (%s): %s", kind, what, exc)
    elif isinstance(exc, StoreLimitError):
        log.warning(
            "tier %s: the server refused to open this store (%s of %d blocks): %s; until it "
            "does, nothing is stored there and its blocks are misses (the tier's stats say "
            "why under 'refused'; puts no other tier took count in blocks_not_stored)",
            kind,
            what,
            count,
            exc,
        )
    else:
        log.warning(
            "tier %s refused access (%s of %d blocks): %s; its blocks are misses until the "
            "server accepts the token",
            kind,
            what,
            count,
            exc,
        )
