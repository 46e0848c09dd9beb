"""block_runs: evenly spaced blocks on both sides become one view per run."""

from __future__ import annotations

import torch

from kvstore.copies.runs import block_runs


def test_runs_follow_adjacent_slots_and_break_where_the_spacing_does() -> None:
    layers, bt, width = 3, 4, 8
    slab = torch.randn(10, layers, 2, bt, width)  # slots
    out = torch.zeros(layers, 2, 6 * bt, width)
    views = [out[:, :, i * bt : (i + 1) * bt] for i in range(6)]
    # blocks 0-2 in slots 4-6, block 3 only elsewhere, blocks 4-5 in slots 1 and 0
    sources = [slab[4], slab[5], slab[6], None, slab[1], slab[0]]
    runs = block_runs(views, sources, 6)
    assert [(a, b) for a, b, _, _ in runs] == [(0, 3), (4, 5), (5, 6)]
    for first, end, dst, src in runs:
        assert dst.shape == src.shape == (layers, 2, end - first, bt, width)
        dst.copy_(src)
    for i, source in enumerate(sources):
        if source is None:
            assert not views[i].any()
        else:
            assert torch.equal(views[i], source)


def test_a_run_stops_at_the_valid_prefix() -> None:
    slab = torch.randn(4, 2, 2, 4, 8)
    out = torch.zeros(2, 2, 16, 8)
    views = [out[:, :, i * 4 : (i + 1) * 4] for i in range(4)]
    runs = block_runs(views, [slab[0], slab[1], slab[2], slab[3]], 2)
    assert [(a, b) for a, b, _, _ in runs] == [(0, 2)]
