"""The connectors' settings (from an engine's extra config dict) and their counters.

Engine-independent: used by the vLLM connector, its worker-side transfers and
the SGLang backend.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.config import StoreConfig, parse_size
from kvstore.errors import ConfigError

__all__ = [
    "FLUSH_POLICIES",
    "OUTPUT_SAVES",
    "TRANSFER_MODES",
    "ConnectorSettings",
    "Counters",
    "shared_tiers_config",
]

log = logging.getLogger(__name__)

FLUSH_POLICIES = ("step", "background", "close")
OUTPUT_SAVES = ("hinted", "always", "never")
TRANSFER_MODES = ("layerwise", "sync")
_MEMORY_KINDS = ("host", "device")


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's settings, from the engine's extra config dict.

    Keys: ``kvstore_config`` (a store config dict or a YAML path; default:
    ``$KVSTORE_CONFIG`` or the embedded host+disk default), ``chunk_tokens``,
    ``flush`` (``step``: persist new blocks at the end of each step that saved
    some; ``background``: in a thread; ``close``: only at shutdown),
    ``transfer`` (``layerwise``: prefetch and store layer by layer; ``sync``:
    whole chunks at the start and end of a step), ``model_id`` and ``salt``
    (namespace), ``stats_dir`` (write counters as JSON there),
    ``recompute_on_load_failure``, ``staging_bytes``, ``verify_sample_rate`` (the
    fraction of hits recomputed and compared with the stored blocks instead of served;
    0 turns shadow verification off), ``verify_tolerance`` (the largest relative
    difference that matches; default by KV dtype; see kvstore/connectors/verify.py) and
    ``save_outputs`` (when a request finishes, also store the chunks its generated
    tokens completed, so the next turn of a conversation hits through its answer:
    ``hinted``, for requests that carry a session hint; ``always``; ``never``).
    """

    store_config: Any = None
    chunk_tokens: int | None = None
    flush: str = "step"
    transfer: str = "layerwise"
    model_id: str | None = None
    salt: str | None = None
    stats_dir: str | None = None
    recompute_on_load_failure: bool = True
    staging_bytes: int = 256 * 1024**2
    verify_sample_rate: float = 0.001  # one hit in a thousand recomputed and compared
    verify_tolerance: float | None = None
    save_outputs: str = "hinted"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Read and check the settings; unknown keys raise :class:`ConfigError`."""
        data = dict(extra or {})
        names = {
            "kvstore_config": "store_config",
            **{n: n for n in cls.__dataclass_fields__ if n != "store_config"},
        }
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config.{unknown[0]}: unknown key; allowed: "
                f"{', '.join(sorted(names))}"
            )
        kwargs = {names[k]: v for k, v in data.items()}
        if "staging_bytes" in kwargs:
            kwargs["staging_bytes"] = parse_size(kwargs["staging_bytes"], "staging_bytes")
        settings = cls(**kwargs)
        settings._check()
        return settings

    def _check(self) -> None:
        if self.flush not in FLUSH_POLICIES:
            raise ConfigError(f"flush: use one of {', '.join(FLUSH_POLICIES)}, got {self.flush!r}")
        if self.save_outputs not in OUTPUT_SAVES:
            raise ConfigError(
                f"save_outputs: use one of {', '.join(OUTPUT_SAVES)}, got {self.save_outputs!r}"
            )
        if self.transfer not in TRANSFER_MODES:
            raise ConfigError(
                f"transfer: use one of {', '.join(TRANSFER_MODES)}, got {self.transfer!r}"
            )
        if self.chunk_tokens is not None and (
            type(self.chunk_tokens) is not int or self.chunk_tokens <= 0
        ):
            raise ConfigError(f"chunk_tokens: expected a positive int, got {self.chunk_tokens!r}")
        for name in ("model_id", "salt", "stats_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")
        if not isinstance(self.recompute_on_load_failure, bool):
            raise ConfigError("recompute_on_load_failure: expected true or false")
        if self.staging_bytes <= 0:
            raise ConfigError("staging_bytes: must be > 0")
        rate = self.verify_sample_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ConfigError(
                f"verify_sample_rate: expected a number from 0 (off) to 1 (every hit), got {rate!r}"
            )
        tol = self.verify_tolerance
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < math.inf
        ):
            raise ConfigError(f"verify_tolerance: expected a number > 0, got {tol!r}")

    def resolved_store_config(self) -> StoreConfig:
        """The store config: the given dict or YAML path, else env / embedded default."""
        return StoreConfig.load(self.store_config)


def shared_tiers_config(config: StoreConfig) -> StoreConfig | None:
    """``config`` without its process-private memory tiers (None if nothing is left).

    What the scheduler side opens to see blocks the workers (other processes)
    stored: their memory tiers are invisible to it anyway, and it must not
    reserve memory of its own for them.
    """
    tiers = tuple(t for t in config.tiers if t.kind not in _MEMORY_KINDS)
    # The restore section comes along: the scheduler plans which hits pay.
    return StoreConfig(tiers=tiers, restore=config.restore) if tiers else None


class Counters:
    """Thread-safe named counters, readable whole or as deltas since the last take."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._taken: dict[str, float] = {}

    def add(self, name: str, amount: float = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def snapshot(self) -> dict[str, float]:
        """Every counter's total."""
        with self._lock:
            return dict(self._values)

    def take_delta(self) -> dict[str, float]:
        """What changed since the last call (only non-zero changes)."""
        with self._lock:
            delta = {k: v - self._taken.get(k, 0) for k, v in self._values.items()}
            self._taken = dict(self._values)
        return {k: v for k, v in delta.items() if v}

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the seconds the block takes to ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def write(self, directory: str | None, extra: Mapping[str, Any] | None = None) -> None:
        """Write the totals to ``<directory>/kvstore-<role>-<pid>.json`` (atomically)."""
        if directory is None:
            return
        path = os.path.join(directory, f"kvstore-{self.role}-{os.getpid()}.json")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"role": self.role, **self.snapshot(), **(extra or {})}, f)
            os.replace(path + ".tmp", path)
        except OSError as exc:  # metrics must never break serving
            log.warning("kvstore: cannot write stats to %s: %s", path, exc)
