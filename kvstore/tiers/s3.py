"""S3 tier: any S3-compatible object store as the shared, bottomless cold tier.

One object per block, content-addressed::

    <prefix>/<layout fingerprint hex>/<first 2 hex digits of the key>/<key hex>

The fingerprint directory keeps blocks of other layouts apart (``stored_keys``
lists only this layout's directory); the two-digit fan-out keeps any one
listing level small. Keys already fold in the namespace (model, adapter,
rank), so two stores share an object only when they share the KV.

Each object is an encoded block (:mod:`kvstore.format.codec`): header with per-layer
checksums, then the payload. Every get verifies what it returns; a corrupt or
foreign object is a miss, counted, and deleted once a second read shows that the
stored bytes are bad (bytes damaged on the way delete nothing: the bucket is shared).
``get(..., layers=(a, b))`` reads the header (a ranged GET of
``header_size(num_layers)`` bytes, cached per key with its ETag) and then only
the payload bytes of those layers (a second ranged GET with ``If-Match`` on that
ETag, so a rewritten object can never pair a stale header with new bytes).

Concurrency: every request runs on one bounded thread pool whose size is the
botocore connection pool's (``concurrency``), so a batch moves that many
objects at once and never opens more connections. Blocks above
``multipart_threshold`` go up as a multipart upload and come down as
parallel ranged GETs of ``part_size`` bytes.

Failures: botocore's own retries are off; every request goes through
:meth:`S3Requests.call <kvstore.tiers._s3util.S3Requests.call>`, which retries
(:func:`kvstore.runtime.retry.retry_call`: backoff with full jitter) on throttling,
5xx, connection errors and timeouts, inside the batch's ``deadline``. Past
it, the block is a miss (``deadline_exceeded`` counts it). Connect and read
timeouts come from the config, so no request waits unbounded. Credentials
come from the boto3 chain and appear in no log line and no error message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import botocore.exceptions
import torch

from kvstore.config import S3TierConfig, TierConfig
from kvstore.errors import (
    ConfigError,
    CorruptBlockError,
    DecryptError,
    LayoutMismatchError,
    TierError,
)
from kvstore.format import (
    TAG_BYTES,
    BlockHeader,
    Codec,
    EncodedBlock,
    layer_pieces,
    parse_header,
    verify_layers,
)
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.runtime import call_or_inline, mask_text
from kvstore.tiers._s3util import (
    CORRUPT_CODES,
    MISSING_CODES,
    PERMANENT_CODES,
    BodyReader,
    HeaderCache,
    S3Requests,
    error_info,
    etag_matches,
    has_code,
)
from kvstore.tiers.base import LayerRange
from kvstore.tiers.remote_common import (
    BufferPool,
    ValueTier,
    check_get_args,
    check_put_args,
    decode_layers,
    decode_value,
    encode_value,
    key_from_hex,
    pack_into,
)

__all__ = ["S3Tier"]

log = logging.getLogger(__name__)

_COUNTERS = (
    *ValueTier.counter_names,
    "deadline_exceeded",
    "retries_exhausted",
    "corrupt_deleted",
    "corrupt_kept",
    "damaged_in_transit",
    "multipart_uploads",
    "ranged_gets",
)
_HEADER_CACHE_ENTRIES = 4096
# Encoded values and GET bodies go through reused buffers: a fresh multi-MiB buffer
# page-faults on first touch, which cost ~20% of put and ~10% of get throughput.
_IDLE_BUFFER_BYTES = 128 * 1024**2
_READ_CHUNK = 1024**2
_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes


@dataclass(frozen=True)
class Target:
    """Where one get's bytes go: the tensor, the layers asked for, the deadline."""

    out: torch.Tensor
    layers: LayerRange
    deadline_at: float


