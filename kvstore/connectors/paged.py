"""Moving KV between kvstore's block layout and an engine's paged KV cache.

kvstore keeps KV as ``(layers, 2, tokens, heads, head_dim)``: plain K and V per
token, the same bytes whatever engine or kernel produced them, so blocks are
portable between engines, attention backends and machines.

An engine's paged cache is, per layer, a tensor of logical shape
``[num_blocks, heads, block_size, C]`` (vLLM >= 0.32 standardises every
backend's per-layer view to this; RFC #42082). What sits *inside* one
``(block, head)`` page of ``block_size x C`` elements is up to the attention
kernel: GPU backends put token ``t``'s K in ``[t, :D]`` and its V in
``[t, D:]`` (:meth:`PageMap.joined_last`), but vLLM's CPU backend packs K
transposed (``[D, block_size]``), and its AMX path tiles both K and V for the
matrix units. A :class:`PageMap` records where ``K[t, d]`` and ``V[t, d]`` live
inside a page; :meth:`PageMap.calibrate` measures it by running the engine's
own cache-write kernel on a scratch page, so every ISA-specific packing is
handled without hard-coding it. :class:`PagedKV` then gathers and scatters any
token range of any layer with that map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.connectors.page_strides import PageSide
from kvstore.errors import InvalidInputError

__all__ = ["NULL_BLOCK", "CacheWriter", "LayerGroups", "PageMap", "PagedKV"]

#: The block id an engine puts where a block was freed or never allocated: vLLM's
#: block pool reserves block 0 as its null block, and its sliding-window groups
#: point every block that fell out of the window there. Never read or written.
NULL_BLOCK = 0

#: ``write(key, value, cache, slot_mapping)``: the engine's cache-write kernel.
#: ``key``/``value`` are ``[tokens, heads, head_dim]``; ``cache`` is a paged
#: cache tensor (one layer); ``slot_mapping[i]`` is the slot of token ``i``
#: (``block * block_size + offset``).
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

# Calibration writes small integers (1..16): exact in every float dtype the
# kernels take (bf16, fp16, fp32, even fp8 e4m3), unlike bit patterns, which a
# kernel that converts through fp32 could canonicalise.
_DIGIT_BASE = 16


@dataclass(frozen=True)
class PageMap:
    """Where ``K[t, d]`` and ``V[t, d]`` sit inside one ``(block, head)`` page.

    ``k_pos[t, d]`` / ``v_pos[t, d]`` are flat indices into the page's logical
    ``[block_size, C]`` grid (``n * C + c``). A latent (MLA) cache has one vector
    per token: ``k_pos`` only, ``v_pos`` None.
    """

    block_size: int
    head_dim: int
    page_width: int
    k_pos: torch.Tensor
    v_pos: torch.Tensor | None

    @property
    def kv_factor(self) -> int:
        """2 for K and V, 1 for a latent cache."""
        return 1 if self.v_pos is None else 2

    @classmethod
    def latent(cls, block_size: int, width: int) -> PageMap:
        """An MLA page: token ``t``'s latent vector is row ``t`` (vLLM's layout on every backend
        that does not tile its cache)."""
        pos = torch.arange(block_size).unsqueeze(1) * width + torch.arange(width).unsqueeze(0)
        return cls(block_size, width, width, pos, None)

    @classmethod
    def joined_last(cls, block_size: int, head_dim: int) -> PageMap:
        """The GPU backends' page: token ``t`` is row ``t``, K then V along the last dim."""
        t = torch.arange(block_size).unsqueeze(1) * (2 * head_dim)
        d = torch.arange(head_dim).unsqueeze(0)
        return cls(block_size, head_dim, 2 * head_dim, t + d, t + head_dim + d)

    @classmethod
    def calibrate(
        cls,
        write: CacheWriter,
        like: torch.Tensor,
        head_dim: int,
        input_dtype: torch.dtype,
        kv_factor: int = 2,
    ) -> PageMap:
        """Measure the page map of the kernel ``write`` on a scratch copy of one block of ``like``.

        ``like`` is a real per-layer cache ``[blocks, heads, block_size, C]``;
        the scratch block has its strides, dtype and device. Token and dim
        indices are written as base-16 digits, one kernel call per digit, so
        every value is a small exact integer. Raises :class:`InvalidInputError`
        if the kernel does not place each element exactly once, identically for
        every head. With ``kv_factor`` 1 (a latent cache) only K is written.
        """
        _, heads, block_size, width = like.shape
        positions = []
        for side in range(kv_factor):  # 0: K, 1: V
            tok = _decode(write, like, side, head_dim, input_dtype, _token_codes(block_size))
            dim = _decode(
                write, like, side, head_dim, input_dtype, _dim_codes(block_size, head_dim)
            )
            positions.append(_invert(tok, dim, heads, block_size, head_dim))
        k_pos, v_pos = positions[0], positions[1] if kv_factor == 2 else None
        if v_pos is not None and torch.isin(k_pos, v_pos).any():
            raise InvalidInputError("calibration: K and V share page positions")
        return cls(block_size, head_dim, width, k_pos, v_pos)


