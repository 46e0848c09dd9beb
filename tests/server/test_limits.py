"""Limits and hostile clients: oversized, malformed and slow frames, idle and excess
connections, corrupt blocks, abandoned loans and reservations, and fuzzed frames -- after
which the server still serves good clients and has changed nothing."""

from __future__ import annotations

import json
import logging
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.cli.kvserver import server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.config import StoreConfig
from kvstore.errors import TierError
from kvstore.format.codec import Codec, encode_block
from kvstore.server import ServerThread
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import random_blocks, small_layout
from kvstore.wire.protocol import (
    FRAME,
    MAGIC,
    VERSION,
    Flag,
    Frame,
    Op,
    SlotStatus,
    Status,
    decode_count,
    decode_get_reply,
    decode_put_reply,
    decode_reserve_reply,
    encode_commit_request,
    encode_get_request,
    encode_json,
    encode_keys,
    encode_u64,
)

Start = Callable[..., ServerThread]
LAYOUT = small_layout()
FRAMES = 19_000  # fuzzed well-framed requests (CI's share of issue 32's >= 10^4)
NOISE = 1_000  # connections sending only noise


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    kv = random_blocks(LAYOUT, n, seed)
    step = LAYOUT.block_tokens
    return [kv[:, :, i * step : (i + 1) * step].contiguous() for i in range(n)]


def wire(keys: list[bytes], data: list[torch.Tensor]) -> bytes:
    return b"".join(
        encode_block(k, LAYOUT, b, Codec.RAW).tobytes() for k, b in zip(keys, data, strict=True)
    )


def hosted_store(server: ServerThread) -> Any:
    return server.server.registry.hosted()[0].store


def test_oversized_frames_are_refused_and_closed(kv_server: Start, raw: Any) -> None:
    server = kv_server(max_frame_bytes="1MiB")
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    conn.send(Op.PUT, encode_keys(make_keys(1)), payload_len=2 * 1024**2)
    frame, meta, _ = conn.read()
    assert frame.status == Status.TOO_LARGE and b"max_frame_bytes" in meta
    assert conn.closed_by_server()
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    conn.send(Op.GET, b"", meta_len=10**8)  # a meta no request needs
    assert conn.read()[0].status == Status.TOO_LARGE
    assert conn.closed_by_server()


def test_frames_that_are_not_ours_close_the_connection(kv_server: Start, raw: Any) -> None:
    server = kv_server()
    conn = raw(server.address)
    conn.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert conn.read()[0].status == Status.BAD_FRAME
    assert conn.closed_by_server()
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    conn.send(Op.EXISTS, encode_keys(make_keys(1)), b"unexpected payload")
    assert conn.read()[0].status == Status.BAD_FRAME
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    conn.send(Op.PING, flags=Flag.REPLY)  # clients send requests
    assert conn.read()[0].status == Status.BAD_FRAME and conn.closed_by_server()


def test_another_protocol_version_is_named(kv_server: Start, raw: Any) -> None:
    server = kv_server()
    conn = raw(server.address)
    head = bytearray(Frame(Op.HELLO, 0, 0, 1, 0, 0).pack())
    head[2] = VERSION + 1
    conn.sock.sendall(bytes(head))
    assert conn.read()[0].status == Status.UNSUPPORTED_VERSION
    assert conn.closed_by_server()


def test_bad_fields_get_an_error_and_change_nothing(kv_server: Start, raw: Any) -> None:
    server = kv_server()
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    keys = make_keys(2)
    body = wire(keys, blocks(2, seed=1))
    frame, meta, _ = conn.call(Op.PUT, encode_keys(keys), body[:-1])  # one byte short
    assert frame.status == Status.BAD_REQUEST and b"payload bytes" in meta
    assert conn.call(Op.PING)[0].status == Status.OK  # the connection goes on
    assert conn.call(Op.GET, encode_get_request(keys, (2, 1)))[0].status == Status.BAD_REQUEST
    assert conn.call(Op.COMMIT, encode_commit_request(99, [True]))[0].status == Status.BAD_REQUEST
    frame, _, _ = conn.call(200)  # an op nobody knows
    assert frame.status == Status.UNKNOWN_OP
    assert conn.call(Op.OPEN, b"{}")[0].status == Status.BAD_REQUEST  # already open
    assert hosted_store(server).stored_keys() == []


