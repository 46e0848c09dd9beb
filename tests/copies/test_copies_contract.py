"""The copy-engine contract, run on every engine: the thread engine (CPU tensors) here,
and the CUDA engine (tensors on the GPU, pinned host memory) where a GPU exists."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvstore.copies import CopyEngine, ThreadCopyEngine, engine_for, engine_for_pairs
from kvstore.errors import ClosedError

WAIT = 30.0

ENGINES = [
    pytest.param("cpu", id="threads"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
    pytest.param("cuda-copy_", id="cuda-copy_", marks=pytest.mark.cuda),
]


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[CopyEngine]:
    kind = request.param
    if kind == "cpu":
        eng: CopyEngine = ThreadCopyEngine()
    else:
        from kvstore.copies.cuda import CudaCopyEngine

        eng = CudaCopyEngine("cuda", dma=kind == "cuda")
    yield eng
    eng.close()


def dev(engine: CopyEngine) -> torch.device:
    return getattr(engine, "device", torch.device("cpu"))


def host(
    shape: tuple[int, ...], engine: CopyEngine, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Host memory as the engine wants it: pinned for the CUDA engine."""
    return torch.zeros(shape, dtype=dtype, pin_memory=dev(engine).type == "cuda")


def test_engine_for_picks_the_engine_of_the_device() -> None:
    cpu = engine_for("cpu")
    assert isinstance(cpu, ThreadCopyEngine)
    assert engine_for_pairs([(torch.zeros(2), torch.ones(2))]) is cpu
    if torch.cuda.is_available():
        from kvstore.copies.cuda import CudaCopyEngine

        gpu = engine_for("cuda")
        assert isinstance(gpu, CudaCopyEngine) and gpu is engine_for("cuda:0")
        pair = (torch.zeros(2), torch.ones(2, device="cuda"))
        assert engine_for_pairs([pair]) is gpu
    else:
        assert engine_for("cuda") is cpu  # without CUDA nothing can be on a GPU anyway


def test_batches_on_a_lane_run_in_submission_order(engine: CopyEngine) -> None:
    lane = engine.lane("chain")
    d = dev(engine)
    xs = [torch.randn(1 << 22, device=d)] + [torch.zeros(1 << 22, device=d) for _ in range(8)]
    lane.after(engine.mark())  # made on this thread's stream: the lane waits for them
    seen: list[int] = []
    events = [
        lane.submit([(xs[i + 1], xs[i])], on_done=lambda _, i=i: seen.append(i)) for i in range(8)
    ]
    assert events[-1].wait(WAIT)
    assert all(e.done() and e.error is None for e in events)
    assert seen == list(range(8))
    assert torch.equal(xs[8], xs[0])


def test_on_done_runs_before_the_event_and_sees_the_bytes(engine: CopyEngine) -> None:
    lane = engine.lane("io")
    src = torch.randn(4, 1 << 16, device=dev(engine))
    dst = host((4, 1 << 16), engine)
    lane.after(engine.mark())
    seen: list[torch.Tensor] = []
    threads: list[threading.Thread] = []

    def on_done(error: BaseException | None) -> None:
        assert error is None
        threads.append(threading.current_thread())
        seen.append(dst.clone())

    event = lane.submit([(dst[i], src[i]) for i in range(4)], on_done)
    assert event.wait(WAIT) and event.error is None
    assert len(seen) == 1 and torch.equal(seen[0], src.cpu())
    assert threads[0] is not threading.current_thread() and threads[0].daemon


def test_after_orders_one_lane_behind_another(engine: CopyEngine) -> None:
    a, b = engine.lane("a"), engine.lane("b")
    d = dev(engine)
    x, y = torch.randn(1 << 24, device=d), torch.zeros(1 << 24, device=d)
    z = host((1 << 24,), engine)
    a.after(engine.mark())
    written = a.submit([(y, x)])
    b.after(written)
    read = b.submit([(z, y)])
    assert read.wait(WAIT) and read.error is None
    assert torch.equal(z, x.cpu())


def test_a_failed_batch_reports_its_error_and_the_lane_goes_on(engine: CopyEngine) -> None:
    lane = engine.lane("err")
    d = dev(engine)
    got: list[BaseException | None] = []
    dst = torch.zeros(4, device=d)
    ones, fives = torch.ones(4, device=d), torch.ones(5, device=d)
    zeros, three, three_dst = (
        torch.zeros(4, device=d),
        torch.ones(3, device=d),
        torch.zeros(3, device=d),
    )
    lane.after(engine.mark())
    bad = lane.submit(
        [(dst, ones), (zeros, fives)],
        got.append,
    )
    good = lane.submit([(three_dst, three)], got.append)
    assert good.wait(WAIT) and bad.done()
    assert isinstance(bad.error, RuntimeError) and got[0] is bad.error and got[1] is None
    assert torch.equal(dst, torch.ones(4, device=d))  # the copy before the failing one was made


