"""Tier configs: one frozen dataclass per medium (their registry: :mod:`kvstore.config.kinds`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstore.config._fields import check_positive as _check_positive
from kvstore.config._fields import default_cache_dir
from kvstore.config._fields import opt as _opt
from kvstore.config.values import (
    parse_bool,
    parse_codec,
    parse_encoding,
    parse_float,
    parse_int,
    parse_optional_bool,
    parse_optional_float,
    parse_optional_secret,
    parse_optional_str,
    parse_size,
    parse_str,
)
from kvstore.errors import ConfigError
from kvstore.format import DEFAULT_GROUP_SIZE, check_group_size
from kvstore.policy import POLICIES
from kvstore.runtime import mask_text, warn_renamed

__all__ = [
    "ClusterTierConfig",
    "DeviceTierConfig",
    "DiskTierConfig",
    "HostTierConfig",
    "NAMESPACE_PATTERN",
    "PAGE_CACHE_MODES",
    "RedisTierConfig",
    "RemoteTierConfig",
    "S3TierConfig",
    "TierConfig",
    "check_address",
    "check_disk_paths",
    "check_encoding",
    "check_namespace",
    "default_tiers",
    "normalize_address",
    "parse_address",
]


@dataclass(frozen=True)
class TierConfig:
    """Settings every tier has. Subclasses add their medium's settings.

    ``capacity``: bytes this tier may hold, rounded down to whole blocks (less
    than one block is an error). For S3, Redis and a kvstore-server, which
    have no size the store can see, it is this store's budget for the tier.

    ``high_watermark`` / ``low_watermark``: fractions of ``capacity``. Once a
    put takes usage past the high watermark, a background job evicts down to
    the low one (hysteresis: evictions come in batches, not one per put),
    demoting each victim to the next tier rather than dropping it; a put that
    needs room at once frees just that room itself. The low watermark must be
    below the high one.

    ``policy``: the eviction order: ``lru`` (least recently used); ``s3fifo``
    (S3-FIFO: new blocks wait in a small probation FIFO and only blocks read
    again reach the main one, so one-off scans do not flush the cache); ``arc``
    (ARC: adaptive recency/frequency). Whatever the policy, cooled extra copies
    go first, hot blocks last, and pinned blocks never
    (docs/benchmarks/policies.md measures when each policy pays).

    ``write_policy``: ``write_back`` copies a block to the next tier when it is
    evicted from this one; a memory tier right in front of a local disk also
    copies its least recently used blocks there in the background once more
    than ``low_watermark`` of its capacity is held only in memory, so
    evictions find them written already. ``write_through`` copies every block
    to the next tier, in the background, as soon as it is written here.

    ``promote_after``: copy a block into this tier (in the background) when a
    read served from a slower tier finds it accessed this many times (its
    heat: accesses, decayed as ``replication`` says); 0: never.

    ``admit_after``: only blocks accessed at least this many times enter this
    tier; others skip it, to the next tier (or are dropped). E.g. 2 on a disk
    tier spares it one-off blocks; 0 admits every block.

    ``read_gbps`` / ``read_latency_ms``: what a read from this tier is taken to
    cost (GB/s, and milliseconds a call) until the store has measured its own
    reads; from then on it keeps a live estimate (``stats()``:
    ``read_gbps_estimate``, ``read_latency_ms_estimate``; ``restore`` says how
    fast it follows). Each kind has a default of its medium's order of magnitude.

    ``encoding``: how blocks are stored on this tier: ``none`` (the layout's bytes,
    bit for bit), or a lossy encoding that stores fewer bytes and decodes on the way
    to the engine, into its dtype: ``fp8_e4m3`` or ``int8`` (about 0.52x of bf16:
    a scale per token and head), ``int4`` (about 0.31x: keys per channel, values per
    token, in groups of ``group_size``). For the slow tiers (disk, Redis, S3), where a
    hit pays only when its bytes arrive faster than the engine recomputes them; the
    memory tiers (host, device) keep the engine's raw slabs, and a kvstore-server
    (``remote``) or a peer cluster stores what it is sent, so there it is refused
    (set it on the server's own tiers). An encoded tier stores its layers
    uncompressed (``codec`` raw or auto). docs/encodings.md has the error each
    encoding introduces and which to use where.

    ``group_size``: int4's group (a power of two dividing ``block_tokens`` and
    ``head_dim``); the other encodings have none.
    """

    kind: ClassVar[str] = ""
    #: Whether blocks on this kind of tier may be stored in a lossy ``encoding`` (the
    #: disk, Redis and S3 tiers' configs have ``encoding`` and ``group_size``).
    encodable: ClassVar[bool] = False
    capacity: int = _opt(0, parse_size)
    high_watermark: float = _opt(0.9, parse_float)
    low_watermark: float = _opt(0.7, parse_float)
    policy: str = _opt("lru", parse_str)
    write_policy: str = _opt("write_back", parse_str)
    promote_after: int = _opt(0, parse_int)
    admit_after: int = _opt(0, parse_int)
    read_gbps: float = _opt(1.0, parse_float)
    read_latency_ms: float = _opt(1.0, parse_float)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` (naming ``path.key``) for impossible values."""
        if self.read_gbps <= 0 or self.read_latency_ms < 0:
            raise ConfigError(
                f"{path}.read_gbps / read_latency_ms: must be > 0 and >= 0, got "
                f"{self.read_gbps} and {self.read_latency_ms}"
            )
        if self.capacity <= 0:
            raise ConfigError(f"{path}.capacity: must be > 0 bytes, got {self.capacity}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ConfigError(
                f"{path}.high_watermark: must be in (0, 1], got {self.high_watermark}"
            )
        if not 0.0 <= self.low_watermark < self.high_watermark:
            raise ConfigError(
                f"{path}.low_watermark: must be in [0, high_watermark={self.high_watermark}), "
                f"got {self.low_watermark}"
            )
        if self.write_policy not in ("write_back", "write_through"):
            raise ConfigError(
                f"{path}.write_policy: use write_back (copy down on eviction) or "
                f"write_through (copy down on every put), got {self.write_policy!r}"
            )
        for name in ("promote_after", "admit_after"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}: must be >= 0, got {getattr(self, name)}")
        if not POLICIES.has(self.policy):
            raise ConfigError(
                f"{path}.policy: unknown eviction policy {self.policy!r}; "
                f"known: {', '.join(POLICIES.names())}"
            )

    @classmethod
    def refused(cls, key: str) -> str | None:
        """Why this kind of tier has no setting ``key`` that other kinds have (what the
        config's error says), or None."""
        if key in ("encoding", "group_size") and not cls.encodable:
            why = _UNENCODED.get(cls.kind, "it stores the blocks it is given")
            return (
                f"a {cls.kind or 'this'} tier stores no encoded blocks ({why}); encodings "
                "are for the disk, redis and s3 tiers"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (with ``kind``) that :meth:`StoreConfig.from_dict` reads back."""
        return {"kind": self.kind, **dataclasses.asdict(self)}


def check_encoding(config: Any, path: str) -> None:
    """An encodable tier's ``encoding`` / ``group_size``: known and well-formed, and
    ``codec`` raw or auto beside an encoding (an encoded tier stores its layers
    uncompressed)."""
    parse_encoding(config.encoding, f"{path}.encoding")
    try:
        check_group_size(config.group_size)
    except ConfigError as exc:
        raise ConfigError(f"{path}.{exc}") from None
    if config.encoding != "none" and config.codec not in ("raw", "auto"):
        raise ConfigError(
            f"{path}.codec: {config.codec} with encoding {config.encoding}: an encoded tier "
            "stores its layers uncompressed; use codec: raw (or auto), or encoding: none"
        )


#: Why a tier kind keeps blocks unencoded (what the ConfigError says).
_UNENCODED = {
    "host": "it keeps the engine's raw slabs, copied to and from the engine as they are",
    "device": "it keeps the engine's raw slabs, copied to and from the engine as they are",
    "remote": "a kvstore-server stores the raw blocks it is sent; set it on the server's tiers",
    "cluster": "its peers store the raw blocks they are sent; set it on their tiers",
}


@dataclass(frozen=True)
class HostTierConfig(TierConfig):
    """Host DRAM tier: one preallocated slab of fixed slots.

    ``pinned``: page-locked memory, so GPU copies need no bounce buffer; None
    (the default): pinned when CUDA is available (true without CUDA is an error).

    ``shared_memory``: back the slab with a memfd that other processes can map
    (``kvstore-server`` sets it to lend blocks to same-host clients; such memory
    is not pinned).

    ``prefault``: commit the slab's pages on a background thread from the
    moment the tier opens, so the first puts copy at memory speed instead of
    page-fault speed (first-touch faults ran at ~1 GB/s against ~21 GB/s for a
    copy into touched memory; ``benchmarks/bench_host_tier.py``). The tier is
    sized to be used, and pinned memory is committed at open anyway; set it to
    false to commit pages only as blocks land (a tier that rarely fills).
    Ignored for pinned memory (committed when allocated).
    """

    kind: ClassVar[str] = "host"
    capacity: int = _opt(4 * 1024**3, parse_size)
    read_gbps: float = _opt(10.0, parse_float)
    read_latency_ms: float = _opt(0.01, parse_float)
    promote_after: int = _opt(2, parse_int)
    pinned: bool | None = _opt(None, parse_optional_bool)
    shared_memory: bool = _opt(False, parse_bool)
    prefault: bool = _opt(True, parse_bool)

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.shared_memory and self.pinned:
            raise ConfigError(f"{path}.pinned: shared_memory host tiers cannot be pinned")


@dataclass(frozen=True)
class DeviceTierConfig(TierConfig):
    """Accelerator memory tier (GPU HBM): one preallocated slab on the device.

    ``device``: any torch device string (``cuda:0``, ``cuda:1``; ``cpu`` works,
    for tests); a CUDA device without CUDA is an error.

    ``capacity``: required for this tier: the bytes of device memory the slab
    takes when the store opens.
    """

    kind: ClassVar[str] = "device"
    read_gbps: float = _opt(300.0, parse_float)
    read_latency_ms: float = _opt(0.01, parse_float)
    device: str = _opt("cuda:0", parse_str)
    promote_after: int = _opt(2, parse_int)

    def validate(self, path: str) -> None:
        super().validate(path)
        import torch  # deferred: config parsing itself needs no torch

        try:
            torch.device(self.device)
        except (RuntimeError, ValueError):
            raise ConfigError(f"{path}.device: {self.device!r} is not a torch device") from None


PAGE_CACHE_MODES = ("keep", "bypass")


@dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    """Local files (NVMe). Blocks survive restarts and are verified on every read.

    ``page_cache``: ``keep`` (the default) writes and reads through the page
    cache, so a block written or read recently is read again at memory speed
    (warm reads ran ~3-5x faster than cold ones; ``bench_disk_tier.py``);
    ``bypass`` writes with ``O_DIRECT``, reads whole raw blocks with ``O_DIRECT``
    straight into page-aligned memory (host-tier slots, vLLM's primary rows) and
    drops a block's pages after any other read, for machines whose memory is
    better spent elsewhere (the host tier
    already keeps hot blocks in memory). ``o_direct: true`` is the older
    spelling of ``page_cache: bypass`` (deprecated: it warns, and goes away in the
    next release); left out (None), ``page_cache`` follows it.

    ``path``: the directory. Blocks go under
    ``<path>/kvstore-v1/<layout fingerprint>/``, one file per block; several
    processes may share it, and each sees the blocks the others stored (a
    kvstore-server keeps each namespace under ``<path>/ns-<namespace>/``).

    ``capacity``: bytes of block files, rounded down to whole blocks; clamped,
    with a warning, to 95% of the free space when the tier opens.

    ``io_threads``: threads that move a batch's blocks in parallel (a single
    block is moved inline), so N blocks cost about one disk round trip.

    ``o_direct``: deprecated, the older spelling of ``page_cache: bypass`` (true warns
    :class:`DeprecationWarning`); true together with ``page_cache: keep`` is an error.

    ``fsync``: fsync each block file before it becomes visible, for
    durability across power loss. ``kill -9`` needs none: a block is written
    to a temporary file and renamed into place, so it is whole or absent.

    ``codec``: how payloads are stored: ``raw``; ``lz4``; ``shuffle-lz4``
    (byte planes shuffled, then lz4: pays for bf16 KV only); ``auto``
    (shuffle-lz4 for a block where it saves at least 10%, else raw).
    Compressing runs below 1 GB/s; see benchmarks/README.md (codec).
    """

    kind: ClassVar[str] = "disk"
    encodable: ClassVar[bool] = True
    capacity: int = _opt(32 * 1024**3, parse_size)
    read_gbps: float = _opt(2.0, parse_float)
    read_latency_ms: float = _opt(0.2, parse_float)
    path: str = field(default_factory=default_cache_dir, metadata={"parse": parse_str})
    io_threads: int = _opt(4, parse_int)
    o_direct: bool = _opt(False, parse_bool)
    fsync: bool = _opt(False, parse_bool)
    codec: str = _opt("raw", parse_codec)
    encoding: str = _opt("none", parse_encoding)
    group_size: int = _opt(DEFAULT_GROUP_SIZE, parse_int)
    page_cache: str | None = _opt(None, parse_optional_str)

    def __post_init__(self) -> None:
        if self.page_cache is None:  # follow the older o_direct switch
            object.__setattr__(self, "page_cache", "bypass" if self.o_direct else "keep")

    def validate(self, path: str) -> None:
        super().validate(path)
        check_encoding(self, path)
        _check_positive(self, path, "io_threads")
        if self.page_cache not in PAGE_CACHE_MODES:
            raise ConfigError(
                f"{path}.page_cache: use keep (blocks stay in the page cache: fast re-reads) "
                f"or bypass (O_DIRECT writes, pages dropped after reads), got {self.page_cache!r}"
            )
        if self.o_direct and self.page_cache == "keep":
            raise ConfigError(
                f"{path}.o_direct: true writes around the page cache, which contradicts "
                "page_cache: keep; use page_cache: bypass (o_direct: true is its old spelling)"
            )
        if self.o_direct:
            warn_renamed(f"{path}.o_direct: true", f"{path}.page_cache: bypass")

    @property
    def bypass_page_cache(self) -> bool:
        """True when blocks should not stay in the page cache after I/O."""
        return self.page_cache == "bypass"


@dataclass(frozen=True)
class S3TierConfig(TierConfig):
    """An S3-compatible object store: the shared, bottomless cold tier.

    Credentials come from the boto3 chain (environment, shared config files,
    instance or container roles), never from this config; needs
    ``pip install 'kvstore-tiers[s3]'``.

    ``bucket``: the bucket (required).

    ``prefix``: object names are
    ``<prefix>/<layout fingerprint>/<first 2 hex digits of the key>/<key hex>``.

    ``endpoint_url``: an S3-compatible endpoint such as ``http://minio:9000``;
    None: AWS.

    ``region``: None lets the boto3 chain decide.

    ``addressing_style``: ``auto``, ``path`` (the bucket in the path) or
    ``virtual`` (the bucket in the host name).

    ``capacity``: this store's budget for the bucket (S3 itself has no limit).

    ``concurrency``: requests in flight per tier: the thread pool and the
    connection pool both have this size.

    ``connect_timeout``: seconds to open a connection.

    ``read_timeout``: seconds without a byte before a request gives up (and
    is retried).

    ``deadline``: seconds a batch call may spend retrying; past it the blocks
    left are misses, so a batch takes at most about ``deadline +
    connect_timeout + read_timeout``.

    ``max_attempts``: tries per request, the first included. Throttling, 5xx,
    connection errors, timeouts and truncated bodies are retried with
    exponential backoff and full jitter; 404 is a miss and other 4xx are not
    retried.

    ``retry_interval``: while the endpoint is unreachable, calls fail at once
    (misses) and one probe request per this many seconds checks whether it is
    back.

    ``multipart_threshold``: blocks larger than this go up as multipart
    uploads and come down as parallel ranged GETs.

    ``part_size``: the part and range size of those (S3 needs at least 5 MiB).

    ``codec``: ``raw``, ``lz4``, ``shuffle-lz4``, a registered plug-in codec
    (:mod:`kvstore.format.codecs`) or ``auto`` (the default here: shuffle-lz4 for a block where it
    saves at least 10%, else raw).
    """

    kind: ClassVar[str] = "s3"
    encodable: ClassVar[bool] = True
    capacity: int = _opt(1024**4, parse_size)
    read_gbps: float = _opt(0.1, parse_float)
    read_latency_ms: float = _opt(30.0, parse_float)
    bucket: str = _opt("", parse_str)
    prefix: str = _opt("kvstore", parse_str)
    endpoint_url: str | None = _opt(None, parse_optional_str)
    region: str | None = _opt(None, parse_optional_str)
    addressing_style: str = _opt("auto", parse_str)
    concurrency: int = _opt(16, parse_int)
    connect_timeout: float = _opt(2.0, parse_float)
    read_timeout: float = _opt(10.0, parse_float)
    deadline: float = _opt(30.0, parse_float)
    max_attempts: int = _opt(5, parse_int)
    multipart_threshold: int = _opt(64 * 1024**2, parse_size)
    part_size: int = _opt(16 * 1024**2, parse_size)
    codec: str = _opt("auto", parse_codec)
    encoding: str = _opt("none", parse_encoding)
    group_size: int = _opt(DEFAULT_GROUP_SIZE, parse_int)
    retry_interval: float = _opt(1.0, parse_float)

    def validate(self, path: str) -> None:
        super().validate(path)
        check_encoding(self, path)
        if not self.bucket:
            raise ConfigError(f"{path}.bucket: required for an s3 tier")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"{path}.addressing_style: use auto, path or virtual")
        _check_positive(
            self,
            path,
            "concurrency",
            "connect_timeout",
            "read_timeout",
            "deadline",
            "max_attempts",
            "part_size",
            "retry_interval",
        )
        if self.part_size < 5 * 1024**2:
            raise ConfigError(f"{path}.part_size: S3 parts must be >= 5MiB, got {self.part_size}")


@dataclass(frozen=True)
class RedisTierConfig(TierConfig):
    """Redis (standalone or Cluster): a shared warm tier.

    Needs ``pip install 'kvstore-tiers[redis]'``.

    ``url``: ``redis://``, ``rediss://`` (TLS) or ``unix://``; a password in it
    (``redis://:PASSWORD@host:6379/0``) is shown as ``***`` wherever kvstore prints
    the url (``kvstore config``, stats, logs, errors).

    ``cluster``: true: ``url`` names a node of a Redis Cluster.

    ``capacity``: this store's budget for the tier; keep Redis's
    ``maxmemory`` above it.

    ``ttl``: seconds after which Redis expires a block by itself (``PX`` on
    every ``SET``); None: kept until evicted or deleted.

    ``key_prefix``: key names are ``<key_prefix>:<layout fingerprint>:<key hex>``.

    ``pool_size``: connections (per node of a cluster); a caller waits up to
    ``socket_timeout`` for a free one.

    ``socket_timeout``: seconds for a connect and for each read.

    ``retry_interval``: while Redis is unreachable, calls fail at once
    (misses) and one probe per this many seconds reconnects.

    ``codec``: as for the S3 tier (``raw`` here by default).
    """

    kind: ClassVar[str] = "redis"
    encodable: ClassVar[bool] = True
    capacity: int = _opt(1024**3, parse_size)
    read_gbps: float = _opt(0.5, parse_float)
    read_latency_ms: float = _opt(0.5, parse_float)
    url: str = _opt("redis://localhost:6379/0", parse_str)
    cluster: bool = _opt(False, parse_bool)
    ttl: float | None = _opt(None, parse_optional_float)
    key_prefix: str = _opt("kvstore", parse_str)
    pool_size: int = _opt(16, parse_int)
    socket_timeout: float = _opt(2.0, parse_float)
    retry_interval: float = _opt(1.0, parse_float)
    codec: str = _opt("raw", parse_codec)
    encoding: str = _opt("none", parse_encoding)
    group_size: int = _opt(DEFAULT_GROUP_SIZE, parse_int)

    def validate(self, path: str) -> None:
        super().validate(path)
        check_encoding(self, path)
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"{path}.url: expected redis://, rediss:// or unix://, got {mask_text(self.url)!r}"
            )
        if self.ttl is not None and self.ttl <= 0:
            raise ConfigError(f"{path}.ttl: must be > 0 seconds or null, got {self.ttl}")
        _check_positive(self, path, "pool_size", "socket_timeout", "retry_interval")


NAMESPACE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


def check_namespace(name: Any, path: str) -> str:
    """``name`` if it is a valid server namespace (a tenant's partition), else ConfigError."""
    if not isinstance(name, str) or not re.fullmatch(NAMESPACE_PATTERN, name):
        raise ConfigError(
            f"{path}: namespace {name!r} must be 1-64 characters of letters, digits, '.', "
            "'_' or '-', starting with a letter or digit"
        )
    return name


#: ``scheme://rest``: a URL where an address was expected.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
#: A host name, an IPv4 address, or an IPv6 address (bare or in brackets).
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.%A-Za-z]+\]|[A-Za-z0-9._%:-]+)$")


