"""NVMe disk tier: one file per block, atomic, verified, persistent across restarts.

Each block is a file holding the codec header (padded to 4 KiB, so the
payload is page- and O_DIRECT-aligned) and the payload. Why a file per block
rather than segment files with an index: blocks are large (MiBs), so the
per-file cost (open, rename, unlink: tens of microseconds) is noise next to
the transfer; rename gives crash-atomic writes without a journal; delete is
an unlink with no compaction; and restart is a directory listing -- no index
file to corrupt or replay. ``benchmarks/bench_disk_tier.py --layout-study``
measures the per-file overhead against writes into one preallocated file.

Writes go to a temp file that is renamed over the final name, so a reader
or a restarted process sees a block whole or not at all; temp files left by
dead writers are removed at start. Reads verify every checksum of what they
return; a file that fails is deleted and reported as a miss. Raw blocks move
with ``pwritev``/``preadv`` straight between files and the engine's tensors
(no staging copy), a few layers per call, each verified right after it lands
(still in the CPU cache). Batches run on a pool of ``io_threads`` threads,
so a batch of N blocks costs about one disk round trip at queue depth N.

Page cache (``page_cache``): ``keep`` leaves written and read blocks in the
kernel's page cache, so a block read again soon (a demoted block promoted
back, a prefix shared by the next request) comes at memory speed; ``bypass``
writes with ``O_DIRECT`` (straight from page-aligned memory such as the host
tier's slots, else through a page-aligned staging buffer), reads a whole raw
block with ``O_DIRECT`` straight into page-aligned memory (vLLM's primary rows,
the host tier's slots), and otherwise drops a block's pages after reading it.

Several processes may share a directory: a writer's blocks appear to other
processes atomically (whole or absent), and readers find blocks written after
they opened (``shared = True``: the manager asks this tier about keys its index
lacks). Capacity is enforced by each process for what it knows; give one
process the writing role per directory, or split the capacity between writers.
Two disk tiers of one config may not share a directory (a ConfigError when the
config is read), nor may two kvstore-servers (:mod:`kvstore.tiers.disk_lock`).

Each layout directory names its layout in ``layout.json``; a tier that finds none
of its own layout's blocks but blocks of others says so, naming them
(:mod:`kvstore.tiers.disk_layouts`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvstore.config import DiskTierConfig, TierConfig
from kvstore.errors import ConfigError, CorruptBlockError, DecryptError, LayoutMismatchError
from kvstore.format import (
    BlockHeader,
    Codec,
    choose_codec,
    codec_number,
    decode_into,
    encode_block,
    header_size,
    layer_pieces,
    parse_header,
    verify_layers,
)
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.runtime import map_or_inline
from kvstore.tiers.base import LayerRange, Tier
from kvstore.tiers.disk_layouts import MAX_NAMED, foreign_layouts, mismatch_line, record_layout
from kvstore.tiers.disk_open import (
    check_path,
    fit_capacity,
    probe_o_direct,
    probe_write,
    unusable,
    unusable_path,
)
from kvstore.tiers.disk_sealed import SealedFiles
from kvstore.tiers.files import FileOps, Tree, read_exact, write_all

__all__ = ["DiskTier", "check_path", "unusable_path"]

log = logging.getLogger(__name__)

PAGE = 4096
#: Bytes of raw payload read per ``preadv`` before verifying them: about a
#: core's L2, so the checksum reads what the copy just brought into cache
#: instead of going back to DRAM (a whole 32 MiB block read, then hashed,
#: made warm reads ~20% slower).
READ_GROUP_NBYTES = 1 << 20
T = TypeVar("T")
#: Errors that mean the directory refuses writes (not one bad block): said once.
_REFUSED = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class _NotRaw(Exception):
    """A block file whose payload is compressed (O_DIRECT reads take raw blocks only)."""


def _page_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts and ends on page boundaries (as O_DIRECT wants)."""
    if len(view) % PAGE:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
    return address is not None and address % PAGE == 0