def _digits(values: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``values`` as ``count`` base-16 digits, each shifted to 1..16 (0 means "not written")."""
    return [(values // _DIGIT_BASE**i) % _DIGIT_BASE + 1 for i in range(count)]


def _ndigits(n: int) -> int:
    count = 1
    while _DIGIT_BASE**count < n:
        count += 1
    return count


def _token_codes(block_size: int) -> list[torch.Tensor]:
    t = torch.arange(block_size).unsqueeze(1)  # [tokens, 1]: the same code for every dim
    return _digits(t, _ndigits(block_size))


def _dim_codes(block_size: int, head_dim: int) -> list[torch.Tensor]:
    d = torch.arange(head_dim).unsqueeze(0).expand(block_size, head_dim)
    return _digits(d, _ndigits(head_dim))


def _decode(
    write: CacheWriter,
    like: torch.Tensor,
    side: int,
    head_dim: int,
    input_dtype: torch.dtype,
    digit_codes: list[torch.Tensor],
) -> torch.Tensor:
    """Run one kernel call per digit; return the decoded index at each page element.

    Result: ``[heads, block_size * C]`` int64, -1 where the kernel wrote nothing.
    """
    _, heads, block_size, _ = like.shape
    slots = torch.arange(block_size, device=like.device)
    decoded = torch.zeros((heads, like.shape[2] * like.shape[3]), dtype=torch.int64)
    written = torch.zeros_like(decoded, dtype=torch.bool)
    for i, codes in enumerate(digit_codes):
        data = codes.expand(block_size, head_dim).unsqueeze(1).expand(block_size, heads, head_dim)
        data = data.to(device=like.device, dtype=input_dtype).contiguous()
        zeros = torch.zeros_like(data)
        scratch = torch.zeros_like(like[:1])  # keeps the real cache's stride order
        key, value = (data, zeros) if side == 0 else (zeros, data)
        write(key, value, scratch, slots)
        page = scratch[0].to(device="cpu", dtype=torch.float32).reshape(heads, -1)
        digit = page.round().to(torch.int64)
        if ((digit < 0) | (digit > _DIGIT_BASE)).any():
            raise InvalidInputError("calibration: the kernel altered the values it copied")
        decoded += (digit - 1).clamp(min=0) * _DIGIT_BASE**i
        written |= digit > 0
    return torch.where(written, decoded, torch.full_like(decoded, -1))


def _invert(
    tok: torch.Tensor, dim: torch.Tensor, heads: int, block_size: int, head_dim: int
) -> torch.Tensor:
    """From per-element (token, dim) labels to a ``[block_size, head_dim]`` position map."""
    pos = torch.full((block_size, head_dim), -1, dtype=torch.int64)
    where = (tok[0] >= 0).nonzero().squeeze(1)
    t, d = tok[0, where], dim[0, where]
    if where.numel() != block_size * head_dim or (d < 0).any() or (d >= head_dim).any():
        raise InvalidInputError(
            f"calibration: the kernel wrote {where.numel()} elements per page side, "
            f"expected {block_size * head_dim}"
        )
    pos[t, d] = where
    if (pos < 0).any():
        raise InvalidInputError("calibration: some (token, dim) has no page position")
    same = torch.equal(tok, tok[:1].expand_as(tok)) and torch.equal(dim, dim[:1].expand_as(dim))
    if not same:
        raise InvalidInputError("calibration: heads are packed differently from each other")
    return pos


class PagedKV:
    """Gather/scatter token ranges between an engine's paged caches and our layout.

    Args:
        caches: per-layer caches ``[num_blocks, heads, page_tokens, C]``, in our
            layer order; ``page_tokens`` may divide ``block_size`` (kernel blocks).
        page_map: where K and V sit inside one page.
        block_size: the engine's (scheduler's) block size in tokens.
    """

    def __init__(self, caches: Sequence[torch.Tensor], page_map: PageMap, block_size: int) -> None:
        if not caches:
            raise InvalidInputError("no KV caches to register")
        shape = tuple(caches[0].shape)
        for i, cache in enumerate(caches):
            if cache.dim() != 4 or tuple(cache.shape) != shape:
                raise InvalidInputError(
                    f"KV cache of layer {i} has shape {tuple(cache.shape)}; every layer must "
                    f"be [blocks, heads, page_tokens, C] like layer 0 {shape}"
                )
        _, self.heads, self.page_tokens, width = shape
        if (self.page_tokens, width) != (page_map.block_size, page_map.page_width):
            raise InvalidInputError(
                f"page map is for pages of {page_map.block_size} x {page_map.page_width}, "
                f"the caches have {self.page_tokens} x {width}"
            )
        if block_size % self.page_tokens:
            raise InvalidInputError(
                f"block size {block_size} is not a multiple of the kernel page {self.page_tokens}"
            )
        self.caches = list(caches)
        self.block_size = block_size
        self.head_dim = page_map.head_dim
        self.kv_factor = page_map.kv_factor
        self.device = caches[0].device
        # (row, column) of every K/V element of a page, ready for advanced indexing.
        self._k = _rows_cols(page_map.k_pos, width, self.device)
        v_pos = page_map.v_pos
        self._v = _rows_cols(v_pos, width, self.device) if v_pos is not None else None
        self._heads = torch.arange(self.heads, device=self.device).view(1, -1, 1)
        # Whole pages move with index_select / index_copy_ and one strided copy a side
        # where each side of a page is a strided view of it (every GPU backend's rows,
        # the CPU backend's transposed K, AMX tiles): no per-element indexing.
        found = [PageSide.find(pos) for pos in (page_map.k_pos, v_pos) if pos is not None]
        self._sides = [side for side in found if side is not None]
        self._whole_pages = len(self._sides) == len(found)
        # Whether K and V fill a page: if not (padding, scales), a write keeps the rest.
        self._covered = (
            self.kv_factor * self.page_tokens * self.head_dim == self.page_tokens * width
        )

    @property
    def num_layers(self) -> int:
        """Number of registered layers."""
        return len(self.caches)

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Page-level slots of tokens ``[start, end)`` of a request.

        ``block_ids[i]`` is the engine block holding the request's tokens
        ``[i * block_size, (i + 1) * block_size)``. Returns ``[end - start, 2]``:
        (kernel page, offset in page) per token.
        """
        if not 0 <= start <= end or end > len(block_ids) * self.block_size:
            raise InvalidInputError(
                f"tokens [{start}, {end}) are outside the {len(block_ids)} blocks given"
            )
        tokens = torch.arange(start, end)
        blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)[tokens // self.block_size]
        flat = blocks * self.block_size + tokens % self.block_size
        pages = torch.stack((flat // self.page_tokens, flat % self.page_tokens), dim=1)
        return pages.to(self.device)

    def pages(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        """The kernel pages holding tokens ``[start, end)``, in order, on the cache's
        device -- when the range is whole pages and each side of a page is a strided
        view of it (then :meth:`gather` and :meth:`scatter` move whole pages); else None."""
        p = self.page_tokens
        if not self._whole_pages or start % p or end % p or start >= end:
            return None
        if end > len(block_ids) * self.block_size:
            raise InvalidInputError(
                f"tokens [{start}, {end}) are outside the {len(block_ids)} blocks given"
            )
        per_block = self.block_size // p
        first = [
            block_ids[t // self.block_size] * per_block + (t % self.block_size) // p
            for t in range(start, end, p)
        ]
        return torch.as_tensor(first, dtype=torch.int64).to(self.device, non_blocking=True)

    def present(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        """Offsets (from ``start``) of tokens ``[start, end)`` not in :data:`NULL_BLOCK`;
        None when every token has a real block."""
        blocks = list(block_ids)
        first, last = start // self.block_size, -(-end // self.block_size)
        if NULL_BLOCK not in blocks[first:last]:
            return None
        tokens = torch.arange(start, end)
        real = torch.as_tensor(blocks, dtype=torch.int64)[tokens // self.block_size] != NULL_BLOCK
        return real.nonzero().squeeze(1)

    def _index(
        self, slots: torch.Tensor, rows_cols: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        page = slots[:, 0].view(-1, 1, 1)
        rows = rows_cols[0][slots[:, 1]].unsqueeze(1)  # [tokens, 1, head_dim]
        cols = rows_cols[1][slots[:, 1]].unsqueeze(1)
        return page, self._heads, rows, cols

    def gather(
        self,
        layer: int,
        slots: torch.Tensor,
        out: torch.Tensor,
        pages: torch.Tensor | None = None,
    ) -> None:
        """Copy layer ``layer`` of the tokens at ``slots`` into ``out`` ``[kv, T, heads, D]``.

        ``pages`` (from :meth:`pages`, for the same tokens): read whole pages instead.
        """
        if pages is not None:
            self._gather_pages(layer, pages, out)
            return
        cache = self.caches[layer]
        out[0].copy_(cache[self._index(slots, self._k)])
        if self._v is not None:
            out[1].copy_(cache[self._index(slots, self._v)])

    def scatter(
        self,
        layer: int,
        slots: torch.Tensor,
        src: torch.Tensor,
        pages: torch.Tensor | None = None,
    ) -> None:
        """Write ``src`` ``[kv, tokens, heads, D]`` into layer ``layer`` at ``slots``.

        ``pages`` (from :meth:`pages`, for the same tokens): write whole pages instead.
        """
        if pages is not None:
            self._scatter_pages(layer, pages, src)
            return
        cache = self.caches[layer]
        cache.index_put_(self._index(slots, self._k), src[0].to(cache.device, cache.dtype))
        if self._v is not None:
            cache.index_put_(self._index(slots, self._v), src[1].to(cache.device, cache.dtype))

    def _gather_pages(self, layer: int, pages: torch.Tensor, out: torch.Tensor) -> None:
        cache = self.caches[layer]
        whole = cache.index_select(0, pages).view(pages.numel(), self.heads, -1)
        for side, where in enumerate(self._sides):
            out[side].view(where.sizes(pages.numel(), self.heads)).copy_(where.view(whole))

    def _scatter_pages(self, layer: int, pages: torch.Tensor, src: torch.Tensor) -> None:
        cache = self.caches[layer]
        n = pages.numel()
        whole = (
            torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            if self._covered
            else cache.index_select(0, pages)
        )
        flat = whole.view(n, self.heads, -1)
        for side, where in enumerate(self._sides):
            where.view(flat).copy_(src[side].view(where.sizes(n, self.heads)))
        cache.index_copy_(0, pages, whole)


def _rows_cols(
    pos: torch.Tensor, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    return (pos // width).to(device), (pos % width).to(device)


@dataclass(frozen=True)
class LayerGroups:
    """Which engine KV cache group each layer belongs to, and which groups slide.

    ``of_layer[i]`` indexes the per-group block-id tuples of the specs; the
    default is one group holding every layer.
    """

    of_layer: tuple[int, ...] = ()
    sliding: frozenset[int] = frozenset()
    #: Layers the engine runs after it has taken the step's load errors: a speculative
    #: draft's, whose forward follows the target's (see TransferWorker.finish_load).
    late: frozenset[int] = frozenset()

    def group(self, layer: int) -> int:
        """The group of ``layer``."""
        return self.of_layer[layer] if self.of_layer else 0

    def used(self) -> list[int]:
        """The groups the layers use, each once."""
        return sorted(set(self.of_layer)) if self.of_layer else [0]
