"""plan_rows: strided copies as 2-D byte copies, checked on CPU by running each plan
with memmove and comparing with copy_."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvstore.copies.rows import Rows, plan_rows


def run(plan: list[Rows]) -> None:
    """What cudaMemcpy2DAsync does, on host memory."""
    for rows in plan:
        for r in range(rows.height):
            ctypes.memmove(rows.dst + r * rows.dpitch, rows.src + r * rows.spitch, rows.width)


def check(dst: torch.Tensor, src: torch.Tensor, **limits: int) -> list[Rows]:
    want = dst.clone()
    want.copy_(src)
    plan = plan_rows(dst, src, **limits)
    assert plan is not None
    run(plan)
    assert torch.equal(dst, want)
    return plan


def kv(layers: int = 4, tokens: int = 64, heads: int = 4, dim: int = 32) -> torch.Tensor:
    """An engine's ``(L, 2, tokens, H, D)`` tensor."""
    return torch.randn(layers, 2, tokens, heads, dim).to(torch.bfloat16)


def test_a_chunk_of_an_engine_tensor_is_one_2d_copy_each_way() -> None:
    src = kv()
    chunk = src[:, :, 16:32]  # one 16-token chunk: 2L rows of 16*H*D elements
    slot = torch.empty(chunk.shape, dtype=chunk.dtype)
    plan = check(slot, chunk, min_width=64)
    assert len(plan) == 1 and plan[0].height == 8 and plan[0].width == 16 * 4 * 32 * 2
    back = torch.zeros_like(src)
    plan = check(back[:, :, 16:32], slot, min_width=64)
    assert len(plan) == 1
    assert torch.equal(back[:, :, 16:32], chunk) and not back[:, :, :16].any()


def test_a_layer_of_consecutive_slots_loops_over_the_smaller_dimension() -> None:
    slab = torch.randn(6, 4, 2, 16, 4, 32).to(torch.bfloat16)  # 6 slots
    merged_src = slab[1:5, 2]  # layer 2 of slots 1..4: (4, 2, 16, 4, 32)
    out = kv(tokens=64)[2]  # (2, 64, H, D): layer 2 of a 4-chunk tensor
    dst = out.view(2, 4, 16, 4, 32).transpose(0, 1)  # chunk-major view of it
    plan = check(dst, merged_src, min_width=64)
    assert len(plan) == 2  # rows: 4 chunks; loop: K and V


def test_contiguous_copies_are_a_single_run() -> None:
    a, b = torch.randn(1 << 12), torch.empty(1 << 12)
    plan = check(b, a)
    assert len(plan) == 1 and plan[0].contiguous


def test_no_plan_where_a_plain_memcpy_would_be_wrong() -> None:
    src = kv()
    assert plan_rows(torch.empty(4, 2, 64, 4, 32), src) is None  # dtype conversion
    assert plan_rows(torch.empty_like(src)[..., :16], src[..., :16]) is None  # narrow rows
    assert plan_rows(torch.empty(8, 2, 64, 4, 32), src) is None  # shape
    t = torch.randn(1 << 12)
    assert plan_rows(t[1:], t[:-1]) is None  # what is written meets what is read
    wide = torch.randn(1, 1 << 12).expand(4, 1 << 12)
    assert plan_rows(wide, torch.randn(4, 1 << 12)) is None  # a destination row written twice
    assert plan_rows(torch.empty(64, 64).t(), torch.randn(64, 64)) is None  # inner not contiguous
    assert plan_rows(torch.empty(0), torch.empty(0)) is None
    repeated = torch.randn(1, 4096).expand(4, 4096)
    assert plan_rows(torch.empty(4, 4096), repeated) is None  # a zero stride


def test_too_many_calls_fall_back() -> None:
    src = torch.randn(8, 8, 4, 1024)[:, :, :2]  # (8, 8, 2, 1024)
    dst = torch.empty(8, 9, 4, 1024)[:, :8, 1:3]  # outer dims that merge on one side only
    assert plan_rows(dst, src, max_calls=4) is None
    assert len(check(dst, src, max_calls=64)) == 8


@pytest.mark.parametrize("seed", range(20))
def test_random_views_of_kv_tensors(seed: int) -> None:
    """Random token ranges, layer ranges and chunk sizes: the plan equals copy_."""
    gen = torch.Generator().manual_seed(seed)

    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    src = kv(layers=4, tokens=96)
    lo = pick(80)
    hi = lo + 1 + pick(96 - lo)
    first = pick(4)
    last = first + 1 + pick(4 - first)
    view = src[first:last, :, lo:hi]
    slot = torch.empty(view.shape, dtype=view.dtype)
    check(slot, view, min_width=2)
    dst = kv(layers=4, tokens=96)
    check(dst[first:last, :, lo:hi], slot, min_width=2)
