"""The wire format: encoders round-trip, decoders refuse bad bytes with ProtocolError."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ProtocolError
from kvstore.testing.conformance import make_keys
from kvstore.wire.protocol import (
    FRAME,
    MAX_JSON_META,
    Flag,
    Frame,
    Op,
    SlotStatus,
    decode_commit_request,
    decode_count,
    decode_get_reply,
    decode_get_request,
    decode_hint_request,
    decode_json,
    decode_keys,
    decode_put_reply,
    decode_reserve_reply,
    decode_u64,
    encode_commit_request,
    encode_count,
    encode_get_reply,
    encode_get_request,
    encode_hint_request,
    encode_json,
    encode_keys,
    encode_put_reply,
    encode_reserve_reply,
    encode_u64,
)


def test_frame_round_trip() -> None:
    frame = Frame(Op.GET, Flag.SHM | Flag.REPLY, 0, 12345, 17, 2**40)
    data = frame.pack()
    assert len(data) == FRAME.size == 24
    assert Frame.unpack(data) == frame
    assert frame.is_reply


def test_frame_refuses_other_magic_and_versions() -> None:
    good = Frame(Op.PING, 0, 0, 1, 0, 0).pack()
    with pytest.raises(ProtocolError, match="magic"):
        Frame.unpack(b"XX" + good[2:])
    with pytest.raises(ProtocolError, match="version 9"):
        Frame.unpack(good[:2] + bytes([9]) + good[3:])


def test_keys_round_trip_and_limits() -> None:
    keys = make_keys(5)
    assert decode_keys(encode_keys(keys)) == keys
    assert decode_keys(encode_keys([])) == []
    with pytest.raises(ProtocolError, match="at most 4"):
        decode_keys(encode_keys(keys), max_keys=4)
    with pytest.raises(ProtocolError, match="need"):
        decode_keys(encode_keys(keys)[:-1])
    with pytest.raises(ProtocolError, match="truncated"):
        decode_keys(b"\x01")


def test_get_request_round_trip_and_layer_checks() -> None:
    keys = make_keys(3)
    assert decode_get_request(encode_get_request(keys, None), 4, 10) == (keys, None)
    assert decode_get_request(encode_get_request(keys, (1, 3)), 4, 10) == (keys, (1, 3))
    for bad in ((2, 2), (3, 1), (0, 5)):
        with pytest.raises(ProtocolError, match="layer range"):
            decode_get_request(encode_get_request(keys, bad), 4, 10)
    with pytest.raises(ProtocolError):
        decode_get_request(encode_get_request(keys, None), 4, 2)


def test_slot_replies_round_trip() -> None:
    slots = [(SlotStatus.SHM, 4096), (SlotStatus.MISS, 0), (SlotStatus.INLINE, 0)]
    assert decode_get_reply(encode_get_reply(7, slots), 3) == (7, slots)
    assert decode_reserve_reply(encode_reserve_reply(9, slots), 3) == (9, slots)
    with pytest.raises(ProtocolError):
        decode_get_reply(encode_get_reply(7, slots), 2)
    with pytest.raises(ProtocolError):
        decode_get_reply(encode_get_reply(7, slots)[:-1], 3)


def test_put_reply_and_commit_round_trip() -> None:
    statuses = [SlotStatus.STORED | SlotStatus.DURABLE, SlotStatus.CORRUPT, SlotStatus.PRESENT]
    assert decode_put_reply(encode_put_reply(statuses), 3) == statuses
    with pytest.raises(ProtocolError):
        decode_put_reply(encode_put_reply(statuses), 4)
    assert decode_commit_request(encode_commit_request(5, [True, False]), 8) == (5, [True, False])
    with pytest.raises(ProtocolError, match="0 or 1"):
        decode_commit_request(encode_commit_request(5, [True])[:-1] + b"\x02", 8)
    with pytest.raises(ProtocolError):
        decode_commit_request(encode_commit_request(5, [True] * 9), 8)


def test_hint_request_round_trip_and_checks() -> None:
    keys = make_keys(3)
    fields = {"retain_s": 60.0, "priority": 5, "prefetch": False, "demote": True, "session": "s"}
    assert decode_hint_request(encode_hint_request(fields, keys), 8) == (fields, keys)
    assert decode_hint_request(encode_hint_request(fields, []), 8) == (fields, [])
    assert decode_hint_request(encode_hint_request(fields, None), 8) == (fields, None)
    meta = encode_hint_request(fields, keys)
    with pytest.raises(ProtocolError, match="at most 2"):
        decode_hint_request(meta, 2)
    for bad in (b"", meta[:3], meta[:-1], encode_hint_request(fields, None) + b"x", b"\xff" * 8):
        with pytest.raises(ProtocolError):
            decode_hint_request(bad, 8)
    flag_at = len(encode_hint_request(fields, None)) - 1
    with pytest.raises(ProtocolError, match="keys flag"):
        decode_hint_request(meta[:flag_at] + b"\x02" + meta[flag_at + 1 :], 8)
    with pytest.raises(ProtocolError, match="JSON object"):
        decode_hint_request(b"\x02\x00\x00\x00[]\x00", 8)


def test_scalars_and_json() -> None:
    assert decode_u64(encode_u64(2**63)) == 2**63
    assert decode_count(encode_count(77)) == 77
    for bad in (b"", b"1234567", b"123456789"):
        with pytest.raises(ProtocolError):
            decode_u64(bad)
    assert decode_json(encode_json({"a": [1, "x"]})) == {"a": [1, "x"]}
    for bad in (b"[1]", b"{", b"\xff\xfe", b" " * (MAX_JSON_META + 1)):
        with pytest.raises(ProtocolError):
            decode_json(bad)


_DECODERS = [
    lambda b: decode_keys(b, 0, 64),
    lambda b: decode_get_request(b, 8, 64),
    lambda b: decode_get_reply(b, 3),
    lambda b: decode_reserve_reply(b, 2),
    lambda b: decode_put_reply(b, 3),
    lambda b: decode_commit_request(b, 64),
    lambda b: decode_hint_request(b, 64),
    decode_u64,
    decode_count,
    decode_json,
    Frame.unpack,
]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=256), which=st.integers(0, len(_DECODERS) - 1))
def test_decoders_only_ever_raise_protocol_error(data: bytes, which: int) -> None:
    """Whatever bytes come off the wire, a decoder returns or raises ProtocolError."""
    with contextlib.suppress(ProtocolError):
        _DECODERS[which](data)
