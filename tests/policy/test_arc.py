"""ARC list mechanics: T1/T2, the B1/B2 ghosts and the adaptive target p.

Termination under skipped candidates and the model-based property test run for
every registered policy in test_policy_conformance.py.
"""

from __future__ import annotations

from kvstore.policy import ARCPolicy, LRUPolicy
from kvstore.testing.policies import access, evict
from kvstore.testing.policies import policy_key as k
from kvstore.testing.policies import queue_ids as lists


def test_new_keys_enter_t1_and_a_use_moves_them_to_t2():
    p = ARCPolicy(10)
    for i in range(5):
        p.insert(k(i))
    p.touch(k(1))
    p.touch(k(3))
    p.touch(k(1))
    assert lists(p) == {"t1": [0, 2, 4], "t2": [3, 1], "b1": [], "b2": []}
    # p = 0: T1 goes first while it holds anything, then T2 least recent first.
    assert [int.from_bytes(key, "little") for key in p.candidates()] == [0, 2, 4, 3, 1]


def test_ghost_hits_adapt_the_target():
    p = ARCPolicy(4)
    for i in range(4):
        p.insert(k(i))
    assert evict(p, 1) == [k(0)]
    assert lists(p)["b1"] == [0] and p.target == 0
    p.insert(k(0))  # B1 hit: T1 was evicted too eagerly; p grows, 0 goes to T2
    assert p.target == 1
    assert lists(p) == {"t1": [1, 2, 3], "t2": [0], "b1": [], "b2": []}
    # |T1| = 3 > p: T1 first; with 1..3 pinned, T2's key goes.
    assert evict(p, 1, pinned=frozenset({k(1), k(2), k(3)})) == [k(0)]
    assert lists(p)["b2"] == [0]
    p.insert(k(0))  # B2 hit: T2 was evicted too eagerly; p shrinks
    assert p.target == 0
    assert lists(p)["t2"] == [0] and lists(p)["b2"] == []


def test_target_stays_within_capacity():
    p = ARCPolicy(3)
    for round_ in range(10):
        for i in range(6):
            access(p, k(i + 100 * (round_ % 2)), 3)
    assert 0 <= p.target <= 3


def test_scan_does_not_evict_frequent_keys():
    hot = [k(i) for i in range(5)]
    scan = [k(1000 + i) for i in range(300)]
    for policy, survives in ((ARCPolicy(20), True), (LRUPolicy(20), False)):
        for key in hot:
            access(policy, key, 20)
            access(policy, key, 20)
        hits = 0
        for n, key in enumerate(scan):
            access(policy, key, 20)
            if n % 50 == 49:
                hits += sum(access(policy, h, 20) for h in hot)
        assert (hits == 6 * len(hot)) is survives, (policy.name, hits)


def test_ghosts_stay_within_the_paper_bounds():
    c = 12
    p = ARCPolicy(c)
    for i in range(400):
        access(p, k(i % 37 if i % 3 else 1000 + i), c)
        q = lists(p)
        assert len(q["t1"]) + len(q["b1"]) <= c
        assert sum(len(v) for v in q.values()) <= 2 * c
        assert len(p) <= c


def test_only_evictions_leave_ghosts():
    p = ARCPolicy(10)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(3))
    p.remove(k(1))  # a delete: no ghost
    p.remove(k(3))  # from T2, never offered: no ghost
    p.remove(k(9))  # absent: ignored
    p.touch(k(9))
    assert lists(p) == {"t1": [0, 2], "t2": [], "b1": [], "b2": []}
    it = p.candidates()
    assert next(it) == k(0)
    del it
    p.touch(k(0))  # used after it was offered: no longer on its way out
    p.remove(k(0))
    assert lists(p) == {"t1": [2], "t2": [], "b1": [], "b2": []}
    assert evict(p, 1) == [k(2)]
    assert lists(p)["b1"] == [2] and len(p) == 0


def test_reinsert_of_a_tracked_key_counts_as_a_use():
    p = ARCPolicy(10)
    p.insert(k(1))
    p.insert(k(1))
    assert lists(p) == {"t1": [], "t2": [1], "b1": [], "b2": []}
