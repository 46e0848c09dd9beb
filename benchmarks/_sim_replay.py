"""The cluster model of ``sim_cluster.py``: a cell of nodes, its router and its shared index.

Each node has a host-memory tier and a disk tier, both LRU, sized in blocks; a block put on
a node goes to memory and is written through to disk (and to S3); memory evicts to disk
(demotion), a disk hit is promoted back to memory. The unit the tiers move is a
**segment** (:mod:`_sim_trace`): its blocks are always written and read together, so they
age together; evicting a segment at once instead of block by block is the model's one
coarsening (segments are a few blocks, a few hundred at most; tiers thousands).

The shared index is what every node and router holds in memory, fed by the Redis stream:
a node's changes become visible to the others at its next heartbeat (every ``heartbeat_s``),
so routing and peer lookups read a view up to one heartbeat old; a peer listed for a block
it has since evicted answers "not here" (``stale_hints``) and the next holder or S3 serves.

A request's blocks are each read from the cheapest copy: own memory, own disk, a peer (the
least loaded holder; not kept, unless the block turns hot -- ``hot_threshold`` fetches by
peers with ``heat_half_life_s`` decay -- and fewer than ``replicas`` nodes hold it), S3
(promoted into the node's tiers), or else computed (a miss: stored and written through).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from _sim_trace import DOC_BASE, TURN_BASE, Trace, prompt_segments

__all__ = ["ClusterModel", "Tally", "replay"]

HOST, DISK = 2, 1  # a node's medium for a segment: 0 = not held


@dataclass(frozen=True)
class ClusterModel:
    """Node capacities and the cluster settings the replay follows (kvstore defaults)."""

    host_blocks: int
    disk_blocks: int
    heartbeat_s: float = 2.0
    replicas: int = 2
    hot_threshold: float = 8.0
    heat_half_life_s: float = 60.0
    max_load_factor: float = 1.5
    warmup: float = 0.5
    #: milliseconds to load one block from own memory, own disk, a peer, S3
    ms_per_block: tuple[float, float, float, float] = (3.2, 21.0, 27.0, 35.0)


@dataclass
class Tally:
    """What one replay counted over its measured window (after the warm-up)."""

    nodes: int
    measured_s: float = 0.0
    requests: int = 0
    blocks: int = 0
    host: int = 0
    disk: int = 0
    peer: int = 0
    s3: int = 0
    miss: int = 0
    zincrby: int = 0
    claims: int = 0
    stale_hints: int = 0
    gained: int = 0
    changed: int = 0
    lost: int = 0
    heartbeats: int = 0
    heartbeat_commands: int = 0
    peer_segments: dict[int, int] = field(default_factory=dict)
    by_node: list[int] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)
    prompt_blocks: list[int] = field(default_factory=list)
    held_blocks: list[int] = field(default_factory=list)


class Node:
    """One node's two LRU tiers and its changes since the last heartbeat."""

    __slots__ = ("bit", "disk", "disk_cap", "disk_used", "host", "host_cap", "host_used", "pending")

    def __init__(self, index: int, model: ClusterModel) -> None:
        self.bit = 1 << index
        self.host: OrderedDict[int, int] = OrderedDict()
        self.disk: OrderedDict[int, int] = OrderedDict()
        self.host_cap, self.disk_cap = model.host_blocks, model.disk_blocks
        self.host_used = self.disk_used = 0
        self.pending: dict[int, tuple[int, int]] = {}  # segment -> (medium at last beat, size)

    def medium(self, seg: int) -> int:
        """Where this node holds ``seg``: HOST, DISK or 0."""
        return HOST if seg in self.host else DISK if seg in self.disk else 0

    def _note(self, seg: int, size: int) -> None:
        if seg not in self.pending:
            self.pending[seg] = (self.medium(seg), size)

    def hit(self, seg: int, size: int) -> None:
        """A read of a block this node holds: refresh it, promote it from disk."""
        if seg in self.host:
            self.host.move_to_end(seg)
            return
        self.disk.move_to_end(seg)
        self._host_add(seg, size)

    def add(self, seg: int, size: int) -> None:
        """A block new to this node: into memory, written through to disk."""
        self._host_add(seg, size)
        self._disk_add(seg, size)

    def _host_add(self, seg: int, size: int) -> None:
        self._note(seg, size)
        self.host[seg] = size
        self.host_used += size
        while self.host_used > self.host_cap and self.host:
            victim = next(iter(self.host))
            self._note(victim, self.host[victim])
            vsize = self.host.pop(victim)
            self.host_used -= vsize
            if victim not in self.disk:  # demote rather than drop
                self._disk_add(victim, vsize)

    def _disk_add(self, seg: int, size: int) -> None:
        if seg in self.disk:
            self.disk.move_to_end(seg)
            return
        self._note(seg, size)
        self.disk[seg] = size
        self.disk_used += size
        while self.disk_used > self.disk_cap and self.disk:
            victim = next(iter(self.disk))
            self._note(victim, self.disk[victim])
            self.disk_used -= self.disk.pop(victim)

    def held_blocks(self) -> int:
        """Blocks this node lists in the index (memory or disk)."""
        return self.disk_used + sum(s for g, s in self.host.items() if g not in self.disk)


