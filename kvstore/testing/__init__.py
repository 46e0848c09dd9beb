"""Test support shipped with kvstore, for our tests and for authors of new tiers.

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
- :mod:`kvstore.testing.commands` -- ``kvstore`` and ``kvstore-server`` run as a
  user runs them, and the one-line error a mistake must get.

Importing :mod:`kvstore.testing.conformance` needs pytest, and
:mod:`kvstore.testing.policy_conformance` hypothesis too (the ``dev`` extra).
"""