class S3Tier(ValueTier):
    """Blocks as objects in an S3 bucket (see the module docstring)."""

    kind = "s3"
    persistent = True
    shared = True  # other processes and nodes write the same bucket
    local = False
    #: Objects per listing request (S3 returns at most 1000).
    list_page = 1000
    counter_names = _COUNTERS

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        if not isinstance(config, S3TierConfig):
            raise ConfigError(f"s3 tier needs an S3TierConfig, got {type(config).__name__}")
        config.validate("s3")
        super().__init__(config, layout)
        self.cfg = config
        self._dir = f"{config.prefix.strip('/')}/{layout.fingerprint_hex}/"
        # Above the threshold a whole block moves in part_size pieces, in parallel.
        self._large = layout.block_nbytes + self._header_nbytes > config.multipart_threshold
        self._headers = HeaderCache(_HEADER_CACHE_ENTRIES)
        self._buffers = BufferPool(_IDLE_BUFFER_BYTES)
        self._healthy = True
        #: The client, its thread pool and breaker: every request goes through it.
        self._s3 = S3Requests(config, self._counters)
        try:  # a missing bucket or refused credentials fail the open, in one line
            self._s3.check_bucket(self._dir)
        except BaseException:
            self._s3.close()
            raise

    def encrypt_with(self, cipher: Any) -> None:
        """Seal objects with ``cipher`` (encryption at rest, :mod:`kvstore.format.sealing`); a
        sealed block carries a tag a layer, which may make it a multipart one."""
        super().encrypt_with(cipher)
        tags = TAG_BYTES * self.layout.num_layers
        self._large = self.layout.block_nbytes + tags + self._header_nbytes > (
            self.cfg.multipart_threshold
        )

    # -- names and sizes ----------------------------------------------------
    @property
    def directory(self) -> str:
        """``<prefix>/<layout fingerprint hex>/``: where this tier's objects live."""
        return self._dir

    def object_name(self, key: BlockKey) -> str:
        """The object name of ``key`` under this tier's prefix and layout."""
        text = bytes(key).hex()
        return f"{self._dir}{text[:2]}/{text}"

    # -- the primitives -----------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        check_put_args(self.layout, keys, blocks)
        deadline_at = time.monotonic() + self.cfg.deadline
        if self._large:  # one block at a time, its parts in parallel
            done = [self._put_large(k, b, deadline_at) for k, b in zip(keys, blocks, strict=True)]
        else:
            done = self._s3.map(lambda i: self._put_one(keys[i], blocks[i], deadline_at), len(keys))
        return self._unless_down(done, "stored")

    def get(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[torch.Tensor],
        layers: LayerRange = None,
    ) -> list[bool]:
        self._check_open()
        layers = check_get_args(self.layout, keys, outs, layers)
        deadline_at = time.monotonic() + self.cfg.deadline
        if self._large and layers is None:
            done = [
                self._get_guarded(k, o, None, deadline_at) for k, o in zip(keys, outs, strict=True)
            ]
        else:
            done = self._s3.map(
                lambda i: self._get_guarded(keys[i], outs[i], layers, deadline_at), len(keys)
            )
        return self._unless_down(done, "read")

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._check_open()
        deadline_at = time.monotonic() + self.cfg.deadline
        done = self._s3.map(lambda i: self._head(keys[i], deadline_at), len(keys))
        return self._unless_down(done, "checked")

    def _unless_down(self, done: list[bool], what: str) -> list[bool]:
        """Per-block results, or :class:`TierError` when the endpoint itself is down.

        A block that is missing or corrupt is a per-block False (the manager
        forgets that copy); an unreachable endpoint is not the blocks' fault,
        so it raises and the manager keeps its books for when S3 is back.
        """
        if done and not any(done) and not self._s3.available:
            raise TierError(f"s3 endpoint unavailable: {len(done)} blocks not {what}")
        return done

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self._check_open()
        unique = list(dict.fromkeys(keys))
        for key in unique:
            self._headers.drop(key)
        chunks = [unique[i : i + _DELETE_BATCH] for i in range(0, len(unique), _DELETE_BATCH)]
        deadline_at = time.monotonic() + self.cfg.deadline
        failed = sum(
            self._s3.map(lambda i: self._delete_chunk(chunks[i], deadline_at), len(chunks))
        )
        if failed:
            raise TierError(
                f"s3 tier: {failed} of {len(unique)} deletes under s3://{self.cfg.bucket}/"
                f"{self._dir} failed"
            )

    def stored_keys(self) -> Iterator[BlockKey]:
        self._check_open()
        return self._list_keys()

    # -- put ----------------------------------------------------------------
    def _put_one(self, key: BlockKey, block: torch.Tensor, deadline_at: float) -> bool:
        encoded = encode_value(key, self.layout, block, self.cfg.codec, self.encoding)
        size = encoded.nbytes
        if self.cipher is not None:
            size = self._header_nbytes + encoded.header.payload_nbytes
            size += TAG_BYTES * encoded.header.num_layers
        buf = self._buffers.take(size, exact=True)  # the body must be exactly it
        try:
            self._pack(encoded, buf)
            self._s3.put_object(self.object_name(key), buf, deadline_at)
        except Exception as exc:
            self._failed("put", key, exc)
            return False
        finally:
            self._buffers.give([buf])
        self._stored(key, size)
        return True

    def _pack(self, encoded: EncodedBlock, buf: bytearray) -> None:
        """``encoded`` into ``buf``: copied, or sealed straight into it."""
        if self.cipher is None:
            pack_into(encoded, buf)
            return
        from kvstore.format import seal  # imports cryptography: only where a tier encrypts

        start = self._header_nbytes
        sealed = seal(encoded, self.cipher, memoryview(buf)[start:])
        buf[:start] = sealed.header_bytes

    def _put_large(self, key: BlockKey, block: torch.Tensor, deadline_at: float) -> bool:
        try:
            encoded = encode_value(key, self.layout, block, self.cfg.codec, self.encoding)
            if self.cipher is not None:
                from kvstore.format import seal

                encoded = seal(encoded, self.cipher)
            data = encoded.tobytes()
            name = self.object_name(key)
            if len(data) <= self.cfg.multipart_threshold:  # compression brought it under
                call_or_inline(self._s3.pool, lambda: self._s3.put_object(name, data, deadline_at))
            else:
                self._s3.put_multipart(name, data, deadline_at)
        except Exception as exc:
            self._failed("put", key, exc)
            return False
        self._stored(key, len(data))
        return True

    def _stored(self, key: BlockKey, nbytes: int) -> None:
        self._headers.drop(key)  # a rewrite may have another codec and ETag
        self._counters.add("blocks_put")
        self._counters.add("bytes_out", nbytes)
        self._healthy = True

    # -- get ----------------------------------------------------------------
    def _get_guarded(
        self, key: BlockKey, out: torch.Tensor, layers: LayerRange, deadline_at: float
    ) -> bool:
        """Read one block (or its layers) into ``out``; every failure is a miss."""
        try:
            if layers is not None:
                self._get_layers(key, out, layers, deadline_at, use_cache=True)
            elif self._large:
                data = self._s3.fetch_ranged(self.object_name(key), deadline_at)
                decode_value(data, self.layout, key, out, None, self.cipher)
            else:
                self._get_whole(key, out, deadline_at)
        except DecryptError as exc:
            return self._decrypt_failed(key, exc)
        except (CorruptBlockError, LayoutMismatchError) as exc:
            return self._corrupt(key, exc, Target(out, layers, deadline_at))
        except Exception as exc:
            if has_code(exc, CORRUPT_CODES, 416):
                why = CorruptBlockError(f"object is shorter than a header: {exc}")
                return self._corrupt(key, why, Target(out, layers, deadline_at))
            if has_code(exc, MISSING_CODES, 404):
                self._headers.drop(key)
                self._counters.add("misses")
            else:
                self._failed("get", key, exc)
            return False
        self._counters.add("blocks_got")
        self._healthy = True
        return True

    def _get_whole(self, key: BlockKey, out: torch.Tensor, deadline_at: float) -> None:
        """One GET, verified into ``out``: a raw block streams straight into ``out``
        (checked in place), a compressed one through a reused buffer."""
        name, bucket = self.object_name(key), self.cfg.bucket
        bufs: list[bytearray] = []

        def fetch() -> None:
            resp = self._s3.client.get_object(Bucket=bucket, Key=name)
            size, reader = int(resp.get("ContentLength", 0)), BodyReader(resp["Body"])
            try:
                self._read_whole(key, reader, (size, str(resp.get("ETag", ""))), out, bufs)
            except BaseException:
                reader.close()
                raise
            self._counters.add("bytes_in", size)

        try:
            self._s3.call(fetch, deadline_at)
        finally:
            self._buffers.give(bufs)

    def _read_whole(
        self,
        key: BlockKey,
        reader: BodyReader,
        meta: tuple[int, str],
        out: torch.Tensor,
        bufs: list[bytearray],
    ) -> None:
        """Header first; then a raw payload straight into ``out``, else via a buffer."""
        size, etag = meta
        head = bytearray(self._header_nbytes)
        if reader.fill([memoryview(head)]) < len(head):
            raise CorruptBlockError("object is shorter than a block header")
        header = parse_header(head, self.layout, key)
        if self.cipher is not None:
            self.cipher.check(header)
        if etag:  # saves a request per later layerwise get
            self._headers.put(key, header, etag)
        plain = header.codec == Codec.RAW and self.cipher is None
        pieces = layer_pieces(out) if plain else None
        if pieces is not None and size == header.total_nbytes:
            flat = [p for row in pieces for p in row]
            if reader.fill(flat) < header.payload_nbytes or not reader.at_end():
                raise CorruptBlockError("object body has a different length than its header")
            verify_layers(header, pieces)
            return
        rest = max(size - len(head), 0)
        buf = self._buffers.take(rest)
        bufs.append(buf)
        view = memoryview(buf)[:rest]
        if reader.fill([view]) < rest or not reader.at_end():
            raise CorruptBlockError(f"object body is not the {size} bytes announced")
        if self.cipher is None:
            decode_value(head + view, self.layout, key, out)
        elif rest != header.payload_nbytes:
            raise CorruptBlockError("object body has a different length than its header")
        else:  # opened straight from the body buffer
            decode_layers(header, view, self.layout, out, None, self.cipher)

    def _get_layers(
        self,
        key: BlockKey,
        out: torch.Tensor,
        layers: tuple[int, int],
        deadline_at: float,
        use_cache: bool,
    ) -> None:
        """Header (cached or ranged GET), then a ranged GET of just ``layers``' bytes."""
        cached = self._headers.get(key) if use_cache else None
        header, etag = cached if cached is not None else self._fetch_header(key, deadline_at)
        offset, nbytes = header.layer_span(*layers)
        start = header.header_nbytes + offset
        name = self.object_name(key)
        try:
            payload, _, _ = self._s3.call(
                lambda: self._s3.get_range(name, start, nbytes, etag), deadline_at
            )
        except botocore.exceptions.ClientError as exc:
            if cached is not None and has_code(exc, frozenset({"PreconditionFailed"}), 412):
                self._headers.drop(key)  # rewritten since we cached it: read it afresh
                self._get_layers(key, out, layers, deadline_at, use_cache=False)
                return
            raise
        self._counters.add("ranged_gets")
        self._counters.add("bytes_in", len(payload))
        decode_layers(header, payload, self.layout, out, layers, self.cipher)

    def _fetch_header(self, key: BlockKey, deadline_at: float) -> tuple[BlockHeader, str]:
        name, size = self.object_name(key), self._header_nbytes
        data, total, etag = self._s3.call(
            lambda: self._s3.get_range(name, 0, size, None), deadline_at
        )
        self._counters.add("ranged_gets")
        self._counters.add("bytes_in", len(data))
        header = parse_header(data, self.layout, key)
        if self.cipher is not None:
            self.cipher.check(header)
        if total != header.total_nbytes:  # cut short or appended to by someone else
            raise CorruptBlockError(
                f"object is {total} bytes; its header says {header.total_nbytes}"
            )
        self._headers.put(key, header, etag)
        return header, etag

    # -- existence, deletion, listing ---------------------------------------
    def _head(self, key: BlockKey, deadline_at: float) -> bool:
        name, bucket = self.object_name(key), self.cfg.bucket
        try:
            # One attempt: an existence check is on the lookup path, and a failed
            # one only costs a miss.
            self._s3.call(
                lambda: self._s3.client.head_object(Bucket=bucket, Key=name), deadline_at, 1
            )
        except Exception as exc:
            if not has_code(exc, MISSING_CODES, 404):
                self._failed("head", key, exc)
            return False
        return True

    def _delete_chunk(self, keys: list[BlockKey], deadline_at: float) -> int:
        """Delete up to 1000 objects in one request; return how many failed."""
        objects = [{"Key": self.object_name(k)} for k in keys]
        try:
            resp = self._s3.call(
                lambda: self._s3.client.delete_objects(
                    Bucket=self.cfg.bucket, Delete={"Objects": objects, "Quiet": True}
                ),
                deadline_at,
            )
        except Exception as exc:
            self._failed("delete", keys[0], exc)
            return len(keys)
        errors = resp.get("Errors", [])
        if errors:
            self._counters.add("errors", len(errors))
            log.warning(
                "s3 tier: %d deletes refused (first: %s)", len(errors), errors[0].get("Code")
            )
        return len(errors)

    def _list_keys(self) -> Iterator[BlockKey]:
        """Every block key under this layout's directory, one listing page at a time."""
        token: str | None = None
        while True:
            try:
                page = self._s3.list_page(self._dir, self.list_page, token)
            except Exception as exc:
                self._list_failed(exc)
                return
            for obj in page.get("Contents", ()):
                key = key_from_hex(str(obj["Key"]).rpartition("/")[2])
                if key is not None and obj["Key"] == self.object_name(key):
                    yield key
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def _list_failed(self, exc: BaseException) -> None:
        where = f"s3://{self.cfg.bucket}/{self._dir}"
        code, _ = error_info(exc)
        if code in PERMANENT_CODES:  # misconfiguration: say so loudly
            raise TierError(f"s3 tier: cannot list {where}: {code}") from None
        self._counters.add("errors")
        why = mask_text(str(exc))
        log.warning("s3 tier: listing %s failed (%s); the index misses the rest", where, why)

    # -- plumbing -----------------------------------------------------------
    def _failed(self, op: str, key: BlockKey, exc: BaseException) -> None:
        self._counters.add("errors")
        # Warn on the first failure after a success; the rest of an outage goes to debug.
        level = logging.WARNING if self._healthy else logging.DEBUG
        self._healthy = False
        log.log(level, "s3 tier: %s of %s failed: %s", op, self.object_name(key), exc)

    def _corrupt(self, key: BlockKey, exc: Exception, target: Target) -> bool:
        """A block that failed verification: read the whole object once more.

        The bucket is shared and the bytes may have been damaged on the way: an
        object is deleted only when S3 vouches that the bytes read are the bytes
        it stores (a single-part object's ETag is their MD5) and they are bad.
        A re-read that verifies is a hit; anything else is a miss that keeps the
        object (a later put of the key replaces it).
        """
        self._counters.add("corrupt")
        self._headers.drop(key)
        name = self.object_name(key)
        try:
            body, etag = self._s3.call(lambda: self._s3.get_whole(name), target.deadline_at)
            decode_value(body, self.layout, key, target.out, target.layers, self.cipher)
        except DecryptError as again:
            return self._decrypt_failed(key, again)
        except (CorruptBlockError, LayoutMismatchError) as again:
            if etag_matches(body, etag):
                self._counters.add("corrupt_deleted")
                log.warning("s3 tier: %s is corrupt (%s); deleting it", name, again)
                self._delete_corrupt(key)
            else:
                self._counters.add("corrupt_kept")
                log.warning("s3 tier: %s read back damaged (%s); not deleting it", name, exc)
            return False
        except Exception as err:
            self._counters.add("corrupt_kept")
            log.warning("s3 tier: %s failed verification (%s), re-read failed: %s", name, exc, err)
            return False
        self._counters.add("damaged_in_transit")
        self._counters.add("blocks_got")
        return True

    def _decrypt_failed(self, key: BlockKey, exc: Exception) -> bool:
        """An object this tier cannot open: a miss, counted, and kept (the bucket is
        shared: a node holding the right key may read it)."""
        self._counters.add("decrypt_failures")
        log.warning("s3 tier: %s cannot be opened: %s", self.object_name(key), exc)
        return False

    def _delete_corrupt(self, key: BlockKey) -> None:
        try:
            self._delete_chunk([key], time.monotonic() + self.cfg.deadline)
        except Exception as err:
            log.warning("s3 tier: could not delete corrupt %s: %s", self.object_name(key), err)

    def stats(self) -> dict[str, Any]:
        return self._value_stats(
            self.cfg.codec,
            available=self._s3.available,
            bucket=self.cfg.bucket,
            prefix=self._dir,
            concurrency=self.cfg.concurrency,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._s3.close()
