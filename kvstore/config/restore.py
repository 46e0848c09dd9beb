"""Parsing and checks of the ``restore`` section's prefill table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from kvstore.errors import ConfigError

__all__ = ["check_prefill_table", "parse_prefill_table"]

PrefillTable = tuple[tuple[int, float], ...]


def parse_prefill_table(value: Any, key: str) -> PrefillTable | None:
    """``[[tokens, seconds], ...]``, ``{tokens: seconds}`` or the same as a YAML/JSON
    string (an environment variable) -> sorted ``((tokens, seconds), ...)``; None stays."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: not valid YAML/JSON: {exc}") from None
        if value is None:
            return None
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ConfigError(f"{key}: expected a list of [tokens, seconds] pairs, got {value!r}")
    table = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigError(f"{key}[{i}]: expected [tokens, seconds], got {pair!r}")
        tokens, seconds = pair
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise ConfigError(f"{key}[{i}]: tokens must be an int, got {tokens!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ConfigError(f"{key}[{i}]: seconds must be a number, got {seconds!r}")
        table.append((tokens, float(seconds)))
    return tuple(sorted(table))


def check_prefill_table(table: PrefillTable, key: str) -> None:
    """Raise :class:`ConfigError` unless tokens rise strictly from > 0 and seconds are
    > 0 and never fall (a longer prompt never prefills faster)."""
    last_tokens, last_seconds = 0, 0.0
    for i, (tokens, seconds) in enumerate(table):
        if tokens <= last_tokens:
            raise ConfigError(f"{key}[{i}]: tokens must be > 0 and rise, got {tokens}")
        if seconds <= 0 or seconds < last_seconds:
            raise ConfigError(
                f"{key}[{i}]: seconds must be > 0 and never fall as prompts grow, got {seconds}"
            )
        last_tokens, last_seconds = tokens, seconds
