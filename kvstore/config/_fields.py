"""Helpers the config dataclasses share: field declarations, checks, building from dicts."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from kvstore.config.values import Parser
from kvstore.errors import ConfigError

__all__ = ["build", "check_positive", "default_cache_dir", "opt"]


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/kvstore``, else ``~/.cache/kvstore``: the default disk tier path."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore")


def opt(default: Any, parser: Parser) -> Any:
    """A dataclass field with ``default`` whose raw values are read by ``parser``."""
    return field(default=default, metadata={"parse": parser})


def check_positive(config: Any, path: str, *names: str) -> None:
    """Raise :class:`ConfigError` naming ``path.name`` for each field that is not > 0."""
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{path}.{name}: must be > 0, got {getattr(config, name)}")


def build(cls: type[Any], data: Any, path: str) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, naming bad keys by ``path``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            refused = getattr(cls, "refused", None)
            why = refused(key) if refused is not None else None
            if why is not None:
                raise ConfigError(f"{path}.{key}: {why}")
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"{path}.{key}: unknown key; allowed keys: {allowed}")
        parser = fields[key].metadata.get("parse")
        kwargs[key] = parser(value, f"{path}.{key}") if parser else value
    return cls(**kwargs)
