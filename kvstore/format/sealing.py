"""Encryption at rest: each stored layer sealed with AES-256-GCM, a key per tenant.

The disk, Redis and S3 tiers seal what they store when the config's
``encryption`` section names a keyring (:mod:`kvstore.config.encryption`);
memory tiers (host, device) are not at rest and stay plain. The cipher is the
``cryptography`` package's AES-GCM (OpenSSL underneath), never one of our own.

Format (:mod:`kvstore.format.codec`): an encrypted block's header says so (format
version 3) and names the key id; each layer's stored bytes are its ciphertext
followed by its 16-byte tag, so a ranged read of a few layers opens just those.
The per-layer checksums stay the plaintext's and are checked after opening.

Nonces: one random 96-bit nonce per block, in the header; layer ``i`` is sealed
under that nonce with ``i`` xor-ed into its last four bytes. Why not a random
nonce per layer: the same safety (within a block the layers' nonces differ; two
blocks collide only if their random nonces differ by a layer index, about
``layers * 2**-96`` per pair of blocks: 2**-37 at 16M blocks of 4096 layers), one
``os.urandom`` per block and 12 header bytes instead of 12 per layer.

Associated data of layer ``i``: the format tag; the tenant, the store's
namespace and the key id, each length-prefixed; the layout's fingerprint, the
block's key, ``i`` and the codec. The namespace is the server's (the ``ns-<name>``
of its disk directories, S3 prefixes and Redis keys), ``cluster.namespace`` for a
library store. A block copied under another key or into another namespace's place
(of the same tenant too), a layer moved to another position, a block of another
tenant or layout: each fails its tag. (A block's key folds in the model's
namespace, not the server's: clients name keys, and two namespaces may hold the
same one.)

Format version 2, the first, bound everything but the namespace. Its blocks are
not opened (:meth:`BlockCipher.check`: a counted miss, never data; a later put of
the key overwrites them): reading them by their own rule would leave exactly those
blocks movable between a tenant's namespaces.

A block that cannot be opened (no key for its id, a tag that does not verify:
tampered, or sealed under another key; a plain block where encryption is on) is
:class:`~kvstore.errors.DecryptError`: the tier counts it (``decrypt_failures``)
and answers a miss, and deletes nothing, because another process holding the
right key may share the medium. A later put of the key overwrites it.

Tenants: the tenant of a store is ``tenant_of(namespace)``, which puts every
namespace in tenant ``default`` until :func:`use_tenant_resolver` plugs in another
mapping (a kvstore-server with ``server.tenants`` plugs in its own).

This module is the format's side (the cipher, sealing and opening a block); which tiers
of a store seal, with whose keys, is wired by :mod:`kvstore.tiers.encryption`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvstore.errors import ConfigError, CorruptBlockError, DecryptError
from kvstore.format.codec import (
    NONCE_BYTES,
    TAG_BYTES,
    BlockHeader,
    Codec,
    EncodedBlock,
    checksum_pieces,
    decode_layer,
    layer_pieces,
)
from kvstore.format.header import SEALED_VERSION
from kvstore.format.keyring import KeyringSource, TenantKeys
from kvstore.layout import KVLayout
from kvstore.runtime import install_hint

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_TENANT",
    "BlockCipher",
    "aead_module",
    "open_into",
    "seal",
    "sealed_nbytes",
    "tenant_of",
    "use_tenant_resolver",
]

DEFAULT_TENANT = "default"
#: The namespace of a store whose config names none (``cluster.namespace``'s default).
DEFAULT_NAMESPACE = "default"
_AAD = b"kvstore-aead-v2\0"
_NAME = struct.Struct("<H")
_LAYER_CODEC = struct.Struct("<IB")
_GROUP = struct.Struct("<H")
#: Keys read under an older key id, remembered for the re-encryption, which takes them
#: right after its own reads: a full set is emptied (reads outside a sweep fill it too).
_MAX_STALE = 1 << 16

TenantResolver = Callable[[str], str]
_resolver: TenantResolver = lambda namespace: DEFAULT_TENANT  # noqa: E731


def tenant_of(namespace: str) -> str:
    """The tenant whose keys seal the blocks of ``namespace`` (``default`` for all
    until tenants exist)."""
    return _resolver(namespace)


def use_tenant_resolver(resolver: TenantResolver | None) -> None:
    """Map namespaces to tenants with ``resolver`` (None: everything is ``default``)."""
    global _resolver
    _resolver = resolver if resolver is not None else (lambda namespace: DEFAULT_TENANT)


def aead_module() -> Any:
    """The ``cryptography`` package's AEAD module; :class:`ConfigError` saying what to
    install where it is missing."""
    try:
        aead = importlib.import_module("cryptography.hazmat.primitives.ciphers.aead")
    except ImportError:
        raise ConfigError(
            "encryption: needs the cryptography package; install it with: "
            f"{install_hint('encrypt')}"
        ) from None
    return aead


def sealed_nbytes(layout: KVLayout) -> int:
    """Stored payload bytes of an encrypted raw block of ``layout`` (tags included)."""
    return layout.block_nbytes + TAG_BYTES * layout.num_layers


def _names(*names: str) -> bytes:
    """``names`` each UTF-8, length-prefixed (no name can run into the next)."""
    return b"".join(_NAME.pack(len(b)) + b for b in (n.encode() for n in names))


class BlockCipher:
    """Seals and opens one store's blocks with a tenant's keys (thread-safe);
    ``namespace``: the store's, bound into every layer's associated data."""

    def __init__(self, tenant: str, keys: TenantKeys, namespace: str = DEFAULT_NAMESPACE) -> None:
        aead = aead_module()
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self.tenant = tenant
        self.namespace = namespace
        self.active = keys.active
        self._keys = dict(keys.keys)
        self._aead = {kid: aead.AESGCM(key) for kid, key in self._keys.items()}
        self._invalid = InvalidTag
        self._lowlevel = (Cipher, algorithms.AES, modes.GCM)
        self._lock = threading.Lock()  # guards _stale and _counts
        self._stale: set[bytes] = set()
        self._counts = dict.fromkeys(
            ("sealed", "opened", "opened_old_key", "reencrypt_pending", "reencrypted"), 0
        )

    @classmethod
    def from_config(cls, config: KeyringSource, namespace: str) -> BlockCipher:
        """The cipher of a store of ``namespace`` (reads the keyring now)."""
        keyring = config.keyring()
        tenant = tenant_of(namespace)
        return cls(tenant, keyring.tenant(tenant), namespace)

    @property
    def old_keys(self) -> list[str]:
        """Key ids in the keyring besides the active one (blocks may be sealed under them)."""
        return [kid for kid in self._keys if kid != self.active]

    # -- sealing ----------------------------------------------------------------
    def _aad(self, header: BlockHeader, index: int) -> bytes:
        return b"".join(
            (
                _AAD,
                _names(self.tenant, self.namespace, header.key_id),
                header.layout_fp,
                header.key,
                _LAYER_CODEC.pack(index, int(header.codec)),
                # An encoded block binds its group size too (its codec, the encoding,
                # is bound above); blocks in no encoding are bound as before.
                _GROUP.pack(header.group_size) if header.encoding is not None else b"",
            )
        )

    @staticmethod
    def _nonce(header: BlockHeader, index: int) -> bytes:
        tail = int.from_bytes(header.nonce[-4:], "little") ^ index
        return header.nonce[:-4] + tail.to_bytes(4, "little")

    def seal_layer(
        self, header: BlockHeader, index: int, src: Sequence[memoryview], dst: memoryview
    ) -> None:
        """Seal layer ``index`` (its plain stored bytes, in pieces) into ``dst``
        (ciphertext, then the tag: ``TAG_BYTES`` more than the plaintext)."""
        nonce, aad = self._nonce(header, index), self._aad(header, index)
        if len(src) == 1:  # one call, the key schedule kept in the AESGCM object
            self._aead[header.key_id].encrypt_into(nonce, src[0], aad, dst)
            return
        cipher, aes, gcm = self._lowlevel
        enc = cipher(aes(self._keys[header.key_id]), gcm(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        offset = 0
        for piece in src:
            enc.update_into(piece, dst[offset : offset + len(piece)])
            offset += len(piece)
        enc.finalize()
        dst[offset : offset + TAG_BYTES] = enc.tag

    def open_layer(
        self, header: BlockHeader, index: int, stored: memoryview, dst: Sequence[memoryview]
    ) -> None:
        """Open layer ``index`` (ciphertext and tag) into the pieces ``dst``;
        :class:`DecryptError` if the tag does not verify (``dst`` is then garbage)."""
        nonce, aad = self._nonce(header, index), self._aad(header, index)
        body = len(stored) - TAG_BYTES
        if body < 0 or sum(len(d) for d in dst) != body:
            raise CorruptBlockError(f"layer {index} of block {header.key.hex()} has a wrong size")
        try:
            if len(dst) == 1:
                self._aead[header.key_id].decrypt_into(nonce, stored, aad, dst[0])
                return
            cipher, aes, gcm = self._lowlevel
            tag = bytes(stored[body:])
            dec = cipher(aes(self._keys[header.key_id]), gcm(nonce, tag)).decryptor()
            dec.authenticate_additional_data(aad)
            offset = 0
            for piece in dst:
                dec.update_into(stored[offset : offset + len(piece)], piece)
                offset += len(piece)
            dec.finalize()
        except self._invalid:
            raise DecryptError(
                f"layer {index} of block {header.key.hex()} does not verify under key "
                f"{header.key_id!r} of tenant {self.tenant!r} in namespace "
                f"{self.namespace!r} (tampered, sealed with another key, or moved from "
                "another key or namespace)"
            ) from None

    def check(self, header: BlockHeader) -> None:
        """Raise :class:`DecryptError` unless this cipher can open ``header``'s block."""
        if not header.sealed:
            raise DecryptError(
                f"block {header.key.hex()} is not encrypted, and this tier stores only "
                "encrypted blocks"
            )
        if header.sealed_version != SEALED_VERSION:
            raise DecryptError(
                f"block {header.key.hex()} is sealed in format version "
                f"{header.sealed_version}, which did not bind its namespace; it is not "
                "opened (a later put of the key replaces it)"
            )
        if header.key_id not in self._aead:
            raise DecryptError(
                f"block {header.key.hex()} is sealed with key {header.key_id!r}, which "
                f"tenant {self.tenant!r}'s keyring does not hold"
            )

    # -- re-encryption bookkeeping ----------------------------------------------
    def opened(self, header: BlockHeader) -> None:
        """Count an opened block; remember it if an older key sealed it."""
        with self._lock:
            self._counts["opened"] += 1
            if header.key_id != self.active:
                self._counts["opened_old_key"] += 1
                if len(self._stale) >= _MAX_STALE:
                    self._stale.clear()
                self._stale.add(header.key)

    def take_stale(self, keys: Iterable[bytes]) -> list[bytes]:
        """Of ``keys``, those last read under an older key (forgotten as they are taken)."""
        with self._lock:
            found = [k for k in keys if bytes(k) in self._stale]
            self._stale.difference_update(bytes(k) for k in found)
        return found

    def stats(self) -> dict[str, Any]:
        """What the tier's ``stats()`` shows of its encryption."""
        with self._lock:
            counts = dict(self._counts)
        return {
            "encrypted": True,
            "tenant": self.tenant,
            "namespace": self.namespace,
            "active_key": self.active,
            **counts,
        }

    def count_sealed(self) -> None:
        """Count a sealed block."""
        self.count("sealed")

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (shown in the tier's ``stats()``)."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n


def _split(parts: Sequence[memoryview], sizes: Sequence[int]) -> list[list[memoryview]]:
    """``parts`` (a block's payload buffers, in order) cut into one list per layer."""
    flat = [p.cast("B") if p.format != "B" or p.ndim != 1 else p for p in parts]
    groups: list[list[memoryview]] = []
    i, offset = 0, 0
    for size in sizes:
        group: list[memoryview] = []
        while size:
            piece = flat[i][offset:]
            take = min(size, len(piece))
            group.append(piece[:take])
            size -= take
            offset += take
            if offset == len(flat[i]):
                i, offset = i + 1, 0
        groups.append(group)
    return groups


def seal(encoded: EncodedBlock, cipher: BlockCipher, dst: memoryview | None = None) -> EncodedBlock:
    """``encoded`` (a plain block) sealed under the cipher's active key, its payload
    written into ``dst`` (``header.payload_nbytes + TAG_BYTES * layers`` bytes; None:
    a new buffer)."""
    plain = encoded.header
    sizes = plain.layer_nbytes
    total = plain.payload_nbytes + TAG_BYTES * len(sizes)
    out = memoryview(bytearray(total)) if dst is None else dst.cast("B")[:total]
    header = dataclasses.replace(
        plain,
        payload_nbytes=total,
        layer_nbytes=tuple(n + TAG_BYTES for n in sizes),
        key_id=cipher.active,
        nonce=os.urandom(NONCE_BYTES),
        sealed_version=SEALED_VERSION,
    )
    offset = 0
    for index, group in enumerate(_split(encoded.payload, sizes)):
        n = sizes[index] + TAG_BYTES
        cipher.seal_layer(header, index, group, out[offset : offset + n])
        offset += n
    cipher.count_sealed()
    return EncodedBlock(header=header, header_bytes=header.pack(), payload=(out,))


def open_into(
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    layout: KVLayout,
    out: torch.Tensor,
    layers: tuple[int, int] | None,
    cipher: BlockCipher,
) -> None:
    """Open, verify and decode layers ``[first, last)`` of a sealed block into ``out``.

    ``payload`` holds exactly those layers' stored bytes. Raw layers are opened
    straight into ``out`` (CPU memory); others through a scratch buffer. Raises
    :class:`DecryptError` (or :class:`CorruptBlockError`); ``out`` may be partly
    written then.
    """
    cipher.check(header)
    first, last = layers if layers is not None else (0, header.num_layers)
    _, span = header.layer_span(first, last)
    view = memoryview(payload).cast("B")
    if len(view) < span:
        raise CorruptBlockError(f"block payload truncated: {len(view)} of {span} bytes")
    pieces = layer_pieces(out) if header.codec == Codec.RAW else None
    offset = 0
    for i in range(first, last):
        n = header.layer_nbytes[i]
        stored = view[offset : offset + n]
        if pieces is not None:
            cipher.open_layer(header, i, stored, pieces[i - first])
            if checksum_pieces(pieces[i - first]) != header.layer_checksums[i]:
                raise CorruptBlockError(f"checksum mismatch in layer {i} of {header.key.hex()}")
        else:
            plain = bytearray(n - TAG_BYTES)
            cipher.open_layer(header, i, stored, [memoryview(plain)])
            decode_layer(header, i, plain, layout, out[i - first])
        offset += n
    cipher.opened(header)
