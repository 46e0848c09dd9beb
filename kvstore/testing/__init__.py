"""Test support shipped with kvstore, for authors of new tiers and policies (and our tests).

- :mod:`kvstore.testing.conformance` -- :class:`TierConformance`, the test
  suite every tier must pass (subclass it in a pytest module).
- :mod:`kvstore.testing.policy_conformance` -- :class:`PolicyConformance`, the
  suite every eviction policy must pass; :mod:`kvstore.testing.policies` drives a policy
  as the data path does (``evict``, ``access``).
- :mod:`kvstore.testing.faults` -- :class:`FaultyTier`, a wrapper that injects
  errors, misses and delays into a real tier.
- :mod:`kvstore.testing.lockcheck` -- :class:`LockCheckedTier`, a wrapper that
  records every tier call made while the books' lock is held (the lock rule).
- :mod:`kvstore.testing.data` -- deterministic KV tensors for tests.

The harnesses of our own tests and benchmarks (the chaos, memory soak and wire fuzzer,
proxies that fail, corrupt or throttle, request traces) live in the repository's
``kvharness/`` folder, not in the wheel.

Code outside this package imports these names from here; each is imported on first use.
Importing :mod:`kvstore.testing.conformance` needs pytest, and
:mod:`kvstore.testing.policy_conformance` hypothesis too (the ``dev`` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime import load_export

if TYPE_CHECKING:
    from kvstore.testing.conformance import TierConformance, make_keys
    from kvstore.testing.data import (
        block_list,
        empty_blocks,
        host_config,
        random_blocks,
        small_layout,
    )
    from kvstore.testing.faults import DAMAGES, FaultyFileOps, FaultyTier, wait_for_tier
    from kvstore.testing.lockcheck import LockCheckedTier
    from kvstore.testing.policies import access, evict, key_ids, policy_key, queue_ids
    from kvstore.testing.policy_conformance import PolicyConformance

__all__ = [
    "DAMAGES",
    "FaultyFileOps",
    "FaultyTier",
    "LockCheckedTier",
    "PolicyConformance",
    "TierConformance",
    "access",
    "block_list",
    "empty_blocks",
    "evict",
    "host_config",
    "key_ids",
    "make_keys",
    "policy_key",
    "queue_ids",
    "random_blocks",
    "small_layout",
    "wait_for_tier",
]

_EXPORTS = {
    "DAMAGES": "kvstore.testing.faults",
    "FaultyFileOps": "kvstore.testing.faults",
    "FaultyTier": "kvstore.testing.faults",
    "LockCheckedTier": "kvstore.testing.lockcheck",
    "PolicyConformance": "kvstore.testing.policy_conformance",
    "TierConformance": "kvstore.testing.conformance",
    "access": "kvstore.testing.policies",
    "block_list": "kvstore.testing.data",
    "empty_blocks": "kvstore.testing.data",
    "evict": "kvstore.testing.policies",
    "host_config": "kvstore.testing.data",
    "key_ids": "kvstore.testing.policies",
    "make_keys": "kvstore.testing.conformance",
    "policy_key": "kvstore.testing.policies",
    "queue_ids": "kvstore.testing.policies",
    "random_blocks": "kvstore.testing.data",
    "small_layout": "kvstore.testing.data",
    "wait_for_tier": "kvstore.testing.faults",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
