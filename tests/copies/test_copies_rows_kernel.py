"""The rows kernel (copies/kernel.py, copies/regions.py): on CPU tensors under Triton's
interpreter (what TRITON_INTERPRET=1 runs), byte for byte against the thread engine
(the CPU twin) on random batches; refused where the contract says the copies one by one
could differ; on a GPU (marked ``cuda``) compiled, inside the CUDA engine and the HBM tier.
Triton comes with the ``dev`` extra that scripts/setup.sh installs."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.copies import ThreadCopyEngine
from kvstore.copies.regions import plan_regions

pytest.importorskip("triton", reason="triton is installed by scripts/setup.sh (the dev extra)")

from kvstore.copies import kernel

DTYPES = [torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64]
STORAGE = 1024  # bytes per storage in the random batches


@dataclass(frozen=True)
class View:
    """A strided view of one of the batch's storages: which, dtype, shape, strides, offset."""

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    def of(self, storages: list[torch.Tensor]) -> torch.Tensor:
        return (
            storages[self.storage]
            .view(self.dtype)
            .as_strided(self.shape, self.strides, self.offset)
        )

    def addresses(self) -> list[int]:
        """Every byte this view addresses (with repeats), relative to its storage."""
        item = torch.empty(0, dtype=self.dtype).element_size()
        elems = [self.offset]
        for size, stride in zip(self.shape, self.strides, strict=True):
            elems = [e + i * stride for e in elems for i in range(size)]
        if 0 in self.shape:
            return []
        return [e * item + b for e in elems for b in range(item)]


def storages(seed: int, count: int = 2, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (STORAGE,), dtype=torch.uint8, generator=gen).to(device)
        for _ in range(count)
    ]


def build(
    batch: list[tuple[View, View]], stores: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(d.of(stores), s.of(stores)) for d, s in batch]


def must_refuse(batch: list[tuple[View, View]]) -> bool:
    """The contract's oracle: a destination byte written twice, or one the batch reads."""
    written = Counter((d.storage, a) for d, _ in batch for a in d.addresses())
    read = {(s.storage, a) for _, s in batch for a in s.addresses()}
    return any(n > 1 for n in written.values()) or bool(written.keys() & read)


@st.composite
def views(draw: st.DrawFn, dtype: torch.dtype, shape: tuple[int, ...]) -> View:
    item = torch.empty(0, dtype=dtype).element_size()
    limit = STORAGE // item
    if draw(st.booleans()):  # contiguous, the common case
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= max(size, 1)
        strides.reverse()
    else:
        strides = [draw(st.integers(0, 9)) for _ in shape]
    reach = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if 0 not in shape else 0
    offset = draw(st.integers(0, max(0, limit - reach - 1)))
    return View(draw(st.integers(0, 1)), dtype, shape, tuple(strides), offset)


