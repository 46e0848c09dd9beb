"""The trace generator of ``sim_cluster.py``: seeded serving traffic with real prompt sharing.

A prompt is a chain of **segments**, each a run of whole blocks that is always computed,
written and read together:

- a **system prompt** (a pool of ``system_prompts``, chosen by a Zipf law of exponent
  ``system_zipf``: a few prompts carry most traffic, as in a multi-tenant deployment);
- for a share ``doc_share`` of sessions, a **document** (a pool of ``docs`` +
  ``docs_per_node`` x nodes, Zipf ``doc_zipf``: RAG contexts, code repositories, long
  manuals). A document always sits behind the same system prompt (its application's), so
  its blocks -- chained hashes of the whole prefix -- are one set of keys cluster-wide;
- one segment per **turn** of a multi-turn session: the previous reply plus the new user
  message. Turn ``t`` sends every earlier turn again, so it extends the previous prompt.

Sessions start as a Poisson process (``rate_per_node`` requests/s per node, divided by the
mean number of turns), have a geometric number of turns (mean ``turns_mean``) separated by
exponential think times (mean ``think_s``), and end early at ``max_tokens``. Lengths are
log-normal around the ``*_tokens_median`` knobs (``length_sigma``), rounded up to blocks.
Everything is drawn from one ``numpy`` generator seeded by ``seed``: the same arguments give
the same trace, bit for bit.

The simulation replays the traffic of a **cell** of ``cell_nodes`` nodes; the rest of the
cluster is represented by the time at which some node outside the cell first computed (and
wrote through to S3) each shared system prompt and document (:attr:`Trace.others_sys` /
:attr:`Trace.others_doc`): an exponential draw at the rate at which the other nodes' sessions
pick that item. Per-session segments (turns) are private to one session, so to the cell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DOC_BASE",
    "TURN_BASE",
    "CellSpec",
    "Trace",
    "TraceConfig",
    "generate",
    "infinite_hit_rate",
    "prompt_segments",
]

#: Segment ids: system prompt ``s`` is ``s``, document ``d`` is ``DOC_BASE + d``, turn ``i``
#: (a row of :attr:`Trace.turn_blocks`) is ``TURN_BASE + i``: disjoint ranges, plain ints.
DOC_BASE = 1 << 32
TURN_BASE = 1 << 48


@dataclass(frozen=True)
class TraceConfig:
    """The knobs of the workload (defaults: a chat + RAG service; all of them assumed)."""

    block_tokens: int = 256
    rate_per_node: float = 4.0
    system_prompts: int = 200
    system_zipf: float = 1.0
    system_tokens_median: int = 1024
    docs: int = 20_000
    docs_per_node: int = 0
    doc_zipf: float = 0.9
    doc_tokens_median: int = 4096
    doc_share: float = 0.3
    turns_mean: float = 4.0
    think_s: float = 30.0
    turn_tokens_median: int = 512
    length_sigma: float = 0.8
    max_tokens: int = 131_072


@dataclass(frozen=True)
class Trace:
    """One cell's requests, sorted by time, and the segments they are made of.

    Request ``r`` of session ``j = session[r]`` sends system prompt ``session_sys[j]``, then
    document ``session_doc[j]`` (-1: none), then turns ``turn_first[j]`` .. ``turn[r]``
    (rows of ``turn_blocks``; the last one is new). ``window_s`` is the replayed time.
    """

    time: np.ndarray
    session: np.ndarray
    turn: np.ndarray
    session_sys: np.ndarray
    session_doc: np.ndarray
    turn_first: np.ndarray
    turn_blocks: np.ndarray
    sys_blocks: np.ndarray
    doc_blocks: np.ndarray
    others_sys: np.ndarray
    others_doc: np.ndarray
    window_s: float


@dataclass(frozen=True)
class CellSpec:
    """Which part of which cluster a trace is drawn for."""

    nodes: int
    cell_nodes: int
    requests: int
    seed: int


def zipf_probs(n: int, exponent: float) -> np.ndarray:
    """P(rank k) proportional to k^-exponent, k = 1..n (rank 1 is item 0)."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    probs: np.ndarray = weights / weights.sum()
    return probs


