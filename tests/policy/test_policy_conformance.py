"""Every registered eviction policy passes kvstore.testing.policy_conformance."""

from __future__ import annotations

from kvstore.policy import EvictionPolicy, make_policy, policy_names
from kvstore.testing.policy_conformance import PolicyConformance


def _suite(name: str) -> type[PolicyConformance]:
    """A conformance test class for the registered policy ``name``."""

    def make(self: PolicyConformance, capacity: int) -> EvictionPolicy:
        return make_policy(name, capacity)

    return type(f"TestPolicy_{name}", (PolicyConformance,), {"make_policy": make})


for _name in sorted(policy_names()):
    globals()[f"TestPolicy_{_name}"] = _suite(_name)


def test_every_built_in_policy_is_covered() -> None:
    assert {"TestPolicy_lru", "TestPolicy_s3fifo", "TestPolicy_arc"} <= set(globals())