def test_wait_stream_orders_the_callers_work_after_the_copies(engine: CopyEngine) -> None:
    lane = engine.lane("ws")
    d = dev(engine)
    src = host((1 << 22,), engine)
    src.normal_()
    dst = torch.zeros(1 << 22, device=d)
    lane.after(engine.mark())
    event = lane.submit([(dst, src)])
    event.wait_stream()  # CUDA: the current stream waits on the GPU; threads: this thread
    total = dst.sum()  # queued after the wait
    assert torch.allclose(total.cpu(), src.sum())
    assert event.wait(WAIT)


def test_mark_orders_a_lane_after_the_callers_producer(engine: CopyEngine) -> None:
    d = dev(engine)
    src = torch.zeros(1 << 22, device=d)
    if d.type == "cuda":
        torch.cuda._sleep(50_000_000)  # the producer is still running when the lane copies
    src.fill_(7.0)
    lane = engine.lane("mark")
    lane.after(engine.mark())
    dst = host((1 << 22,), engine)
    assert lane.submit([(dst, src)]).wait(WAIT)
    assert bool((dst == 7.0).all())


def test_copy_all_moves_blocks_between_slots_and_chunk_views(engine: CopyEngine) -> None:
    d = dev(engine)
    kv = torch.randn(4, 2, 4 * 64, 4, 32, device=d).to(torch.bfloat16)  # 4 chunks of 64 tokens
    slab = host((6, 4, 2, 64, 4, 32), engine, torch.bfloat16)
    chunks = [kv[:, :, i * 64 : (i + 1) * 64] for i in range(4)]
    engine.copy_all([(slab[1 + i], chunks[i]) for i in range(4)])  # out of the engine's tensor
    for i in range(4):
        assert torch.equal(slab[1 + i], chunks[i].cpu())
    back = torch.zeros_like(kv)
    engine.copy_all([(back[:, :, i * 64 : (i + 1) * 64], slab[1 + i]) for i in range(4)])
    assert torch.equal(back, kv)
    layer = torch.zeros(2, 4 * 64, 4, 32, dtype=torch.bfloat16, device=d)
    engine.copy_all([(layer[:, i * 64 : (i + 1) * 64], slab[1 + i][2]) for i in range(4)])
    assert torch.equal(layer, kv[2])


def test_copy_all_waits_for_the_callers_stream(engine: CopyEngine) -> None:
    d = dev(engine)
    src = torch.zeros(1 << 22, device=d)
    if d.type == "cuda":
        torch.cuda._sleep(50_000_000)
    src.fill_(3.0)
    dst = host((1 << 22,), engine)
    engine.copy_all([(dst, src)])
    assert bool((dst == 3.0).all())  # on the host at once: copy_all waited for the copy


def test_record_drain_and_close(engine: CopyEngine) -> None:
    lane = engine.lane("end")
    d = dev(engine)
    dst, ones = torch.zeros(1 << 20, device=d), torch.ones(1 << 20, device=d)
    lane.after(engine.mark())
    lane.submit([(dst, ones)])
    mark = lane.record()
    assert lane.drain(WAIT) and mark.wait(WAIT) and mark.error is None
    assert bool((dst == 1).all())
    engine.close()
    assert engine.closed
    with pytest.raises(ClosedError):
        engine.lane("end")
    with pytest.raises(ClosedError):
        lane.submit([])
    assert lane.drain(WAIT)
    engine.copy_all([(dst, torch.zeros(1 << 20, device=d))])  # needs no lane
    assert not dst.any()


@pytest.mark.cuda
def test_the_cuda_engine_copies_strided_host_blocks_as_dma_rows() -> None:
    from kvstore.copies.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    try:
        if not engine.dma:
            pytest.skip("libcudart not found: the engine copies with copy_")
        kv = torch.randn(4, 2, 256, 8, 128, device="cuda").to(torch.bfloat16)
        slab = torch.empty(2, 4, 2, 128, 8, 128, dtype=torch.bfloat16, pin_memory=True)
        before = engine.stats()["copies_dma"]
        engine.copy_all([(slab[i], kv[:, :, i * 128 : (i + 1) * 128]) for i in range(2)])
        assert engine.stats()["copies_dma"] > before
        assert torch.equal(slab.cuda(), kv.view(4, 2, 2, 128, 8, 128).permute(2, 0, 1, 3, 4, 5))
    finally:
        engine.close()


@pytest.mark.cuda
def test_a_thread_lane_refuses_gpu_batches() -> None:
    from kvstore.errors import KVStoreError

    engine = ThreadCopyEngine()
    try:
        event = engine.lane("gpu").submit([(torch.zeros(4, device="cuda"), torch.ones(4))])
        assert event.wait(WAIT) and isinstance(event.error, KVStoreError)
        assert "CUDA engine" in str(event.error)
    finally:
        engine.close()
