"""Cache-aware routing: send a prompt to the node that can load its prefix fastest.

>>> router = Router(store_config.cluster, layout)
>>> ranked = router.rank(keys)          # or router.rank_tokens(token_ids, "my-model")
>>> ranked[0].node_id, ranked[0].merit, ranked[0].prefix_blocks

Each node's **figure of merit** for a prompt counts the leading chunks it
could load without recomputing them, each weighted by where the node would
load it from: its own memory (host DRAM or GPU, ``route_memory_weight``,
default 1.0), its own disk (``route_disk_weight``, 0.6) or the shared S3 tier
that every node reads (``route_shared_weight``, 0.3). The prefix ends at the
first chunk that neither the node nor S3 holds. So a node holding a prefix in
memory ranks above one holding it on disk, which ranks above a node that
would read it from S3, which ranks above a node that must recompute it.
``load_weight`` trades merit for load: a node's score is its merit minus
``load_weight`` times the load (requests per second) of its last heartbeat
(0, the default: load only breaks ties).

**Time, where the nodes publish it.** Each node's heartbeat carries its live
read speeds (memory, disk, shared storage) and its engine's prefill speed
(:class:`~kvstore.cluster.speeds.NodeSpeeds`), so each rank also says, in
milliseconds, how long the node would take to load its share of the prefix
(``restore_ms``) and to have the prompt ready (``ready_ms``): loading the leading
chunks that pay and recomputing the rest, by the restore planner's rule
(:meth:`~kvstore.cluster.speeds.NodeSpeeds.plan`), so a prefix on a medium slower
than the node's prefill costs no more than recomputing it. When every live node
gives a ``ready_ms``, nodes rank by it (least first; then load) instead of by
merit: a node holding the prefix on a disk that is slow today ranks below one that
reads it from a fast S3 and below one that recomputes it faster.

Lookups read this process's copy of the shared index
(:class:`~kvstore.cluster.view.IndexView`): no Redis round trip per prompt.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.cluster.index import ClusterIndex, NodeInfo
from kvstore.cluster.view import IndexView
from kvstore.config import ClusterConfig
from kvstore.errors import InvalidInputError
from kvstore.keys import BlockKey, Namespace, chain_keys, check_keys, tokens_to_bytes
from kvstore.layout import KVLayout

__all__ = ["NodeRank", "Router"]


@dataclass(slots=True)
class NodeRank:
    """One node's standing for a prompt.

    ``prefix_blocks``: leading chunks the node holds itself (memory or disk);
    ``memory_blocks`` / ``disk_blocks`` / ``shared_blocks``: the chunks of the
    prefix it can load (its own and, past them, S3's) by where it would load
    them from; ``merit``: their weighted sum; ``restore_ms`` / ``ready_ms``: the
    expected milliseconds to load them all / to have the prompt's chunks ready,
    loading those that pay and recomputing the rest (None: the node did not
    publish the speeds it needs).
    """

    node_id: str
    advertise: str | None
    prefix_blocks: int
    load: float
    memory_blocks: int = 0
    disk_blocks: int = 0
    shared_blocks: int = 0
    merit: float = 0.0
    restore_ms: float | None = None
    ready_ms: float | None = None


class Router:
    """Ranks the live nodes of a cluster for prompts of one layout and namespace."""

    def __init__(
        self,
        cluster: ClusterConfig,
        layout: KVLayout,
        namespace: str | None = None,
        index: ClusterIndex | None = None,
        load_weight: float = 0.0,
    ) -> None:
        self.cluster = cluster
        self.layout = layout
        self.namespace = namespace or cluster.namespace
        self.index = index if index is not None else ClusterIndex(cluster)
        self.load_weight = load_weight
        self._weights = (
            cluster.route_memory_weight,
            cluster.route_disk_weight,
            cluster.route_shared_weight,
        )
        self._chunk = (layout.block_nbytes, layout.block_tokens)
        self._owns_index = index is None
        self._view: IndexView | None = None

    def view(self) -> IndexView:
        """The in-memory copy of the index this router reads (loaded on first use;
        TierError if Redis cannot be reached then)."""
        if self._view is None:
            view = IndexView(self.index, self.namespace, self.layout.fingerprint_hex)
            view.start()
            self._view = view
        return self._view

    def rank(self, keys: Sequence[BlockKey]) -> list[NodeRank]:
        """Every live node, best first (see the module docstring)."""
        view = self.view()
        nodes, live = view.live()
        bits = _checked_bits(view, keys)
        counts = _prefix_counts(bits, live, len(keys))
        standing, none = self._standing, _Counts(len(keys))
        ranks = [standing(info, counts.get(slot, none), len(keys)) for slot, info in nodes.items()]
        if ranks and all(r.ready_ms is not None for r in ranks):
            return sorted(ranks, key=lambda r: (r.ready_ms or 0.0, r.load, r.node_id))
        weight = self.load_weight
        return sorted(ranks, key=lambda r: (-(r.merit - weight * r.load), r.load, r.node_id))

    def _standing(self, info: NodeInfo, counts: _Counts, total: int) -> NodeRank:
        """One node's rank: a few operations whatever the prompt's length (a router ranks
        every live node for every prompt)."""
        memory, disk = counts.memory, counts.disk
        shared = counts.prefix - memory - disk
        w_memory, w_disk, w_shared = self._weights
        merit = w_memory * memory + w_disk * disk + w_shared * shared
        nbytes, tokens = self._chunk
        rest = (total - counts.prefix) * tokens
        restore, ready = info.speeds.times((memory, disk, shared), nbytes, rest, tokens)
        return NodeRank(
            info.node_id,
            info.advertise,
            counts.own,
            info.load,
            memory,
            disk,
            shared,
            round(merit, 6),
            restore,
            ready,
        )

    def rank_tokens(self, token_ids: Any, namespace: Namespace | str) -> list[NodeRank]:
        """:meth:`rank` for a prompt's tokens, hashed as the engines hash them in
        ``namespace`` (a :class:`~kvstore.keys.Namespace`, or a model name as
        ``KVStore.namespace`` takes it); a trailing partial chunk has no key."""
        if isinstance(namespace, str):
            namespace = Namespace(model=namespace, layout=self.layout)
        elif not isinstance(namespace, Namespace):
            raise InvalidInputError(
                "namespace must be a model id string or a Namespace, "
                f"got {type(namespace).__name__}"
            )
        namespace.check_layout(self.layout)
        step = self.layout.block_tokens
        full = None
        if isinstance(token_ids, (list, tuple)):
            full = len(token_ids) - len(token_ids) % step
        return self.rank(chain_keys(tokens_to_bytes(token_ids, limit=full), step, namespace.seed))

    def best(self, keys: Sequence[BlockKey]) -> NodeRank | None:
        """The node to send the prompt to (None: no node is alive)."""
        ranked = self.rank(keys)
        return ranked[0] if ranked else None

    def close(self) -> None:
        """Stop following the index and drop the Redis connections (idempotent)."""
        if self._view is not None:
            self._view.close()
            self._view = None
        if self._owns_index:
            self.index.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Counts:
    """One node's prefix: its length (own and S3 chunks), and the node's own chunks."""

    prefix: int
    own: int = 0
    own_run: bool = True
    memory: int = 0
    disk: int = 0


def _prefix_counts(bits: list[int], live: int, n: int) -> dict[int, _Counts]:
    """Per live slot, the :class:`_Counts` of the prompt whose keys have ``bits``.

    One pass over runs of keys with the same holders (a prompt's chunks come in a
    few long runs: held by the same nodes, in the same media), with a mask of the
    nodes whose prefix is still running; only the holders of each run are visited,
    so the cost grows with the runs and the copies, not with the keys or the nodes.
    """
    counts: dict[int, _Counts] = {}
    running = live
    start = 0
    for b, group in itertools.groupby(bits):
        run = len(list(group))
        held = b & running
        if not b & 1:  # not in S3: nodes that lack it stop here
            for slot in _slots(running & ~held):
                counts.setdefault(slot, _Counts(n)).prefix = start
            running = held
            if not running:
                break
        for slot in _slots(held):
            c = counts.setdefault(slot, _Counts(n))
            if b & (2 << (2 * slot)):
                c.memory += run
            else:
                c.disk += run
            if c.own_run:
                c.own += run
        for slot in _slots(running & ~held):  # in S3 only: their own run ends
            counts.setdefault(slot, _Counts(n)).own_run = False
        start += run
    return counts


def _checked_bits(view: IndexView, keys: Sequence[BlockKey]) -> list[int]:
    """``view.bits(keys)``, with the keys validated (InvalidInputError otherwise).

    A key the index holds is a valid key (only valid keys are ever stored), so
    only the keys not found are checked: a lookup of a long cached prefix costs
    a dict probe per key and no per-key validation in Python.
    """
    if not isinstance(keys, (list, tuple)):
        keys = check_keys(keys)
    try:
        bits = view.bits(keys)
    except TypeError:  # unhashable: a bytearray (made bytes here) or no key at all
        keys = check_keys(keys)
        bits = view.bits(keys)
    missing = bits.count(0)
    if missing:
        first = bits.index(0)
        if missing == len(bits) - first:  # the usual shape: a held prefix, a missing tail
            check_keys(keys[first:], f"keys[{first}:]")
        else:
            check_keys(list(itertools.compress(keys, map(operator.not_, bits))), "keys not held")
    return bits


def _slots(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() // 2)
        mask ^= low
    return out
