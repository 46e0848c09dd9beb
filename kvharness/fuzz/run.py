"""A wire fuzzer for kvstore-server: frames built from the protocol's own description,
mutated, sent to a live server process, every answer judged.

>>> report = run_fuzz(FuzzSettings(frames=10_000, seed=1), workdir)
>>> report.failed      # crashes, wrong answers, missed refusals, log lines out of place

It starts a real ``kvstore-server`` (:class:`~kvstore.cli.kvserver.KVStoreServerProcess`,
with an admin token and a restricted one), stores reference blocks through the real client
(:class:`~kvstore.client.Client`), then opens connection after connection
(:mod:`kvharness.fuzz.cases`): well-behaved ones, mutated fields, bad headers,
frames out of the handshake's order, missing, wrong and replayed tokens, truncated
frames, lying lengths, noise, and -- beside them, on threads -- slow and idle
connections. Every answer is judged by :mod:`kvharness.fuzz.oracle`: a success
the protocol forbids is a *missed refusal*; any other answer it does not allow (another
status, a malformed reply, bytes other than those stored, a connection kept open after a
fatal refusal or closed when it should stay) is a *wrong answer*. After each batch the
server must still be alive and serve the reference blocks byte for byte (else a
*crash*), and its RSS is sampled. At the end the server's log must hold exactly one
``closed connection from`` line for each connection the server had to cut off, and none
for the others.
"""

from __future__ import annotations

import collections
import contextlib
import random
import re
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvharness.fuzz.cases import CASES, HOME, OTHER, Cases, Pool, Step
from kvharness.fuzz.model import Expect, Header, Peer, Phase, Truth
from kvharness.fuzz.oracle import expect
from kvstore.cli import HOST, KVStoreServerProcess, server_test_config
from kvstore.client import Client, ClientOptions
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from kvstore.testing import small_layout
from kvstore.wire import FRAME, MAGIC, VERSION, Flag, Op, Status

__all__ = ["FuzzReport", "FuzzSettings", "fuzz_server_config", "run_fuzz"]

_LOG_LINE = re.compile(r"closed connection from 127\.0\.0\.1:(\d+): ")
_SENTINEL = 0xFFFF0000
_MAX_REPLY = 64 * 1024**2


@dataclass(frozen=True)
class FuzzSettings:
    """One fuzz run."""

    frames: int = 10_000
    seed: int = 0
    batch: int = 2_000  # frames between liveness checks and RSS samples
    warmup: float = 0.2  # the share of frames before RSS samples count
    slow_share: float = 0.02  # connections that also start a slow or idle one beside
    io_timeout_s: float = 0.5
    idle_timeout_s: float = 2.0
    # dropped reservations of live fuzz connections: held this long (not 600 s, which
    # would fill the 4 MiB host tier with slots nobody writes)
    reservation_hold_s: float = 2.0
    reply_timeout_s: float = 10.0


@dataclass
class FuzzReport:
    """What a run found (``failed``: anything the protocol does not allow)."""

    frames: int = 0
    crashes: int = 0
    wrong_answers: int = 0
    refusals_missed: int = 0
    rss_growth: float = 0.0
    connections: int = 0
    bad_connections: int = 0
    log_lines: int = 0
    log_lines_wrong: int = 0
    internal_errors: int = 0
    seconds: float = 0.0
    frames_per_s: float = 0.0
    rss_mib: list[float] = field(default_factory=list)
    mix: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seed: int = 0

    @property
    def failed(self) -> bool:
        """True if the server did anything the protocol does not allow."""
        return bool(
            self.crashes or self.wrong_answers or self.refusals_missed or self.log_lines_wrong
        )

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (problems: the first 20)."""
        out = asdict(self)
        out["problems"] = self.problems[:20]
        return out


def fuzz_server_config(
    workdir: str | Path, tokens: dict[str, bytes], settings: FuzzSettings
) -> dict[str, Any]:
    """The fuzzed server's config: small tiers and limits, short timeouts, two tokens."""
    # the host tier is a prefaulted memfd per store: small, and few stores (the admin's,
    # the restricted token's, one a mutated OPEN may open), so RSS shows leaks, not stores
    tiers = [{"kind": "host", "capacity": "4MiB"}, {"kind": "disk", "capacity": "64MiB"}]
    return server_test_config(
        workdir,
        tiers,
        token=tokens["admin"].decode(),
        tokens=[{"name": "team", "token": tokens["team"].decode(), "namespaces": [OTHER]}],
        io_timeout_s=settings.io_timeout_s,
        idle_timeout_s=settings.idle_timeout_s,
        reservation_hold_s=settings.reservation_hold_s,
        min_rate="1MiB",
        max_frame_bytes="1MiB",
        max_batch_blocks=64,
        max_inflight_requests=4,
        max_stores=3,
        max_connections=64,
        threads=2,
    )


