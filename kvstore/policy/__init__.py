"""Policies: which blocks to evict, and when.

- :mod:`kvstore.policy.base` -- the :class:`EvictionPolicy` interface.
- :mod:`kvstore.policy.lru` -- least recently used (the default).
- :mod:`kvstore.policy.watermark` -- high/low watermark arithmetic.
"""

from __future__ import annotations

from kvstore.policy.base import (
    Clock,
    EvictionPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from kvstore.policy.lru import LRUPolicy
from kvstore.policy.watermark import Watermarks

__all__ = [
    "Clock",
    "EvictionPolicy",
    "LRUPolicy",
    "Watermarks",
    "make_policy",
    "policy_names",
    "register_policy",
]
