"""The environment's overrides of a plain config dict, one variable at a time.

:func:`kvstore.config.apply_env` walks the variables; :class:`EnvOverlay` applies each
to the dict it builds, and, for an explicit dict (``KVStore(layout, {...})``), keeps a
variable out of a key the dict gives: variables override a file, never an explicit dict.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from kvstore.config.kinds import tier_kinds
from kvstore.errors import ConfigError

__all__ = ["EnvOverlay"]


class EnvOverlay:
    """The dict :func:`apply_env` builds: its tiers apart, and what an explicit dict gives.

    ``shadowed``: None: variables override; else the variables an explicit dict's keys
    keep out (variable -> key). ``sections`` / ``scalars``: the top-level keys a
    ``<PREFIX><SECTION>_<FIELD>`` / ``<PREFIX><SCALAR>`` variable sets.
    """

    def __init__(
        self,
        data: dict[str, Any],
        prefix: str,
        shadowed: dict[str, str] | None,
        sections: Collection[str],
        scalars: Collection[str],
    ) -> None:
        self.data = data
        self.prefix = prefix
        self.shadowed = shadowed
        self.sections = sections
        self.scalars = scalars
        self.tiers: list[Any] = []
        self.tiers_given = "tiers" in data

    def gives(self, key: str, present: bool, variable: str) -> bool:
        """Whether an explicit dict gives ``key`` (``present`` in it): then ``variable``
        is recorded in :attr:`shadowed` and not applied."""
        if self.shadowed is None or not present:
            return False
        self.shadowed[variable] = key
        return True

    def apply(self, name: str, value: str) -> str | None:
        """Apply one variable: a top-level scalar, a section field, or a tier field; the
        key it set (``tiers[0].capacity``), or None where an explicit dict gives it."""
        prefix = self.prefix
        setting = name[len(prefix) :].lower()
        if setting in self.scalars:
            if self.gives(setting, setting in self.data, name):
                return None
            self.data[setting] = value
            return setting
        head, _, key = setting.partition("_")
        if head in self.sections and key:
            section = self.data.get(head) or {}
            if not isinstance(section, Mapping):
                raise ConfigError(f"{head}: expected a mapping, got {type(section).__name__}")
            if self.gives(f"{head}.{key}", key in section, name):
                return None
            self.data[head] = {**section, key: value}
            return f"{head}.{key}"
        if head not in tier_kinds() or not key:
            kinds = ", ".join(tier_kinds())
            raise ConfigError(
                f"{name}: unknown setting; use {prefix}<KIND>_<FIELD> with a kind of {kinds}, "
                f"{prefix}<SECTION>_<FIELD> with a section of {', '.join(sorted(self.sections))}, "
                f"{prefix}LEASE_S, {prefix}MOVER_THREADS, or {prefix}TIERS / {prefix}CONFIG"
            )
        tiers = self.tiers
        matches = [i for i, t in enumerate(tiers) if isinstance(t, dict) and t.get("kind") == head]
        if not matches:
            raise ConfigError(f"{name}: the config has no tier of kind {head!r} to override")
        where = f"tiers[{matches[0]}].{key}"
        if self.gives(where, self.tiers_given and key in tiers[matches[0]], name):
            return None
        tiers[matches[0]][key] = value
        return where
