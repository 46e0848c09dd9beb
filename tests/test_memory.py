"""SlabAllocator: fixed slots in one buffer; all-or-nothing alloc, exact capacity, thread-safe."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvstore.errors import CapacityError, ClosedError, InvalidInputError
from kvstore.runtime import memory
from kvstore.runtime.memory import SlabAllocator, cuda_available


def test_fresh_allocator():
    slab = SlabAllocator(slot_nbytes=64, num_slots=8)
    assert (slab.num_free, slab.num_used, slab.num_slots, slab.slot_nbytes) == (8, 0, 8, 64)
    assert slab.buffer is not None
    assert slab.buffer.dtype == torch.uint8 and slab.buffer.numel() == 64 * 8
    assert slab.device == torch.device("cpu") and slab.pinned is False


def test_alloc_hands_out_low_slots_first_and_distinct():
    slab = SlabAllocator(16, 8)
    assert slab.alloc(3) == [0, 1, 2]
    assert slab.alloc(0) == []
    assert slab.alloc(2) == [3, 4]
    assert (slab.num_free, slab.num_used) == (3, 5)


def test_alloc_is_all_or_nothing():
    slab = SlabAllocator(16, 8)
    held = slab.alloc(6)
    with pytest.raises(CapacityError):
        slab.alloc(3)
    assert (slab.num_free, slab.num_used) == (2, 6)
    # the two free slots are still there, and are exactly the ones not held
    rest = slab.alloc(2)
    assert sorted(held + rest) == list(range(8))
    with pytest.raises(CapacityError):
        slab.alloc(1)
    assert slab.num_free == 0


def test_alloc_more_than_capacity():
    slab = SlabAllocator(16, 4)
    with pytest.raises(CapacityError):
        slab.alloc(5)
    assert slab.num_free == 4
    assert len(slab.alloc(4)) == 4


def test_double_free_raises():
    slab = SlabAllocator(16, 4)
    slots = slab.alloc(2)
    slab.free(slots[:1])
    with pytest.raises(RuntimeError, match="not allocated"):
        slab.free(slots[:1])
    assert slab.num_free == 3
    with pytest.raises(RuntimeError, match="not allocated"):
        slab.free([3])  # never allocated
    assert slab.num_free == 3


def test_double_free_is_caught_under_python_O():
    code = (
        "from kvstore.runtime.memory import SlabAllocator\n"
        "s = SlabAllocator(16, 4)\n"
        "a = s.alloc(1)\n"
        "s.free(a)\n"
        "try:\n"
        "    s.free(a)\n"
        "except Exception:\n"
        "    print('caught')\n"
        "else:\n"
        "    print('missed', sorted(s.alloc(4)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "caught", proc.stdout


def test_views_have_slot_size_and_are_disjoint():
    slab = SlabAllocator(slot_nbytes=24, num_slots=5)
    slots = slab.alloc(5)
    views = [slab.view(s) for s in slots]
    for slot, view in zip(slots, views, strict=True):
        assert view.dtype == torch.uint8 and view.numel() == 24
        assert view.untyped_storage().data_ptr() == slab.buffer.untyped_storage().data_ptr()
        assert view.storage_offset() == slot * 24
        view.fill_(slot + 1)
    for slot, view in zip(slots, views, strict=True):
        assert bool((view == slot + 1).all()), f"slot {slot} was overwritten by a neighbour"
    expected = torch.arange(1, 6, dtype=torch.uint8).repeat_interleave(24)
    assert torch.equal(slab.buffer, expected)


def test_view_shares_memory_with_buffer():
    slab = SlabAllocator(8, 2)
    (slot,) = slab.alloc(1)
    slab.view(slot)[:] = 7
    assert torch.equal(slab.view(slot), torch.full((8,), 7, dtype=torch.uint8))
    assert int(slab.buffer[slot * 8 : (slot + 1) * 8].sum()) == 56


def test_capacity_comes_back_exactly_after_frees():
    slab = SlabAllocator(16, 10)
    rng = random.Random(0)
    held: list[int] = []
    for _ in range(500):
        if held and (rng.random() < 0.5 or slab.num_free == 0):
            k = rng.randint(1, len(held))
            rng.shuffle(held)
            slab.free(held[:k])
            held = held[k:]
        else:
            got = slab.alloc(rng.randint(1, slab.num_free))
            assert not set(got) & set(held)
            held += got
        assert slab.num_used == len(held)
        assert slab.num_free == 10 - len(held)
    slab.free(held)
    assert slab.num_free == 10
    assert sorted(slab.alloc(10)) == list(range(10))


def test_thread_safety_smoke():
    num_slots, slot_nbytes, threads, rounds = 64, 32, 4, 2000
    slab = SlabAllocator(slot_nbytes, num_slots)
    owner: list[int | None] = [None] * num_slots
    errors: list[str] = []
    start = threading.Barrier(threads)

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        mine: list[int] = []
        start.wait()
        try:
            for _ in range(rounds):
                if mine and rng.random() < 0.5:
                    k = rng.randint(1, len(mine))
                    back, mine = mine[:k], mine[k:]
                    for s in back:
                        if not bool((slab.view(s) == tid).all()):
                            errors.append(f"slot {s} of thread {tid} was written by another")
                        owner[s] = None
                    slab.free(back)
                    continue
                try:
                    got = slab.alloc(rng.randint(1, 6))
                except CapacityError:
                    continue
                for s in got:
                    if owner[s] is not None:
                        errors.append(f"slot {s} handed to {tid} while held by {owner[s]}")
                    owner[s] = tid
                    slab.view(s).fill_(tid)
                mine += got
            for s in mine:
                owner[s] = None
            slab.free(mine)
        except Exception as exc:  # surfaced below
            errors.append(f"thread {tid}: {exc!r}")

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: more interleavings
    try:
        for t in pool:
            t.start()
        for t in pool:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in pool)
    assert errors == []
    assert (slab.num_free, slab.num_used) == (num_slots, 0)
    assert sorted(slab.alloc(num_slots)) == list(range(num_slots))


def test_close():
    slab = SlabAllocator(16, 4)
    slab.alloc(1)
    slab.close()
    assert slab.buffer is None
    with pytest.raises(ClosedError):
        slab.alloc(1)
    with pytest.raises(ClosedError):
        slab.view(0)
    slab.close()  # idempotent
    assert slab.buffer is None


@pytest.mark.parametrize(("slot_nbytes", "num_slots"), [(0, 4), (16, 0), (-1, 4), (16, -2)])
def test_bad_geometry_raises(slot_nbytes, num_slots):
    with pytest.raises(InvalidInputError):
        SlabAllocator(slot_nbytes, num_slots)


def test_cuda_available_matches_torch():
    assert cuda_available() is bool(torch.cuda.is_available())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_and_pinned_slabs():
    dev = SlabAllocator(32, 4, device="cuda")
    assert dev.buffer.is_cuda and not dev.pinned
    (slot,) = dev.alloc(1)
    dev.view(slot).fill_(3)
    assert int(dev.view(slot).sum()) == 96
    dev.close()
    host = SlabAllocator(32, 4, pinned=True)
    assert host.pinned and host.buffer.is_pinned()
    host.close()


# -- prefault ---------------------------------------------------------------------
MiB = 1 << 20


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@pytest.fixture
def slow_populate(monkeypatch: pytest.MonkeyPatch):
    """Prefault in 64 KiB steps, each taking >= 5 ms, recording the ranges it faults."""
    calls: list[tuple[int, int]] = []
    real = memory.madvise

    def fake(address: int, length: int, advice: int) -> int:
        calls.append((address, length))
        time.sleep(0.005)
        return real(address, length, advice)

    monkeypatch.setattr(memory, "PREFAULT_CHUNK", 64 * 1024)
    monkeypatch.setattr(memory, "madvise", fake)
    return calls


def test_prefault_is_off_unless_asked_for():
    slab = SlabAllocator(MiB, 4)
    assert slab.prefault_stats() == {
        "prefault": "off",
        "prefault_bytes_ready": 0,
        "prefault_bytes_total": 0,
        "prefault_done": False,
    }
    assert slab.wait_prefault(0) is True  # nothing to wait for
    slab.close()


def test_prefault_faults_the_whole_slab_and_says_so():
    slab = SlabAllocator(MiB, 16, prefault=True)
    assert slab.wait_prefault(30)
    assert slab.prefault_stats() == {
        "prefault": "done",
        "prefault_bytes_ready": 16 * MiB,
        "prefault_bytes_total": 16 * MiB,
        "prefault_done": True,
    }
    assert slab.buffer is not None and int(slab.buffer.sum()) == 0  # bytes unchanged: zeros
    slab.close()
    assert slab.prefault_stats()["prefault"] == "done"


def test_prefault_progress_grows_front_to_back(slow_populate):
    slab = SlabAllocator(MiB, 4, prefault=True)  # 64 steps of 64 KiB
    seen = []
    assert _wait_for(lambda: seen.append(slab.prefault_stats()) or seen[-1]["prefault_done"])
    running = [s for s in seen if s["prefault"] == "running"]
    assert any(0 < s["prefault_bytes_ready"] < 4 * MiB for s in running)
    ready = [s["prefault_bytes_ready"] for s in seen]
    assert ready == sorted(ready) and ready[-1] == 4 * MiB
    base = slab.buffer.data_ptr()
    starts = [address - base for address, _ in slow_populate]
    assert starts == sorted(starts) and starts[0] == 0  # front to back
    slab.close()


def test_close_mid_prefault_stops_the_thread_promptly(slow_populate):
    slab = SlabAllocator(MiB, 16, prefault=True)  # 256 steps of >= 5 ms: > 1 s
    assert _wait_for(lambda: slab.prefault_stats()["prefault_bytes_ready"] > 0)
    start = time.monotonic()
    slab.close()
    assert time.monotonic() - start < 0.5
    stats = slab.prefault_stats()
    assert stats["prefault"] == "stopped" and not stats["prefault_done"]
    assert 0 < stats["prefault_bytes_ready"] < 16 * MiB
    calls = len(slow_populate)
    time.sleep(0.05)
    assert len(slow_populate) == calls  # the thread is gone, not just paused
    assert not any(t.name == "kvstore-prefault" and t.is_alive() for t in threading.enumerate())


def test_slots_come_from_the_prefaulted_front(slow_populate):
    slab = SlabAllocator(MiB, 8, prefault=True)
    assert _wait_for(lambda: slab.prefault_stats()["prefault_bytes_ready"] >= MiB)
    ready = slab.prefault_stats()["prefault_bytes_ready"]
    first = slab.alloc(1)
    assert (first[0] + 1) * MiB <= ready  # inside the part already faulted in
    slab.free(first)
    assert slab.alloc(1) == first  # a freed (touched) slot is reused before fresh ones
    taken = slab.alloc(5)  # slots 1-5, handed out before the thread reached them
    in_flight = len(slow_populate) + 1  # the step under way may have started before
    assert slab.wait_prefault(30)
    base = slab.buffer.data_ptr()
    later = [address - base for address, _ in slow_populate[in_flight:]]
    # Their writers fault those pages: the thread skipped to the first slot not handed out.
    assert later and min(later) >= 6 * MiB
    slab.free(first + taken)
    slab.close()


def test_the_prefault_waits_while_copies_fault_their_own_slots(slow_populate):
    """Copies into slots past the faulted part have the machine to themselves: the
    thread pauses until they end (then skips their slots); copies into faulted slots
    do not stop it."""
    slab = SlabAllocator(MiB, 16, prefault=True)
    assert _wait_for(lambda: slab.prefault_stats()["prefault_bytes_ready"] > 0)
    slots = slab.alloc(12)  # 12 MiB, far past the part faulted in
    with slab.writing(slots):
        time.sleep(0.02)  # the step in flight ends
        calls = len(slow_populate)
        time.sleep(0.1)  # >= 20 steps' time
        assert len(slow_populate) == calls
        assert slab.prefault_stats()["prefault"] == "running"
    assert slab.wait_prefault(30)
    base = slab.buffer.data_ptr()
    assert min(address - base for address, _ in slow_populate[calls:]) >= 12 * MiB
    with slab.writing(slots[:1]):  # faulted by now: nothing to wait for
        pass
    slab.free(slots)
    slab.close()


def test_prefault_without_populate_touches_only_free_pages(monkeypatch: pytest.MonkeyPatch):
    release = threading.Event()

    def unsupported(address: int, length: int, advice: int) -> int:
        release.wait(10)  # hold the first step until a slot is written
        ctypes.set_errno(errno.EINVAL)  # an old kernel: no MADV_POPULATE_WRITE
        return -1

    monkeypatch.setattr(memory, "madvise", unsupported)
    slab = SlabAllocator(MiB, 4, prefault=True)
    (slot,) = slab.alloc(1)
    slab.view(slot).fill_(0xAB)
    release.set()
    assert slab.wait_prefault(30)
    assert slab.prefault_stats()["prefault_bytes_ready"] == 4 * MiB
    assert bool((slab.view(slot) == 0xAB).all())  # the touch never wrote a slot in use
    assert int(slab.buffer[MiB:].sum()) == 0
    slab.close()


def test_prefault_is_capped_by_available_memory(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(memory, "_available_memory", lambda: 10 * MiB)
    slab = SlabAllocator(MiB, 16, prefault=True)
    assert slab.wait_prefault(30)
    stats = slab.prefault_stats()
    assert stats["prefault_bytes_total"] == 9 * MiB  # 10% of what is left stays untouched
    assert stats["prefault_done"] and stats["prefault_bytes_ready"] == 9 * MiB
    slab.close()


def test_shared_slabs_are_prefaulted_too():
    slab = SlabAllocator(MiB, 4, shared=True, prefault=True)
    assert slab.wait_prefault(30) and slab.prefault_stats()["prefault"] == "done"
    slab.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_sees_the_prefault_stopped_and_can_use_the_slab(slow_populate):
    slab = SlabAllocator(MiB, 16, prefault=True)
    assert _wait_for(lambda: slab.prefault_stats()["prefault_bytes_ready"] > 0)
    pid = os.fork()
    if pid == 0:  # the child: no torch kernels here, only the allocator's bookkeeping
        code = 1
        try:
            stats = slab.prefault_stats()
            slots = slab.alloc(2)
            slab.free(slots)
            start = time.monotonic()
            slab.close()
            if stats["prefault"] == "stopped" and time.monotonic() - start < 1:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert slab.prefault_stats()["prefault"] in ("running", "done")  # the parent's goes on
    slab.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_slabs_need_no_prefault():
    host = SlabAllocator(32, 4, pinned=True, prefault=True)
    assert host.prefault_stats()["prefault"] == "committed"
    assert host.prefault_stats()["prefault_done"]
    host.close()


def test_trim_heap_gives_freed_memory_back() -> None:
    """glibc's malloc_trim where it exists (a store calls it when it closes): 64 MB of
    heap freed below blocks still in use stays with the process until the trim."""
    from kvstore.runtime.memory import trim_heap

    statm = Path("/proc/self/statm")
    if not statm.exists():
        pytest.skip("needs /proc")

    def rss() -> int:
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    blocks = [bytearray(16384) for _ in range(5000)]  # 80 MB of heap (below mmap's threshold)
    del blocks[:4000]  # the first 64 MB freed; the live ones above keep the heap's top
    before = rss()
    if not trim_heap():
        pytest.skip("this C library has no malloc_trim")
    assert before - rss() >= 16 * 2**20
    assert len(blocks) == 1000