def _not_our_scheme(scheme: str, rest: str, path: str) -> ConfigError:
    """Why a URL of ``scheme`` is not where a kvstore-server listens (one line)."""
    if scheme in ("http", "https"):
        return ConfigError(
            f"{path}: {mask_text(f'{scheme}://{rest}')} is an HTTP URL, but kvstore-server "
            "speaks its own "
            "binary protocol, not HTTP (its HTTP port serves only /metrics and /healthz); "
            "give the server's listen address as HOST:PORT, e.g. 127.0.0.1:7070"
        )
    if scheme in ("redis", "rediss"):
        return ConfigError(
            f"{path}: a Redis URL is not a kvstore-server address; for Redis use a redis "
            "tier (kind: redis, url: redis://HOST:PORT/DB), for a server HOST:PORT"
        )
    return ConfigError(
        f"{path}: {scheme}:// is not an address scheme kvstore knows; give HOST:PORT, "
        "tcp://HOST:PORT, unix:/path or unix:///path"
    )


def normalize_address(address: str, path: str, any_port: bool = False) -> str:
    """The address a client connects to, in kvstore's own spelling (``HOST:PORT`` or
    ``unix:/path``), from that or from the URL forms people write: ``tcp://HOST:PORT``,
    ``unix:///path``. Anything else -- an HTTP or Redis URL, a host without a port, a
    port out of range -- is a :class:`ConfigError` naming ``path`` and saying what to
    write instead."""
    match = _SCHEME.match(address)
    if match is not None:
        scheme, rest = match.group(1).lower(), match.group(2)
        if scheme == "tcp":
            try:
                check_address(rest, path, any_port)
            except ConfigError:
                raise ConfigError(
                    f"{path}: expected tcp://HOST:PORT, got {mask_text(address)!r}"
                ) from None
            return rest
        if scheme == "unix":
            if not rest.strip("/"):
                raise ConfigError(f"{path}: unix:// needs a socket path, e.g. unix:///run/kv.sock")
            return f"unix:{rest}"
        raise _not_our_scheme(scheme, rest, path)
    check_address(address, path, any_port)
    return address


