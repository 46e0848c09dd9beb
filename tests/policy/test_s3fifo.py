"""S3-FIFO queue mechanics, scan resistance and pins, and the registry's policies.

Termination and the model-based property test run for every registered policy in
test_policy_conformance.py."""

from __future__ import annotations

from kvstore.policy import ARCPolicy, LRUPolicy, S3FIFOPolicy, make_policy, policy_names
from kvstore.testing.policies import access, evict
from kvstore.testing.policies import key_ids as ids
from kvstore.testing.policies import policy_key as k
from kvstore.testing.policies import queue_ids as queues

# -- queue mechanics ----------------------------------------------------------


def test_new_keys_go_to_small_and_leave_in_fifo_order():
    p = S3FIFOPolicy(capacity=10)  # S aims at 1 block
    for i in range(5):
        p.insert(k(i))
    assert queues(p) == {"small": [0, 1, 2, 3, 4], "main": [], "ghost": []}
    assert ids(p.candidates()) == [0, 1, 2, 3, 4]
    assert len(p) == 5 and all(k(i) in p for i in range(5))  # offering removes nothing


def test_used_key_moves_from_small_to_main_instead_of_leaving():
    p = S3FIFOPolicy(capacity=10)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    p.touch(k(0))
    assert p.frequency(k(0)) == 2
    assert evict(p, 1) == [k(1)]  # 0 was used: it moved to M, 1 went
    assert queues(p) == {"small": [2, 3], "main": [0], "ghost": [1]}
    assert p.frequency(k(0)) == 0  # the move to M resets the counter


def test_counter_is_capped_at_three():
    p = S3FIFOPolicy(capacity=10)
    p.insert(k(0))
    for _ in range(10):
        p.touch(k(0))
    assert p.frequency(k(0)) == 3
    assert p.frequency(k(9)) is None


def test_main_gives_used_keys_another_round():
    p = S3FIFOPolicy(capacity=10)
    for i in range(3):
        p.insert(k(i))
        p.touch(k(i))
    it = p.candidates()
    # S moves its used keys to M (counters reset); then M's oldest is offered.
    assert next(it) == k(0)
    del it
    assert queues(p) == {"small": [], "main": [0, 1, 2], "ghost": []}
    p.touch(k(0))
    p.touch(k(0))
    it = p.candidates()
    assert [next(it), next(it)] == [k(1), k(2)]  # 0 went round: counter 2 -> 1
    assert p.frequency(k(0)) == 1
    assert next(it) == k(0)  # round two: 1 -> 0, then offered
    assert p.frequency(k(0)) == 0
    del it
    p.remove(k(1))
    assert queues(p)["ghost"] == []  # evictions from M leave no ghost


def test_ghost_hit_goes_straight_to_main():
    p = S3FIFOPolicy(capacity=10)
    for i in range(3):
        p.insert(k(i))
    assert evict(p, 1) == [k(0)]
    assert queues(p)["ghost"] == [0] and k(0) not in p
    p.insert(k(0))  # evicted from S too early: it comes back into M
    assert queues(p) == {"small": [1, 2], "main": [0], "ghost": []}


def test_only_removals_of_offered_small_keys_leave_ghosts():
    p = S3FIFOPolicy(capacity=10)
    for i in range(5):
        p.insert(k(i))
    p.touch(k(4))
    p.remove(k(3))  # a delete: never offered
    it = p.candidates()
    assert next(it) == k(0)  # offered: the manager may evict it
    del it
    p.remove(k(0))  # ... and did
    p.remove(k(1))  # a delete (or a lost copy) of a key never offered
    assert queues(p) == {"small": [2, 4], "main": [], "ghost": [0]}
    assert evict(p, 1) == [k(2)]  # 4 was used: it moved to M
    p.remove(k(4))  # removal from M
    assert queues(p) == {"small": [], "main": [], "ghost": [0, 2]}


def test_remove_and_touch_of_absent_keys_are_noops():
    p = S3FIFOPolicy(capacity=10)
    p.insert(k(1))
    p.remove(k(7))
    p.touch(k(7))
    assert queues(p) == {"small": [1], "main": [], "ghost": []} and k(7) not in p
    p.remove(k(1))
    p.remove(k(1))
    assert queues(p) == {"small": [], "main": [], "ghost": []}
    assert len(p) == 0 and list(p.candidates()) == []


def test_reinsert_of_a_tracked_key_counts_as_a_use():
    p = S3FIFOPolicy(capacity=10)
    p.insert(k(1))
    p.insert(k(1))
    assert len(p) == 1 and p.frequency(k(1)) == 1


def test_ghost_is_bounded_by_the_main_share():
    p = S3FIFOPolicy(capacity=20)  # S 2 blocks, M (and G) 18
    for i in range(200):
        access(p, k(i), 20)
    ghost = queues(p)["ghost"]
    assert len(ghost) == 18 and ghost == list(range(162, 180))  # the most recent evictions
    assert len(p) == 20


def test_unknown_capacity_sizes_queues_from_what_is_resident():
    p = S3FIFOPolicy()  # capacity 0: S aims at 10% of the keys held
    for i in range(30):
        p.insert(k(i))
    assert ids(evict(p, 3)) == [0, 1, 2]
    assert len(queues(p)["ghost"]) == 3


# -- scans --------------------------------------------------------------------


def test_one_hit_wonder_scan_does_not_evict_hot_keys():
    hot = [k(i) for i in range(5)]
    scan = [k(1000 + i) for i in range(300)]
    for policy, survives in ((S3FIFOPolicy(capacity=20), True), (LRUPolicy(20), False)):
        for key in hot:
            access(policy, key, 20)
            access(policy, key, 20)
        hits = 0
        for n, key in enumerate(scan):
            access(policy, key, 20)
            if n % 50 == 49:  # the hot set comes back after 50 one-off keys (> capacity)
                hits += sum(access(policy, h, 20) for h in hot)
        assert (hits == 6 * len(hot)) is survives, (policy.name, hits)


# -- pins ---------------------------------------------------------------------


def test_pinned_keys_are_passed_over_then_evicted_when_free():
    p = S3FIFOPolicy(capacity=10)
    for i in range(6):
        p.insert(k(i))
    assert evict(p, 2, pinned=frozenset({k(0), k(1)})) == [k(2), k(3)]
    assert queues(p)["small"] == [0, 1, 4, 5]
    assert evict(p, 2) == [k(0), k(1)]
    assert queues(p)["ghost"] == [2, 3, 0, 1]


def test_conformance_covers_the_scan_resistant_policies():
    assert {"lru", "s3fifo", "arc"} <= set(policy_names())
    assert isinstance(make_policy("s3fifo", 8), S3FIFOPolicy)
    assert isinstance(make_policy("arc", 8), ARCPolicy)


def test_clock_and_capacity_reach_the_policy():
    def clock() -> float:
        return 7.0

    p = make_policy("s3fifo", 123, clock)
    assert p.capacity == 123 and p.clock is clock
