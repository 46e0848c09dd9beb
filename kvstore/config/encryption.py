"""The ``encryption:`` section: encryption at rest, and the keyring it reads.

Off by default. With a key file (or an environment variable holding the same
document) the disk, Redis and S3 tiers seal every block they store with
AES-256-GCM (:mod:`kvstore.format.sealing`)::

    encryption:
      key_file: /etc/kvstore/keys.yaml    # mode 0600: a world-readable file is refused
      tiers: [disk, redis, s3]            # which at-rest tiers encrypt (default: all three)

The keyring document (YAML or JSON), one entry per tenant, each with its keys by
id and the id that seals new blocks (keys: 32 bytes, as 64 hex digits or base64)::

    tenants:
      default:
        active: k2
        keys:
          k1: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
          k2: 3Tr0Vn2pF0m0a5jX1d8m0l3b7yq9Jm8sU1h0c2k4e6g=

``active`` and ``keys`` at the top level are tenant ``default``'s. Environment:
``KVSTORE_ENCRYPTION_KEY_FILE=/path`` and ``KVSTORE_ENCRYPTION_TIERS=disk,s3``
set the fields; ``key_env: KVSTORE_KEYRING`` names a variable whose value is the
document itself (for secrets injected as environment variables).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kvstore.config._fields import opt
from kvstore.config.values import parse_bool, parse_optional_str
from kvstore.config.yaml_text import load_yaml
from kvstore.errors import ConfigError
from kvstore.format import Keyring, TenantKeys

__all__ = [
    "ENCRYPTING_TIERS",
    "EncryptionConfig",
    "Keyring",
    "TenantKeys",
    "parse_keyring",
]

#: The tier kinds whose blocks rest outside process memory and can be encrypted.
ENCRYPTING_TIERS = ("disk", "redis", "s3")
KEY_BYTES = 32
_KEY_ID = re.compile(r"[A-Za-z0-9._:-]{1,32}")


def _parse_tiers(value: Any, path: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"{path}: expected a list of tier kinds, got {type(value).__name__}")
    tiers = tuple(str(t).strip() for t in items if str(t).strip())
    for kind in tiers:
        if kind not in ENCRYPTING_TIERS:
            raise ConfigError(
                f"{path}: {kind!r} cannot be encrypted; use some of {', '.join(ENCRYPTING_TIERS)} "
                "(host and device memory are not at rest; a remote server or a cluster's "
                "peers encrypt with their own encryption settings)"
            )
    return tiers


@dataclass(frozen=True)
class EncryptionConfig:
    """Encryption at rest (docs/tenants.md shows it in context).

    ``key_file``: the keyring document (YAML or JSON: per tenant, keys by id as 64
    hex digits or base64, and the ``active`` id; docs/tenants.md); refused if every
    user may read it (``chmod 600``).

    ``key_env``: the name of an environment variable holding the keyring
    document instead (one of ``key_file`` and ``key_env``; neither: off).

    ``tiers``: the tier kinds that encrypt (``disk``, ``redis``, ``s3``; from the
    environment as ``disk,s3``).

    ``reencrypt``: when the keyring holds keys besides the active one, a store
    rewrites its blocks sealed under those keys with the active key, in the
    background, from its open on (``stats()``: ``reencrypted`` per tier).
    """

    key_file: str | None = opt(None, parse_optional_str)
    key_env: str | None = opt(None, parse_optional_str)
    tiers: tuple[str, ...] = opt(ENCRYPTING_TIERS, _parse_tiers)
    reencrypt: bool = opt(True, parse_bool)

    @property
    def enabled(self) -> bool:
        """Whether blocks are encrypted (a key file or variable is named)."""
        return self.key_file is not None or self.key_env is not None

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` for impossible values (no file is read here)."""
        if self.key_file is not None and self.key_env is not None:
            raise ConfigError(f"{path}: give one of key_file and key_env, not both")
        _parse_tiers(list(self.tiers), f"{path}.tiers")
        if self.enabled and not self.tiers:
            raise ConfigError(f"{path}.tiers: empty; name the tiers to encrypt or drop the keys")

    def to_dict(self) -> dict[str, Any]:
        """Plain values."""
        return {
            "key_file": self.key_file,
            "key_env": self.key_env,
            "tiers": list(self.tiers),
            "reencrypt": self.reencrypt,
        }

    def keyring(self, environ: Mapping[str, str] | None = None) -> Keyring:
        """Read the keyring this section names (at a store's open; one-line
        :class:`ConfigError` for a missing, unsafe or malformed one)."""
        if self.key_file is not None:
            return parse_keyring(_read_key_file(self.key_file), f"key file {self.key_file}")
        if self.key_env is None:
            raise ConfigError("encryption: no key_file or key_env is set")
        env = os.environ if environ is None else environ
        text = env.get(self.key_env)
        if not text:
            raise ConfigError(f"encryption.key_env: ${self.key_env} is not set or empty")
        return parse_keyring(text, f"${self.key_env}")