def test_an_open_of_a_layout_past_u32_is_a_bad_request(kv_server: Start, raw: Any) -> None:
    """Found by the wire fuzzer: a layout field of 2**32 or more failed in the layout's
    fingerprint (a u32 each), answered INTERNAL with a traceback in the server's log."""
    server = kv_server()
    conn = raw(server.address)
    conn.handshake()
    for field, value in (("num_layers", 2**32), ("head_dim", 2**64)):
        desc = {**LAYOUT.describe(), field: value}
        body = {"namespace": "default", "layout": desc, "fingerprint": LAYOUT.fingerprint_hex}
        frame, meta, _ = conn.call(Op.OPEN, encode_json(body))
        assert frame.status == Status.BAD_REQUEST, meta
        assert f"{field} must be below 2**32".encode() in meta
    assert conn.call(Op.PING)[0].status == Status.OK  # the connection goes on


def test_a_long_error_message_is_cut_at_a_character(kv_server: Start, raw: Any) -> None:
    """Found by the wire fuzzer: an error message over 4 KiB (here naming a long non-ASCII
    namespace) was cut at byte 4096, in the middle of a character: not UTF-8."""
    server = kv_server()
    conn = raw(server.address)
    conn.handshake()
    for name in ("x" + "ü" * 3000, "ü" * 3000):  # the cut falls inside a character in one
        body = {"namespace": name, "layout": LAYOUT.describe(), "fingerprint": "0" * 16}
        frame, meta, _ = conn.call(Op.OPEN, json.dumps(body, ensure_ascii=False).encode())
        assert frame.status == Status.BAD_REQUEST and 4000 < len(meta) <= 4096
        assert meta.decode("utf-8").startswith("namespace")


def _closed_lines(caplog: pytest.LogCaptureFixture) -> dict[int, int]:
    """Per client port, the server's "closed connection from 127.0.0.1:PORT" lines."""
    lines: dict[int, int] = {}
    for record in caplog.records:
        message = record.getMessage()
        if message.startswith("closed connection from 127.0.0.1:"):
            port = int(message.split(":")[1].split()[0])
            lines[port] = lines.get(port, 0) + 1
    return lines


