"""SlabAllocator: fixed slots in one buffer; all-or-nothing alloc, exact capacity, thread-safe."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
import torch

from kvstore.errors import CapacityError, ClosedError, InvalidInputError
from kvstore.memory import SlabAllocator, cuda_available


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
        "from kvstore.memory import SlabAllocator\n"
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
