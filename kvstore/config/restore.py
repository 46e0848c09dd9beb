"""Parsing and checks of the ``restore`` section's prefill table and tier speeds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.config.yaml_text import load_yaml
from kvstore.errors import ConfigError

__all__ = ["check_prefill_table", "parse_prefill_table", "parse_tier_speeds"]

PrefillTable = tuple[tuple[int, float], ...]


def parse_prefill_table(value: Any, key: str) -> PrefillTable | None:
    """``[[tokens, seconds], ...]``, ``{tokens: seconds}`` or the same as a YAML/JSON
    string (an environment variable) -> sorted ``((tokens, seconds), ...)``; None stays."""
    if value is None:
        return None
    if isinstance(value, str):
        value = load_yaml(value, key, "is not valid YAML/JSON")
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


TierSpeeds = tuple[tuple[str, float, float], ...]


def parse_tier_speeds(value: Any, key: str) -> TierSpeeds:
    """``{tier id: [GB/s, ms a call]}`` (a tier id is its kind and how many tiers of that
    kind come before it: ``disk:0``, ``s3:0``), or the same as a YAML/JSON string (an
    environment variable) -> sorted ``((tier id, gbps, ms), ...)``."""
    if isinstance(value, str):
        value = load_yaml(value, key, "is not valid YAML/JSON")
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected {{tier id: [GB/s, ms a call]}}, got {value!r}")
    out = []
    for tier, pair in value.items():
        kind, _, n = str(tier).partition(":")
        if not kind or not n.isdigit():
            raise ConfigError(f"{key}: {tier!r} is not a tier id such as disk:0")
        numbers = isinstance(pair, (list, tuple)) and len(pair) == 2
        if not numbers or not all(_real(x) for x in pair):
            raise ConfigError(f"{key}.{tier}: expected [GB/s, ms a call], got {pair!r}")
        gbps, ms = float(pair[0]), float(pair[1])
        if gbps <= 0 or ms < 0:
            raise ConfigError(f"{key}.{tier}: GB/s must be > 0 and ms >= 0, got {pair!r}")
        out.append((str(tier), gbps, ms))
    return tuple(sorted(out))


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
