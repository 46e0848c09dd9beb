"""LRU eviction order and the policy registry."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.policy import POLICIES, EvictionPolicy, LRUPolicy, make_policy, register_policy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def order(policy: EvictionPolicy) -> list[int]:
    return [int.from_bytes(key, "little") for key in policy.candidates()]


def test_insertion_order_is_eviction_order():
    lru = LRUPolicy()
    for i in range(5):
        lru.insert(k(i))
    assert order(lru) == [0, 1, 2, 3, 4]
    assert len(lru) == 5
    assert k(3) in lru and k(9) not in lru and "x" not in lru


def test_touch_moves_to_most_recent():
    lru = LRUPolicy()
    for i in range(4):
        lru.insert(k(i))
    lru.touch(k(0))
    assert order(lru) == [1, 2, 3, 0]
    lru.touch(k(2))
    lru.touch(k(1))
    assert order(lru) == [3, 0, 2, 1]
    lru.touch(k(1))  # already most recent
    assert order(lru) == [3, 0, 2, 1]


def test_reinsert_counts_as_use():
    lru = LRUPolicy()
    for i in range(3):
        lru.insert(k(i))
    lru.insert(k(0))
    assert order(lru) == [1, 2, 0]
    assert len(lru) == 3


def test_touch_of_absent_key_is_ignored():
    lru = LRUPolicy()
    lru.insert(k(1))
    lru.touch(k(2))
    assert order(lru) == [1]
    assert k(2) not in lru and len(lru) == 1


def test_remove():
    lru = LRUPolicy()
    for i in range(4):
        lru.insert(k(i))
    lru.remove(k(1))
    assert order(lru) == [0, 2, 3]
    lru.remove(k(1))  # absent: ignored
    lru.remove(k(99))
    assert order(lru) == [0, 2, 3] and len(lru) == 3 and k(1) not in lru
    lru.touch(k(1))  # a removed key is not revived by touch
    assert k(1) not in lru
    lru.insert(k(1))  # but comes back, newest, on insert
    assert order(lru) == [0, 2, 3, 1]
    for i in range(4):
        lru.remove(k(i))
    assert len(lru) == 0 and order(lru) == []


def test_candidates_is_lazy_and_reflects_state():
    lru = LRUPolicy()
    for i in range(1000):
        lru.insert(k(i))
    it = lru.candidates()
    assert [int.from_bytes(next(it), "little") for _ in range(3)] == [0, 1, 2]
    assert len(lru) == 1000


def test_make_policy():
    def clock() -> float:
        return 42.0

    policy = make_policy("lru", clock=clock)
    assert isinstance(policy, LRUPolicy) and policy.name == "lru"
    assert policy.clock is clock
    assert make_policy("lru") is not make_policy("lru")


@pytest.mark.parametrize("name", ["LRU", "lfu", "", "s3-fifo", "ARC"])
def test_make_policy_unknown_name(name):
    with pytest.raises(ConfigError, match="lru"):  # the message lists the known policies
        make_policy(name)


def test_register_policy():
    with POLICIES.scoped():

        @register_policy
        class FIFO(LRUPolicy):
            name = "fifo-test"

            def touch(self, key):  # FIFO ignores use
                pass

        policy = make_policy("fifo-test")
    assert "fifo-test" not in POLICIES
    assert type(policy) is FIFO
    for i in range(3):
        policy.insert(k(i))
    policy.touch(k(0))
    assert order(policy) == [0, 1, 2]
