"""coalesce() and copy_pairs(): merged copies write exactly what the copies one by one write."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.copies import CopyPair, coalesce, copy_pairs, needs_inference_mode

# -- the property test: random layouts against a plain per-pair copy ------------------

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int16]


@dataclass(frozen=True)
class Side:
    """Where the tensors of one side (all dst, or all src) of the pairs live."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offsets: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Case:
    dst: Side
    src: Side
    shared: bool  # the sources live in the destinations' storage
    stray: int | None  # this pair's dst lives in a storage of its own (same layout)


def reach(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from a view's first to one past its last addressed element."""
    if any(n == 0 for n in shape):
        return 0
    return sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1


@st.composite
def strides_for(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides in some dimension order, padded ones, or anything (overlap allowed)."""
    mode = draw(st.sampled_from(["dense", "padded", "random"]))
    if mode == "random":
        return tuple(draw(st.integers(0, 6)) for _ in shape)
    order = draw(st.permutations(range(len(shape))))
    strides = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        strides[d] = acc
        pad = draw(st.integers(0, 2)) if mode == "padded" else 0
        acc *= max(shape[d], 1) + pad
    return tuple(strides)


@st.composite
def offsets_for(draw: st.DrawFn, n: int, extent: int) -> tuple[int, ...]:
    """Offsets of ``n`` views: adjacent, a constant step (any sign), reversed, or random."""
    mode = draw(st.sampled_from(["adjacent", "step", "reversed", "random", "same"]))
    extent = max(extent, 1)
    if mode == "adjacent":
        offs = [i * extent for i in range(n)]
    elif mode == "reversed":
        offs = [(n - 1 - i) * extent for i in range(n)]
    elif mode == "same":
        offs = [0] * n
    elif mode == "step":
        step = draw(st.integers(-2 * extent - 2, 2 * extent + 2))
        offs = [i * step for i in range(n)]
    else:
        offs = draw(st.lists(st.integers(0, 2 * n * extent), min_size=n, max_size=n))
    low = min(offs)
    start = draw(st.integers(0, 3))
    return tuple(o - low + start for o in offs)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n = draw(st.integers(1, 6))
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
    dstrides = draw(strides_for(shape))
    dst = Side(
        shape, dstrides, draw(offsets_for(n, reach(shape, dstrides))), draw(st.sampled_from(DTYPES))
    )
    sshape = draw(
        st.sampled_from(
            [shape, tuple(1 if i == 0 else s for i, s in enumerate(shape)), shape[1:] or shape]
        )
    )
    sstrides = draw(strides_for(sshape))
    shared = draw(st.booleans())
    sdtype = dst.dtype if shared else draw(st.sampled_from(DTYPES))
    soffs = draw(offsets_for(n, reach(sshape, sstrides)))
    if shared:  # somewhere around the destinations: may or may not overlap them
        shift = draw(st.integers(0, max(dst.offsets) + reach(shape, dstrides) + 2))
        soffs = tuple(o + shift for o in soffs)
    stray = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    return Case(dst, Side(sshape, sstrides, soffs, sdtype), shared, stray)


def base_sizes(case: Case) -> tuple[int, int]:
    dsize = max(case.dst.offsets) + reach(case.dst.shape, case.dst.strides) + 2
    ssize = max(case.src.offsets) + reach(case.src.shape, case.src.strides) + 2
    return (max(dsize, ssize), 0) if case.shared else (dsize, ssize)


def build(case: Case) -> tuple[list[torch.Tensor], list[CopyPair]]:
    """Fresh storages with known contents (ascending integers) and the pairs over them."""
    dsize, ssize = base_sizes(case)
    dbase = torch.arange(dsize).to(case.dst.dtype)
    sbase = dbase if case.shared else (torch.arange(ssize) + 1000).to(case.src.dtype)
    stray = torch.arange(dsize).to(case.dst.dtype) * -1
    pairs = []
    for i, (do, so) in enumerate(zip(case.dst.offsets, case.src.offsets, strict=True)):
        dbuf = stray if i == case.stray else dbase
        pairs.append(
            (
                dbuf.as_strided(case.dst.shape, case.dst.strides, do),
                sbase.as_strided(case.src.shape, case.src.strides, so),
            )
        )
    return [dbase, sbase, stray], pairs


def one_by_one(pairs: list[CopyPair]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def outcome(
    case: Case, copy: Callable[[list[CopyPair]], object]
) -> tuple[list[torch.Tensor], type[BaseException] | None]:
    bases, pairs = build(case)
    try:
        copy(pairs)
    except RuntimeError as exc:
        return bases, type(exc)
    return bases, None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_coalesced_copies_match_copies_one_by_one(case: Case) -> None:
    want, want_error = outcome(case, one_by_one)
    got, got_error = outcome(case, copy_pairs)
    if want_error is not None:  # the same copy fails, though maybe after other copies
        assert got_error is not None
        return
    assert got_error is None
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    _, pairs = build(case)
    merged = coalesce(pairs)
    assert len(merged) <= len(pairs)
    assert sum(d.numel() for d, _ in merged) == sum(d.numel() for d, _ in pairs)


# -- merging really happens where it should ------------------------------------------


def test_adjacent_blocks_become_one_contiguous_copy() -> None:
    src = torch.randn(16, 8, 32)
    dst = torch.zeros(16, 8, 32)
    pairs = [(dst[i], src[i]) for i in range(16)]
    merged = coalesce(pairs)
    assert len(merged) == 1
    assert merged[0][0].is_contiguous() and merged[0][0].shape == (16, 8, 32)
    assert copy_pairs(pairs) == 1
    assert torch.equal(dst, src)


@pytest.mark.parametrize("into_kv", [False, True])
def test_kv_chunks_become_one_strided_copy(into_kv: bool) -> None:
    layers, n, bt, heads, dim = 3, 5, 4, 2, 8
    kv = torch.randn(layers, 2, n * bt, heads, dim)
    blocks = torch.randn(n, layers, 2, bt, heads, dim)
    chunks = [kv[:, :, i * bt : (i + 1) * bt] for i in range(n)]
    pairs = [(c, blocks[i]) if into_kv else (blocks[i], c) for i, c in enumerate(chunks)]
    assert len(coalesce(pairs)) == 1
    copy_pairs(pairs)
    for i, chunk in enumerate(chunks):
        assert torch.equal(chunk, blocks[i])


def test_layer_slices_of_consecutive_slots_become_one_strided_copy() -> None:
    slab = torch.zeros(12, 4, 2, 16)  # slots x layers x (K, V) x bytes
    layer = torch.randn(8, 2, 16)
    pairs = [(slab[3 + i][1], layer[i]) for i in range(8)]
    merged = coalesce(pairs)
    assert len(merged) == 1 and not merged[0][0].is_contiguous()
    assert len(coalesce(pairs, strided=False)) == 8  # cross-device rule: contiguous only
    copy_pairs(pairs)
    assert torch.equal(slab[3:11, 1], layer)
    assert slab[:, [0, 2, 3]].abs().sum() == 0 and slab[:3].abs().sum() == 0


def test_shuffled_slots_stay_apart_and_land_right() -> None:
    slab = torch.zeros(16, 4, 8)
    src = torch.randn(16, 4, 8)
    slots = list(range(16))
    random.Random(7).shuffle(slots)
    pairs = [(slab[s], src[i]) for i, s in enumerate(slots)]
    assert len(coalesce(pairs)) > 1
    copy_pairs(pairs)
    for i, s in enumerate(slots):
        assert torch.equal(slab[s], src[i])


def test_falling_addresses_merge_from_the_last_pair() -> None:
    dst, src = torch.zeros(6, 10), torch.randn(6, 10)
    pairs = [(dst[i], src[i]) for i in reversed(range(6))]
    assert len(coalesce(pairs)) == 1
    copy_pairs(pairs)
    assert torch.equal(dst, src)


def test_opposite_directions_do_not_merge() -> None:
    dst, src = torch.zeros(6, 10), torch.randn(6, 10)
    pairs = [(dst[5 - i], src[i]) for i in range(6)]
    assert len(coalesce(pairs)) == 6
    copy_pairs(pairs)
    assert torch.equal(dst, src.flip(0))


def test_one_source_to_many_destinations_merges() -> None:
    dst, src = torch.zeros(6, 10), torch.randn(10)
    pairs = [(dst[i], src) for i in range(6)]
    assert len(coalesce(pairs)) == 1
    copy_pairs(pairs)
    assert torch.equal(dst, src.expand(6, 10))


def test_different_storages_never_merge() -> None:
    srcs = torch.randn(4, 64)
    dsts = [torch.zeros(64) for _ in range(4)]
    pairs = [(d, srcs[i]) for i, d in enumerate(dsts)]
    assert len(coalesce(pairs)) == 4
    copy_pairs(pairs)
    assert all(torch.equal(d, srcs[i]) for i, d in enumerate(dsts))


def test_a_merge_never_reaches_past_the_first_storage() -> None:
    """Two storages over one buffer with the same start but different sizes: the
    second pair lies outside the first one's storage, so no view of it may reach."""
    buffer = bytearray(4 * 64)
    short = torch.frombuffer(buffer, dtype=torch.float32, count=16)
    whole = torch.frombuffer(buffer, dtype=torch.float32)
    assert short.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    src = torch.randn(2, 16)
    pairs = [(short[0:16], src[0]), (whole[16:32], src[1])]
    assert len(coalesce(pairs)) == 2
    copy_pairs(pairs)
    assert torch.equal(whole[:32], src.flatten())


def test_mixed_dtypes_and_devices_never_merge() -> None:
    dst = torch.zeros(4, 8)
    src32, src64 = torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64)
    pairs = [(dst[0], src32[0]), (dst[1], src32[1]), (dst[2], src64[2]), (dst[3], src64[3])]
    assert len(coalesce(pairs)) == 2  # two runs: one per source dtype and storage
    copy_pairs(pairs)
    assert torch.equal(dst[:2], src32[:2]) and torch.equal(dst[2:], src64[2:].float())
    meta = torch.empty(4, 8, device="meta")
    assert len(coalesce([(meta[i], meta[i]) for i in range(4)])) == 4
    assert len(coalesce([(dst[0], src32[0]), (meta[1], src32[1])])) == 2


@pytest.mark.parametrize("odd", ["dtype", "strides", "shape"])
def test_a_pair_of_another_kind_ends_the_run_even_at_the_right_address(odd: str) -> None:
    """Pair 2 starts exactly one step after pair 1 in the same storage, but is a
    different view (dtype, strides or shape): a view made from pair 0 would
    address its elements wrongly, so it must not join the run."""
    base = torch.zeros(64)
    src = torch.arange(24.0).view(3, 8)
    third = {
        "dtype": base.view(torch.int32)[16:24],
        "strides": base[16:32:2],
        "shape": base[16:24].view(2, 4),
    }[odd]
    third_src = src[2] if odd != "shape" else src[2].view(2, 4)
    pairs = [(base[0:8], src[0]), (base[8:16], src[1]), (third, third_src)]
    assert len(coalesce(pairs)) == 2
    want = torch.zeros(64)
    for dst, s in [(want[0:8], src[0]), (want[8:16], src[1])]:
        dst.copy_(s)
    {"dtype": want.view(torch.int32)[16:24], "strides": want[16:32:2], "shape": want[16:24]}[
        odd
    ].copy_(src[2])
    copy_pairs(pairs)
    assert torch.equal(base, want)


def test_overlapping_destinations_keep_the_last_write() -> None:
    buf = torch.zeros(40)
    src = torch.randn(4, 10)
    pairs = [(buf[i * 5 : i * 5 + 10], src[i]) for i in range(4)]  # each overlaps the next
    assert len(coalesce(pairs)) == 4
    copy_pairs(pairs)
    want = torch.zeros(40)
    for i in range(4):
        want[i * 5 : i * 5 + 10] = src[i]
    assert torch.equal(buf, want)


def test_copies_within_one_storage_that_read_earlier_writes_stay_in_order() -> None:
    x = torch.arange(8 * 4.0).view(8, 4)
    pairs = [(x[i + 1], x[i]) for i in range(7)]  # each reads what the previous wrote
    assert len(coalesce(pairs)) == 7
    copy_pairs(pairs)
    assert torch.equal(x, torch.arange(4.0).expand(8, 4))


def test_zero_size_tensors_are_left_alone() -> None:
    dst, src = torch.zeros(4, 0), torch.zeros(4, 0)
    pairs = [(dst[i], src[i]) for i in range(4)]
    merged = coalesce(pairs)
    assert len(merged) == 4 and all(m[0] is p[0] for m, p in zip(merged, pairs, strict=True))
    assert copy_pairs(pairs) == 4


def test_sources_broadcast_from_fewer_dims_never_merge() -> None:
    dst = torch.zeros(2, 2, 3)
    rows = torch.randn(2, 3)
    pairs = [(dst[0], rows[0]), (dst[1], rows[1])]  # (2, 3) <- (3,): broadcast
    assert len(coalesce(pairs)) == 2  # merged, rows' new dim would line up with dst's 2
    copy_pairs(pairs)
    assert torch.equal(dst[0], rows[0].expand(2, 3)) and torch.equal(dst[1], rows[1].expand(2, 3))


def test_autograd_tensors_never_merge() -> None:
    src = torch.randn(4, 8, requires_grad=True)
    dst = torch.zeros(4, 8)
    pairs = [(dst[i], src[i]) for i in range(4)]
    assert len(coalesce(pairs)) == 4
    with torch.no_grad():
        copy_pairs(pairs)
    assert torch.equal(dst, src.detach())


def test_copy_pairs_raises_what_copy_raises() -> None:
    with pytest.raises(RuntimeError):
        copy_pairs([(torch.zeros(4), torch.zeros(5))])


# -- inference tensors ------------------------------------------------------------------


def test_inference_destinations_are_written_outside_inference_mode() -> None:
    with torch.inference_mode():
        slab = torch.zeros(8, 3, 16)
    assert slab.is_inference() and not torch.is_inference_mode_enabled()
    with pytest.raises(RuntimeError, match=r"[Ii]nference"):
        slab[0].copy_(torch.ones(3, 16))  # what a worker thread would hit
    src = torch.randn(8, 3, 16)
    pairs = [(slab[i], src[i]) for i in range(8)]
    assert needs_inference_mode(pairs)
    assert copy_pairs(pairs) == 1
    assert torch.equal(slab, src)


def test_a_view_of_an_inference_tensor_as_destination() -> None:
    with torch.inference_mode():
        kv = torch.zeros(4, 2, 32, 8)
    src = torch.randn(4, 4, 2, 8, 8)
    pairs = [(kv[:, :, 8 * i : 8 * (i + 1)], src[i]) for i in range(4)]  # views of kv
    assert all(d.is_inference() for d, _ in pairs)
    copy_pairs(pairs[:1])  # a single pair, unmerged
    copy_pairs(pairs[1:])
    for i in range(4):
        assert torch.equal(kv[:, :, 8 * i : 8 * (i + 1)], src[i])


def test_inference_mode_is_entered_only_when_needed() -> None:
    plain = [(torch.zeros(3), torch.ones(3))]
    assert not needs_inference_mode(plain)
    with torch.inference_mode():
        inf = torch.zeros(3)
        assert not needs_inference_mode([(inf, torch.ones(3))])  # already in it
    assert needs_inference_mode([*plain, (inf, torch.ones(3))])
    copy_pairs([*plain, (inf, torch.ones(3))])  # a mixed batch: one mode serves both
    assert torch.equal(plain[0][0], torch.ones(3)) and torch.equal(inf, torch.ones(3))


def test_lazily_conjugated_or_negated_sources_never_merge() -> None:
    c = torch.randn(4, 3, dtype=torch.complex64)
    conj, neg = c.conj(), c.conj().imag  # a conjugate bit; a negative bit on a real view
    assert conj.is_conj() and neg.is_neg()
    cd, rd = torch.zeros(4, 3, dtype=torch.complex64), torch.zeros(4, 3)
    conj_pairs = [(cd[i], conj[i]) for i in range(4)]
    neg_pairs = [(rd[i], neg[i]) for i in range(4)]
    assert len(coalesce(conj_pairs)) == 4 and len(coalesce(neg_pairs)) == 4
    copy_pairs(conj_pairs)
    copy_pairs(neg_pairs)
    assert torch.equal(cd, c.conj().resolve_conj()) and torch.equal(rd, -c.imag)


def test_sparse_sources_fail_as_copy_does() -> None:
    dst, src = torch.zeros(2, 3), torch.randn(2, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        copy_pairs([(dst[0], src[0]), (dst[1], src[1])])


def test_a_conjugated_or_negated_view_at_the_right_address_ends_the_run() -> None:
    """``c.conj()[i]`` lies exactly where ``c[i]`` does: only its lazy bit differs."""
    c = torch.randn(4, 3, dtype=torch.complex64)
    cd = torch.zeros(4, 3, dtype=torch.complex64)
    conj_pairs = [(cd[i], c[i] if i < 2 else c.conj()[i]) for i in range(4)]
    assert len(coalesce(conj_pairs)) == 3  # [0, 1] merged; the conjugate views alone
    copy_pairs(conj_pairs)
    assert torch.equal(cd[:2], c[:2]) and torch.equal(cd[2:], c[2:].conj().resolve_conj())
    rd = torch.zeros(4, 3)
    neg_pairs = [(rd[i], c.imag[i] if i < 2 else c.conj().imag[i]) for i in range(4)]
    assert len(coalesce(neg_pairs)) == 3
    copy_pairs(neg_pairs)
    assert torch.equal(rd[:2], c.imag[:2]) and torch.equal(rd[2:], -c.imag[2:])
