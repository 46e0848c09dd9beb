"""The name this project is installed under, for messages that say how to install it.

The distribution is ``kvstore-tiers`` (``pyproject.toml``); the package it installs imports as
``kvstore``. ``kvstore`` on the public package index is an unrelated package, so every
install command names ``kvstore-tiers``.
"""

from __future__ import annotations

__all__ = ["DISTRIBUTION", "install_hint"]

#: The distribution name, as in ``pyproject.toml`` and ``importlib.metadata``.
DISTRIBUTION = "kvstore-tiers"


def install_hint(extra: str) -> str:
    """The pip command that installs this project with ``extra``:
    ``pip install 'kvstore-tiers[s3]'``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
