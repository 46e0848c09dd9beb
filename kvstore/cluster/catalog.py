"""Which layout ``kvstore route`` ranks in: the (namespace, layout) stores the index holds.

A node's blocks are listed in the shared index per namespace and layout fingerprint
(:mod:`kvstore.cluster.index`), and each node writes its layouts' descriptions there
too. So a router that was told no layout can take the one its namespace holds, and
one that was told a layout the index does not hold can say what it does hold,
instead of ranking every node at 0 chunks with no word why.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.cluster.index import ClusterIndex, IndexedStore
from kvstore.errors import InvalidInputError
from kvstore.layout import KVLayout

__all__ = ["describe_stores", "route_layout"]

_FLAGS = "--layers, --kv-heads, --head-dim, --block-tokens and --dtype"


def describe_stores(stores: Sequence[IndexedStore]) -> str:
    """``namespace N: layout F (geometry; B blocks on K nodes)``, each, or ``nothing``."""
    parts = []
    for s in stores:
        what = ""
        if s.layout is not None:
            d = s.layout
            what = (
                f"{d.get('num_layers')} layers x {d.get('num_kv_heads')} KV heads x "
                f"{d.get('head_dim')}, {d.get('block_tokens')} tokens, {d.get('dtype')}; "
            )
        nodes = len(s.blocks)
        held = f"{sum(s.blocks.values()):,} blocks on {nodes} node{'s' * (nodes != 1)}"
        parts.append(f"namespace {s.namespace}: layout {s.fingerprint} ({what}{held})")
    return "; ".join(parts) or "nothing"


def route_layout(
    index: ClusterIndex,
    namespace: str,
    given: KVLayout | None,
    fingerprint: str | None,
    fallback: KVLayout,
) -> tuple[KVLayout, list[str]]:
    """The layout to rank in, and notes for the user.

    ``given`` (the layout flags) is used as it is, with a note when the index holds no
    blocks of it in ``namespace``. Else the one layout of ``namespace`` the index holds
    (the one ``fingerprint`` -- or a unique start of it -- names, when given);
    :class:`InvalidInputError` when that is ambiguous, absent or undescribed. With
    neither and nothing in ``namespace``: ``fallback``, with a note.
    """
    stores = index.stores()
    mine = [s for s in stores if s.namespace == namespace]
    if given is not None:
        if any(s.fingerprint == given.fingerprint_hex for s in mine):
            return given, []
        return given, [
            f"no node lists blocks of layout {given.fingerprint_hex} in namespace "
            f"{namespace}; the index holds: {describe_stores(stores)}"
        ]
    wanted = (fingerprint or "").lower()
    found = [s for s in mine if s.fingerprint.startswith(wanted)]
    if len(found) == 1:
        return _described(found[0]), []
    if found:
        raise InvalidInputError(
            f"namespace {namespace} holds {len(found)} layouts in the index: "
            f"{describe_stores(found)}; pass --layout FINGERPRINT"
        )
    if fingerprint is not None:
        raise InvalidInputError(
            f"--layout {fingerprint}: no node lists blocks of it in namespace {namespace}; "
            f"the index holds: {describe_stores(stores)}"
        )
    elsewhere = " (pass --namespace)" if stores else ""
    return fallback, [
        f"the index holds no blocks in namespace {namespace}; it holds: "
        f"{describe_stores(stores)}{elsewhere}; ranking for layout {fallback.fingerprint_hex}"
    ]


def _described(store: IndexedStore) -> KVLayout:
    """The layout the nodes described, or :class:`InvalidInputError` asking for its flags."""
    why = "the index does not describe it (its nodes run an older kvstore)"
    if store.layout is not None:
        try:
            return KVLayout.from_description(store.layout)
        except InvalidInputError as exc:
            why = f"the index's description of it is unreadable ({exc})"
    raise InvalidInputError(
        f"layout {store.fingerprint} in namespace {store.namespace}: {why}; "
        f"pass its flags ({_FLAGS})"
    )
