"""The wire fuzzer (kvharness.fuzz.run) against a live kvstore-server process: 10^4
frames built from the protocol's description and mutated; the server never crashes,
never answers what it must refuse, serves only the bytes stored, logs one line per
connection it cuts off, and keeps its memory. Also: the oracle's own rules."""

from __future__ import annotations

import random
import shutil
import tempfile

from kvharness.fuzz.cases import CASES
from kvharness.fuzz.model import SPECS, Header, Peer, Phase, Truth
from kvharness.fuzz.oracle import expect
from kvharness.fuzz.run import FuzzSettings, run_fuzz
from kvstore.testing.data import small_layout
from kvstore.wire.protocol import MAGIC, Flag, Op, Status, encode_get_request, encode_keys

LAYOUT = small_layout()
LIMITS = {"max_frame_bytes": 1024**2, "max_batch_blocks": 64}


def test_the_fuzzer_knows_every_op_of_the_protocol() -> None:
    assert set(SPECS) == set(Op)


def peer(phase: Phase) -> Peer:
    return Peer(Truth(LAYOUT), {"admin": (b"t" * 16, None)}, LIMITS, phase=phase)


def test_the_oracle_demands_refusals_the_protocol_demands() -> None:
    keys = encode_keys([b"k" * 16])
    early = expect(peer(Phase.NEW), Header(Op.EXISTS, meta_len=len(keys)), keys, b"")
    assert early.must_refuse and early.fatal and early.allowed == {Status.UNAUTHENTICATED}
    unopened = expect(peer(Phase.AUTHED), Header(Op.EXISTS, meta_len=len(keys)), keys, b"")
    assert unopened.allowed == {Status.NOT_OPEN} and unopened.fatal
    reply = expect(peer(Phase.OPEN), Header(Op.PING, flags=Flag.REPLY), b"", b"")
    assert reply.allowed == {Status.BAD_FRAME} and reply.fatal
    other = expect(peer(Phase.OPEN), Header(Op.PING, magic=MAGIC[::-1]), b"", b"")
    assert other.header_error and other.allowed == {Status.BAD_FRAME}
    unknown = expect(peer(Phase.OPEN), Header(200), b"", b"")
    assert unknown.allowed == {Status.UNKNOWN_OP} and not unknown.fatal
    bad_range = encode_get_request([b"k" * 16], (2, 1))
    get = expect(peer(Phase.OPEN), Header(Op.GET, meta_len=len(bad_range)), bad_range, b"")
    assert get.allowed == {Status.BAD_REQUEST} and not get.fatal
    ok = expect(peer(Phase.OPEN), Header(Op.EXISTS, meta_len=len(keys)), keys, b"", strict=True)
    assert ok.allowed == {Status.OK}


def test_the_oracle_refuses_bytes_other_than_those_stored() -> None:
    truth = Truth(LAYOUT)
    whole = random.Random(0).randbytes(LAYOUT.block_nbytes)
    truth.stored("fuzz", b"k" * 16, whole)
    step = LAYOUT.layer_nbytes
    assert truth.compare("fuzz", b"k" * 16, whole[step : 2 * step], (1, 2)) is None
    assert truth.compare("fuzz", b"k" * 16, whole[:step], (1, 2)) is not None
    assert truth.compare("team-a", b"k" * 16, whole, (0, LAYOUT.num_layers)) is not None


def test_ten_thousand_fuzzed_frames_against_a_live_server() -> None:
    work = tempfile.mkdtemp(prefix="kvs-fuzz-", dir="/tmp")  # a short Unix socket path
    try:
        report = run_fuzz(FuzzSettings(frames=10_000, seed=32, batch=2_500), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    problems = "\n".join(report.problems[:20])
    assert report.frames >= 10_000
    assert report.crashes == 0, problems
    assert report.wrong_answers == 0, problems
    assert report.refusals_missed == 0, problems
    assert report.internal_errors == 0, problems
    # one logged line for each connection the server cut off, none for the others
    assert report.log_lines_wrong == 0, problems
    assert report.bad_connections > 100 and report.log_lines == report.bad_connections
    assert set(CASES) <= set(report.mix), report.mix  # every kind of mutation ran
    assert len(report.rss_mib) >= 4
    assert report.rss_growth < 0.25, report.rss_mib  # loose: the server holds its memory
