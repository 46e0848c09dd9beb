"""Parsing of configuration values: sizes, numbers, flags, names.

Each parser takes the raw value (from YAML, a dict or an environment
variable) and the key path it came from, and raises
:class:`~kvstore.errors.ConfigError` naming that path. Reading configuration
*sources* happens in :mod:`kvstore.config` only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from kvstore.errors import ConfigError
from kvstore.format import AUTO, CODECS, ENCODING_NAMES, codec_names, encoding_names

__all__ = [
    "Parser",
    "format_size",
    "parse_bool",
    "parse_codec",
    "parse_encoding",
    "parse_float",
    "parse_int",
    "parse_optional_bool",
    "parse_optional_float",
    "parse_optional_secret",
    "parse_optional_str",
    "parse_size",
    "parse_str",
]

#: ``parser(value, key_path) -> parsed value``
Parser = Callable[[Any, str], Any]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes in ``value``: an int, or a string like ``"512MiB"`` / ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            unit = _UNITS[match.group(2).lower()]
            exact = Fraction(match.group(1)) * unit  # no float rounding of big sizes
            if unit == 1 and exact.denominator != 1:
                raise ConfigError(f"{key}: {value!r} is not a whole number of bytes")
            return math.floor(exact)
    raise ConfigError(f"{key}: cannot read {value!r} as a size (e.g. 1073741824, '512MiB', '2GB')")


def format_size(nbytes: float) -> str:
    """Human-readable binary size, e.g. ``'1.50 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def parse_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in (
        *("1", "true", "yes", "on"),
        *("0", "false", "no", "off"),
    ):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def parse_optional_bool(value: Any, key: str) -> bool | None:
    if value is None or (isinstance(value, str) and value.lower() in ("auto", "none", "")):
        return None
    return parse_bool(value, key)


def parse_str(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def parse_optional_str(value: Any, key: str) -> str | None:
    return None if value is None else parse_str(value, key)


def parse_optional_secret(value: Any, key: str) -> str | None:
    """A token or password given inline (None: not given). Unlike :func:`parse_str` its
    error never quotes the value: a secret stays out of the message."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        name = type(value).__name__
        kind = "an empty string" if value == "" else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
        raise ConfigError(
            f"{key}: expected a non-empty string, got {kind} (its value is not shown: it "
            "is a secret); quote a token that YAML reads as a number or a flag"
        )
    return value


def parse_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def parse_optional_float(value: Any, key: str) -> float | None:
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
        return None
    return parse_float(value, key)


def parse_encoding(value: Any, key: str) -> str:
    """A tier's ``encoding:`` (:mod:`kvstore.format.encodings`), lowercased."""
    name = parse_str(value, key).lower()
    if name not in ENCODING_NAMES:
        known = ", ".join(encoding_names())
        raise ConfigError(f"{key}: unknown encoding {value!r}; use one of {known}")
    return name


def parse_codec(value: Any, key: str) -> str:
    name = parse_str(value, key).lower()
    if name != AUTO and not CODECS.has(name):
        known = ", ".join(codec_names())
        raise ConfigError(f"{key}: unknown codec {value!r}; use one of {known}")
    return name