class DiskTier(Tier):
    """Blocks in files under ``config.path``; see the module docstring."""

    kind = "disk"
    persistent = True
    shared = True

    def __init__(self, config: TierConfig, layout: KVLayout, ops: FileOps | None = None) -> None:
        if not isinstance(config, DiskTierConfig):
            raise ConfigError(f"disk tier needs a DiskTierConfig, got {type(config).__name__}")
        super().__init__(config, layout)
        self.disk_config = config
        self._ops = ops or FileOps()
        self._tree = Tree(Path(config.path).expanduser(), layout.fingerprint_hex)
        self._data_offset = _round_up(header_size(layout.num_layers))
        self._file_nbytes = self._data_offset + self._payload_nbytes
        self._codec = None if config.codec == "auto" else codec_number(config.codec)
        self._nonce = itertools.count()
        self._counts: dict[str, int] = {}
        self._counts_lock = threading.Lock()  # guards _counts only
        self._local = threading.local()  # per-thread O_DIRECT staging buffers
        self._closed = False
        #: How block files are sealed and opened once :meth:`encrypt_with` is called.
        self._sealed: SealedFiles | None = None
        #: Why files cannot be created here (EROFS, EACCES), None while they can.
        self._write_error: str | None = None
        #: True from a write the full disk refused until one fits again: said once each way.
        self._full = False
        self._full_lock = threading.Lock()
        # A capacity below one block file is refused before any directory is made.
        self.blocks_in(config.capacity, self._file_nbytes, "block file")
        self._prepare_directory()
        self._bypass = config.bypass_page_cache
        self._o_direct = self._bypass and self._probe_o_direct()
        self._capacity = self._fit_capacity(config.capacity)
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-disk")

    # -- set-up ---------------------------------------------------------------
    def _prepare_directory(self) -> None:
        """Make the tree, index what is there, and find out whether it can be written.

        A path that cannot become a directory (under a regular file, on a read-only
        mount where it does not exist yet) is a :class:`ConfigError`: such a tier could
        never hold a block. An existing directory that refuses writes opens read-only:
        it serves the blocks already there, stores none, and says so (one warning, and
        ``writable: false`` in its stats).
        """
        try:
            self._tree.make_dirs()
        except OSError as exc:
            if not self._tree.base.is_dir():
                raise ConfigError(unusable(self._tree.root, exc)) from None
            self._write_error = exc.strerror or str(exc)
        try:  # one pass over the tree: index what is there, sweep dead writers' temps
            self._found, removed = self._tree.scan(self._ops)
        except OSError as exc:
            raise ConfigError(unusable(self._tree.root, exc)) from None
        if removed:
            log.info("disk tier %s: removed %d stale temp files", self._tree.base, removed)
            self._count("stale_temps_removed", removed)
        if self._write_error is None:
            self._write_error = self._probe_write()
        if self._write_error is not None:
            self._count("dir_errors")
            log.warning(
                "disk tier %s: cannot write (%s); serving the blocks already there, storing none",
                self._tree.base,
                self._write_error,
            )
        else:
            record_layout(self._tree.base, self.layout)
        if not self._found:
            self._name_other_layouts()

    def _name_other_layouts(self) -> None:
        """A directory with none of this layout's blocks but blocks of others: most
        likely the store was opened with another layout than its blocks were written
        with (another dtype, head count, chunk size). Say so, once per other layout,
        naming both: otherwise every lookup is a silent miss."""
        others = foreign_layouts(self._tree.root, self.layout)
        for other in others[:MAX_NAMED]:
            log.warning("%s", mismatch_line(self._tree.root, self.layout, other))
        if len(others) > MAX_NAMED:
            log.warning(
                "disk tier %s: holds blocks of %d more layouts (%s/)",
                self._tree.root,
                len(others) - MAX_NAMED,
                self._tree.base.parent,
            )

    def _probe_write(self) -> str | None:
        """Why a file cannot be created in the layout directory, or None if it can."""
        return probe_write(self._ops, self._tree.base, next(self._nonce))

    def _probe_o_direct(self, warn: bool = True) -> bool:
        """True if this filesystem takes O_DIRECT (tmpfs, for one, does not)."""
        return probe_o_direct(self._tree.base, warn)

    def _fit_capacity(self, wanted: int) -> int:
        """Blocks that fit in ``wanted`` bytes, and in the free disk space."""
        blocks = self.blocks_in(wanted, self._file_nbytes, "block file")
        return fit_capacity(blocks, self._tree.base, len(self._found), self._file_nbytes)

    def encrypt_with(self, cipher: Any) -> None:
        """Seal blocks with ``cipher`` (encryption at rest: :mod:`kvstore.tiers.disk_sealed`)."""
        self.cipher = cipher
        self._sealed = SealedFiles(self.layout, cipher, self._buffer, self._payload_nbytes)
        self._data_offset = self._sealed.data_offset
        self._file_nbytes = self._sealed.file_nbytes
        self._capacity = self._fit_capacity(self.disk_config.capacity)

    # -- Tier interface -------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def path(self) -> Path:
        """The directory holding this layout's blocks."""
        return self._tree.base

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        return self._run(self._write_one, list(zip(keys, blocks, strict=True)))

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
    ) -> list[bool]:
        items = [(key, out, layers) for key, out in zip(keys, outs, strict=True)]
        return self._run(lambda item: self._read_one(*item), items)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            try:
                self._ops.unlink(self._tree.block_path(key))
                self._count("deletes")
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("disk tier: cannot delete %s: %s", key.hex(), exc)
                self._count("delete_errors")

    @property
    def _payload_nbytes(self) -> int:
        """A block's payload as this tier stores it: the layout's, or encoded."""
        if self.encoding is None:
            return self.layout.block_nbytes
        return self.encoding.layer_nbytes(self.layout) * self.layout.num_layers

    @property
    def file_nbytes(self) -> int:
        """Bytes of one block's file (header, padding to the page, payload): the unit its
        capacity is counted in."""
        return self._file_nbytes

    @property
    def data_offset(self) -> int:
        """Where a block file's payload starts (its header comes first)."""
        return self._data_offset

    def block_path(self, key: BlockKey) -> str:
        """The file that holds (or would hold) block ``key``."""
        return self._tree.block_path(key)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [os.path.exists(self._tree.block_path(key)) for key in keys]

    def stored_keys(self) -> Iterator[BlockKey]:
        """Keys on disk, least recently written first (their eviction order)."""
        found, self._found = (self._found, []) if self._found else (self._tree.scan()[0], [])
        return iter([BlockKey(key) for key in found])

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            counts = dict(self._counts)
        return {
            "path": str(self._tree.base),
            "page_cache": self.disk_config.page_cache,
            "o_direct": self._o_direct,
            "writable": self._write_error is None,
            "write_error": self._write_error,
            "decrypt_failures": 0,
            **(self.cipher.stats() if self.cipher is not None else {}),
            **counts,
        }

    def prepare_close(self) -> None:
        """Write the flush at close with ``O_DIRECT`` (where the filesystem takes it),
        whatever ``page_cache`` says: nothing here reads those blocks back, and on this
        VM buffered writes ran at 0.1-1.5 GB/s (page-cache pages to allocate, copies on
        a busy CPU) against 1.2-2.4 GB/s straight from the host tier's slots."""
        if not self._o_direct and self._probe_o_direct(warn=False):
            self._o_direct = True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    # -- batching -------------------------------------------------------------
    def _run(self, fn: Callable[[T], bool], items: list[T]) -> list[bool]:
        if len(items) <= 1:  # no thread hand-off for a single block
            return [fn(item) for item in items]
        return map_or_inline(self._pool, fn, items)

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] = self._counts.get(name, 0) + n

    # -- writing --------------------------------------------------------------
    def _write_one(self, item: tuple[BlockKey, torch.Tensor]) -> bool:
        key, block = item
        # Not ``self._codec or ...``: Codec.RAW is 0, so ``codec: raw`` would mean auto
        # (compressing bf16 at ~0.1 GB/s wherever shuffle+lz4 saves 10%).
        codec = self._codec
        if codec is None:  # auto; an encoded tier stores its layers uncompressed
            codec = Codec.RAW if self.encoding is not None else choose_codec(block, self.layout)
        encoded = encode_block(key, self.layout, block, codec, self.encoding)
        staged = self._sealed is not None
        if self._sealed is not None:
            encoded, image = self._sealed.image(encoded)
            parts: list[Any] = [image]
        else:
            parts = [encoded.header_bytes, bytes(self._data_offset - len(encoded.header_bytes))]
            parts += list(encoded.payload)
        temp = self._tree.temp_path(key, next(self._nonce))
        try:
            total = self._data_offset + encoded.header.payload_nbytes
            self._write_file(temp, parts, total, staged)
            self._ops.rename(temp, self._tree.block_path(key))
        except OSError as exc:
            self._discard(temp)
            self._write_failed(key, exc)
            return False
        if self._write_error is not None:
            self._write_error = None
            log.warning("disk tier %s: writable again", self._tree.base)
        if self._full and self._set_full(False):
            log.info("disk tier %s: there is room again; storing again", self._tree.base)
        self._count("writes")
        self._count("bytes_written", encoded.nbytes)
        return True

    def _write_failed(self, key: BlockKey, exc: OSError) -> None:
        """Count a failed write; a directory that refuses writes is said once, not per block."""
        self._count("enospc" if exc.errno == errno.ENOSPC else "write_errors")
        if exc.errno == errno.ENOSPC:  # one line for a full disk, not one per block
            level = logging.WARNING if self._set_full(True) else logging.DEBUG
            log.log(
                level,
                "disk tier %s: the disk is full (%s); blocks that do not fit are not stored "
                "(misses): free space there or lower the tier's capacity",
                self._tree.base,
                exc.strerror or exc,
            )
            return
        if exc.errno not in _REFUSED:
            log.warning("disk tier: cannot write block %s: %s", key.hex(), exc)
            return
        first = self._write_error is None
        self._write_error = exc.strerror or str(exc)
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "disk tier %s: cannot write (%s); storing nothing", self._tree.base, exc)

    def _set_full(self, full: bool) -> bool:
        """Record whether the disk is full; True if that changed."""
        with self._full_lock:
            changed, self._full = self._full != full, full
        return changed

    def _write_file(self, path: str, parts: list[Any], total: int, staged: bool = False) -> None:
        """Create ``path`` and write ``parts`` to it (recreating a vanished directory);
        ``staged``: ``parts`` is one page-aligned buffer, padded for O_DIRECT already."""
        direct = self._o_direct and (staged or self._codec == Codec.RAW)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if direct:
            flags |= os.O_DIRECT
            if not staged:
                parts = self._direct_parts(parts, total)
        try:
            fd = self._ops.open(path, flags)
        except FileNotFoundError:  # someone removed the directory: make it again
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = self._ops.open(path, flags)
        try:
            write_all(self._ops, fd, parts, 0)
            if self.disk_config.fsync:
                self._ops.fsync(fd)
            if self._bypass and not direct:  # best effort: starts writeback, drops clean pages
                self._drop_cached(fd)
        finally:
            self._ops.close(fd)

    def _direct_parts(self, parts: list[Any], total: int) -> list[Any]:
        """``parts`` (header, padding, payload) in buffers O_DIRECT takes.

        The payload goes as it is when every piece starts and ends on a page
        boundary (blocks leaving the host tier's slots do): only the header is
        copied, into a page-aligned buffer. Otherwise everything is staged.
        """
        payload = [memoryview(p).cast("B") for p in parts[2:]]
        if not all(_page_aligned(p) for p in payload):
            return [self._stage(parts, total)]
        head = self._buffer("head", self._data_offset)
        offset = 0
        for part in parts[:2]:
            data = memoryview(part).cast("B")
            head[offset : offset + len(data)] = data
            offset += len(data)
        return [head[: self._data_offset], *payload]

    def _buffer(self, name: str, size: int) -> memoryview:
        """This thread's page-aligned buffer ``name`` of at least ``size`` bytes."""
        buffers: dict[str, mmap.mmap] = self._local.__dict__.setdefault("buffers", {})
        region = buffers.get(name)
        if region is None or len(region) < size:
            region = buffers[name] = mmap.mmap(-1, _round_up(size))
        return memoryview(region)

    def _stage(self, parts: list[Any], total: int) -> memoryview:
        """Copy ``parts`` into this thread's page-aligned buffer (O_DIRECT needs one);
        counted in :meth:`stats` as ``staged_writes``."""
        self._count("staged_writes")
        size = _round_up(total)
        view = self._buffer("staging", self._file_nbytes)
        offset = 0
        for part in parts:
            data = memoryview(part).cast("B")
            view[offset : offset + len(data)] = data
            offset += len(data)
        view[offset:size] = bytes(size - offset)
        return view[:size]

    def _drop_cached(self, fd: int) -> None:
        """Ask the kernel to drop the file's pages from the page cache (``bypass``)."""
        with contextlib.suppress(OSError):
            self._ops.fadvise(fd, 0, 0, getattr(os, "POSIX_FADV_DONTNEED", 4))

    def _discard(self, path: str) -> None:
        try:
            self._ops.unlink(path)
        except OSError:
            return

    # -- reading --------------------------------------------------------------
    def _read_one(
        self, key: BlockKey, out: torch.Tensor, layers: LayerRange, buffered: bool = False
    ) -> bool:
        path = self._tree.block_path(key)
        direct = None if buffered or self.cipher else self._direct_target(out, layers)
        # A sealed block is read whole, with O_DIRECT, into a page-aligned buffer.
        whole = self.cipher is not None and self._o_direct and layers is None and not buffered
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct or whole else 0)
        try:
            fd = self._ops.open(path, flags)
        except FileNotFoundError:
            self._count("misses")
            return False
        except OSError as exc:
            self._count("read_errors")
            log.warning("disk tier: cannot open block %s: %s", key.hex(), exc)
            return False
        again = False
        try:
            if self._sealed is not None:
                nbytes = self._sealed.read(self._ops, fd, key, out, layers)
            elif direct is not None:
                nbytes = self._read_direct(fd, key, direct)
            else:
                nbytes = self._read_block(fd, key, out, layers)
        except _NotRaw:  # compressed by another writer: read it through the page cache
            again = True
        except DecryptError as exc:  # a key problem, not a bad medium: delete nothing
            self._count("decrypt_failures")
            log.warning("disk tier: block %s cannot be opened: %s", key.hex(), exc)
            return False
        except (CorruptBlockError, LayoutMismatchError) as exc:
            self._count("corrupt")
            log.warning("disk tier: block %s failed verification (%s); deleting it", key.hex(), exc)
            self._discard(path)
            return False
        except OSError as exc:
            self._count("read_errors")
            log.warning("disk tier: cannot read block %s: %s", key.hex(), exc)
            return False
        finally:
            if self._bypass and direct is None and not whole:
                self._drop_cached(fd)
            self._ops.close(fd)
        if again:
            return self._read_one(key, out, layers, buffered=True)
        if direct is not None:
            self._count("direct_reads")
        self._count("reads")
        self._count("bytes_read", nbytes)
        return True

    def _direct_target(
        self, out: torch.Tensor, layers: LayerRange
    ) -> list[list[memoryview]] | None:
        """``out``'s pages, when a whole raw block can be read into them with O_DIRECT
        (``bypass``, a filesystem that takes it, page-aligned memory such as vLLM's
        primary rows or the host tier's slots): no page cache, no copy."""
        if not self._o_direct or layers is not None or self.encoding is not None:
            return None
        pieces = layer_pieces(out)
        if pieces is None or not all(_page_aligned(p) for row in pieces for p in row):
            return None
        return pieces

    def _read_direct(self, fd: int, key: BlockKey, pieces: list[list[memoryview]]) -> int:
        """Read a whole raw block with O_DIRECT straight into ``pieces`` -- header and
        payload in one ``preadv``, one disk round trip -- then verify it (the caller must
        not use ``pieces`` if this raises). :class:`_NotRaw` if it is compressed."""
        head = self._buffer("head", self._data_offset)[: self._data_offset]
        flat = [p for row in pieces for p in row]
        got = read_exact(self._ops, fd, [head, *flat], 0)
        if got < header_size(self.layout.num_layers):
            raise CorruptBlockError("block file shorter than its header")
        header = parse_header(head, self.layout, key)
        if header.codec != Codec.RAW:
            raise _NotRaw
        offset, span = header.layer_span(0, header.num_layers)
        if offset != 0 or got < self._data_offset + span:
            raise CorruptBlockError("block file truncated")
        verify_layers(header, pieces, 0)
        return span

    def _read_block(self, fd: int, key: BlockKey, out: torch.Tensor, layers: LayerRange) -> int:
        """Read, verify and decode layers of one open block file into ``out``."""
        head = bytearray(self._data_offset)
        if read_exact(self._ops, fd, [head], 0) < header_size(self.layout.num_layers):
            raise CorruptBlockError("block file shorter than its header")
        header = parse_header(head, self.layout, key)
        first, last = layers if layers is not None else (0, header.num_layers)
        offset, span = header.layer_span(first, last)
        offset += self._data_offset
        pieces = layer_pieces(out) if header.codec == Codec.RAW else None
        if pieces is not None:  # straight into the caller's tensor, verified in place
            self._read_raw(fd, header, pieces, first, offset)
        else:
            self._read_decode(fd, header, out, (first, last), (offset, span))
        return span

    def _read_raw(
        self, fd: int, header: BlockHeader, pieces: list[list[memoryview]], first: int, offset: int
    ) -> None:
        """Read raw layers ``first, ...`` into ``pieces``, verifying each group as it lands.

        Groups of about :data:`READ_GROUP_NBYTES`: the checksum then reads bytes
        the copy has just brought into the CPU cache. Sequential reads keep the
        kernel's readahead going for cold files.
        """
        per_group = max(1, READ_GROUP_NBYTES // max(1, self.layout.layer_nbytes))
        for start in range(0, len(pieces), per_group):
            rows = pieces[start : start + per_group]
            flat = [p for row in rows for p in row]
            want = sum(len(p) for p in flat)
            if read_exact(self._ops, fd, flat, offset) < want:
                raise CorruptBlockError("block file truncated")
            verify_layers(header, rows, first + start)
            offset += want

    def _read_decode(
        self,
        fd: int,
        header: BlockHeader,
        out: torch.Tensor,
        layers: tuple[int, int],
        extent: tuple[int, int],
    ) -> None:
        offset, span = extent
        payload = bytearray(span)
        if read_exact(self._ops, fd, [payload], offset) < span:
            raise CorruptBlockError("block file truncated")
        decode_into(header, payload, self.layout, out, layers)
