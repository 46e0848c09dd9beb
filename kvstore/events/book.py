"""``TokenBook``: which tokens each stored chunk holds, for the events that need them.

kvstore keys are hashes; consumers of KV events need the tokens themselves
(they hash ``block_size``-token blocks of their own). A writer that knows the
tokens records them with the keys it stores::

    book = TokenBook(layout.block_tokens, journal="/var/lib/kvstore/tokens.journal")
    book.record(keys, token_ids[: len(keys) * layout.block_tokens], parent=None)
    store.put(keys, kv)

``parent`` is the key of the chunk just before ``keys[0]`` (None at a prompt's
start); within ``keys`` each chunk is the parent of the next.

With a journal file, every change is appended to it (one ``write`` per call,
reaching the OS before the call returns, so it survives ``kill -9`` like the
disk tier; not fsynced), so a restarted process still knows the tokens of the
blocks its disk tier kept. The file is read on open (a torn last record, from a
crash mid-write, is cut off) and rewritten with only the live entries when it
grows past twice their number.

Record format: ``op`` (``+`` record, ``-`` forget), key (16 bytes), parent flag
and key (1 + 16), token count (uint32 LE), tokens (int32 LE), CRC-32 of all of
it (uint32 LE), after an 8-byte file header.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO

import numpy as np

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.keys import KEY_BYTES, BlockKey, check_keys, tokens_to_bytes

__all__ = ["TokenBook"]

log = logging.getLogger(__name__)

_MAGIC = b"KVSTOKB1"
_HEAD = struct.Struct("<c16sB16sI")
_CRC = struct.Struct("<I")
_NO_KEY = bytes(KEY_BYTES)
#: The journal is compacted once it holds this many records more than twice the live ones.
_COMPACT_SLACK = 1024

Entry = tuple[BlockKey | None, bytes]


def _encode(op: bytes, key: bytes, parent: bytes | None, tokens: bytes) -> bytes:
    head = _HEAD.pack(op, key, parent is not None, parent or _NO_KEY, len(tokens) // 4)
    body = head + tokens
    return body + _CRC.pack(zlib.crc32(body))


def _read_records(f: BinaryIO) -> tuple[list[tuple[bytes, bytes, bytes | None, bytes]], int]:
    """The whole records after the header and the offset where they end."""
    records: list[tuple[bytes, bytes, bytes | None, bytes]] = []
    good = f.tell()
    while True:
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            break
        op, key, has_parent, parent, count = _HEAD.unpack(head)
        tokens = f.read(count * 4)
        crc = f.read(_CRC.size)
        if len(tokens) < count * 4 or len(crc) < _CRC.size or op not in (b"+", b"-"):
            break
        if _CRC.unpack(crc)[0] != zlib.crc32(head + tokens):
            break
        records.append((op, key, parent if has_parent else None, tokens))
        good = f.tell()
    return records, good


class TokenBook:
    """Key -> (parent key, tokens) of every chunk whose tokens a writer recorded.

    ``block_tokens``: tokens per chunk (the layout's). ``journal``: a file that
    keeps the book across restarts (None: memory only). Thread-safe.
    """

    def __init__(
        self,
        block_tokens: int,
        journal: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(block_tokens, int) or block_tokens <= 0:
            raise InvalidInputError(f"block_tokens must be an int > 0, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._entries: dict[BlockKey, Entry] = {}
        # When each entry was last recorded (``clock``; entries read from the journal: at
        # open), so that :meth:`retain` can spare a put still on its way.
        self._recorded: dict[BlockKey, float] = {}
        self._clock = clock
        self._lock = threading.Lock()
        self._path = None if journal is None else os.fspath(journal)
        self._file: BinaryIO | None = None
        self._records = 0
        if self._path is not None:
            self._open_journal(self._path)

    # -- the journal -------------------------------------------------------------
    def _open_journal(self, path: str) -> None:
        """Load ``path`` (creating it if absent), cut a torn tail, open it for appends."""
        try:
            f = open(path, "r+b" if os.path.exists(path) else "w+b")  # noqa: SIM115
        except OSError as exc:
            raise ConfigError(f"events.token_journal {path!r}: {exc.strerror}") from None
        magic = f.read(len(_MAGIC))
        if magic != _MAGIC:
            if magic:
                f.close()
                raise ConfigError(f"events.token_journal {path!r}: not a kvstore token journal")
            f.write(_MAGIC)
        records, good = _read_records(f)
        for op, key, parent, tokens in records:
            if op == b"-":
                self._entries.pop(BlockKey(key), None)
            elif len(tokens) == self.block_tokens * 4:
                self._entries[BlockKey(key)] = (
                    None if parent is None else BlockKey(parent),
                    tokens,
                )
        now = self._clock()
        self._recorded = dict.fromkeys(self._entries, now)
        f.truncate(max(good, len(_MAGIC)))
        f.seek(0, os.SEEK_END)
        self._file = f
        self._records = len(records)

    def _append(self, data: bytes, count: int) -> None:
        """Append ``count`` records (under the lock); compact when the file is mostly dead."""
        if self._file is None or not count:
            return
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:  # a full disk: the book goes on in memory
            log.warning("token journal %s: %s; journal closed", self._path, exc)
            self._file.close()
            self._file = None
            return
        self._records += count
        if self._records > 2 * len(self._entries) + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal with only the live entries (atomically, by rename)."""
        assert self._file is not None and self._path is not None
        tmp = self._path + ".compact"
        with open(tmp, "wb") as out:
            out.write(_MAGIC)
            for key, (parent, tokens) in self._entries.items():
                out.write(_encode(b"+", key, parent, tokens))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self._path)
        self._file.close()
        self._file = open(self._path, "ab")  # noqa: SIM115
        self._records = len(self._entries)

    # -- the book ------------------------------------------------------------------
    def record(self, keys: Sequence[BlockKey], tokens: Any, parent: BlockKey | None = None) -> int:
        """Record that ``keys`` hold ``tokens`` (exactly ``len(keys) * block_tokens`` ids:
        list, numpy array or 1-D tensor), ``parent`` being the key of the chunk before
        ``keys[0]`` (None at a prompt's start). Returns how many entries changed.

        Bad input raises :class:`~kvstore.errors.InvalidInputError` and changes nothing.
        """
        checked = check_keys(keys)
        if parent is not None:
            parent = check_keys([parent], "parent")[0]
        data = bytes(tokens_to_bytes(tokens))
        size = self.block_tokens * 4
        if len(data) != len(checked) * size:
            raise InvalidInputError(
                f"tokens: expected {len(checked) * self.block_tokens} token ids "
                f"({len(checked)} chunks of {self.block_tokens}), got {len(data) // 4}"
            )
        parents = [parent, *checked[:-1]]
        new = [
            (key, (up, data[i * size : (i + 1) * size]))
            for i, (key, up) in enumerate(zip(checked, parents, strict=True))
        ]
        now = self._clock()
        with self._lock:
            changed = [(k, e) for k, e in new if self._entries.get(k) != e]
            self._entries.update(changed)
            self._recorded.update((k, now) for k, _ in new)
            if self._file is not None and changed:
                journal = b"".join(_encode(b"+", k, p, t) for k, (p, t) in changed)
                self._append(journal, len(changed))
        return len(changed)

    def get(self, key: BlockKey) -> tuple[BlockKey | None, list[int]] | None:
        """``(parent key, token ids)`` of ``key``, or None if no tokens were recorded."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        return entry[0], np.frombuffer(entry[1], dtype="<i4").tolist()

    def parent(self, key: BlockKey) -> BlockKey | None:
        """The parent key of ``key`` (None if unknown or a prompt's first chunk)."""
        with self._lock:
            entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def forget(self, keys: Iterable[BlockKey]) -> int:
        """Drop the entries of ``keys``; returns how many there were."""
        with self._lock:
            gone = [k for k in keys if self._entries.pop(k, None) is not None]
            for key in gone:
                del self._recorded[key]
            if self._file is not None and gone:
                self._append(b"".join(_encode(b"-", k, None, b"") for k in gone), len(gone))
        return len(gone)

    def retain(self, keys: Iterable[BlockKey], grace_s: float | None = None) -> int:
        """Keep only the entries of ``keys`` (e.g. what a store holds), and those recorded
        in the last ``grace_s`` seconds (tokens noted for a put still on its way);
        returns how many were dropped."""
        keep = set(keys)
        since = float("inf") if grace_s is None else self._clock() - grace_s
        with self._lock:
            stale = [k for k in self._entries if k not in keep and self._recorded[k] < since]
        return self.forget(stale)

    def keys(self) -> list[BlockKey]:
        """The keys with recorded tokens."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def journal_records(self) -> int:
        """Records in the journal file now (0 without one)."""
        with self._lock:
            return self._records if self._file is not None else 0

    def close(self) -> None:
        """Close the journal (the book stays readable in memory)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> TokenBook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