def bits(mask: int) -> list[int]:
    """The node indexes set in ``mask``."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class Cell:
    """The replay of one trace through ``nodes`` nodes, routed or at random."""

    def __init__(self, trace: Trace, model: ClusterModel, nodes: int, routed: bool) -> None:
        self.trace, self.model, self.routed = trace, model, routed
        self.nodes = [Node(i, model) for i in range(nodes)]
        self.holders: dict[int, int] = {}  # the published index: segment -> node bitmask
        self.heat: dict[int, tuple[float, float]] = {}  # segment -> (heat, when)
        self.load_now = [0] * nodes
        self.load_before = [0] * nodes
        self.s3_sys = trace.others_sys.copy()  # when each shared segment reached S3
        self.s3_doc = trace.others_doc.copy()
        self.tally = Tally(nodes=nodes, by_node=[0] * nodes)
        self.start = model.warmup * trace.window_s

    def load(self, n: int) -> int:
        """Requests the router sent node ``n`` in this heartbeat and the one before."""
        return self.load_now[n] + self.load_before[n]

    def route(self, ids: list[int], sizes: list[int]) -> int:
        """The node with the longest held prefix that is not overloaded; ties: least loaded."""
        prefix: dict[int, int] = {}
        cand, depth = (1 << len(self.nodes)) - 1, 0
        for seg, size in zip(ids, sizes, strict=True):
            kept = cand & self.holders.get(seg, 0)
            for n in bits(cand & ~kept):
                prefix[n] = depth
            depth += size
            cand = kept
            if not cand:
                break
        for n in bits(cand):
            prefix[n] = depth
        loads = [self.load(n) for n in range(len(self.nodes))]
        limit = self.model.max_load_factor * sum(loads) / len(loads) + 1
        return min(
            range(len(self.nodes)),
            key=lambda n: (-(prefix.get(n, 0) if loads[n] <= limit else 0), loads[n], n),
        )

    def in_s3(self, seg: int, newest: int, t: float) -> bool:
        """Whether S3 holds ``seg`` at ``t`` (every computed block was written through)."""
        if seg >= TURN_BASE:
            return seg != newest  # earlier turns were computed (and written) earlier
        if seg >= DOC_BASE:
            return bool(self.s3_doc[seg - DOC_BASE] <= t)
        return bool(self.s3_sys[seg] <= t)

    def computed(self, seg: int, t: float) -> None:
        """A shared segment was computed here: from now on it is in S3."""
        if TURN_BASE > seg >= DOC_BASE:
            self.s3_doc[seg - DOC_BASE] = min(self.s3_doc[seg - DOC_BASE], t)
        elif seg < DOC_BASE:
            self.s3_sys[seg] = min(self.s3_sys[seg], t)

    def from_peer(self, node: Node, seg: int, size: int, t: float) -> bool:
        """Fetch ``seg`` from the least loaded peer that holds it; maybe keep a replica."""
        listed = self.holders.get(seg, 0) & ~node.bit
        if not listed:
            return False
        holding = [p for p in bits(listed) if self.nodes[p].medium(seg)]
        if t >= self.start:
            self.tally.stale_hints += len(bits(listed)) - len(holding)
        if not holding:
            return False
        peer = self.nodes[min(holding, key=lambda p: (self.load(p), p))]
        peer.hit(seg, size)
        old, when = self.heat.get(seg, (0.0, t))
        heat = old * 0.5 ** ((t - when) / self.model.heat_half_life_s) + 1.0
        self.heat[seg] = (heat, t)
        hot = heat >= self.model.hot_threshold
        replicate = hot and len(bits(self.holders.get(seg, 0))) < self.model.replicas
        if replicate:
            node.add(seg, size)
        if t >= self.start:
            self.tally.zincrby += size  # one ZINCRBY per block fetched
            self.tally.claims += int(replicate)
            self.tally.peer_segments[seg] = size
        return True

    def serve(self, n: int, ids: list[int], sizes: list[int], t: float) -> list[int]:
        """Read every block of the prompt from its cheapest copy; blocks per source."""
        node, got = self.nodes[n], [0, 0, 0, 0, 0]  # host, disk, peer, s3, computed
        newest = ids[-1]
        for seg, size in zip(reversed(ids), reversed(sizes), strict=True):
            medium = node.medium(seg)  # reversed: the prefix's head ends most recent
            if medium:
                node.hit(seg, size)
                got[0 if medium == HOST else 1] += size
            elif self.from_peer(node, seg, size, t):
                got[2] += size
            elif self.in_s3(seg, newest, t):
                node.add(seg, size)
                got[3] += size
            else:
                node.add(seg, size)
                self.computed(seg, t)
                got[4] += size
        return got

    def heartbeat(self, measuring: bool) -> None:
        """Every node publishes its changes (one stream entry); loads roll over."""
        tally = self.tally
        for node in self.nodes:
            gained = changed = lost = 0
            for seg, (before, size) in node.pending.items():
                now = node.medium(seg)
                if now == before:
                    continue
                if not before:
                    gained += size
                    self.holders[seg] = self.holders.get(seg, 0) | node.bit
                elif not now:
                    lost += size
                    left = self.holders.get(seg, 0) & ~node.bit
                    if left:
                        self.holders[seg] = left
                    else:
                        self.holders.pop(seg, None)
                else:
                    changed += size
            node.pending.clear()
            if measuring:
                tally.gained, tally.changed, tally.lost = (
                    tally.gained + gained,
                    tally.changed + changed,
                    tally.lost + lost,
                )
                # HSET held (if any gained/changed), HDEL (if any lost), PEXPIRE held,
                # HSET node (heartbeat, load), ZADD live, XADD changes
                tally.heartbeat_commands += 4 + int(gained + changed > 0) + int(lost > 0)
                tally.heartbeats += 1
        self.load_before, self.load_now = self.load_now, [0] * len(self.nodes)

    def record(self, n: int, got: list[int]) -> None:
        """Count one measured request."""
        tally = self.tally
        tally.requests += 1
        tally.by_node[n] += 1
        tally.host += got[0]
        tally.disk += got[1]
        tally.peer += got[2]
        tally.s3 += got[3]
        tally.miss += got[4]
        blocks = sum(got)
        tally.blocks += blocks
        tally.prompt_blocks.append(blocks)
        tally.load_ms.append(sum(g * c for g, c in zip(got, self.model.ms_per_block, strict=False)))

    def run(self, seed: int) -> Tally:
        """Replay the whole trace; the tally covers the requests after the warm-up."""
        trace, hb = self.trace, self.model.heartbeat_s
        picks = np.random.default_rng(seed).integers(0, len(self.nodes), len(trace.time))
        next_beat = hb
        for r, t in enumerate(trace.time.tolist()):
            while t >= next_beat:
                self.heartbeat(next_beat > self.start)
                next_beat += hb
            ids, sizes = prompt_segments(trace, r)
            n = self.route(ids, sizes) if self.routed else int(picks[r])
            self.load_now[n] += 1
            got = self.serve(n, ids, sizes, t)
            if t >= self.start:
                self.record(n, got)
        self.tally.measured_s = trace.window_s - self.start
        self.tally.held_blocks = [node.held_blocks() for node in self.nodes]
        return self.tally


def replay(trace: Trace, model: ClusterModel, nodes: int, routed: bool, seed: int) -> Tally:
    """Replay ``trace`` through ``nodes`` nodes (cache-aware router or random) and count."""
    return Cell(trace, model, nodes, routed).run(seed)
