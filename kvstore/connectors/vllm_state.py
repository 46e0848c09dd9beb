"""Recurrent-state KV cache groups of a vLLM engine (Mamba2, gated delta-net), in our terms.

A hybrid model keeps, beside its attention KV, a fixed-size *state* per layer
(Mamba2: a conv state and an SSM state; Qwen3-Next's gated delta-net: a conv
state and a recurrent state). vLLM describes such a group with a ``MambaSpec``:
one tuple of ``shapes`` and one of ``dtypes`` per layer (the tensors of one
block), and in ``mamba_cache_mode="align"`` it keeps, per block boundary of a
prompt, the state after that boundary's last token in the block of that index.

This module reads those groups (by duck typing: no vLLM import, tested with
plain objects) and folds every one of them into a fingerprint, which the
connector puts into its namespace: a change of any group's shapes, dtypes,
kind or caching mode gives other keys, so a state stored for one geometry is
never served to another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvstore.errors import ConfigError

__all__ = ["StateGroup", "describe_states", "is_state_spec", "state_fingerprint"]


def is_state_spec(spec: Any) -> bool:
    """Whether a vLLM KV cache spec is a recurrent state (``MambaSpec`` or a subclass)."""
    return any(cls.__name__ == "MambaSpec" for cls in type(spec).__mro__)


@dataclass(frozen=True)
class StateGroup:
    """One vLLM KV cache group of recurrent state.

    Args:
        index: the group's position in vLLM's ``kv_cache_groups``.
        layer_names: the group's layers (natural order).
        shapes: the shape of each state tensor of one layer's block.
        dtypes: the dtype of each of those tensors.
        kind: vLLM's ``mamba_type``, by name (e.g. ``mamba2``, ``gdn_attn``).
        cache_mode: vLLM's ``mamba_cache_mode``; only ``align`` keeps a state per block.
        block_size: tokens per block of the group (the state's granularity).
    """

    index: int
    layer_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    kind: str
    cache_mode: str
    block_size: int

    @classmethod
    def from_spec(cls, index: int, layer_names: tuple[str, ...], spec: Any) -> StateGroup:
        """Read a ``MambaSpec``; :class:`ConfigError` when its shapes and dtypes disagree."""
        shapes = tuple(tuple(int(d) for d in s) for s in spec.shapes)
        dtypes = tuple(spec.dtypes)
        if len(shapes) != len(dtypes) or not shapes:
            raise ConfigError(
                f"KV cache group {index}: a state spec needs one dtype per state tensor "
                f"(got {len(shapes)} shapes and {len(dtypes)} dtypes)"
            )
        kind = getattr(spec, "mamba_type", "mamba")
        return cls(
            index=index,
            layer_names=layer_names,
            shapes=shapes,
            dtypes=dtypes,
            kind=str(getattr(kind, "name", kind)).lower(),  # vLLM's enum: MAMBA2, GDN_ATTN
            cache_mode=str(getattr(spec, "mamba_cache_mode", "none")),
            block_size=int(spec.block_size),
        )

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's state (every tensor of one block, unpadded)."""
        return sum(
            math.prod(s) * torch.empty((), dtype=d).element_size()
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def cached_per_block(self) -> bool:
        """vLLM keeps a state at every block boundary (align mode): a prefix can resume."""
        return self.cache_mode == "align"

    def spec_text(self) -> str:
        """Everything that fixes the state's bytes, as text (what the fingerprint covers)."""
        tensors = ",".join(
            f"{'x'.join(map(str, s))}:{str(d).removeprefix('torch.')}"
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )
        return (
            f"g{self.index}:{self.kind}:{self.cache_mode}:b{self.block_size}:"
            f"n{len(self.layer_names)}:[{tensors}]"
        )

    def describe(self, layers: int | None = None) -> str:
        """E.g. ``3 mamba2 state layers (2 tensors, 49152 bytes each)`` (``layers``: a
        count other than this group's)."""
        n = len(self.layer_names) if layers is None else layers
        return (
            f"{n} {self.kind} state layers ({len(self.shapes)} tensors, "
            f"{self.layer_nbytes} bytes each)"
        )


def describe_states(groups: Sequence[StateGroup]) -> str:
    """The state groups for the start-up log, alike ones together (vLLM puts each
    state layer of a hybrid in a group of its own)."""
    counts: dict[tuple[str, int, int], int] = {}
    first: dict[tuple[str, int, int], StateGroup] = {}
    for g in groups:
        like = (g.kind, len(g.shapes), g.layer_nbytes)
        counts[like] = counts.get(like, 0) + len(g.layer_names)
        first.setdefault(like, g)
    return ", ".join(first[k].describe(n) for k, n in counts.items())


def state_fingerprint(groups: tuple[StateGroup, ...]) -> str | None:
    """16 hex digits over every state group's spec (None without state groups).

    Folded into the connector's namespace, so attention KV and state stored
    for one hybrid geometry never serve another.
    """
    if not groups:
        return None
    text = ";".join(g.spec_text() for g in sorted(groups, key=lambda g: g.index))
    return xxhash.xxh3_64_hexdigest(text.encode())