def check_address(address: str, path: str, any_port: bool = False, url: str = "tcp") -> None:
    """Raise :class:`ConfigError` unless ``address`` is ``HOST:PORT`` or ``unix:/path``
    (``any_port``: port 0, "pick a free one", is allowed: for listening). A URL is
    refused saying what to write instead: ``url://HOST:PORT`` (``tcp``; ``http`` for the
    metrics endpoint) as ``HOST:PORT``; a remote tier and a client take ``tcp://`` and
    ``unix://`` URLs too (:func:`normalize_address`)."""
    if address.startswith("unix:") and not address.startswith("unix://"):
        if not address[5:]:
            raise ConfigError(f"{path}: unix: needs a socket path, e.g. unix:/run/kvstore.sock")
        return
    match = _SCHEME.match(address)
    if match is not None:
        scheme, rest = match.group(1).lower(), match.group(2)
        if scheme == url != "tcp":
            check_address(rest.rstrip("/"), path, any_port)
            spelled = rest.rstrip("/")
        elif scheme not in ("tcp", "unix"):
            raise _not_our_scheme(scheme, rest, path)
        else:
            spelled = normalize_address(address, path, any_port)
        raise ConfigError(f"{path}: write {spelled!r} (HOST:PORT or unix:/path), not a URL")
    host, sep, port = address.rpartition(":")
    lowest = 0 if any_port else 1
    if not sep or not host or not port.isdigit() or not _HOST.match(host):
        raise ConfigError(f"{path}: expected HOST:PORT or unix:/path, got {address!r}")
    if not lowest <= int(port) < 65536:
        raise ConfigError(f"{path}: port {port} of {address!r} is not in {lowest}..65535")


