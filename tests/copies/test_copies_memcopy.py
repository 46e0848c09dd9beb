"""Batches of contiguous host copies in one C call (``kvstore.native._memcopy``), and when not."""

from __future__ import annotations

import pytest
import torch

from kvstore.copies import coalescing, engine_for

memcopy = coalescing.memcopy
if memcopy is None:
    pytest.skip("kvstore.native._memcopy is not built", allow_module_level=True)


def separate_blocks(n: int, numel: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(numel, generator=gen) for _ in range(n)]
    return [(torch.zeros(numel), src) for src in srcs]


def test_separate_contiguous_blocks_go_to_c_and_copy_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = memcopy.copy_regions

    def counting(table: object, threads: int) -> None:
        calls.append(threads)
        real(table, threads)

    monkeypatch.setattr(memcopy, "copy_regions", counting)
    pairs = separate_blocks(12, 300_000)  # ~1.2 MB each: split across threads too
    engine_for("cpu").copy_all(pairs)
    assert len(calls) == 1  # one call for the whole batch
    assert all(torch.equal(dst, src) for dst, src in pairs)


@pytest.mark.parametrize("case", ["overlap", "dtype", "strided", "one"])
def test_what_memcpy_cannot_copy_exactly_goes_to_torch(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memcopy, "copy_regions", lambda *a: pytest.fail("must not use C here"))
    buf = torch.arange(100, dtype=torch.float32)
    if case == "overlap":  # the second copy reads what the first wrote
        pairs = [(buf[10:20], buf[0:10]), (buf[30:40], buf[15:25])]
        expect = buf.clone()
        expect[10:20] = expect[0:10].clone()
        expect[30:40] = expect[15:25].clone()
    elif case == "dtype":  # a conversion, not a byte copy
        pairs = [(torch.zeros(10, dtype=torch.float64), buf[:10]), (buf[50:60], buf[:10])]
    elif case == "strided":
        pairs = [(buf[0:20:2], buf[40:50]), (buf[60:70], buf[80:90])]
    else:
        pairs = [(buf[50:60], buf[:10])]
    engine_for("cpu").copy_all(pairs)
    if case == "overlap":
        assert torch.equal(buf, expect)
    else:
        assert all(torch.equal(dst, src.to(dst.dtype)) for dst, src in pairs)


def test_without_the_extension_every_pair_is_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coalescing, "memcopy", None)
    pairs = separate_blocks(5, 1000, seed=3)
    engine_for("cpu").copy_all(pairs)
    assert all(torch.equal(dst, src) for dst, src in pairs)
