"""Store configuration: frozen dataclasses, read from dicts, YAML and env.

This is the only module that reads configuration sources. The shape is::

    tiers:
      - kind: host            # pinned host DRAM (pinned only when CUDA exists)
        capacity: 2GiB        # ints are bytes; "512MiB", "1.5GB" are parsed
        high_watermark: 0.9   # evict when usage passes this fraction ...
        low_watermark: 0.7    # ... down to this one (hysteresis)
      - kind: device
        device: cuda:0
        capacity: 8GiB

The first tier is the fastest; eviction demotes blocks down the list.
Unknown keys and impossible values raise :class:`~kvstore.errors.ConfigError`
naming the key (``tiers[1].capacity``).

Environment overrides (applied by :meth:`StoreConfig.load`,
:meth:`StoreConfig.default` and :meth:`StoreConfig.from_yaml` unless
``environ={}`` is passed; :func:`apply_env` alone shows what they set). They
override a file, never an explicit dict: :meth:`StoreConfig.from_dict` (and so
``KVStore(layout, {...})``) lets the process's variables fill only what the dict
leaves unset, and warns naming each variable whose key the dict gives:

- ``KVSTORE_CONFIG=/path/store.yaml`` -- the base file for ``load()``.
- ``KVSTORE_TIERS='[{"kind": "host", "capacity": "1GiB"}]'`` -- replaces the
  tier list (YAML or JSON).
- ``KVSTORE_<KIND>_<FIELD>=value`` -- sets one field of the first tier of
  that kind, e.g. ``KVSTORE_HOST_CAPACITY=8GiB``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvstore.config._fields import build as _build
from kvstore.config._fields import check_positive as _check_positive
from kvstore.config._fields import default_cache_dir
from kvstore.config._fields import opt as _opt
from kvstore.config.cluster import ClusterConfig
from kvstore.config.daemon import DaemonConfig
from kvstore.config.encryption import EncryptionConfig
from kvstore.config.environment import EnvOverlay
from kvstore.config.events import EventsConfig
from kvstore.config.kinds import TIERS, build_tier, peer_tier_class, tier_config_class, tier_kinds
from kvstore.config.restore import check_prefill_table, parse_prefill_table, parse_tier_speeds
from kvstore.config.server import Credential, ServerConfig, TokenConfig, is_loopback
from kvstore.config.tenants import (
    TenantConfig,
    TenantToken,
    check_tenant_name,
    parse_tenant,
    parse_token,
)
from kvstore.config.tiers import (
    ClusterTierConfig,
    DeviceTierConfig,
    DiskTierConfig,
    HostTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    S3TierConfig,
    TierConfig,
    check_disk_paths,
    check_namespace,
    default_tiers,
    normalize_address,
)
from kvstore.config.values import (
    Parser,
    format_size,
    parse_bool,
    parse_float,
    parse_int,
    parse_optional_float,
    parse_size,
    parse_str,
)
from kvstore.config.yaml_text import load_yaml
from kvstore.errors import ConfigError

__all__ = [
    "PREFETCH_POLICIES",
    "TIERS",
    "ClusterConfig",
    "ClusterTierConfig",
    "Credential",
    "DaemonConfig",
    "DeviceTierConfig",
    "DiskTierConfig",
    "EncryptionConfig",
    "EventsConfig",
    "HintsConfig",
    "HostTierConfig",
    "PrefetchConfig",
    "RestoreConfig",
    "SavesConfig",
    "ReplicationConfig",
    "RedisTierConfig",
    "RemoteTierConfig",
    "S3TierConfig",
    "ServerConfig",
    "StoreConfig",
    "TenantConfig",
    "TenantToken",
    "TierConfig",
    "TokenConfig",
    "apply_env",
    "check_namespace",
    "check_prefill_table",
    "check_tenant_name",
    "default_cache_dir",
    "format_size",
    "is_loopback",
    "load_daemon_config",
    "normalize_address",
    "parse_size",
    "parse_tenant",
    "parse_token",
    "peer_tier_class",
    "tier_config_class",
    "tier_kinds",
]


@dataclass(frozen=True)
class ReplicationConfig:
    """Hot-block replication: blocks read often get a copy in the fastest tier.

    Heat is a decayed access count: +1 per put or read, halved every
    ``half_life_s`` seconds and every ``half_life_accesses`` accesses to the
    whole store, so "hot" means hot relative to the traffic, at any request
    rate. Tiers' ``promote_after`` and ``admit_after`` count heat too.

    ``enabled``: false: no block counts as hot (no copies into the first tier,
    no protection from eviction); ``promote_after`` and ``admit_after`` still
    apply.

    ``hot_threshold``: the heat that makes a block hot: it is copied into the
    first tier and not evicted there while it stays hot; cooled extra copies
    are the first to go.

    ``half_life_s``: heat halves this often (seconds).

    ``half_life_accesses``: heat also halves every this many accesses to the
    whole store; 0: twice the memory tiers' capacity in blocks.

    ``max_copies``: copies of a block in memory tiers (device, host) at most;
    copies on disk or in S3 are the backing store, not replicas, and do not count.
    """

    enabled: bool = _opt(True, parse_bool)
    hot_threshold: int = _opt(8, parse_int)
    half_life_s: float = _opt(300.0, parse_float)
    half_life_accesses: int = _opt(0, parse_int)
    max_copies: int = _opt(2, parse_int)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for impossible values."""
        _check_positive(self, path, "hot_threshold", "half_life_s", "max_copies")
        if self.half_life_accesses < 0:
            raise ConfigError(f"{path}.half_life_accesses: must be >= 0 (0: automatic)")


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class PrefetchConfig:
    """Background, layer-by-layer loads (``KVStore.prefetch``).

    ``policy``: what :meth:`PrefetchHandle.result` waits for, as in SGLang:
    ``best_effort`` takes what has arrived, ``wait_complete`` waits for
    everything, ``timeout`` waits up to ``timeout_base_s +
    timeout_per_1k_tokens_s * tokens / 1000`` seconds (at most ``timeout_max_s``).

    ``timeout_base_s`` / ``timeout_per_1k_tokens_s`` / ``timeout_max_s``: the
    ``timeout`` policy's deadline: the base, plus so much per 1,000 tokens of
    the prefix, at most the max.

    ``threads``: threads that run prefetches.

    ``layers_per_step``: layers of every block a prefetch loads per step with
    ``order="layer"`` (``KVStore.prefetch(layers_per_step=...)`` overrides it).

    ``staging_bytes``: pinned host memory a prefetch into a GPU reads blocks from
    slower tiers (disk, S3, a server) into before copying them to the GPU: two
    buffers of half this size, one read while the other is copied.
    """

    policy: str = _opt("wait_complete", parse_str)
    timeout_base_s: float = _opt(2.0, parse_float)
    timeout_per_1k_tokens_s: float = _opt(0.1, parse_float)
    timeout_max_s: float = _opt(30.0, parse_float)
    threads: int = _opt(2, parse_int)
    layers_per_step: int = _opt(1, parse_int)
    staging_bytes: int = _opt(256 << 20, parse_size)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for impossible values."""
        if self.policy not in PREFETCH_POLICIES:
            known = ", ".join(PREFETCH_POLICIES)
            raise ConfigError(
                f"{path}.policy: unknown prefetch policy {self.policy!r}; use {known}"
            )
        _check_positive(
            self,
            path,
            "timeout_base_s",
            "timeout_max_s",
            "threads",
            "layers_per_step",
            "staging_bytes",
        )
        if self.timeout_per_1k_tokens_s < 0:
            raise ConfigError(f"{path}.timeout_per_1k_tokens_s: must be >= 0")

    def deadline_s(self, num_tokens: int) -> float:
        """Seconds the ``timeout`` policy waits for a prefix of ``num_tokens``."""
        grown = self.timeout_base_s + self.timeout_per_1k_tokens_s * num_tokens / 1000
        return min(self.timeout_max_s, grown)


@dataclass(frozen=True)
class RestoreConfig:
    """Whether loading a stored prefix pays, from measured speeds.

    ``planning``: on (the default), a lookup offers only the leading chunks whose
    load is expected to beat recomputing them (``store.plan``; the vLLM connector,
    ``KVStoreTier`` and ``get_prefix`` follow it); off, every stored chunk is a hit
    (``KVSTORE_RESTORE_PLANNING=off``).

    ``prefill_table``: the engine's prefill time by prompt length, as
    ``[[tokens, seconds], ...]`` (``benchmarks/bench_restore.py --calibrate-only``
    measures it with vLLM); or
    ``prefill_tokens_per_s``, one flat rate. With neither, the vLLM connector learns
    a rate from the engine's own step times (``learn_prefill``); until it has one,
    every stored chunk is loaded.

    ``warm``: chunks a plan leaves on a tier too slow to pay are copied to a faster
    tier in the background, so the next request finds them fast.

    ``warm_wait_s``: that copy (and a deferred search of a slow tier) waits until the
    prefills the plans expect have ended, so that it does not slow them down (on a CPU
    engine the copy shares cores, memory bandwidth and the GIL with the model), but
    no longer than this many seconds (0: start at once).

    ``warm_settle_s``: the copy starts only once no compute has been expected for this
    long (or for as long as the last expected compute, if that was shorter), so that a
    prompt that arrives right after the last one ended (requests back to back, or a
    prefill that ran past its estimate) finds no copy under way.

    ``speed_half_life_s``: each tier's read speed is a fit over its recent
    reads, each weighted by how recent it is; a read's weight halves every
    this many seconds (a tier that slows down shows within a few half-lives).

    ``speed_stale_s``: an estimate with no read for this long is reported as
    ``stale`` (the last figures; the tier's ``read_gbps`` / ``read_latency_ms``
    stand until its first read); the next plan that skips the tier probes it.

    ``tier_speeds``: ``{tier id: [GB/s, ms a call]}``, the tiers' initial read speeds
    (over their ``read_gbps`` / ``read_latency_ms``), as ``kvstore calibrate-tiers``
    measures them; a tier id is the tier's kind and how many tiers of that kind come
    before it (``disk:0``).
    """

    planning: bool = _opt(True, parse_bool)
    prefill_table: tuple[tuple[int, float], ...] | None = _opt(None, parse_prefill_table)
    prefill_tokens_per_s: float | None = _opt(None, parse_optional_float)
    learn_prefill: bool = _opt(True, parse_bool)
    warm: bool = _opt(True, parse_bool)
    warm_wait_s: float = _opt(30.0, parse_float)
    warm_settle_s: float = _opt(0.5, parse_float)
    speed_half_life_s: float = _opt(30.0, parse_float)
    speed_stale_s: float = _opt(300.0, parse_float)
    tier_speeds: tuple[tuple[str, float, float], ...] = _opt((), parse_tier_speeds)

    def declared_speed(self, tier_id: str) -> tuple[float, float] | None:
        """``(GB/s, ms a call)`` that ``tier_speeds`` declares for ``tier_id`` (None: none)."""
        return next(((g, ms) for t, g, ms in self.tier_speeds if t == tier_id), None)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for impossible values."""
        _check_positive(self, path, "speed_half_life_s", "speed_stale_s")
        for name in ("warm_wait_s", "warm_settle_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise ConfigError(
                f"{path}.prefill_tokens_per_s: must be > 0, got {self.prefill_tokens_per_s}"
            )
        if self.prefill_table is not None:
            check_prefill_table(self.prefill_table, f"{path}.prefill_table")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the table as lists, so YAML writes it)."""
        out = dataclasses.asdict(self)
        if self.prefill_table is not None:
            out["prefill_table"] = [list(pair) for pair in self.prefill_table]
        out["tier_speeds"] = {tier: [gbps, ms] for tier, gbps, ms in self.tier_speeds}
        return out


@dataclass(frozen=True)
class HintsConfig:
    """Session hints (``store.hint``, the connector's ``kv_transfer_params``, the server).

    ``max_retain_s``: the longest retention a hint is granted (longer ones are clipped).
    ``max_retained_fraction``: at most this fraction of all tiers' capacity (in
    blocks) is retained at once (a hint past it is clipped).
    ``max_sessions``: sessions whose keys are remembered, so a hint may name a
    session alone (the least recently hinted are forgotten first).
    """

    max_retain_s: float = _opt(3600.0, parse_float)
    max_retained_fraction: float = _opt(0.5, parse_float)
    max_sessions: int = _opt(10_000, parse_int)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for impossible values."""
        _check_positive(self, path, "max_retain_s", "max_retained_fraction", "max_sessions")
        if self.max_retained_fraction > 1:
            raise ConfigError(
                f"{path}.max_retained_fraction: must be <= 1, got {self.max_retained_fraction}"
            )


