"""kvstore.connectors.page_strides: a page side's strided description reproduces the
calibrated positions exactly, or there is none."""

from __future__ import annotations

import pytest
import torch

from kvstore.connectors.page_strides import PageSide


def grid(tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(tokens).view(-1, 1), torch.arange(dim).view(1, -1)


@pytest.mark.parametrize(
    ("name", "tokens", "dim"),
    [("rows", 16, 80), ("transposed", 128, 64), ("tiles", 128, 64), ("pairs", 32, 96)],
)
def test_mixed_radix_layouts_are_found_and_view_the_page(name: str, tokens: int, dim: int) -> None:
    t, d = grid(tokens, dim)
    pos = {
        "rows": t * (2 * dim) + dim + d,  # a GPU page's V: row t, after K's columns
        "transposed": d * tokens + t,  # the CPU backend's K
        "tiles": (t // 16) * (16 * dim) + (d // 2) * 32 + (t % 16) * 2 + d % 2,  # AMX-like
        "pairs": 7 + (t // 2) * (2 * dim) + d * 2 + t % 2,  # token pairs, an offset
    }[name]
    side = PageSide.find(pos)
    assert side is not None and side.offset == int(pos[0, 0])
    pages, heads, elements = 3, 2, int(pos.max()) + 1
    whole = torch.randn(pages, heads, elements)
    view = side.view(whole).reshape(pages, tokens, heads, dim)
    want = whole[:, :, pos.reshape(-1)].view(pages, heads, tokens, dim).permute(0, 2, 1, 3)
    assert torch.equal(view, want)


def test_a_layout_without_strides_is_none() -> None:
    t, d = grid(8, 4)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    assert PageSide.find(order[t * 4 + d]) is None
    # strides that hold at each digit's first element but not inside: verified, refused
    pos = t * 4 + d
    pos[3, 2], pos[3, 1] = pos[3, 1].item(), pos[3, 2].item()
    assert PageSide.find(pos) is None
