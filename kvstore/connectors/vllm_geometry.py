"""What fixes the KV bytes and keys of a vLLM engine: its KV cache groups, read into our terms.

vLLM describes a model's KV cache as *groups* of layers sharing one block table,
each with a spec: full attention, MLA (one latent per token), sliding-window
attention, Mamba state, ... The connector serves the attention kinds:

- ``full``: plain K and V of every token (``FullAttentionSpec``; also a
  sliding-window layer when vLLM's hybrid manager is off, since vLLM then keeps
  every token of it);
- ``mla``: one latent vector per token (``MLAAttentionSpec``): kv factor 1,
  identical on every tensor-parallel rank, so stored once for all ranks;
- ``sliding``: K and V of a window (``SlidingWindowSpec``): vLLM frees the
  blocks that fall out of the window, so only blocks it still holds are saved
  and only the window is loaded.

Recurrent-state groups (``MambaSpec``: Mamba2, gated delta-net) are read into
:class:`~kvstore.connectors.vllm_state.StateGroup` (shapes, dtypes, kind, caching
mode) and every one of them is folded into the model id the keys are made from,
so no state geometry is ever served another's KV. Their state is stored per chunk
(:mod:`kvstore.connectors.vllm_hybrid`) when vLLM keeps it per block
(``mamba_cache_mode="align"``, state blocks as large as attention's). Any other
kind (chunked local attention, cross attention), or state vLLM does not keep per
block, is not stored; since a prefix hit needs every layer's state, a model with
such a group gets no kvstore hits at all, and says so at start-up.

Engine-independent in its types: the specs are read by duck typing, so this
module imports nothing of vLLM and is tested with plain objects.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.connectors.vllm_state import (
    StateGroup,
    describe_states,
    is_state_spec,
    state_fingerprint,
)
from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

__all__ = ["AttentionGroup", "EngineGeometry", "natural_key"]


@dataclass(frozen=True)
class AttentionGroup:
    """One vLLM KV cache group the connector serves.

    Args:
        index: the group's position in vLLM's ``kv_cache_groups`` (and in every
            per-group block-id tuple vLLM passes).
        kind: ``full``, ``mla`` or ``sliding``.
        layer_names: the group's attention layers.
        window: the sliding window in tokens (``sliding`` only).
    """

    index: int
    kind: str
    layer_names: tuple[str, ...]
    window: int | None = None

    def describe(self, layers: int | None = None) -> str:
        """E.g. ``6 sliding-window (512) layers`` (``layers``: a count other than this group's)."""
        n = len(self.layer_names) if layers is None else layers
        if self.kind == "sliding":
            return f"{n} sliding-window ({self.window}) layers"
        return f"{n} {'MLA' if self.kind == 'mla' else 'full-attention'} layers"


@dataclass(frozen=True)
class _SpecShape:
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_factor: int
    dtype: torch.dtype


def _classify(spec: Any) -> tuple[str | None, int | None]:
    """``(kind, window)`` of a vLLM spec; kind None for what the connector cannot serve."""
    names = [cls.__name__ for cls in type(spec).__mro__]
    if "MLAAttentionSpec" in names:
        return ("mla", None) if not getattr(spec, "sliding_window", None) else (None, None)
    if type(spec).__name__ == "SlidingWindowSpec":
        return "sliding", int(spec.sliding_window)
    if type(spec).__name__ == "FullAttentionSpec":
        return "full", None
    return None, None


def _shape(spec: Any, kind: str) -> _SpecShape:
    head_size_v = getattr(spec, "head_size_v", None)
    if kind == "mla":
        kv_factor, heads = 1, 1
    else:
        kv_factor, heads = 2, int(spec.num_kv_heads)
        if head_size_v not in (None, spec.head_size):
            raise ConfigError("KVStoreConnector needs K and V of the same head size")
    return _SpecShape(int(spec.block_size), heads, int(spec.head_size), kv_factor, spec.dtype)


@dataclass(frozen=True)
class EngineGeometry:
    """What fixes the KV bytes and keys of this vLLM instance (identical in every role).

    ``layer_names`` are the served layers in our layer order; ``groups`` the
    served groups; ``skipped`` describes the groups left to recompute (non-empty:
    the connector serves no prefix); ``num_groups`` counts all of vLLM's groups.
    """

    layer_names: tuple[str, ...]
    groups: tuple[AttentionGroup, ...]
    skipped: tuple[str, ...]
    num_groups: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_factor: int
    dtype: torch.dtype
    model_dtype: torch.dtype
    model_id: str
    tp_size: int
    pp_size: int = 1
    states: tuple[StateGroup, ...] = ()
    #: Served layers of a speculative draft (EAGLE, MTP): vLLM runs them after the
    #: target's forward, in the target's KV cache groups.
    draft_layers: tuple[str, ...] = ()

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, kv_cache_config: Any, model_id: str | None
    ) -> EngineGeometry:
        """Read the geometry; :class:`ConfigError` for models the connector cannot key."""
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        pp_size = int(parallel.pipeline_parallel_size)
        if pp_size > 1:
            _check_even_stages(model, pp_size)
        all_groups = list(kv_cache_config.kv_cache_groups)
        groups, skipped, shapes, states = _read_groups(all_groups)
        if not groups:
            has = "; ".join(skipped + [g.describe() for g in states]) or "no KV cache groups"
            raise ConfigError(
                f"KVStoreConnector found no attention layers it can store (the model has {has})"
            )
        if len(shapes) != 1:
            raise ConfigError(
                "KVStoreConnector needs one KV shape (block size, KV heads, head size, "
                f"dtype) across its attention groups; this model has {len(shapes)}"
            )
        (shape,) = shapes
        skipped += [f"{g.describe()} ({why})" for g, why in _unserved(states, shape.block_size)]
        model_id = model_id or _model_id(model)
        names = tuple(sorted((n for g in groups for n in g.layer_names), key=natural_key))
        draft, drafts = _draft(vllm_config, names)
        if draft:  # the draft's layers hold its KV: another draft, other keys
            model_id += f"|draft={draft}"
        fingerprint = state_fingerprint(tuple(states))
        if fingerprint is not None:  # any state group's change gives other keys
            model_id += f"|state={fingerprint}"
        return cls(
            layer_names=names,
            groups=tuple(groups),
            skipped=tuple(skipped),
            num_groups=len(all_groups),
            block_size=shape.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            kv_factor=shape.kv_factor,
            dtype=shape.dtype,
            model_dtype=model.dtype,
            model_id=model_id,
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=pp_size,
            states=tuple(states),
            draft_layers=drafts,
        )

    @property
    def replicated(self) -> bool:
        """MLA: every TP rank holds the same latent, so one copy serves every rank and TP size."""
        return self.kv_factor == 1

    @property
    def serves(self) -> bool:
        """False when some layers' state cannot be stored: no prefix can then be served."""
        return not self.skipped

    @property
    def plain(self) -> bool:
        """Every layer is plain or MLA attention: no recurrent state, sliding window or
        speculative draft (whose blocks at a request's end are not the chunk's alone)."""
        return not (self.states or self.sliding_groups() or self.draft_layers)

    @property
    def per_request_loads(self) -> bool:
        """Several KV cache groups: vLLM takes load failures per request, not per block,
        which only its asynchronous loads can report (see the connector)."""
        return self.num_groups > 1

    def layer_groups(self) -> list[int]:
        """vLLM group index of each served layer, in our layer order."""
        owner = {name: g.index for g in self.groups for name in g.layer_names}
        return [owner[name] for name in self.layer_names]

    def draft_indices(self) -> frozenset[int]:
        """Our indices of the speculative draft's layers."""
        return frozenset(self.layer_names.index(name) for name in self.draft_layers)

    def sliding_groups(self) -> frozenset[int]:
        """vLLM indices of the sliding-window groups (their freed blocks are vLLM's null block)."""
        return frozenset(g.index for g in self.groups if g.kind == "sliding")

    def describe(self) -> str:
        """One line for the start-up log: what kvstore serves and what it leaves to recompute."""
        counts: dict[tuple[str, int | None], int] = {}
        first: dict[tuple[str, int | None], AttentionGroup] = {}
        for g in self.groups:  # vLLM splits one kind into several equal-sized groups
            counts[g.kind, g.window] = counts.get((g.kind, g.window), 0) + len(g.layer_names)
            first.setdefault((g.kind, g.window), g)
        served = ", ".join(first[k].describe(n) for k, n in sorted(counts.items(), key=str))
        stored = len(self.groups)
        if self.serves and self.states:
            served += ", " + describe_states(self.states)
            stored += len(self.states)
        if stored > 1:
            served += f" in {stored} KV cache groups"
        if self.skipped:
            return (
                f"kvstore stores nothing for this model: it cannot store {'; '.join(self.skipped)}"
                f" and a prefix needs every layer (it would serve {served}); every prompt is "
                "recomputed"
            )
        extra = " (one copy shared by every TP rank)" if self.replicated else ""
        if self.draft_layers:
            extra += f" ({len(self.draft_layers)} of them the speculative draft's)"
        return f"kvstore serves {served}{extra}"

    def layout(self, chunk_tokens: int) -> KVLayout:
        """Our layout of one chunk of this model's KV (per TP rank unless replicated)."""
        return KVLayout(
            num_layers=len(self.layer_names),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_tokens=chunk_tokens,
            dtype=self.dtype,
            kv_factor=self.kv_factor,
        )