def _read_key_file(name: str) -> str:
    try:
        with open(name, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"encryption.key_file {name!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"encryption.key_file {name!r}: not UTF-8 text") from None
    if mode & stat.S_IROTH:
        raise ConfigError(
            f"encryption.key_file {name!r} is readable by every user (mode "
            f"{stat.S_IMODE(mode):o}); make it private: chmod 600 {name}"
        )
    return text


def parse_keyring(text: str, where: str) -> Keyring:
    """The keyring a YAML / JSON document describes (see the module docstring)."""
    data = load_yaml(text, f"encryption: {where}", "is not valid YAML or JSON", detail=False)
    if not isinstance(data, Mapping):
        raise ConfigError(f"encryption: {where}: expected a mapping of tenants")
    if "tenants" in data:
        tenants = data["tenants"]
        if not isinstance(tenants, Mapping) or not tenants:
            raise ConfigError(f"encryption: {where}: tenants must map names to keys")
    else:
        tenants = {"default": data}
    parsed = {
        str(name): _tenant_keys(entry, f"{where}: tenant {name}") for name, entry in tenants.items()
    }
    return Keyring(MappingProxyType(parsed))


def _tenant_keys(entry: Any, where: str) -> TenantKeys:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("keys"), Mapping):
        raise ConfigError(f"encryption: {where}: expected 'keys' (id: key) and 'active'")
    unknown = set(entry) - {"keys", "active"}
    if unknown:
        raise ConfigError(f"encryption: {where}: unknown key {sorted(unknown)[0]!r}")
    keys = {}
    for key_id, value in entry["keys"].items():
        key_id = str(key_id)
        if not _KEY_ID.fullmatch(key_id):
            raise ConfigError(
                f"encryption: {where}: key id {key_id!r}: use 1-32 letters, digits, . _ : -"
            )
        keys[key_id] = _key_bytes(value, f"{where}, key {key_id}")
    if not keys:
        raise ConfigError(f"encryption: {where}: no keys")
    active = str(entry.get("active", next(iter(keys)) if len(keys) == 1 else ""))
    if active not in keys:
        raise ConfigError(
            f"encryption: {where}: active key {active!r} is not among its keys "
            f"({', '.join(keys)}); name the key that seals new blocks"
        )
    return TenantKeys(active, MappingProxyType(keys))


def _key_bytes(value: Any, where: str) -> bytes:
    """A 32-byte key from 64 hex digits or base64 (``hex:`` / ``base64:`` prefixes allowed)."""
    text = str(value).strip()
    scheme, sep, rest = text.partition(":")
    if sep and scheme in ("hex", "base64"):
        text = rest.strip()
    raw: bytes | None = None
    try:
        if scheme == "hex" or (scheme != "base64" and re.fullmatch(r"[0-9a-fA-F]{64}", text)):
            raw = bytes.fromhex(text)
        else:
            raw = base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raw = None
    if raw is None or len(raw) != KEY_BYTES:
        got = "not hex or base64" if raw is None else f"{len(raw)} bytes"
        raise ConfigError(
            f"encryption: {where}: a key must be {KEY_BYTES} bytes as 64 hex digits or "
            f"base64 ({got}); make one with: python -c 'import secrets; "
            "print(secrets.token_hex(32))'"
        )
    return raw