def test_each_connection_cut_off_is_one_log_line(
    kv_server: Start, raw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the wire fuzzer: bad frames, truncated frames and slow clients were cut off
    without a word in the log (a failed token got a line of its own). Now every
    connection the server cuts off gets exactly one line naming the client and why; one
    that ends between frames gets none."""
    caplog.set_level(logging.INFO, logger="kvstore.server")
    token = "fuzz-token-0123456789abcdef"
    server = kv_server(token=token, io_timeout_s=0.3)
    good = raw(server.address)  # ends between frames: no line
    good.handshake(LAYOUT, token=token.encode())
    assert good.call(Op.PING)[0].status == Status.OK
    port = good.sock.getsockname()[1]
    good.close()
    bad = []
    noise = raw(server.address)
    noise.sock.sendall(b"XX" + bytes(22))  # not a frame of this protocol
    wrong = raw(server.address)
    wrong.handshake()
    wrong.send(Op.AUTH, bytes(32))  # a wrong answer to the challenge
    slow = raw(server.address)
    slow.sock.sendall(Frame(Op.HELLO, 0, 0, 1, 0, 0).pack()[:5])  # and nothing more
    cut = raw(server.address)
    cut.sock.sendall(Frame(Op.HELLO, 0, 0, 1, 40, 0).pack() + b"{")
    cut.sock.shutdown(socket.SHUT_WR)  # leaves mid-frame
    for conn in (noise, wrong, slow, cut):
        assert conn.closed_by_server()
        bad.append(conn.sock.getsockname()[1])
    for _ in range(500):  # the server logs as each one closes: wait for the lines
        if len(_closed_lines(caplog)) >= len(bad):
            break
        time.sleep(0.02)
    lines = _closed_lines(caplog)
    assert lines == {p: 1 for p in bad}, caplog.text
    assert port not in lines
    text = caplog.text
    assert "BAD_FRAME" in text and "UNAUTHENTICATED" in text and "too slow" in text
    assert "mid-frame" in text
    assert text.count("authentication failed") == 1  # no second line of its own


def test_corrupt_blocks_in_a_put_are_dropped_alone(kv_server: Start, raw: Any) -> None:
    server = kv_server()
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    keys, data = make_keys(3), blocks(3, seed=2)
    body = bytearray(wire(keys, data))
    each = len(body) // 3
    body[each + each - 5] ^= 0xFF  # a payload byte of block 1: its layer checksum fails
    wrong_key = wire([keys[0]], data[:1])  # block 2's bytes claim to be block 0
    body[2 * each :] = wrong_key
    frame, meta, _ = conn.call(Op.PUT, encode_keys(keys), bytes(body))
    assert frame.status == Status.OK
    assert decode_put_reply(meta, 3) == [SlotStatus.STORED, SlotStatus.CORRUPT, SlotStatus.CORRUPT]
    store = hosted_store(server)
    assert [store.engine.datapath.contains(k) for k in keys] == [True, False, False]
    assert server.stats()["blocks_corrupt_received"] == 2
    assert store.engine.datapath.pinned_blocks() == 0


def test_abandoned_reservations_and_loans_end_with_the_connection(
    kv_server: Start, raw: Any
) -> None:
    server = kv_server()
    with Client(LAYOUT, ClientOptions(server.address)) as c:
        assert all(c.put(make_keys(2), blocks(2, seed=3)))
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    frame, meta, _ = conn.call(Op.RESERVE, encode_keys(make_keys(3, salt=1)))
    assert frame.status == Status.OK
    assert decode_reserve_reply(meta, 3)[1][0][0] == SlotStatus.SHM
    frame, meta, _payload = conn.call(
        Op.GET, encode_get_request(make_keys(2), None), flags=Flag.SHM
    )
    lease, slots = decode_get_reply(meta, 2)
    assert lease and all(s == SlotStatus.SHM for s, _ in slots)
    store = hosted_store(server)
    assert store.engine.datapath.pinned_blocks() == 5  # 3 being written, 2 lent
    conn.close()  # a client that dies without COMMIT or RELEASE
    deadline = time.monotonic() + 5
    while store.engine.datapath.pinned_blocks() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.engine.datapath.pinned_blocks() == 0
    assert store.engine.datapath.contains(make_keys(3, salt=1)[0]) is False


def test_a_reservation_never_committed_is_aborted_at_the_next_reserve(
    kv_server: Start, raw: Any
) -> None:
    """A client that reserves and never commits, but goes on working, pinned the slots
    until it disconnected; after ``io_timeout_s`` its next RESERVE aborts them."""
    server = kv_server(io_timeout_s=0.3)
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    frame, meta, _ = conn.call(Op.RESERVE, encode_keys(make_keys(3, salt=2)))
    abandoned, _slots = decode_reserve_reply(meta, 3)
    store = hosted_store(server)
    assert frame.status == Status.OK and store.engine.datapath.pinned_blocks() == 3
    time.sleep(0.5)
    frame, meta, _ = conn.call(Op.RESERVE, encode_keys(make_keys(1, salt=3)))
    assert frame.status == Status.OK
    assert store.engine.datapath.pinned_blocks() == 1  # the new one only
    assert server.stats()["reservations_expired"] == 1
    commit = encode_commit_request(abandoned, [True, True, True])
    frame, meta, _ = conn.call(Op.COMMIT, commit)
    assert frame.status != Status.OK and b"io_timeout_s" in meta
    assert not any(store.engine.datapath.contains(k) for k in make_keys(3, salt=2))


_FROZEN_WRITER = """
import sys, threading
import kvstore.client.sync as client_sync
from kvstore.client import Client, ClientOptions
from kvstore.testing.conformance import make_keys
from kvstore.testing.data import block_list, small_layout

layout = small_layout()
client = Client(layout, ClientOptions(sys.argv[1], shared_memory=True, timeout=30))
assert client.put(make_keys(1, salt=40), block_list(layout, 1, seed=40)) == [True]
assert client.shared_memory

class Frozen:  # the copy into the reserved slots never ends
    def copy_all(self, pairs):
        print("reserved", flush=True)
        threading.Event().wait()

client_sync.engine_for = lambda device: Frozen()
client.put(make_keys(3, salt=41), block_list(layout, 3, seed=41))
"""


def test_the_held_slots_of_a_killed_writer_go_back_at_once(kv_server: Start) -> None:
    """A client killed mid-copy: its connection ends, and its process is gone (its pid
    from OPEN), so its reservation's slots go back without waiting for
    ``reservation_hold_s``."""
    server = kv_server(reservation_hold_s=3600)
    proc = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_WRITER, server.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reserved"
        store = hosted_store(server)
        assert store.engine.datapath.pinned_blocks() == 3
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while store.engine.datapath.pinned_blocks() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.engine.datapath.pinned_blocks() == 0
        assert server.stats().get("reservations_held", 0) == 0
        assert not any(store.engine.datapath.contains(k) for k in make_keys(3, salt=41))
    finally:
        proc.kill()
        proc.wait()


def test_a_delete_of_blocks_its_own_connection_holds_is_refused_at_once(
    kv_server: Start, raw: Any
) -> None:
    """Found by the wire fuzzer: a DELETE waits for the blocks' readers. A client that
    GETs through shared memory and deletes before its RELEASE is that reader, and waits
    for the DELETE's answer: nothing came until the lease expired (30 s), a worker thread
    held all along (a few such clients stalled every store call of the server)."""
    server = kv_server()
    keys = make_keys(2)
    with Client(LAYOUT, ClientOptions(server.address)) as c:
        assert all(c.put(keys, blocks(2, seed=5)))
    conn = raw(server.address, timeout=5)  # far less than the lease
    conn.handshake(LAYOUT)
    _, meta, _ = conn.call(Op.GET, encode_get_request(keys[:1], None), flags=Flag.SHM)
    lease, slots = decode_get_reply(meta, 1)
    assert lease and slots[0][0] == SlotStatus.SHM
    frame, meta, _ = conn.call(Op.DELETE, encode_keys(keys))
    assert frame.status == Status.BUSY and b"RELEASE it first" in meta
    assert hosted_store(server).engine.datapath.contains(keys[1])  # refused whole: nothing deleted
    conn.send(Op.RELEASE, encode_u64(lease), flags=Flag.NO_REPLY)
    frame, meta, _ = conn.call(Op.DELETE, encode_keys(keys))
    assert frame.status == Status.OK and decode_count(meta) == 2


def test_slow_and_idle_clients_are_cut_off_without_stalling_others(
    kv_server: Start, raw: Any
) -> None:
    server = kv_server(io_timeout_s=0.5, idle_timeout_s=0.5, min_rate="1MiB")
    slow = raw(server.address, timeout=10)
    idle = raw(server.address, timeout=10)
    idle.handshake()
    head = Frame(Op.HELLO, 0, 0, 1, 2, 0).pack() + b"{}"
    stop = threading.Event()
    pings: list[float] = []

    def good_client() -> None:
        with Client(LAYOUT, ClientOptions(server.address)) as c:
            while not stop.is_set():
                start = time.perf_counter()
                c.ping()
                pings.append(time.perf_counter() - start)
                time.sleep(0.01)

    worker = threading.Thread(target=good_client)
    worker.start()
    start = time.monotonic()
    try:
        for byte in head:  # slow-loris: a byte every 0.2 s
            slow.sock.sendall(bytes([byte]))
            time.sleep(0.2)
    except OSError:
        pass
    assert slow.closed_by_server()
    assert time.monotonic() - start < 3
    assert idle.closed_by_server()
    stop.set()
    worker.join()
    assert pings and max(pings) < 0.5  # nobody else waited on the slow client


def test_a_slow_payload_is_cut_off(kv_server: Start, raw: Any) -> None:
    server = kv_server(io_timeout_s=0.3, min_rate="1MiB")
    conn = raw(server.address, timeout=10)
    conn.handshake(LAYOUT)
    keys = make_keys(64)
    conn.send(Op.PUT, encode_keys(keys), payload_len=64 * len(wire(keys[:1], blocks(1, 4))))
    start = time.monotonic()
    try:
        while time.monotonic() - start < 5:
            conn.sock.sendall(b"\0" * 100)  # 1 KB/s: far below min_rate
            time.sleep(0.1)
    except OSError:
        pass
    assert conn.closed_by_server()
    assert time.monotonic() - start < 3
    assert hosted_store(server).engine.datapath.pinned_blocks() == 0  # the reservation was undone


def test_connections_beyond_the_limit_are_refused(kv_server: Start, raw: Any) -> None:
    server = kv_server(max_connections=2)
    first, second = raw(server.address), raw(server.address)
    first.handshake()
    second.handshake()
    third = raw(server.address)
    assert third.closed_by_server(timeout=2)
    assert server.stats()["connections_refused"] >= 1


def test_pipelined_requests_beyond_the_inflight_limit_are_all_answered(
    kv_server: Start, raw: Any
) -> None:
    server = kv_server(max_inflight_requests=2)
    conn = raw(server.address)
    conn.handshake(LAYOUT)
    for _ in range(20):
        conn.send(Op.GET, encode_get_request(make_keys(4), None))
    replies = [conn.read() for _ in range(20)]
    assert sorted(f.request_id for f, _, _ in replies) == list(range(3, 23))
    assert all(f.status == Status.OK for f, _, _ in replies)


# -- fuzzing -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    work = tmp_path_factory.mktemp("fuzz")
    sock_dir = __import__("tempfile").mkdtemp(prefix="kvs-", dir="/tmp")
    config = server_test_config(work, None, unix_socket=f"{sock_dir}/s.sock", io_timeout_s=2.0)
    with ServerThread(StoreConfig.from_dict(config, environ={})) as server:
        with Client(LAYOUT, ClientOptions(server.address)) as c:
            assert all(c.put(make_keys(8, salt=42), blocks(8, seed=42)))
        yield server


def _good_client_still_served(server: ServerThread) -> None:
    with Client(LAYOUT, ClientOptions(server.address, shared_memory=False)) as c:
        outs = [torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype) for _ in range(8)]
        assert c.get(make_keys(8, salt=42), outs) == [True] * 8
        assert all(torch.equal(o, b) for o, b in zip(outs, blocks(8, seed=42), strict=True))


def _random_frame(rng: random.Random, rid: int) -> bytes:
    """A well-framed request with random fields (op, flags, meta, payload)."""
    op = rng.choice([*list(Op), rng.randint(0, 255)])
    meta = rng.randbytes(rng.choice([0, 1, 4, 8, 12, 20, 36, rng.randint(0, 200)]))
    if rng.random() < 0.3:  # a key list that decodes
        meta = struct.pack("<I", 2) + rng.randbytes(32)
    payload = rng.randbytes(rng.randint(0, 64)) if op in (Op.PUT, Op.COMMIT) else b""
    flags = rng.choice([0, 0, 0, Flag.SHM, Flag.NO_REPLY, Flag.DURABLE])
    if rng.random() < 0.02:
        flags = rng.randint(0, 65535)
    head = struct.pack(
        "<2sBBHHIIQ", MAGIC, VERSION, int(op), flags, 0, rid, len(meta), len(payload)
    )
    return head + meta + payload


def _until_pong(conn: Any, rid: int) -> bool:
    """Read replies until PING ``rid`` answers; False if the server hung up."""
    try:
        while True:
            frame, _, _ = conn.read()
            if frame.op == Op.PING and frame.request_id == rid:
                return True
    except (ConnectionError, OSError):
        return False


@pytest.mark.timeout(600)
def test_fuzzed_frames_change_nothing(fuzz_server: ServerThread, raw: Any) -> None:
    """2 x 10^4 random byte strings -- 19,000 well-framed requests with random fields,
    each answered before the next, and 1,000 strings of noise: the server answers or
    hangs up, and serves good clients the same bytes afterwards. (The 10^5-frame form is
    ``benchmarks/bench_fuzz.py``, whose runs are in docs/benchmarks/.)"""
    rng = random.Random(1234)
    address = fuzz_server.address
    conn, hangups = None, 0
    for rid in range(1, FRAMES + 1):
        if conn is None:
            conn = raw(address, timeout=5)
            conn.handshake(LAYOUT)
        pong = 0xFFFF0000 + rid % 0xFFFF
        ping = Frame(Op.PING, 0, 0, pong, 0, 0).pack()
        try:
            conn.sock.sendall(_random_frame(rng, rid) + ping)
        except OSError:
            conn = None
            continue
        if not _until_pong(conn, pong):
            conn.close()
            conn, hangups = None, hangups + 1
    for _ in range(NOISE):
        noise = raw(address, timeout=5)
        noise.handshake(LAYOUT)
        noise.sock.sendall(rng.randbytes(rng.randint(1, 64)))
        noise.close()
    _good_client_still_served(fuzz_server)
    store = fuzz_server.server.registry.hosted()[0].store
    assert sorted(store.stored_keys()) == sorted(make_keys(8, salt=42))
    served = sum(fuzz_server.stats()["requests"].values())
    assert served >= 2 * FRAMES - 2 * hangups  # every frame reached a handler or a refusal
    assert hangups > 100  # and many were refused hard enough to close the connection


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    op=st.integers(0, 255),
    flags=st.integers(0, 65535),
    meta=st.binary(max_size=300),
    payload=st.binary(max_size=300),
)
def test_hypothesis_frames(
    fuzz_server: ServerThread, raw: Any, op: int, flags: int, meta: bytes, payload: bytes
) -> None:
    conn = raw(fuzz_server.address, timeout=5)
    conn.handshake(LAYOUT)
    head = struct.pack("<2sBBHHIIQ", MAGIC, VERSION, op, flags, 0, 7, len(meta), len(payload))
    conn.sock.sendall(head + meta + payload)
    conn.sock.settimeout(0.2)
    try:
        data = conn.sock.recv(FRAME.size)
        if len(data) == FRAME.size:
            reply = Frame.unpack(data)
            assert reply.is_reply and reply.request_id in (0, 7)
    except (TimeoutError, OSError):
        pass
    conn.close()
    _good_client_still_served(fuzz_server)


def test_server_down_is_a_bounded_tier_error(kv_server: Start) -> None:
    server = kv_server()
    address = server.address
    server.stop()
    with Client(LAYOUT, ClientOptions(address, connect_timeout=0.5, timeout=1.0)) as c:
        start = time.monotonic()
        with pytest.raises(TierError, match="cannot connect"):
            c.ping()
        with pytest.raises(TierError, match="unavailable"):  # the breaker: no wait at all
            c.ping()
        assert time.monotonic() - start < 2
