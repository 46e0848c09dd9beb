"""TokenBook: tokens per key, all-or-nothing records, and a journal that survives restarts."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError, InvalidInputError
from kvstore.events.book import TokenBook
from kvstore.keys import BlockKey

K = [BlockKey(bytes([i]) * 16) for i in range(10)]


def test_record_get_forget() -> None:
    book = TokenBook(4)
    assert book.record(K[:3], list(range(12)), parent=K[9]) == 3
    assert book.get(K[0]) == (K[9], [0, 1, 2, 3])
    assert book.get(K[2]) == (K[1], [8, 9, 10, 11])
    assert book.get(K[5]) is None and book.parent(K[1]) == K[0]
    assert book.record(K[:1], np.arange(4, dtype=np.int64), parent=K[9]) == 0  # unchanged
    assert book.record(K[3:4], torch.arange(4) + 100) == 1
    assert book.get(K[3]) == (None, [100, 101, 102, 103])
    assert book.forget([K[0], K[5]]) == 1 and K[0] not in book and len(book) == 3
    assert book.retain([K[1]]) == 2 and book.keys() == [K[1]]


def test_retain_spares_what_was_recorded_within_the_grace() -> None:
    now = [100.0]
    book = TokenBook(4, clock=lambda: now[0])
    book.record(K[:2], list(range(8)))  # at 100
    now[0] = 150.0
    book.record(K[2:3], list(range(4)))  # at 150: a put still on its way
    book.record(K[:1], list(range(4)))  # recorded again: its time moves to 150
    now[0] = 200.0
    assert book.retain([], grace_s=60.0) == 1 and book.keys() == [K[0], K[2]]
    assert book.retain([K[2]], grace_s=10.0) == 1 and book.keys() == [K[2]]
    assert book.retain([]) == 1 and len(book) == 0  # no grace: only what is held


@pytest.mark.parametrize(
    ("keys", "tokens", "parent", "match"),
    [
        (K[:2], list(range(7)), None, "expected 8 token ids"),
        (K[:2], list(range(9)), None, "expected 8 token ids"),
        ([b"short"], list(range(4)), None, "keys"),
        (K[:1], list(range(4)), b"bad", "parent"),
        (K[:1], [0, 1, 2, 1.5], None, "ints"),
        (K[:1], [0, 1, 2, 2**40], None, "token"),
    ],
)
def test_bad_input_changes_nothing(
    tmp_path: Path, keys: list[bytes], tokens: list[object], parent: bytes | None, match: str
) -> None:
    journal = tmp_path / "tokens.journal"
    book = TokenBook(4, journal=journal)
    book.record(K[5:6], [1, 2, 3, 4])
    size = journal.stat().st_size
    with pytest.raises(InvalidInputError, match=match):
        book.record(keys, tokens, parent)  # type: ignore[arg-type]
    assert book.keys() == [K[5]] and journal.stat().st_size == size
    book.close()


def test_the_journal_survives_a_restart_and_a_torn_last_record(tmp_path: Path) -> None:
    journal = tmp_path / "tokens.journal"
    with TokenBook(4, journal=journal) as book:
        book.record(K[:3], list(range(12)))
        book.forget([K[1]])
        book.record(K[4:5], [7, 7, 7, 7], parent=K[2])
    with TokenBook(4, journal=journal) as book:
        assert sorted(book.keys()) == sorted([K[0], K[2], K[4]])
        assert book.get(K[4]) == (K[2], [7, 7, 7, 7])
    whole = journal.stat().st_size
    with open(journal, "ab") as f:  # a crash in the middle of the next append
        f.write(b"+" + K[6] + b"\x00" * 9)
    with TokenBook(4, journal=journal) as book:
        assert sorted(book.keys()) == sorted([K[0], K[2], K[4]])
        assert journal.stat().st_size == whole  # the torn tail was cut off
        book.record(K[6:7], [1, 2, 3, 4])
    with TokenBook(4, journal=journal) as book:
        assert book.get(K[6]) == (None, [1, 2, 3, 4]) and len(book) == 4


def test_a_damaged_record_ends_the_journal_there(tmp_path: Path) -> None:
    journal = tmp_path / "tokens.journal"
    with TokenBook(4, journal=journal) as book:
        book.record(K[:1], [1, 2, 3, 4])
        first = journal.stat().st_size
        book.record(K[1:2], [5, 6, 7, 8])
    data = bytearray(journal.read_bytes())
    data[first + 40] ^= 0xFF  # a token of the second record: its CRC fails
    journal.write_bytes(bytes(data))
    with TokenBook(4, journal=journal) as book:
        assert book.keys() == [K[0]]


def test_the_journal_is_compacted_when_mostly_dead(tmp_path: Path) -> None:
    journal = tmp_path / "tokens.journal"
    with TokenBook(4, journal=journal) as book:
        for _ in range(700):
            book.record(K[:2], list(range(8)))
            book.forget(K[:2])
        book.record(K[:2], list(range(8)))
        assert book.journal_records() < 1100
    assert journal.stat().st_size < 1100 * 50
    with TokenBook(4, journal=journal) as book:
        assert sorted(book.keys()) == K[:2] and book.get(K[1]) == (K[0], [4, 5, 6, 7])
    assert not os.path.exists(str(journal) + ".compact")


def test_a_file_that_is_not_a_journal_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"something else entirely")
    with pytest.raises(ConfigError, match="not a kvstore token journal"):
        TokenBook(4, journal=other)
    with pytest.raises(ConfigError, match="token_journal"):
        TokenBook(4, journal=tmp_path / "missing-dir" / "j")
    with pytest.raises(InvalidInputError):
        TokenBook(0)