def _read_groups(
    all_groups: list[Any],
) -> tuple[list[AttentionGroup], list[str], set[_SpecShape], list[StateGroup]]:
    """vLLM's groups as (attention groups, descriptions of the groups not stored,
    the attention groups' shapes, recurrent-state groups)."""
    groups, skipped, shapes, states = [], [], set(), []
    for index, group in enumerate(all_groups):
        spec = group.kv_cache_spec
        names = tuple(sorted(group.layer_names, key=natural_key))
        if is_state_spec(spec):
            states.append(StateGroup.from_spec(index, names, spec))
            continue
        kind, window = _classify(spec)
        if kind is None:
            skipped.append(f"{len(group.layer_names)} {type(spec).__name__} layers")
            continue
        shapes.add(_shape(spec, kind))
        groups.append(AttentionGroup(index, kind, names, window))
    return groups, skipped, shapes, states


def _unserved(states: list[StateGroup], block_size: int) -> list[tuple[StateGroup, str]]:
    """The state groups whose state cannot be stored per chunk, and why."""
    out = []
    for g in states:
        if not g.cached_per_block:
            out.append(
                (
                    g,
                    f"vLLM keeps its state per block only with mamba_cache_mode "
                    f"'align'; this engine runs {g.cache_mode!r}",
                )
            )
        elif g.block_size != block_size:
            out.append((g, f"state blocks of {g.block_size} tokens, attention's {block_size}"))
    return out