@st.composite
def batches(draw: st.DrawFn) -> list[tuple[View, View]]:
    dtype = draw(st.sampled_from(DTYPES))
    out = []
    for _ in range(draw(st.integers(0, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
        out.append((draw(views(dtype, shape)), draw(views(dtype, shape))))
    return out


def twin_and_kernel(
    batch: list[tuple[View, View]], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The batch copied by the thread engine and by the rows kernel, from equal storages."""
    twin, ours = storages(seed), storages(seed)
    ThreadCopyEngine().copy_all(build(batch, twin))
    regions = plan_regions(build(batch, ours))
    assert regions is not None
    kernel.copy_regions(regions)
    return twin, ours


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.integers(0, 1000))
def test_random_batches_match_the_thread_engine_byte_for_byte(
    batch: list[tuple[View, View]], seed: int
) -> None:
    if must_refuse(batch):
        assert plan_regions(build(batch, storages(seed))) is None
        return
    twin, ours = twin_and_kernel(batch, seed)
    for a, b in zip(twin, ours, strict=True):
        assert torch.equal(a, b)


def engine_tensor_and_slab(
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's ``(L, 2, n * bt, H, D)`` tensor and a slab of 5 slots."""
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(4, 2, 3 * 4, 2, 8, generator=gen).to(dtype)
    slab = torch.randn(5, 4, 2, 4, 2, 8, generator=gen).to(dtype)
    return kv, slab


def test_a_gather_from_slab_slots_into_chunk_views_is_the_twins_copy() -> None:
    kv, slab = engine_tensor_and_slab()
    want, got = torch.zeros_like(kv), torch.zeros_like(kv)
    slots = [3, 0, 4]

    def pairs(out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(out[:, :, i * 4 : (i + 1) * 4], slab[s]) for i, s in enumerate(slots)]

    ThreadCopyEngine().copy_all(pairs(want))
    regions = plan_regions(pairs(got))
    assert regions is not None
    assert regions.rows == 3 * 4 * 2 and regions.unit == 8  # 2L rows a block, 16-byte aligned
    assert kernel.copy_regions(regions) == 1  # one storage pair: one launch
    assert torch.equal(want.view(torch.int16), got.view(torch.int16))


def test_a_scatter_into_slab_slots_is_the_twins_copy() -> None:
    kv, slab = engine_tensor_and_slab()
    want, got = torch.zeros_like(slab), torch.zeros_like(slab)
    pairs = [(got[s], kv[:, :, i * 4 : (i + 1) * 4]) for i, s in enumerate([2, 4, 1])]
    ThreadCopyEngine().copy_all(
        [(want[s], kv[:, :, i * 4 : (i + 1) * 4]) for i, s in enumerate([2, 4, 1])]
    )
    assert kernel.try_copy(pairs) == 3 * kv[:, :, :4].numel() * 2
    assert torch.equal(want.view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("shift", [0, 1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("width", [1, 3, 7, 8, 13, 64])
def test_odd_widths_and_alignments_pick_the_widest_unit_that_divides(
    shift: int, width: int
) -> None:
    src = torch.arange(512, dtype=torch.int32).view(torch.uint8)[:1024]
    dst_store = torch.zeros(1024, dtype=torch.uint8)
    want = dst_store.clone()
    # 4 rows of `width` bytes, 80 bytes apart, shifted by `shift` bytes on both sides
    d = dst_store.as_strided((4, width), (80, 1), shift)
    s = src.as_strided((4, width), (96, 1), 8 + shift)
    want.as_strided((4, width), (80, 1), shift).copy_(s)
    regions = plan_regions([(d, s)])
    assert regions is not None
    step = next(u for u in (8, 4, 2, 1) if not (shift % u or width % u))
    assert regions.unit == step
    kernel.copy_regions(regions)
    assert torch.equal(dst_store, want)


def test_dtype_views_of_one_storage_copy_the_same_bytes() -> None:
    base = torch.randn(64, dtype=torch.float32)
    out = torch.zeros(256, dtype=torch.uint8)
    want = out.clone()
    pairs = [
        (out[:64].view(torch.bfloat16)[::2], base.view(torch.bfloat16)[1:33:2]),
        (out[128:192].view(torch.int32), base[16:32].view(torch.int32)),
    ]
    ThreadCopyEngine().copy_all(
        [
            (want[:64].view(torch.bfloat16)[::2], pairs[0][1]),
            (want[128:192].view(torch.int32), pairs[1][1]),
        ]
    )
    assert kernel.try_copy(pairs) > 0
    assert torch.equal(out, want)


def test_an_empty_batch_plans_nothing_and_copies_nothing() -> None:
    regions = plan_regions([])
    assert regions is not None and regions.rows == 0 and regions.groups == ()
    assert kernel.copy_regions(regions) == 0
    empty = torch.empty(0, 4)
    assert plan_regions([(empty, torch.empty(0, 4))]) == regions
    assert kernel.try_copy([]) == 0  # nothing for the kernel: the caller's old path (a no-op)


def test_one_contiguous_run_is_left_to_copy_() -> None:
    src, dst = torch.arange(64), torch.zeros(64, dtype=torch.int64)
    assert kernel.try_copy([(dst, src)]) == 0  # one row: a plain memcpy does it best
    assert torch.count_nonzero(dst) == 0


@pytest.mark.parametrize(
    "case",
    ["dst_overlaps_src", "dsts_overlap", "dst_repeats", "dtype", "broadcast", "conj", "subclass"],
)
def test_batches_the_contract_refuses_plan_to_none_and_stay_untouched(case: str) -> None:
    store = torch.arange(256, dtype=torch.float32)
    before = store.clone()
    if case == "dst_overlaps_src":  # copy_ one by one reads what an earlier row wrote
        pairs = [(store[8:72].view(8, 8)[:, :4], store[0:64].view(8, 8)[:, :4])]
    elif case == "dsts_overlap":
        pairs = [(store[100:108], store[0:8]), (store[104:112], store[8:16])]
    elif case == "dst_repeats":  # a destination with stride 0 writes one element many times
        pairs = [(store[200:201].expand(8), store[0:8])]
    elif case == "dtype":
        pairs = [(store[100:108], store[0:8].to(torch.float64))]
    elif case == "broadcast":
        pairs = [(store[100:116].view(2, 8), store[0:8])]
    elif case == "conj":
        c = torch.zeros(8, dtype=torch.complex64)
        pairs = [(c, torch.ones(8, dtype=torch.complex64).conj())]
    else:
        pairs = [(store[100:108], torch.nn.Parameter(store[0:8].clone(), requires_grad=False))]
    assert plan_regions(pairs) is None
    assert kernel.try_copy(pairs) == 0
    assert torch.equal(store, before)


def test_a_source_read_many_times_is_fine() -> None:
    src = torch.arange(8, dtype=torch.int16)
    dst = torch.zeros(4, 8, dtype=torch.int16)
    assert kernel.try_copy([(dst, src.expand(4, 8))]) > 0
    assert torch.equal(dst, src.expand(4, 8))


def test_inference_tensors_are_written_like_any_other() -> None:
    with torch.inference_mode():
        kv = torch.zeros(4, 2, 8, 16)
    src = torch.randn(4, 2, 8, 16)
    assert kernel.try_copy(
        [(kv[:, :, i * 2 : (i + 1) * 2], src[:, :, i * 2 : (i + 1) * 2]) for i in range(4)]
    )
    assert torch.equal(kv, src)


def test_a_kernel_that_fails_to_launch_disables_itself_and_the_caller_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken:  # a launch that raises: what a missing compiler does on a GPU box
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("no compiler")

    loaded = kernel._LOADED
    assert kernel.available()
    monkeypatch.setattr(loaded, "interpreted", Broken())
    monkeypatch.setattr(loaded, "broken", False)
    monkeypatch.setattr(loaded, "reason", loaded.reason)
    kv, slab = engine_tensor_and_slab()
    out = torch.zeros_like(kv)
    pairs = [(out[:, :, i * 4 : (i + 1) * 4], slab[i]) for i in range(3)]
    assert kernel.try_copy(pairs) == 0
    assert not kernel.available() and "no compiler" in kernel.reason()
    assert torch.count_nonzero(out) == 0  # nothing copied: the caller's old path does it all


# -- on a GPU: the compiled kernel, the CUDA engine, the HBM tier --------------------------------


@pytest.mark.cuda
def test_random_batches_on_the_gpu_match_the_thread_engine() -> None:
    rng = random.Random(7)
    done = 0
    for seed in range(80):
        dtype = rng.choice(DTYPES)
        item = torch.empty(0, dtype=dtype).element_size()
        batch = []
        for _ in range(rng.randint(1, 4)):
            shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
            pair = []
            for _ in range(2):
                strides = tuple(rng.randint(1, 9) for _ in shape)
                reach = sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
                offset = rng.randint(0, STORAGE // item - reach - 1)
                pair.append(View(rng.randint(0, 1), dtype, shape, strides, offset))
            batch.append((pair[0], pair[1]))
        if must_refuse(batch):
            continue
        twin = storages(seed)
        ThreadCopyEngine().copy_all(build(batch, twin))
        ours = storages(seed, device="cuda")
        regions = plan_regions(build(batch, ours))
        assert regions is not None
        kernel.copy_regions(regions)
        torch.cuda.synchronize()
        for a, b in zip(twin, ours, strict=True):
            assert torch.equal(a, b.cpu())
        done += 1
    assert done > 20


@pytest.mark.cuda
def test_the_cuda_engine_gathers_and_scatters_with_the_rows_kernel() -> None:
    from kvstore.copies.cuda import CudaCopyEngine

    engine = CudaCopyEngine("cuda")
    assert engine.d2d == "rows"
    kv, slab = (t.cuda() for t in engine_tensor_and_slab())
    out = torch.zeros_like(kv)
    engine.copy_all([(out[:, :, i * 4 : (i + 1) * 4], slab[s]) for i, s in enumerate([3, 0, 4])])
    want = torch.cat([slab[3], slab[0], slab[4]], dim=2)
    assert torch.equal(out, want)
    back = torch.zeros_like(slab)
    event = engine.lane("rows").submit(
        [(back[s], kv[:, :, i * 4 : (i + 1) * 4]) for i, s in enumerate([1, 2, 0])]
    )
    assert event.wait(30) and event.error is None
    assert torch.equal(back[1], kv[:, :, 0:4]) and torch.equal(back[0], kv[:, :, 8:12])
    stats = engine.stats()
    assert stats["batches_rows"] == 2, stats
    engine.close()


@pytest.mark.cuda
def test_the_hbm_tier_get_into_an_engine_tensor_goes_through_the_kernel() -> None:
    from kvstore import KVLayout, KVStore
    from kvstore.copies import engine_for

    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16)
    kv = torch.randn(4, 2, 8 * 16, 2, 64, device="cuda").to(torch.bfloat16)
    tiers = [{"kind": "device", "device": "cuda", "capacity": 64 * layout.block_nbytes}]
    with KVStore(layout, {"tiers": tiers}) as store:
        keys = store.hash_tokens(list(range(8 * 16)), "rows")
        store.put(keys, kv)
        store.drain()
        before = engine_for("cuda").stats()["batches_rows"]  # type: ignore[attr-defined]
        out = torch.zeros_like(kv)
        assert all(store.get(keys, out=out))
        assert torch.equal(out, kv)
        assert engine_for("cuda").stats()["batches_rows"] > before  # type: ignore[attr-defined]