def draw(rng: np.random.Generator, probs: np.ndarray, size: int) -> np.ndarray:
    """``size`` items drawn with ``probs`` (inverse CDF: fast and deterministic)."""
    cdf = np.cumsum(probs)
    picks = np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right")
    items: np.ndarray = np.minimum(picks, len(probs) - 1).astype(np.int64)
    return items


def lengths(rng: np.random.Generator, median_tokens: int, sigma: float, size: int) -> np.ndarray:
    """Log-normal token counts around ``median_tokens`` (``sigma``: of the log)."""
    tokens: np.ndarray = median_tokens * np.exp(sigma * rng.standard_normal(size))
    return tokens


def blocks_of(tokens: np.ndarray, cfg: TraceConfig, cap_tokens: int) -> np.ndarray:
    """Token counts rounded up to whole blocks, between 1 and ``cap_tokens``'s blocks."""
    cap = max(1, cap_tokens // cfg.block_tokens)
    return np.clip(np.ceil(tokens / cfg.block_tokens), 1, cap).astype(np.int64)


def others_first(
    rng: np.random.Generator, probs: np.ndarray, rate: float, start: float
) -> np.ndarray:
    """When the nodes outside the cell first use each item (inf: never in the window)."""
    if rate <= 0:
        return np.full(len(probs), math.inf)
    with np.errstate(divide="ignore"):
        return start + rng.exponential(1.0, len(probs)) / (rate * probs)


@dataclass(frozen=True)
class Pools:
    """The shared items: popularity, each document's system prompt, sizes in blocks."""

    sys_p: np.ndarray
    doc_p: np.ndarray
    doc_sys: np.ndarray
    sys_blocks: np.ndarray
    doc_blocks: np.ndarray


def pools(rng: np.random.Generator, cfg: TraceConfig, nodes: int) -> Pools:
    """Draw the system prompts and documents of a ``nodes``-node cluster."""
    sys_p = zipf_probs(cfg.system_prompts, cfg.system_zipf)
    n_docs = cfg.docs + cfg.docs_per_node * nodes
    doc_p = zipf_probs(n_docs, cfg.doc_zipf)
    sys_tokens = lengths(rng, cfg.system_tokens_median, cfg.length_sigma, cfg.system_prompts)
    doc_tokens = lengths(rng, cfg.doc_tokens_median, cfg.length_sigma, n_docs)
    return Pools(
        sys_p=sys_p,
        doc_p=doc_p,
        doc_sys=draw(rng, sys_p, n_docs),
        sys_blocks=blocks_of(sys_tokens, cfg, 16384),
        doc_blocks=blocks_of(doc_tokens, cfg, 65536),
    )


def turn_times(
    rng: np.random.Generator, cfg: TraceConfig, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each session's turns: (owner session of each turn row, first row of each, times)."""
    turns = rng.geometric(1.0 / cfg.turns_mean, len(starts))
    turn_first = (np.cumsum(turns) - turns).astype(np.int64)
    owner = np.repeat(np.arange(len(starts)), turns)
    index = np.arange(len(owner)) - turn_first[owner]
    gaps = np.where(index == 0, 0.0, rng.exponential(cfg.think_s, len(owner)))
    return owner, turn_first, starts[owner] + _segmented_cumsum(gaps, turn_first, owner)


def generate(cfg: TraceConfig, spec: CellSpec) -> Trace:
    """Draw the trace of one cell of ``spec.cell_nodes`` nodes in a ``spec.nodes`` cluster."""
    rng = np.random.default_rng(spec.seed)
    cell = min(spec.nodes, spec.cell_nodes)
    window = spec.requests / (cell * cfg.rate_per_node)
    # Sessions start before t=0 too, so the request rate is steady from the first request
    # (the caches still start cold: the replay's warm-up is what absorbs that).
    ramp = 4.0 * cfg.turns_mean * cfg.think_s
    n_sessions = int(rng.poisson(cell * cfg.rate_per_node / cfg.turns_mean * (window + ramp)))
    starts = rng.uniform(-ramp, window, n_sessions)
    items = pools(rng, cfg, spec.nodes)
    has_doc = rng.random(n_sessions) < cfg.doc_share
    session_doc = np.where(has_doc, draw(rng, items.doc_p, n_sessions), -1)
    doc_or_0 = np.maximum(session_doc, 0)
    chat_sys = draw(rng, items.sys_p, n_sessions)
    session_sys = np.where(has_doc, items.doc_sys[doc_or_0], chat_sys)
    owner, turn_first, times = turn_times(rng, cfg, starts)
    turn_tokens = lengths(rng, cfg.turn_tokens_median, cfg.length_sigma, len(owner))
    turn_blocks = blocks_of(turn_tokens, cfg, cfg.max_tokens)
    base = items.sys_blocks[session_sys] + np.where(has_doc, items.doc_blocks[doc_or_0], 0)
    prompt = base[owner] + _segmented_cumsum(turn_blocks, turn_first, owner)
    # A session ends early once its prompt would pass max_tokens.
    keep = (times >= 0) & (times < window) & (prompt <= cfg.max_tokens // cfg.block_tokens)
    rows = np.flatnonzero(keep)[np.argsort(times[keep], kind="stable")]
    # The rest of the cluster (nodes - cell of them) starts sessions at this rate.
    others_rate = (spec.nodes - cell) * cfg.rate_per_node / cfg.turns_mean
    via_docs = np.bincount(items.doc_sys, weights=items.doc_p, minlength=cfg.system_prompts)
    sys_use = (1 - cfg.doc_share) * items.sys_p + cfg.doc_share * via_docs
    return Trace(
        time=times[rows],
        session=owner[rows],
        turn=rows,
        session_sys=session_sys,
        session_doc=session_doc,
        turn_first=turn_first,
        turn_blocks=turn_blocks,
        sys_blocks=items.sys_blocks,
        doc_blocks=items.doc_blocks,
        others_sys=others_first(rng, sys_use, others_rate, -ramp),
        others_doc=others_first(rng, cfg.doc_share * items.doc_p, others_rate, -ramp),
        window_s=window,
    )


def _segmented_cumsum(values: np.ndarray, first: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """The running sum of ``values`` within each session (rows ``first[j]`` onwards)."""
    total = np.cumsum(values)
    before = np.where(first > 0, total[np.maximum(first - 1, 0)], 0)
    out: np.ndarray = total - before[owner]
    return out


def prompt_segments(trace: Trace, r: int) -> tuple[list[int], list[int]]:
    """Request ``r``'s segment ids and sizes in blocks, in prompt order."""
    j = int(trace.session[r])
    s = int(trace.session_sys[j])
    ids = [s]
    sizes = [int(trace.sys_blocks[s])]
    d = int(trace.session_doc[j])
    if d >= 0:
        ids.append(DOC_BASE + d)
        sizes.append(int(trace.doc_blocks[d]))
    first = int(trace.turn_first[j])
    last = int(trace.turn[r])
    ids.extend(range(TURN_BASE + first, TURN_BASE + last + 1))
    sizes.extend(trace.turn_blocks[first : last + 1].tolist())
    return ids, sizes


def infinite_hit_rate(trace: Trace) -> float:
    """The share of prompt blocks an infinite cache of this cell alone would hold."""
    seen: set[int] = set()
    hits = total = 0
    for r in range(len(trace.time)):
        ids, sizes = prompt_segments(trace, r)
        for seg, size in zip(ids, sizes, strict=True):
            total += size
            if seg in seen:
                hits += size
            seen.add(seg)
    return hits / total if total else 0.0