def _draft(vllm_config: Any, names: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """The speculative draft model (``name@revision|method``) and which of ``names`` are
    its layers: vLLM numbers a draft's layers (EAGLE, MTP) after the target's."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None:
        return None, ()
    method = getattr(spec, "method", None)
    ident = f"{draft.model}@{getattr(draft, 'revision', None) or 'default'}|{method}"
    model = vllm_config.model_config
    total = getattr(model, "get_total_num_hidden_layers", None)
    if callable(total):
        target = int(total())
    else:
        config = getattr(model, "hf_text_config", None) or model.hf_config
        target = int(config.num_hidden_layers)
    found = (re.search(r"layers\.(\d+)\.", name) for name in names)
    indices = [int(m.group(1)) if m else -1 for m in found]
    return ident, tuple(n for n, i in zip(names, indices, strict=True) if i >= target)


def _check_even_stages(model: Any, pp_size: int) -> None:
    """Every pipeline stage must hold as many layers: the scheduler sees stage 0's layout
    only, and looks up every stage's blocks with it."""
    config = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if layers is None or layers % pp_size or os.environ.get("VLLM_PP_LAYER_PARTITION"):
        raise ConfigError(
            f"KVStoreConnector needs the model's layers ({layers}) split evenly across "
            f"{pp_size} pipeline stages (and no VLLM_PP_LAYER_PARTITION)"
        )


def natural_key(name: str) -> list[Any]:
    """Sort ``layers.10`` after ``layers.9``: the layer order must not depend on vLLM's."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _model_id(model: Any) -> str:
    """Model, revision, weight dtype and quantization: what changes the KV of a prompt."""
    parts = [f"{model.model}@{model.revision or 'default'}", str(model.dtype)]
    if getattr(model, "quantization", None):
        parts.append(f"quant={model.quantization}")
    return "|".join(parts)
