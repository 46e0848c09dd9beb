"""Policies: which blocks to evict, and when.

- :mod:`kvstore.policy.base` -- the :class:`EvictionPolicy` interface.
- :mod:`kvstore.policy.lru` -- least recently used (the default).
- :mod:`kvstore.policy.s3fifo` -- S3-FIFO, scan-resistant (``policy: s3fifo``).
- :mod:`kvstore.policy.arc` -- ARC, adaptive recency/frequency (``policy: arc``).
- :mod:`kvstore.policy.watermark` -- high/low watermark arithmetic.

:data:`POLICIES` is the registry of policies by name (:mod:`kvstore.runtime.registry`):
``register_policy``, a ``kvstore.policies`` entry point, or ``POLICIES.register``.
Where copies of a block live is not the policies' business: :mod:`kvstore.placement`.
"""

from __future__ import annotations

from kvstore.policy.arc import ARCPolicy
from kvstore.policy.base import (
    POLICIES,
    Clock,
    EvictionPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from kvstore.policy.lru import LRUPolicy
from kvstore.policy.s3fifo import S3FIFOPolicy
from kvstore.policy.watermark import Watermarks

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "Clock",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "Watermarks",
    "make_policy",
    "policy_names",
    "register_policy",
]