def parse_address(value: Any, key: str) -> str:
    """A remote tier's ``address`` (:func:`normalize_address`): ``HOST:PORT``,
    ``unix:/path``, ``tcp://HOST:PORT`` or ``unix:///path``, kept in the first two
    spellings."""
    return normalize_address(parse_str(value, key), key)


@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """A ``kvstore-server``: over TCP or a Unix socket, through shared memory on one host.

    ``address``: ``HOST:PORT`` or ``unix:/path/to/socket`` (``tcp://HOST:PORT`` and
    ``unix:///path`` are read as those; an ``http://`` URL is refused: the server speaks
    its own protocol, not HTTP).

    ``namespace``: the server-side partition (a tenant): 1-64 letters, digits,
    ``.``, ``_`` or ``-``; a token may be limited to some namespaces.

    ``capacity``: the server keeps its own tiers and evicts by itself, so
    this only bounds what this process counts as stored there.

    ``token`` / ``token_file``: the secret the server asks for, inline or in a
    file (its first line); give one, not both.

    ``shared_memory``: on the server's host, copy blocks straight into and out
    of the server's memory (one memcpy) instead of over the socket.

    ``tls`` / ``tls_ca`` / ``tls_server_name``: TLS over TCP (not over a Unix
    socket), trusting the CA bundle ``tls_ca`` (None: the system's) and
    checking the certificate for ``tls_server_name`` (None: the host of
    ``address``).

    ``pool_size``: connections at most.

    ``connect_timeout``: seconds to connect.

    ``timeout``: seconds per request.

    ``retry_interval``: after a failure, calls fail at once (misses) and one
    probe per this many seconds reconnects.

    ``durable``: acknowledge puts only once they reached the server's
    persistent tier (its disk), so a server killed right after keeps them.
    """

    kind: ClassVar[str] = "remote"
    capacity: int = _opt(1024**4, parse_size)
    read_gbps: float = _opt(2.0, parse_float)
    read_latency_ms: float = _opt(0.2, parse_float)
    address: str = _opt("127.0.0.1:7070", parse_address)
    namespace: str = _opt("default", parse_str)
    token: str | None = _opt(None, parse_optional_secret)
    token_file: str | None = _opt(None, parse_optional_str)
    shared_memory: bool = _opt(True, parse_bool)
    tls: bool = _opt(False, parse_bool)
    tls_ca: str | None = _opt(None, parse_optional_str)
    tls_server_name: str | None = _opt(None, parse_optional_str)
    pool_size: int = _opt(4, parse_int)
    connect_timeout: float = _opt(2.0, parse_float)
    timeout: float = _opt(30.0, parse_float)
    retry_interval: float = _opt(1.0, parse_float)
    durable: bool = _opt(False, parse_bool)

    def __post_init__(self) -> None:
        # tcp://HOST:PORT and unix:///path given in code read as from a file; what is
        # no address at all is left for validate() to name with its key.
        with contextlib.suppress(ConfigError):
            object.__setattr__(self, "address", normalize_address(self.address, "address"))

    def validate(self, path: str) -> None:
        super().validate(path)
        normalize_address(self.address, f"{path}.address")
        check_namespace(self.namespace, f"{path}.namespace")
        if self.token is not None and self.token_file is not None:
            raise ConfigError(f"{path}.token_file: give token or token_file, not both")
        if self.address.startswith("unix:") and self.tls:
            raise ConfigError(f"{path}.tls: not used over a Unix socket; remove it")
        _check_positive(self, path, "pool_size", "connect_timeout", "timeout", "retry_interval")

    def secret(self) -> bytes | None:
        """The token (read from ``token_file`` when one is named), or None."""
        if self.token_file is None:
            return None if self.token is None else self.token.encode()
        try:
            with open(self.token_file, encoding="utf-8") as f:
                return f.readline().strip().encode()
        except OSError as exc:
            raise ConfigError(f"token_file {self.token_file!r}: {exc.strerror}") from None


