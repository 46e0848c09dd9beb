"""High/low watermark arithmetic (in blocks) and the eviction plan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.policy import Watermarks


@pytest.mark.parametrize(
    ("capacity", "high", "low", "expected"),
    [
        (10, 0.9, 0.7, (10, 9, 7)),
        (100, 0.9, 0.7, (100, 90, 70)),
        (100, 1.0, 0.0, (100, 100, 0)),
        (1000, 0.95, 0.5, (1000, 950, 500)),
        (7, 0.9, 0.7, (7, 6, 4)),  # floors
        (1, 0.9, 0.7, (1, 1, 0)),  # high is at least one block; low below high
        (2, 0.1, 0.0, (2, 1, 0)),
        (10, 0.5, 0.5, (10, 5, 4)),  # low is clamped below high
        (10, 0.5, 0.9, (10, 5, 4)),
        (10, 1.5, 0.7, (10, 10, 7)),  # high is clamped to capacity
    ],
)
def test_of(capacity, high, low, expected):
    marks = Watermarks.of(capacity, high, low)
    assert (marks.capacity, marks.high, marks.low) == expected


def test_of_is_exact_for_decimal_fractions():
    marks = Watermarks.of(100, 0.57, 0.29)
    assert (marks.high, marks.low) == (57, 29)


@pytest.mark.parametrize(
    ("resident", "incoming", "expected"),
    [
        (0, 0, (0, 0)),
        (0, 5, (0, 0)),
        (5, 4, (0, 0)),  # lands exactly on high: no eviction
        (9, 0, (0, 0)),
        (8, 2, (0, 3)),  # crosses high (10 > 9) but fits: want down to low (10 - 7)
        (9, 1, (0, 3)),
        (10, 0, (0, 3)),  # above high already: bring it down even with nothing incoming
        (10, 1, (1, 4)),  # over capacity by one: must 1, want down to low
        (10, 5, (5, 8)),
        (9, 10, (9, 9)),  # everything must go (9 + 10 - 10 = 9), want capped at resident
        (3, 10, (3, 3)),
        (2, 20, (12, 2)),  # cannot fit: must > resident signals it, want capped at resident
        (0, 11, (1, 0)),
    ],
)
def test_plan_worked_examples(resident, incoming, expected):
    marks = Watermarks(capacity=10, high=9, low=7)
    assert marks.plan(resident, incoming) == expected


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 10_000),
    high=st.floats(0.01, 1.0),
    low=st.floats(0.0, 1.0),
    resident_frac=st.floats(0.0, 1.0),
    incoming=st.integers(0, 20_000),
)
def test_plan_properties(capacity, high, low, resident_frac, incoming):
    marks = Watermarks.of(capacity, high, low)
    assert 0 <= marks.low < marks.high <= capacity
    resident = int(resident_frac * capacity)
    must, want = marks.plan(resident, incoming)
    after = resident + incoming
    # must: the least that lets everything fit (may exceed resident: then it cannot fit)
    assert must == max(0, after - capacity)
    assert 0 <= want <= resident
    assert want >= min(must, resident)
    if after <= marks.high:
        assert must == want == 0
    else:
        # hysteresis: evict down to low, unless there is not that much to evict
        assert want == min(resident, max(must, after - marks.low))
        if resident >= after - marks.low:
            assert after - want == marks.low
    if must <= resident:
        assert after - must <= capacity


@pytest.mark.parametrize("resident", [0, 50, 89, 90, 91, 100])
def test_hysteresis_evicts_in_batches(resident):
    marks = Watermarks.of(100, 0.9, 0.7)
    # fill one block at a time: an eviction batch happens only when passing high
    must, want = marks.plan(resident, 1)
    if resident + 1 > 90:
        assert want == resident + 1 - 70 and want >= 21
    else:
        assert (must, want) == (0, 0)
