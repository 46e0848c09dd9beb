"""Tier configs: one frozen dataclass per medium, and the registry of their kinds."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstore._values import (
    parse_bool,
    parse_codec,
    parse_float,
    parse_int,
    parse_optional_bool,
    parse_optional_float,
    parse_optional_str,
    parse_size,
    parse_str,
)
from kvstore.config._fields import build as _build
from kvstore.config._fields import check_positive as _check_positive
from kvstore.config._fields import default_cache_dir
from kvstore.config._fields import opt as _opt
from kvstore.errors import ConfigError

__all__ = [
    "ClusterTierConfig",
    "DeviceTierConfig",
    "DiskTierConfig",
    "HostTierConfig",
    "NAMESPACE_PATTERN",
    "RedisTierConfig",
    "RemoteTierConfig",
    "S3TierConfig",
    "TierConfig",
    "build_tier",
    "check_address",
    "check_namespace",
    "default_tiers",
    "tier_config_class",
    "tier_kinds",
]


@dataclass(frozen=True)
class TierConfig:
    """Settings every tier has. Subclasses add their medium's settings."""

    kind: ClassVar[str] = ""
    capacity: int = _opt(0, parse_size)
    high_watermark: float = _opt(0.9, parse_float)
    low_watermark: float = _opt(0.7, parse_float)
    policy: str = _opt("lru", parse_str)
    write_policy: str = _opt("write_back", parse_str)
    promote_after: int = _opt(0, parse_int)
    admit_after: int = _opt(0, parse_int)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` (naming ``path.key``) for impossible values."""
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
        from kvstore.policy import policy_names  # deferred: policies import the key types

        if self.policy not in policy_names():
            raise ConfigError(
                f"{path}.policy: unknown eviction policy {self.policy!r}; "
                f"known: {', '.join(policy_names())}"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (with ``kind``) that :meth:`StoreConfig.from_dict` reads back."""
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class HostTierConfig(TierConfig):
    """Host DRAM tier. ``pinned``: page-locked memory (None: when CUDA exists).

    ``shared_memory``: back the slab with a memfd that other processes can map
    (``kvstore-server`` sets it to lend blocks to same-host clients; such memory
    is not pinned).
    """

    kind: ClassVar[str] = "host"
    capacity: int = _opt(4 * 1024**3, parse_size)
    promote_after: int = _opt(2, parse_int)
    pinned: bool | None = _opt(None, parse_optional_bool)
    shared_memory: bool = _opt(False, parse_bool)

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.shared_memory and self.pinned:
            raise ConfigError(f"{path}.pinned: shared_memory host tiers cannot be pinned")


@dataclass(frozen=True)
class DeviceTierConfig(TierConfig):
    """Accelerator memory tier (``device`` is any torch device string)."""

    kind: ClassVar[str] = "device"
    device: str = _opt("cuda:0", parse_str)
    promote_after: int = _opt(2, parse_int)

    def validate(self, path: str) -> None:
        super().validate(path)
        import torch  # deferred: config parsing itself needs no torch

        try:
            torch.device(self.device)
        except (RuntimeError, ValueError):
            raise ConfigError(f"{path}.device: {self.device!r} is not a torch device") from None


@dataclass(frozen=True)
class DiskTierConfig(TierConfig):
    """Local files (NVMe). Blocks survive restarts and are verified on every read."""

    kind: ClassVar[str] = "disk"
    capacity: int = _opt(32 * 1024**3, parse_size)
    path: str = field(default_factory=default_cache_dir, metadata={"parse": parse_str})
    io_threads: int = _opt(4, parse_int)
    o_direct: bool = _opt(False, parse_bool)
    fsync: bool = _opt(False, parse_bool)
    codec: str = _opt("raw", parse_codec)

    def validate(self, path: str) -> None:
        super().validate(path)
        _check_positive(self, path, "io_threads")


@dataclass(frozen=True)
class S3TierConfig(TierConfig):
    """An S3-compatible object store: the shared, bottomless cold tier."""

    kind: ClassVar[str] = "s3"
    capacity: int = _opt(1024**4, parse_size)
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
    retry_interval: float = _opt(1.0, parse_float)

    def validate(self, path: str) -> None:
        super().validate(path)
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
    """Redis (standalone or Cluster): a shared warm tier."""

    kind: ClassVar[str] = "redis"
    capacity: int = _opt(1024**3, parse_size)
    url: str = _opt("redis://localhost:6379/0", parse_str)
    cluster: bool = _opt(False, parse_bool)
    ttl: float | None = _opt(None, parse_optional_float)
    key_prefix: str = _opt("kvstore", parse_str)
    pool_size: int = _opt(16, parse_int)
    socket_timeout: float = _opt(2.0, parse_float)
    retry_interval: float = _opt(1.0, parse_float)
    codec: str = _opt("raw", parse_codec)

    def validate(self, path: str) -> None:
        super().validate(path)
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"{path}.url: expected redis://, rediss:// or unix://, got {self.url!r}"
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


def check_address(address: str, path: str, any_port: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``address`` is ``HOST:PORT`` or ``unix:/path``
    (``any_port``: port 0, "pick a free one", is allowed: for listening)."""
    if address.startswith("unix:"):
        if not address[5:]:
            raise ConfigError(f"{path}: unix: needs a socket path, e.g. unix:/run/kvstore.sock")
        return
    host, sep, port = address.rpartition(":")
    lowest = 0 if any_port else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) < 65536:
        raise ConfigError(f"{path}: expected HOST:PORT or unix:/path, got {address!r}")


@dataclass(frozen=True)
class RemoteTierConfig(TierConfig):
    """A ``kvstore-server``: over TCP or a Unix socket, through shared memory on one host.

    The server keeps its own tiers and evicts by itself, so ``capacity`` (1 TiB
    by default, as for S3) only bounds what this process counts as stored there.
    ``namespace`` is the server-side partition (a tenant); a token may be limited
    to some namespaces. ``token`` or ``token_file`` authenticate; ``tls`` with
    ``tls_ca`` (a CA bundle; None: the system's) encrypts. ``durable`` asks the
    server to acknowledge puts only once they reached its persistent tier.
    """

    kind: ClassVar[str] = "remote"
    capacity: int = _opt(1024**4, parse_size)
    address: str = _opt("127.0.0.1:7070", parse_str)
    namespace: str = _opt("default", parse_str)
    token: str | None = _opt(None, parse_optional_str)
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

    def validate(self, path: str) -> None:
        super().validate(path)
        check_address(self.address, f"{path}.address")
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


def default_tiers() -> tuple[TierConfig, ...]:
    """The embedded default: 4 GiB of host memory over 32 GiB of files in the user's cache."""
    return (HostTierConfig(), DiskTierConfig())


_TIER_CONFIGS: dict[str, type[TierConfig]] = {
    cls.kind: cls
    for cls in (
        HostTierConfig,
        DeviceTierConfig,
        DiskTierConfig,
        S3TierConfig,
        RedisTierConfig,
        RemoteTierConfig,
    )
}


def tier_config_class(kind: str, path: str = "kind") -> type[TierConfig]:
    """The config dataclass of tier ``kind``."""
    try:
        return _TIER_CONFIGS[kind]
    except KeyError:
        known = ", ".join(sorted(_TIER_CONFIGS))
        raise ConfigError(f"{path}: unknown tier kind {kind!r}; known kinds: {known}") from None


def tier_kinds() -> list[str]:
    """Every tier kind the config knows."""
    return sorted(_TIER_CONFIGS)


def build_tier(data: Any, path: str) -> TierConfig:
    """A validated tier config from a mapping with a ``kind``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping with a 'kind', got {type(data).__name__}")
    if "kind" not in data:
        raise ConfigError(f"{path}.kind: missing; every tier needs a kind")
    rest = {k: v for k, v in data.items() if k != "kind"}
    tier: TierConfig = _build(tier_config_class(data["kind"], f"{path}.kind"), rest, path)
    tier.validate(path)
    return tier