SAVE_MODES = ("async", "sync")


@dataclass(frozen=True)
class SavesConfig:
    """Saves from GPU tensors (``KVStore.put`` / ``put_layer`` of CUDA tensors).

    ``mode``: ``async`` (the default) snapshots the source into a GPU staging
    ring on the caller's stream and returns at once; the copies to the store's
    tiers run in the background and a block becomes visible when they land
    (``store.drain()`` waits for them; reads of a key being saved wait for it).
    ``sync`` copies before returning. Saves from host tensors are always
    synchronous.

    ``staging_bytes``: GPU memory of the staging ring, taken on the first
    asynchronous save; a full ring makes savers wait, and a source larger than
    the ring is saved synchronously.
    """

    mode: str = _opt("async", parse_str)
    staging_bytes: int = _opt(256 << 20, parse_size)

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for impossible values."""
        if self.mode not in SAVE_MODES:
            known = ", ".join(SAVE_MODES)
            raise ConfigError(f"{path}.mode: unknown save mode {self.mode!r}; use {known}")
        _check_positive(self, path, "staging_bytes")


_SECTIONS: dict[str, type[Any]] = {
    "replication": ReplicationConfig,
    "prefetch": PrefetchConfig,
    "saves": SavesConfig,
    "restore": RestoreConfig,
    "hints": HintsConfig,
    "server": ServerConfig,
    "cluster": ClusterConfig,
    "events": EventsConfig,
    "encryption": EncryptionConfig,
}
_SCALARS: dict[str, Parser] = {"lease_s": parse_float, "mover_threads": parse_int}


@dataclass(frozen=True)
class StoreConfig:
    """The whole store's configuration: an ordered list of tiers, fastest first.

    The default is a host tier over a disk tier in ``$XDG_CACHE_HOME/kvstore``
    (``~/.cache/kvstore``), so a cache outlives the process with no config.

    ``tiers``: the tiers, fastest first (at least one): new blocks go to the
    first that admits them, eviction demotes them down the list, reads promote
    them up.
    """

    tiers: tuple[TierConfig, ...] = field(default_factory=lambda: default_tiers())
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    saves: SavesConfig = field(default_factory=SavesConfig)
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    hints: HintsConfig = field(default_factory=HintsConfig)
    #: ``kvstore-server``'s own settings (the library ignores them; the server reads them
    #: as :attr:`DaemonConfig.server`, and this field goes after one release).
    server: ServerConfig = field(default_factory=ServerConfig)
    #: Membership in a cluster of nodes (off unless ``redis_url`` is set).
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    #: KV events in vLLM's format for routers (Dynamo, llm-d); off by default.
    events: EventsConfig = field(default_factory=EventsConfig)
    #: Encryption at rest of the disk, Redis and S3 tiers; off by default.
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)
    #: Seconds a lease pins blocks (prefetches, layerwise writes) unless renewed or released.
    lease_s: float = 30.0
    #: Threads moving blocks between tiers in the background.
    mover_threads: int = 2
    _ENV_PREFIX: ClassVar[str] = "KVSTORE_"

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("tiers: at least one tier is required")
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, TierConfig):
                raise ConfigError(f"tiers[{i}]: expected a TierConfig, got {type(tier).__name__}")
            tier.validate(f"tiers[{i}]")
        check_disk_paths(self.tiers)
        self.replication.validate("replication")
        self.prefetch.validate("prefetch")
        self.saves.validate("saves")
        self.restore.validate("restore")
        self.hints.validate("hints")
        self.server.validate("server")
        self.cluster.validate("cluster")
        self.events.validate("events")
        self.encryption.validate("encryption")

        _check_positive(self, "config", "lease_s", "mover_threads")

    def peer_cluster(self) -> ClusterConfig:
        """The cluster section as a node uses it to reach its peers: without a token of
        its own, the server's (``server.token`` / ``token_file``: the same on every
        node, so the one setting serves clients and peers alike)."""
        cluster = self.cluster
        if cluster.token is not None or cluster.token_file is not None:
            return cluster
        return dataclasses.replace(
            cluster, token=self.server.token, token_file=self.server.token_file
        )

    # -- sources ----------------------------------------------------------
    @classmethod
    def default(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """The embedded default (host over disk), with env overrides."""
        return cls._with_env({}, environ)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> StoreConfig:
        """Read a config dict: an explicit argument, so the environment never overrides it.

        ``environ`` left out: the process's ``KVSTORE_*`` variables fill only the keys
        ``data`` leaves unset (a tier field of a tier list the dict does not give, a
        section field it does not set); each variable whose key ``data`` gives is
        ignored with a :class:`UserWarning` naming it. ``environ`` given: its
        variables override ``data`` as they would a file (``{}``: none apply).
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
        return cls._with_env(dict(data), environ, keep_given=environ is None)

    @classmethod
    def from_yaml(
        cls, path: str | os.PathLike[str], environ: Mapping[str, str] | None = None
    ) -> StoreConfig:
        """Read a YAML file; ``environ`` (default ``os.environ``) overrides it."""
        name = os.fspath(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"config file {name!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {name!r} is not UTF-8 text (byte {exc.start}); "
                "give the YAML file of the store's configuration"
            ) from None
        data = load_yaml(text, f"config file {name!r}") or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
        return cls._with_env(dict(data), environ)

    @classmethod
    def load(
        cls, source: StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None
    ) -> StoreConfig:
        """Resolve a config from whatever a user passed (None: env, then default)."""
        if isinstance(source, StoreConfig):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, (str, os.PathLike)):
            return cls.from_yaml(source)
        if source is not None:
            raise ConfigError(
                "config: expected a StoreConfig, a mapping or the path of a YAML file, "
                f"got {type(source).__name__}"
            )
        variable = cls._ENV_PREFIX + "CONFIG"
        path = os.environ.get(variable)
        if not path:
            return cls.default()
        try:
            return cls.from_yaml(path)
        except ConfigError as exc:  # say where the path came from: no --config was given
            raise ConfigError(f"${variable}={path}: {exc}") from None

    @classmethod
    def _from_plain(cls, data: Mapping[str, Any]) -> StoreConfig:
        allowed = {"tiers", *_SECTIONS, *_SCALARS}
        unknown = set(data) - allowed
        if unknown:
            names = ", ".join(sorted(allowed))
            raise ConfigError(f"{sorted(unknown)[0]}: unknown key; allowed keys: {names}")
        tiers_data = data.get("tiers", [t.to_dict() for t in default_tiers()])
        if not isinstance(tiers_data, (list, tuple)):
            raise ConfigError(f"tiers: expected a list, got {type(tiers_data).__name__}")
        kwargs: dict[str, Any] = {
            "tiers": tuple(build_tier(t, f"tiers[{i}]") for i, t in enumerate(tiers_data))
        }
        for name, section in _SECTIONS.items():
            if name in data:
                kwargs[name] = _build(section, data[name] or {}, name)
        for name, parser in _SCALARS.items():
            if name in data:
                kwargs[name] = parser(data[name], name)
        return cls(**kwargs)

    @classmethod
    def _with_env(
        cls, data: dict[str, Any], environ: Mapping[str, str] | None, keep_given: bool = False
    ) -> StoreConfig:
        env = os.environ if environ is None else environ
        origins: dict[str, str] = {}
        shadowed: dict[str, str] = {}
        data = apply_env(data, env, cls._ENV_PREFIX, origins, shadowed if keep_given else None)
        for name, key in shadowed.items():
            warnings.warn(
                f"{name} is set but not applied: the config dict gives {key}, and "
                "environment variables override a config file, never an explicit dict",
                UserWarning,
                stacklevel=3,
            )
        try:
            return cls._from_plain(data)
        except ConfigError as exc:  # a value from a variable: name the variable too
            key = str(exc).partition(":")[0]
            variable = origins.get(key) or origins.get(key.partition("[")[0])
            if variable is None:
                raise
            raise ConfigError(f"{variable}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that :meth:`from_dict` reads back to an equal config."""
        return {
            "tiers": [t.to_dict() for t in self.tiers],
            "replication": dataclasses.asdict(self.replication),
            "prefetch": dataclasses.asdict(self.prefetch),
            "saves": dataclasses.asdict(self.saves),
            "restore": self.restore.to_dict(),
            "hints": dataclasses.asdict(self.hints),
            "server": self.server.to_dict(),
            "cluster": self.cluster.to_dict(),
            "events": self.events.to_dict(),
            "encryption": self.encryption.to_dict(),
            "lease_s": self.lease_s,
            "mover_threads": self.mover_threads,
        }


def load_daemon_config(
    source: StoreConfig | DaemonConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> DaemonConfig:
    """``kvstore-server``'s config by role, from the same sources as :meth:`StoreConfig.load`
    (a YAML file with store, ``server:``, ``cluster:`` and ``events:`` sections; None:
    ``$KVSTORE_CONFIG``, else the default; environment overrides apply to a file)."""
    if isinstance(source, DaemonConfig):
        return source
    return DaemonConfig.of(StoreConfig.load(source))


def apply_env(
    data: dict[str, Any],
    env: Mapping[str, str],
    prefix: str = "KVSTORE_",
    origins: dict[str, str] | None = None,
    shadowed: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Overlay the environment overrides (see the module docstring) on a plain config
    dict, as :meth:`StoreConfig.from_yaml` does before it checks anything: a new dict
    (``data`` itself if no variable applies), values still the variables' strings.
    ``origins``, if given, gets the variable each overridden key (``tiers[0].capacity``;
    ``tiers``) came from. ``shadowed``, if given, makes ``data`` an explicit dict: a
    variable only fills a key ``data`` leaves unset, and each variable whose key ``data``
    gives is left out and recorded there (variable -> key)."""
    if origins is None:
        origins = {}
    names = sorted(k for k in env if k.startswith(prefix) and k != prefix + "CONFIG")
    if not names:
        return data
    overlay = EnvOverlay(dict(data), prefix, shadowed, _SECTIONS, _SCALARS)
    source = "tiers"
    if prefix + "TIERS" in env and not overlay.gives(
        "tiers", overlay.tiers_given, prefix + "TIERS"
    ):
        source = prefix + "TIERS"
        overlay.data["tiers"] = load_yaml(env[source], source, "is not valid YAML/JSON")
        overlay.tiers_given = False
        origins["tiers"] = source
    raw = overlay.data.get("tiers", [{"kind": t.kind} for t in default_tiers()])
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"{source}: expected a list of tiers, got {type(raw).__name__}")
    overlay.tiers = [dict(t) if isinstance(t, Mapping) else t for t in raw]
    for name in names:
        if name != prefix + "TIERS":
            key = overlay.apply(name, env[name])
            if key is not None:
                origins[key] = name
    overlay.data["tiers"] = overlay.tiers
    return overlay.data