class _Wire:
    """One TCP connection to the server."""

    def __init__(self, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = int(self.sock.getsockname()[1])

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            return False

    def _exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionError:
                chunk = b""
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def read(self) -> tuple[Header, bytes, bytes] | str | None:
        """The next reply; None at the end of the stream; a string: what is malformed.
        TimeoutError when nothing comes."""
        raw = self._exact(FRAME.size)
        if raw is None:
            return None
        magic, version, op, flags, status, rid, meta_len, payload_len = FRAME.unpack(raw)
        if magic != MAGIC or version != VERSION or not flags & Flag.REPLY:
            return f"a reply that is not a reply frame: {raw.hex()}"
        if meta_len > _MAX_REPLY or payload_len > _MAX_REPLY:
            return f"a reply of {meta_len} + {payload_len} bytes"
        meta = self._exact(meta_len) if meta_len else b""
        payload = self._exact(payload_len) if payload_len else b""
        if meta is None or payload is None:
            return "a reply cut short"
        return Header(op, flags, meta_len, payload_len, rid, status), meta, payload

    def closed(self, timeout: float) -> bool:
        """True once the server closes (anything it sends first is ignored)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):  # what it sends before closing is read and dropped
                continue
            return True
        except TimeoutError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Run:
    """The state of one run: the server, the model of what it stores, the counts."""

    def __init__(
        self, settings: FuzzSettings, server: KVStoreServerProcess, layout: KVLayout
    ) -> None:
        self.settings = settings
        self.server = server
        self.rng = random.Random(settings.seed)
        self.layout = layout
        self.tokens = _tokens(settings.seed)
        self.secrets: dict[str, tuple[bytes, frozenset[str] | None]] = {
            "admin": (self.tokens["admin"], None),
            "team": (self.tokens["team"], frozenset({OTHER})),
        }
        self.limits = {"max_frame_bytes": 1024**2, "max_batch_blocks": 64}
        self.truth = Truth(layout)
        self.pool = Pool(layout, settings.seed)
        self.cases = Cases(self.rng, self.pool, self.tokens)
        self.report = FuzzReport(seed=settings.seed)
        self.mix: collections.Counter[str] = collections.Counter()
        self.expected: collections.Counter[int] = collections.Counter()  # port -> lines owed
        self.uncertain: collections.Counter[int] = collections.Counter()  # port -> lines allowed

    # -- judging ------------------------------------------------------------------
    def wrong(self, why: str, missed: bool = False) -> None:
        if missed:
            self.report.refusals_missed += 1
        else:
            self.report.wrong_answers += 1
        if len(self.report.problems) < 200:
            self.report.problems.append(why)

    def peer(self) -> Peer:
        return Peer(self.truth, self.secrets, self.limits)

    def end(self, port: int, how: str) -> None:
        """Note how a connection ended: "bad" (the server owes a log line), "clean"
        (none), "unsure" (one or none)."""
        self.report.connections += 1
        if how == "bad":
            self.report.bad_connections += 1
            self.expected[port] += 1
        elif how == "unsure":
            self.uncertain[port] += 1

    def case(self, kind: str) -> None:
        """One connection of ``kind``."""
        wire = _Wire(self.server.port, self.settings.reply_timeout_s)
        peer = self.peer()
        how = "clean"
        try:
            how = self.drive(wire, peer, CASES[kind][0](self.cases, peer))
        finally:
            wire.close()
            if peer.mapping is not None:
                peer.mapping.close()
            self.end(wire.port, how)

    def drive(self, wire: _Wire, peer: Peer, steps: Any) -> str:
        """Send each step, judge each answer; how the connection ended."""
        for rid, step in enumerate(steps, 1):
            self.report.frames += 1
            self.mix[step.label] += 1
            if step.head is None:
                return self.desync(wire, peer, step)
            head = replace(step.head, request_id=rid)
            judged = expect(peer, head, step.meta, step.payload, step.strict)
            if not wire.send(head.pack() + step.meta + step.payload):
                self.wrong(f"the server hung up before {_name(head.op)} was sent")
                return "unsure"
            how = self.answer(wire, peer, head, judged)
            if how:
                return how
        return "clean"

    def answer(self, wire: _Wire, peer: Peer, head: Header, judged: Expect) -> str:
        """Read and judge the answer to ``head``; "" to go on, else how the connection ended."""
        quiet = (not judged.answered or head.flags & Flag.NO_REPLY) and not judged.must_refuse
        if quiet:  # a success sends nothing: a PING behind it shows where the answers end
            wire.send(Header(Op.PING, request_id=_SENTINEL).pack())
        try:
            got = wire.read()
        except TimeoutError:
            self.wrong(f"no answer to {_name(head.op)} in {self.settings.reply_timeout_s:g}s")
            return "unsure"
        if got is None:
            self.wrong(f"the server closed the connection instead of answering {_name(head.op)}")
            return "unsure"
        if isinstance(got, str):
            self.wrong(got)
            return "unsure"
        reply, meta, payload = got
        if quiet and reply.request_id == _SENTINEL and reply.op == Op.PING and not reply.status:
            return ""
        how = self.judge(wire, head, judged, (reply, meta, payload))
        if quiet and not how:  # the request was answered (an error): the PING's answer follows
            return self.answer(wire, peer, Header(Op.PING, request_id=_SENTINEL), _PONG)
        return how

    def judge(
        self, wire: _Wire, head: Header, judged: Expect, got: tuple[Header, bytes, bytes]
    ) -> str:
        reply, meta, payload = got
        want = (0, 0) if judged.header_error else (head.request_id, head.op)
        what = f"{_name(head.op)} (flags {head.flags:#x}, {head.meta_len}+{head.payload_len} bytes)"
        if (reply.request_id, reply.op) != want:
            self.wrong(f"answer to {what} names request {reply.request_id} op {reply.op}")
            return "unsure"
        if reply.status not in judged.allowed:
            if reply.status == Status.INTERNAL:
                self.report.internal_errors += 1
            self.wrong(
                f"{what} answered {_status(reply.status)}: {meta[:300]!r}; the protocol allows "
                f"{sorted(_status(s) for s in judged.allowed)}",
                missed=reply.status == Status.OK,
            )
            return "unsure"
        if reply.status == Status.OK:
            problem = None
            if judged.check is not None:
                try:
                    problem = judged.check(meta, payload)
                except (KVStoreError, ValueError, KeyError, TypeError) as exc:
                    problem = f"unreadable answer: {exc}"
            if problem:
                self.wrong(f"{what}: {problem}")
                return "unsure"
            return ""
        try:
            meta.decode("utf-8")
        except UnicodeDecodeError:
            self.wrong(f"{what}: its error message is not UTF-8: {meta[-40:]!r}")
        if not judged.fatal:
            return ""
        if not wire.closed(self.settings.reply_timeout_s):
            self.wrong(f"the connection stayed open after {_status(reply.status)} to {what}")
            return "unsure"
        return "bad"

    def desync(self, wire: _Wire, peer: Peer, step: Step) -> str:
        """Send bytes that leave the stream mid-frame; the server must close without
        answering anything the connection's state does not allow."""
        wire.send(step.raw)
        if not step.shut:
            return "bad"
        with contextlib.suppress(OSError):
            wire.sock.shutdown(socket.SHUT_WR)
        while True:
            try:
                got = wire.read()
            except TimeoutError:
                self.wrong(f"a connection ended mid-frame ({step.label}) was not closed")
                return "unsure"
            if got is None:
                return "bad"
            if isinstance(got, str):
                self.wrong(got)
                return "unsure"
            reply = got[0]
            allowed = _ALLOWED_AFTER[peer.phase]
            if reply.status == Status.OK and allowed is not None and reply.op not in allowed:
                self.wrong(
                    f"{_name(reply.op)} succeeded on a connection in {peer.phase.name}", True
                )
            if reply.status == Status.OK and reply.op == Op.GET:
                self.wrong("a GET of a stream out of step was answered OK; its bytes are unchecked")

    # -- slow and idle connections (on threads) -------------------------------------
    def slow(self, kind: str, seed: int) -> tuple[int, str, list[str]]:
        """A slow-loris frame or an idle connection: (port, how it ended, problems)."""
        rng = random.Random(seed)
        pause = self.settings.io_timeout_s / 3
        wire = _Wire(self.server.port, self.settings.reply_timeout_s)
        problems: list[str] = []
        try:
            if kind == "idle":  # sends nothing: closed after idle_timeout_s, no log line
                ok = wire.closed(self.settings.idle_timeout_s + 5)
                return wire.port, "clean", [] if ok else ["an idle connection was never closed"]
            frame = Header(Op.HELLO, meta_len=40).pack() + rng.randbytes(40)
            for i in range(len(frame)):
                if not wire.send(frame[i : i + 1]):
                    break
                time.sleep(pause)
            if not wire.closed(self.settings.reply_timeout_s):
                problems.append("a slow frame's connection was never closed")
            return wire.port, "bad", problems
        finally:
            wire.close()

    # -- liveness and memory --------------------------------------------------------
    def store_reference(self) -> None:
        options = ClientOptions(
            self.server.address, namespace=HOME, token=self.tokens["admin"], shared_memory=False
        )
        with Client(self.layout, options) as client:
            keys = [k for k in self.pool.reference]
            blocks = [self.pool.blocks[self.pool.content(k)] for k in keys]
            if not all(client.put(keys, blocks)):  # type: ignore[arg-type]
                raise KVStoreError("the fuzzed server did not store the reference blocks")
        for key in keys:
            self.truth.stored(HOME, key, self.pool.data[self.pool.content(key)])

    def alive(self) -> bool:
        """The server runs and serves the reference blocks, byte for byte."""
        if not self.server.running:
            self.report.crashes += 1
            self.report.problems.append(f"the server died:\n{self.server.log_tail(2000)}")
            return False
        options = ClientOptions(
            self.server.address,
            namespace=HOME,
            token=self.tokens["admin"],
            shared_memory=False,
            timeout=10.0,
        )
        keys = self.pool.reference
        outs = [torch.empty(self.layout.block_shape, dtype=self.layout.dtype) for _ in keys]
        try:
            with Client(self.layout, options) as client:
                found = client.get(keys, outs)  # type: ignore[arg-type]
        except KVStoreError as exc:
            self.report.crashes += 1
            self.report.problems.append(f"the server stopped answering a valid client: {exc}")
            return False
        for key, ok, out in zip(keys, found, outs, strict=True):
            data = out.view(torch.uint8).numpy().tobytes()
            if not ok or data != self.pool.data[self.pool.content(key)]:
                self.wrong(f"reference block {key.hex()} no longer served as stored")
        return True

    def rss_mib(self) -> float:
        pid = self.server.pid
        if pid is None:
            return 0.0
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    # -- the log ----------------------------------------------------------------------
    def check_log(self) -> None:
        """One ``closed connection`` line per connection the server cut off, none else."""
        text = self.server.log_path.read_text(errors="replace")
        lines = collections.Counter(int(m.group(1)) for m in _LOG_LINE.finditer(text))
        self.report.log_lines = sum(lines.values())
        self.report.internal_errors += text.count("Traceback")
        for port in set(lines) | set(self.expected):
            low = self.expected[port]
            if not low <= lines[port] <= low + self.uncertain[port]:
                self.report.log_lines_wrong += 1
                if len(self.report.problems) < 200:
                    self.report.problems.append(
                        f"port {port}: {lines[port]} 'closed connection' lines, {low} owed"
                    )


_PONG = Expect(frozenset({Status.OK}))
_ALLOWED_AFTER: dict[Phase, frozenset[int] | None] = {
    Phase.NEW: frozenset({Op.HELLO}),
    Phase.GREETED: frozenset({Op.PING}),
    Phase.AUTHED: frozenset({Op.PING, Op.OPEN, Op.STATS, Op.ADMIN}),
    Phase.OPEN: None,
}


_OPS = {int(op): op.name for op in Op}
_STATUSES = {int(status): status.name for status in Status}


def _name(op: int) -> str:
    return _OPS.get(op, f"op {op}")


def _status(status: int) -> str:
    return _STATUSES.get(status, f"status {status}")


def _tokens(seed: int) -> dict[str, bytes]:
    """The run's two tokens: "admin" opens every namespace, "team" only OTHER."""
    return {"admin": b"fuzz-admin-token-%08x" % seed, "team": b"fuzz-team-token-%08x" % seed}


def run_fuzz(settings: FuzzSettings, workdir: str | Path) -> FuzzReport:
    """Fuzz a fresh ``kvstore-server`` in ``workdir`` with ``settings.frames`` frames."""
    layout = small_layout()
    config = fuzz_server_config(workdir, _tokens(settings.seed), settings)
    with KVStoreServerProcess(config, Path(workdir) / "server") as server:
        run = _Run(settings, server, layout)
        run.store_reference()
        _loop(run)
        server.stop()
    run.check_log()
    report = run.report
    report.mix = dict(run.mix)
    return report


def _loop(run: _Run) -> None:
    settings, rng = run.settings, run.rng
    kinds = list(CASES)
    weights = [CASES[k][1] for k in kinds]
    start = time.perf_counter()
    warm = settings.frames * settings.warmup
    samples: list[float] = []
    next_check = settings.batch
    slow: list[Future[tuple[int, str, list[str]]]] = []
    with ThreadPoolExecutor(4) as pool:
        while run.report.frames < settings.frames:
            try:
                run.case(rng.choices(kinds, weights)[0])
            except OSError:  # cannot connect: the server is gone, or this is a bug here
                if run.alive():
                    raise
                break
            if rng.random() < settings.slow_share and sum(not f.done() for f in slow) < 4:
                kind = rng.choice(["slow", "slow", "idle"])
                run.mix[kind] += 1
                run.report.frames += 1
                slow.append(pool.submit(run.slow, kind, rng.getrandbits(32)))
            if run.report.frames >= next_check or run.report.frames >= settings.frames:
                next_check += settings.batch
                if not run.alive():
                    break
                rss = run.rss_mib()
                run.report.rss_mib.append(round(rss, 1))
                if run.report.frames >= warm:
                    samples.append(rss)
        for future in slow:
            port, how, problems = future.result()
            run.end(port, how)
            for problem in problems:
                run.wrong(problem)
    run.report.seconds = round(time.perf_counter() - start, 2)
    run.report.frames_per_s = round(run.report.frames / max(run.report.seconds, 1e-9), 1)
    if len(samples) >= 2:
        run.report.rss_growth = round(samples[-1] / samples[0] - 1, 4)
