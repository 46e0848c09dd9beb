"""Encrypted block files of the disk tier (encryption at rest, :mod:`kvstore.format.sealing`).

A sealed block file is the sealed header, zero padding to a page, then each
layer's ciphertext and tag, zero-padded to a page. It is built in one
page-aligned buffer the layers are sealed straight into, so O_DIRECT writes it
as it is (nothing is copied after sealing); padded always, so a whole-file
O_DIRECT read never ends mid-page. Reads bring the ciphertext into a
page-aligned per-thread buffer and open it into the caller's tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import CorruptBlockError
from kvstore.format import TAG_BYTES, EncodedBlock, header_size, parse_header
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.tiers.base import LayerRange
from kvstore.tiers.files import FileOps, read_exact
from kvstore.tiers.remote_common import decode_layers

__all__ = ["SealedFiles"]

PAGE = 4096
#: ``buffer(name, nbytes)``: this thread's page-aligned buffer ``name`` of at least ``nbytes``.
Buffers = Callable[[str, int], memoryview]


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass(frozen=True)
class SealedFiles:
    """How a disk tier that encrypts writes and reads its block files."""

    layout: KVLayout
    cipher: Any
    buffers: Buffers
    #: A block's payload before sealing (the layout's bytes, or fewer when encoded).
    payload_nbytes: int = 0

    @property
    def data_offset(self) -> int:
        """Where the payload starts in a file (the sealed header rounded up to a page)."""
        return _round_up(header_size(self.layout.num_layers, sealed=True))

    @property
    def file_nbytes(self) -> int:
        """The largest file: header, a raw (or encoded) payload and its tags, padded to
        a page."""
        tags = TAG_BYTES * self.layout.num_layers
        payload = self.payload_nbytes or self.layout.block_nbytes
        return _round_up(self.data_offset + payload + tags)

    def image(self, encoded: EncodedBlock) -> tuple[EncodedBlock, memoryview]:
        """``encoded`` sealed, and its whole file (in this thread's staging buffer)."""
        from kvstore.format import seal  # imports cryptography: only where a tier encrypts

        view = self.buffers("staging", self.file_nbytes)
        start = self.data_offset
        sealed = seal(encoded, self.cipher, view[start:])
        head = sealed.header_bytes
        view[: len(head)] = head
        view[len(head) : start] = bytes(start - len(head))
        total = start + sealed.header.payload_nbytes
        end = _round_up(total)
        view[total:end] = bytes(end - total)
        return sealed, view[:end]

    def read(
        self, ops: FileOps, fd: int, key: BlockKey, out: torch.Tensor, layers: LayerRange
    ) -> int:
        """Read a sealed block's ``layers`` from ``fd`` and open them into ``out``; the
        payload bytes read. Without ``layers``, the whole file in one read (``fd`` may
        be opened with O_DIRECT)."""
        start = self.data_offset
        if layers is None:
            buf = self.buffers("read", self.file_nbytes)[: self.file_nbytes]
            got = read_exact(ops, fd, [buf], 0)
            header = parse_header(buf[: min(got, start)], self.layout, key)
            self.cipher.check(header)
            span = header.payload_nbytes
            if got < start + span:
                raise CorruptBlockError("block file truncated")
            payload = buf[start : start + span]
        else:
            head = bytearray(start)
            if read_exact(ops, fd, [head], 0) < header_size(self.layout.num_layers):
                raise CorruptBlockError("block file shorter than its header")
            header = parse_header(head, self.layout, key)
            self.cipher.check(header)
            offset, span = header.layer_span(*layers)
            payload = self.buffers("read", span)[:span]
            if read_exact(ops, fd, [payload], start + offset) < span:
                raise CorruptBlockError("block file truncated")
        decode_layers(header, payload, self.layout, out, layers, self.cipher)
        return span