@dataclass(frozen=True)
class ClusterTierConfig(TierConfig):
    """The other nodes of a cluster, as a store's last tier (made by the store itself
    from the ``cluster:`` section; never listed in ``tiers``)."""

    kind: ClassVar[str] = "cluster"
    capacity: int = _opt(1024**5, parse_size)
    read_gbps: float = _opt(1.0, parse_float)
    read_latency_ms: float = _opt(1.0, parse_float)


def _real_directory(path: str) -> str:
    """Where ``path`` lands: ``~`` expanded, relative to the working directory, symbolic
    links resolved (as far as they exist yet)."""
    return os.path.realpath(os.path.expanduser(path))


def check_disk_paths(tiers: Sequence[TierConfig]) -> None:
    """Refuse (:class:`ConfigError`) two disk tiers of one config whose directories are
    one, or one inside the other, however spelled (a relative path, ``~``, ``..``, a
    symbolic link): each tier indexes, evicts and deletes the block files it finds
    there as its own, so the two would delete each other's blocks (a lookup counting
    blocks that are gone, a restart finding none). Several *processes* may share one
    directory (docs/tiers.md); two tiers of one store or one server may not."""
    seen: list[tuple[int, str, str]] = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, DiskTierConfig):
            continue
        real = _real_directory(tier.path)
        for j, path, other in seen:
            if real == other:
                where = "" if path == tier.path else f" ({path} and {tier.path} both lead there)"
                raise ConfigError(
                    f"tiers[{i}].path: {real} is also the directory of tiers[{j}]{where}; "
                    "two disk tiers on one directory delete each other's blocks: give "
                    "each disk tier a directory of its own (not one inside the other)"
                )
            inner, outer = (real, other) if len(real) > len(other) else (other, real)
            if inner.startswith(outer.rstrip(os.sep) + os.sep):
                spelled = "" if real == tier.path else f" ({tier.path})"
                raise ConfigError(
                    f"tiers[{i}].path: {real}{spelled} and the directory of tiers[{j}], {other}, "
                    "are one inside the other; give each disk tier a directory of its own "
                    "(side by side, e.g. /data/kv-fast and /data/kv-big)"
                )
        seen.append((i, tier.path, real))


def default_tiers() -> tuple[TierConfig, ...]:
    """The embedded default: 4 GiB of host memory over 32 GiB of files in the user's cache."""
    return (HostTierConfig(), DiskTierConfig())
