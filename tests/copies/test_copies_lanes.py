"""ThreadCopyEngine: lanes run batches in order, events and on_done, after, drain, close."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvstore.copies import Lane, OnDone, ThreadCopyEngine
from kvstore.errors import ClosedError

WAIT = 10.0  # seconds: long enough never to fire on a slow machine, short enough not to hang


@pytest.fixture
def engine() -> Iterator[ThreadCopyEngine]:
    eng = ThreadCopyEngine()
    yield eng
    eng.close()


def hold(lane: Lane) -> threading.Event:
    """Queue a batch that keeps the lane's worker busy until the returned gate is set."""
    gate = threading.Event()
    lane.submit([], on_done=lambda _: gate.wait(WAIT))
    return gate


def workers(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kvstore-copy-{name}"]


def test_batches_on_a_lane_run_in_submission_order(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("chain")
    xs = [torch.randn(1 << 20)] + [torch.zeros(1 << 20) for _ in range(8)]
    seen: list[int] = []
    gate = hold(lane)  # everything below is queued before any of it runs

    def note(i: int) -> OnDone:
        return lambda _: seen.append(i)

    events = [lane.submit([(xs[i + 1], xs[i])], on_done=note(i)) for i in range(8)]
    assert not any(e.done() for e in events)
    gate.set()
    assert events[-1].wait(WAIT)
    assert all(e.done() and e.error is None for e in events)
    assert seen == list(range(8))
    assert torch.equal(xs[8], xs[0])  # each batch read what the one before it wrote


def test_on_done_runs_on_the_worker_before_the_event(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("io")
    dst, src = torch.zeros(4, 64), torch.randn(4, 64)
    threads: list[threading.Thread] = []
    errors: list[BaseException | None] = []
    seen: list[torch.Tensor] = []

    def on_done(error: BaseException | None) -> None:
        time.sleep(0.05)  # a waiter woken before this returns would miss what follows
        threads.append(threading.current_thread())
        errors.append(error)
        seen.append(dst.clone())

    event = lane.submit([(dst[i], src[i]) for i in range(4)], on_done)
    assert event.wait(WAIT)
    assert len(threads) == 1  # on_done's effects are visible once the event is done
    assert threads[0].name == "kvstore-copy-io" and threads[0].daemon
    assert errors == [None] and event.error is None
    assert torch.equal(seen[0], src)  # the copies came first


def test_after_orders_one_lane_behind_another(engine: ThreadCopyEngine) -> None:
    a, b = engine.lane("a"), engine.lane("b")
    x, y, z = torch.randn(1 << 16), torch.zeros(1 << 16), torch.zeros(1 << 16)
    order: list[str] = []
    gate = hold(a)
    written = a.submit([(y, x)], on_done=lambda _: order.append("a"))
    early = b.submit([], on_done=lambda _: order.append("b-before"))  # queued before after()
    b.after(written)
    read = b.submit([(z, y)], on_done=lambda _: order.append("b"))
    assert early.wait(WAIT)  # after() does not hold back what was already queued
    time.sleep(0.1)
    assert not read.done()  # held behind lane a
    gate.set()
    assert read.wait(WAIT)
    assert order == ["b-before", "a", "b"]
    assert torch.equal(z, x)


def test_after_a_done_event_holds_nothing(engine: ThreadCopyEngine) -> None:
    a, b = engine.lane("a"), engine.lane("b")
    done = a.record()
    assert done.done()
    b.after(done)
    dst = torch.zeros(8)
    assert b.submit([(dst, torch.ones(8))]).wait(WAIT)
    assert torch.equal(dst, torch.ones(8))


def test_a_failed_batch_reports_its_error_and_the_worker_goes_on(
    engine: ThreadCopyEngine,
) -> None:
    lane = engine.lane("err")
    got: list[BaseException | None] = []
    dst = torch.zeros(4)
    bad = lane.submit([(dst, torch.ones(4)), (torch.zeros(4), torch.ones(5))], got.append)
    good = lane.submit([(torch.zeros(3), torch.ones(3))], got.append)
    assert good.wait(WAIT) and bad.done()
    assert isinstance(bad.error, RuntimeError)
    assert got[0] is bad.error and got[1] is None and good.error is None
    assert torch.equal(dst, torch.ones(4))  # the copy before the failing one was made
    assert len(workers("err")) == 1


def test_an_exception_in_on_done_is_logged_and_harmless(
    engine: ThreadCopyEngine, caplog: pytest.LogCaptureFixture
) -> None:
    lane = engine.lane("cb")

    def boom(_: BaseException | None) -> None:
        raise ValueError("callback failed")

    with caplog.at_level(logging.ERROR, logger="kvstore.copies.threads"):
        first = lane.submit([(torch.zeros(2), torch.ones(2))], boom)
        dst = torch.zeros(2)
        second = lane.submit([(dst, torch.ones(2))])
        assert second.wait(WAIT)
    assert first.done() and first.error is None
    assert torch.equal(dst, torch.ones(2))
    assert any("on_done" in r.getMessage() and r.exc_info for r in caplog.records)


def test_event_wait_times_out_and_done_never_blocks(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("ev")
    gate = hold(lane)
    event = lane.submit([(torch.zeros(2), torch.ones(2))])
    start = time.monotonic()
    assert not event.done()
    assert not event.wait(0.05)
    assert time.monotonic() - start < WAIT / 2
    assert event.error is None
    gate.set()
    assert event.wait(WAIT) and event.done()


def test_wait_stream_waits_for_the_event_on_the_thread_engine(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("ws")
    dst = torch.zeros(1 << 16)
    event = lane.submit([(dst, torch.ones(1 << 16))], on_done=lambda _: time.sleep(0.05))
    event.wait_stream(None)
    assert event.done() and torch.equal(dst, torch.ones(1 << 16))


def test_record_marks_everything_queued_so_far(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("rec")
    assert lane.record().done()  # idle lane: nothing to wait for
    gate = hold(lane)
    dst = torch.zeros(16)
    lane.submit([(dst, torch.ones(16))])
    mark = lane.record()
    time.sleep(0.05)
    assert not mark.done()
    gate.set()
    assert mark.wait(WAIT) and mark.error is None
    assert torch.equal(dst, torch.ones(16))


def test_drain_waits_for_queued_work(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("drain")
    gate = hold(lane)
    events = [lane.submit([(torch.zeros(8), torch.ones(8))]) for _ in range(5)]
    assert not lane.drain(0.05)
    gate.set()
    assert lane.drain(WAIT)
    assert all(e.done() for e in events)


def test_close_finishes_queued_work_then_refuses_new_work() -> None:
    engine = ThreadCopyEngine()
    lane = engine.lane("close")
    gate = hold(lane)
    dsts = [torch.zeros(1 << 16) for _ in range(3)]
    events = [lane.submit([(d, torch.ones(1 << 16))]) for d in dsts]
    closer = threading.Thread(target=engine.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waiting for the held batch and the queue behind it
    gate.set()
    closer.join(WAIT)
    assert not closer.is_alive() and engine.closed
    assert all(e.done() and e.error is None for e in events)
    assert all(torch.equal(d, torch.ones(1 << 16)) for d in dsts)
    assert workers("close") == []
    with pytest.raises(ClosedError):
        lane.submit([(torch.zeros(2), torch.ones(2))])
    with pytest.raises(ClosedError):
        lane.record()
    with pytest.raises(ClosedError):
        lane.after(events[0])
    with pytest.raises(ClosedError):
        engine.lane("another")
    assert lane.drain(0)
    engine.close()  # idempotent
    dst = torch.zeros(4)
    engine.copy_all([(dst, torch.ones(4))])  # needs no worker
    assert torch.equal(dst, torch.ones(4))


def test_close_from_on_done_does_not_deadlock() -> None:
    engine = ThreadCopyEngine()
    lane = engine.lane("self-close")
    dst = torch.zeros(4)
    gate = hold(lane)
    first = lane.submit([], on_done=lambda _: engine.close())
    second = lane.submit([(dst, torch.ones(4))])  # queued before the close: still runs
    gate.set()
    assert first.wait(WAIT) and second.wait(WAIT)
    assert torch.equal(dst, torch.ones(4))
    with pytest.raises(ClosedError):
        lane.submit([])
    deadline = time.monotonic() + WAIT
    while workers("self-close") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert workers("self-close") == []


def test_lanes_are_persistent_and_start_their_worker_lazily(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("lazy")
    assert engine.lane("lazy") is lane and engine.lane("other") is not lane
    assert lane.name == "lazy"
    assert workers("lazy") == []
    assert lane.submit([(torch.zeros(2), torch.ones(2))]).wait(WAIT)
    assert len(workers("lazy")) == 1
    assert lane.submit([(torch.zeros(2), torch.ones(2))]).wait(WAIT)
    assert len(workers("lazy")) == 1  # the same worker again


def test_many_threads_submitting_to_one_lane(engine: ThreadCopyEngine) -> None:
    lane = engine.lane("shared")
    srcs = torch.randn(8, 32, 128)
    dsts = torch.zeros(8, 32, 128)
    events: list[list[object]] = [[] for _ in range(8)]

    def submitter(t: int) -> None:
        for i in range(32):
            events[t].append(lane.submit([(dsts[t, i], srcs[t, i])]))

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT)
    assert lane.drain(WAIT)
    assert sum(len(e) for e in events) == 256
    assert torch.equal(dsts, srcs)


def test_copy_all_is_synchronous_coalesced_and_raises(engine: ThreadCopyEngine) -> None:
    src = torch.randn(16, 1024)
    dst = torch.zeros(16, 1024)
    engine.copy_all([(dst[i], src[i]) for i in range(16)])
    assert torch.equal(dst, src)
    with pytest.raises(RuntimeError):
        engine.copy_all([(torch.zeros(2), torch.zeros(3))])


def test_a_lane_writes_inference_tensors(engine: ThreadCopyEngine) -> None:
    with torch.inference_mode():
        slab = torch.zeros(6, 2, 64)
        kv = torch.zeros(2, 2, 24, 4)
    src = torch.randn(6, 2, 64)
    chunks = torch.randn(3, 2, 2, 8, 4)
    lane = engine.lane("inference")
    whole = lane.submit([(slab[i], src[i]) for i in range(6)])
    views = lane.submit([(kv[:, :, 8 * i : 8 * (i + 1)], chunks[i]) for i in range(3)])
    one = lane.submit([(slab[0][1], src[5][0])])  # a single view of an inference tensor
    assert one.wait(WAIT)
    assert whole.error is None and views.error is None and one.error is None
    assert torch.equal(slab[1:], src[1:]) and torch.equal(slab[0][1], src[5][0])
    for i in range(3):
        assert torch.equal(kv[:, :, 8 * i : 8 * (i + 1)], chunks[i])
    engine.copy_all([(slab[i], src[i]) for i in range(6)])  # and on the caller's thread
    assert torch.equal(slab, src)
