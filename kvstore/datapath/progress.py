"""Saying what a long wait is for: ``close()`` writing memory-only blocks to disk.

A store that closes copies every block only memory holds to its persistent
tier, gigabytes at disk speed. Waiting seconds in silence looks like a hang,
so :class:`FlushProgress` reports it: a bar redrawn in place on a terminal,
log lines (start, every few seconds, end) with the bytes left otherwise, where
the output is a file or a service's journal.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from kvstore.config import format_size

__all__ = ["FlushProgress"]

log = logging.getLogger("kvstore.close")


class FlushProgress:
    """Progress of one flush: :meth:`begin`, :meth:`update` as bytes land, :meth:`end`.

    On a terminal (``stream.isatty()``) a one-line bar, redrawn at most every
    ``redraw_s``; otherwise ``log`` lines at INFO: what is written where, then
    every ``interval_s`` the bytes left, then the total and the rate. Nothing
    is said for a flush with nothing to write.
    """

    def __init__(
        self, stream: TextIO | None = None, interval_s: float = 2.0, redraw_s: float = 0.1
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream)
        self.interval_s, self.redraw_s = interval_s, redraw_s
        self.total = self.remaining = 0
        self.where = ""
        self.start = self.last = 0.0
        self.seconds: float | None = None

    def begin(self, total: int, where: str) -> None:
        """``total`` bytes are to be written to ``where`` (a tier, a path)."""
        self.total = self.remaining = total
        self.where = where
        self.start = self.last = time.monotonic()
        if total and not self.tty:
            log.info("close: writing %s that only memory holds to %s", format_size(total), where)
        self._draw()

    def update(self, remaining: int, force: bool = False) -> None:
        """``remaining`` bytes are still to be written (``force``: only record it)."""
        self.remaining = max(0, min(self.total, remaining))
        now = time.monotonic()
        wait = self.redraw_s if self.tty else self.interval_s
        if force or not self.total or now - self.last < wait:
            return
        self.last = now
        if self.tty:
            self._draw()
        else:
            log.info(
                "close: %s of %s written to %s, %s left (%.2f GB/s)",
                format_size(self.total - self.remaining),
                format_size(self.total),
                self.where,
                format_size(self.remaining),
                self._rate(now),
            )

    def end(self, why: str = "", *, warn: bool = True) -> None:
        """The flush is over: say how long it took, and what did not fit (the bytes still
        left: the flush's caller counts in them what a full tier dropped to take others),
        because ``why``: a warning when ``warn``, else (the cause was warned of already)
        an info line."""
        now = time.monotonic()
        self.seconds = now - self.start
        if not self.total:
            return
        done = self.total - self.remaining
        if self.tty:
            self._draw(final=True)
        else:
            log.info(
                "close: wrote %s to %s in %.1f s (%.2f GB/s)",
                format_size(done),
                self.where,
                self.seconds,
                self._rate(now),
            )
        if self.remaining:
            log.log(
                logging.WARNING if warn else logging.INFO,
                "close: %s did not fit in %s%s; it is lost when this process ends",
                format_size(self.remaining),
                self.where,
                f": {why}" if why else "",
            )

    def summary(self) -> dict[str, Any]:
        """Bytes to write, bytes written, seconds (None before :meth:`end`)."""
        return {
            "bytes": self.total,
            "bytes_written": self.total - self.remaining,
            "seconds": self.seconds,
        }

    def _rate(self, now: float) -> float:
        return (self.total - self.remaining) / max(1e-9, now - self.start) / 1e9

    def _draw(self, final: bool = False) -> None:
        if not (self.tty and self.total):
            return
        width = 30
        filled = width * (self.total - self.remaining) // self.total
        bar = "#" * filled + "." * (width - filled)
        now = time.monotonic()
        tail = (
            f"done in {now - self.start:.1f} s" if final else f"{format_size(self.remaining)} left"
        )
        line = (
            f"\rkvstore: close: writing {format_size(self.total)} to {self.where} "
            f"[{bar}] {tail}, {self._rate(now):.2f} GB/s"
        )
        self.stream.write(line + ("\n" if final else ""))
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or a stream without isatty
        return False
