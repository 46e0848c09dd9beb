"""The conformance suite every eviction policy passes.

Use it from a test module::

    from kvstore.testing.policy_conformance import PolicyConformance

    class TestMyPolicy(PolicyConformance):
        def make_policy(self, capacity):
            return MyPolicy(capacity)

pytest collects the inherited ``test_*`` methods: candidates end when the caller skips
every key, an abandoned iteration leaves the policy whole, and a model-based property
test (hypothesis) that the policy tracks exactly the keys inserted and not yet removed or
evicted, offering each once. Needs pytest and hypothesis (the ``dev`` extra).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.keys import BlockKey
from kvstore.policy import EvictionPolicy
from kvstore.testing.policies import evict
from kvstore.testing.policies import policy_key as k

__all__ = ["PolicyConformance"]

_KEYS = st.integers(0, 24)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), _KEYS),
        st.tuples(st.just("touch"), _KEYS),
        st.tuples(st.just("remove"), _KEYS),
        st.tuples(st.just("evict"), st.integers(0, 6), st.frozensets(_KEYS, max_size=8)),
        st.tuples(st.just("peek"), st.integers(0, 30)),
    ),
    max_size=120,
)


class PolicyConformance(ABC):
    """Behaviour every :class:`~kvstore.policy.EvictionPolicy` must have."""

    @abstractmethod
    def make_policy(self, capacity: int) -> EvictionPolicy:
        """A new, empty policy for a tier of ``capacity`` blocks (0: unknown)."""

    def test_candidates_end_when_the_caller_skips_everything(self) -> None:
        p = self.make_policy(50)
        for i in range(40):
            p.insert(k(i))
            for _ in range(i % 5):
                p.touch(k(i))
        for _ in range(3):  # and again: skipped keys stay tracked and are offered again
            seen = list(p.candidates())
            assert len(seen) == len(set(seen)) == 40
            assert set(seen) == {k(i) for i in range(40)}
            assert len(p) == 40

    def test_abandoned_iteration_leaves_state_whole(self) -> None:
        p = self.make_policy(20)
        for i in range(20):
            p.insert(k(i))
            if i % 3 == 0:
                p.touch(k(i))
        it = p.candidates()
        first = [next(it) for _ in range(4)]
        del it
        assert len(p) == 20 and all(k(i) in p for i in range(20))
        assert list(p.candidates())[:4] == first  # skipped (pinned) keys stay first in line

    # One method, a subclass per policy: hypothesis sees "differing executors", as meant.
    @settings(
        max_examples=150, deadline=None, suppress_health_check=[HealthCheck.differing_executors]
    )
    @given(ops=_OPS, capacity=st.integers(0, 16))
    def test_policy_tracks_exactly_the_model_set(self, ops: list[Any], capacity: int) -> None:
        p = self.make_policy(capacity)
        model: set[BlockKey] = set()
        for op in ops:
            _apply(p, model, op)
            assert len(p) == len(model)
            assert all((k(i) in p) == (k(i) in model) for i in range(25))
        full = list(p.candidates())
        assert len(full) == len(set(full)) and set(full) == model  # every key, once


def _apply(p: EvictionPolicy, model: set[BlockKey], op: Any) -> None:
    """One step of the property test, on the policy and on the model set."""
    if op[0] == "insert":
        p.insert(k(op[1]))
        model.add(k(op[1]))
    elif op[0] == "touch":
        p.touch(k(op[1]))
    elif op[0] == "remove":
        p.remove(k(op[1]))
        model.discard(k(op[1]))
    elif op[0] == "evict":
        pinned = frozenset(k(i) for i in op[2])
        victims = evict(p, op[1], pinned)
        assert len(victims) == min(op[1], len(model - pinned))
        assert not set(victims) & pinned and set(victims) <= model
        model -= set(victims)
    else:  # a partial iteration the caller abandons
        seen = [key for _, key in zip(range(op[1]), p.candidates(), strict=False)]
        assert len(seen) == len(set(seen)) and set(seen) <= model
