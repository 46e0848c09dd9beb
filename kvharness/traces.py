"""A replayable synthetic serving trace, and its replay through a :class:`KVStore`.

The workload (deterministic from :attr:`TraceSpec.seed`):

- **Chat.** Sessions share one system prompt (``system_chunks`` chunks) and
  grow a history turn by turn: turn ``t`` sends the system prompt, every
  earlier user message and reply, and the new user message. So each turn's
  prompt extends the previous one and its leading chunks are a prefix hit
  if they are still cached. A fixed number of sessions is active at once;
  each request goes to a random active one, and a finished session is
  replaced by a new one.
- **Documents.** Now and then a burst of one-off long documents arrives
  (``doc_chunks`` chunks each, random tokens, no system prompt, never sent
  again) -- a batch summarisation or RAG job. Each document is a scan: its
  chunks are stored and never read back, which is exactly what makes LRU
  push the chat working set (system prompt included) out of the cache.

:func:`replay` sends each request through the store exactly like an engine:
``hash_tokens``, ``lookup``, ``get`` of the hit prefix, and ``put`` of the
rest in pieces of ``put_chunks`` (as chunked prefill would hand them over).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.layout import KVLayout
from kvstore.store import KVStore

__all__ = [
    "ReplayResult",
    "Request",
    "Trace",
    "TraceSpec",
    "distinct_chunks",
    "generate_trace",
    "replay",
    "trace_layout",
]


@dataclass(frozen=True)
class TraceSpec:
    """Shape of the workload. Ranges are inclusive ``(low, high)``."""

    seed: int = 0
    block_tokens: int = 16
    vocab: int = 32_000
    system_chunks: int = 8
    sessions: int = 64  # chat sessions over the whole trace
    active_sessions: int = 32  # sessions open at any time
    turns: tuple[int, int] = (8, 24)
    user_tokens: tuple[int, int] = (16, 64)
    reply_tokens: tuple[int, int] = (32, 160)
    burst_probability: float = 0.05  # chance a chat request is followed by a document burst
    burst_docs: tuple[int, int] = (4, 12)
    doc_chunks: tuple[int, int] = (64, 256)

    def quick(self) -> TraceSpec:
        """A smaller trace of the same shape (for smoke runs)."""
        return TraceSpec(
            seed=self.seed,
            block_tokens=self.block_tokens,
            vocab=self.vocab,
            system_chunks=self.system_chunks,
            sessions=max(1, self.sessions // 5),
            active_sessions=max(1, self.active_sessions * 2 // 5),
            turns=self.turns,
            user_tokens=self.user_tokens,
            reply_tokens=self.reply_tokens,
            burst_probability=self.burst_probability,
            burst_docs=self.burst_docs,
            doc_chunks=self.doc_chunks,
        )


@dataclass(frozen=True)
class Request:
    """One prompt: its token ids, and what produced it."""

    tokens: np.ndarray  # int32 token ids
    kind: str  # "chat" or "doc"
    session: int = -1  # chat session id; -1 for documents
    turn: int = 0


@dataclass(frozen=True)
class Trace:
    """A generated workload: the spec and the requests in arrival order."""

    spec: TraceSpec
    requests: list[Request]

    @property
    def system_tokens(self) -> int:
        """Tokens of the shared system prompt (whole chunks)."""
        return self.spec.system_chunks * self.spec.block_tokens

    def chunks(self) -> int:
        """Full chunks looked up over the whole trace."""
        return sum(len(r.tokens) // self.spec.block_tokens for r in self.requests)


def trace_layout(spec: TraceSpec) -> KVLayout:
    """A tiny layout (2 KiB per block) with the trace's chunk size, so replays are fast."""
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=32,
        block_tokens=spec.block_tokens,
        dtype=torch.bfloat16,
    )


class _Session:
    """A chat session: its id, the history so far, and the turns left."""

    def __init__(self, sid: int, system: np.ndarray, turns: int) -> None:
        self.sid = sid
        self.history = system
        self.turn = 0
        self.turns = turns


def _randint(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _tokens(rng: np.random.Generator, spec: TraceSpec, n: int) -> np.ndarray:
    return rng.integers(0, spec.vocab, n, dtype=np.int32)


def _chat_turn(rng: np.random.Generator, spec: TraceSpec, s: _Session) -> Request:
    """The next prompt of ``s``; its reply then joins the history."""
    prompt = np.concatenate([s.history, _tokens(rng, spec, _randint(rng, spec.user_tokens))])
    reply = _tokens(rng, spec, _randint(rng, spec.reply_tokens))
    s.history = np.concatenate([prompt, reply])
    s.turn += 1
    return Request(tokens=prompt, kind="chat", session=s.sid, turn=s.turn - 1)


def _requests(spec: TraceSpec) -> Iterator[Request]:
    rng = np.random.default_rng(spec.seed)
    system = _tokens(rng, spec, spec.system_chunks * spec.block_tokens)
    started = 0
    active: list[_Session] = []
    while active or started < spec.sessions:
        while len(active) < spec.active_sessions and started < spec.sessions:
            active.append(_Session(started, system, _randint(rng, spec.turns)))
            started += 1
        i = int(rng.integers(len(active)))
        yield _chat_turn(rng, spec, active[i])
        if active[i].turn >= active[i].turns:
            active.pop(i)
        if rng.random() < spec.burst_probability:
            for _ in range(_randint(rng, spec.burst_docs)):
                n = _randint(rng, spec.doc_chunks) * spec.block_tokens
                yield Request(tokens=_tokens(rng, spec, n), kind="doc")


def generate_trace(spec: TraceSpec | None = None) -> Trace:
    """The workload of ``spec`` (default :class:`TraceSpec`); same spec, same trace."""
    spec = spec or TraceSpec()
    return Trace(spec=spec, requests=list(_requests(spec)))


@dataclass
class ReplayResult:
    """Chunks looked up and hit during a replay, overall and by kind."""

    looked_up: dict[str, int] = field(default_factory=lambda: {"chat": 0, "doc": 0, "system": 0})
    hit: dict[str, int] = field(default_factory=lambda: {"chat": 0, "doc": 0, "system": 0})
    distinct: int = 0  # distinct chunk keys seen

    def hit_rate(self, kind: str | None = None) -> float:
        """Chunks hit / chunks looked up: of everything (None), ``chat``, ``doc`` or ``system``."""
        kinds = ("chat", "doc") if kind is None else (kind,)
        looked = sum(self.looked_up[k] for k in kinds)
        return sum(self.hit[k] for k in kinds) / looked if looked else 0.0


def distinct_chunks(trace: Trace, store: KVStore, namespace: str = "trace") -> int:
    """Distinct chunk keys in ``trace`` (hashes only; the store's contents are untouched)."""
    seen: set[bytes] = set()
    for req in trace.requests:
        seen.update(store.hash_tokens(req.tokens, namespace))
    return len(seen)


def replay(
    store: KVStore,
    trace: Trace,
    namespace: str = "trace",
    put_chunks: int = 16,
    settle: bool = True,
) -> ReplayResult:
    """Send every request of ``trace`` through ``store`` as an engine would; count hits.

    ``settle``: wait for the store's background moves (eviction down to the low
    watermark) after each ``put``, as if the engine's calls were spaced far
    enough apart for them to finish. That makes a replay deterministic --
    without it, which blocks are resident at the next call depends on thread
    timing (a few points of hit rate from run to run).
    """
    bt = store.layout.block_tokens
    if bt != trace.spec.block_tokens:
        raise ValueError(f"store chunks are {bt} tokens, the trace's {trace.spec.block_tokens}")
    kv = torch.zeros(store.layout.tensor_shape(put_chunks), dtype=store.layout.dtype)
    result = ReplayResult()
    seen: set[bytes] = set()
    sys_chunks = trace.spec.system_chunks
    for req in trace.requests:
        keys = store.hash_tokens(req.tokens, namespace)
        seen.update(keys)
        n = store.lookup(keys)
        if n:
            # The engine loads the hit prefix (the "use"); a block evicted since the
            # lookup (moves run in the background) shortens it rather than failing.
            out = torch.empty(store.layout.tensor_shape(n), dtype=store.layout.dtype)
            n = store.get_prefix(keys[:n], out)
        for start in range(n, len(keys), put_chunks):
            part = keys[start : start + put_chunks]
            store.put(part, kv[:, :, : len(part) * bt])
            if settle:
                store.drain()
        result.looked_up[req.kind] += len(keys)
        result.hit[req.kind] += n
        if req.kind == "chat":
            result.looked_up["system"] += sys_chunks
            result.hit["system"] += min(n, sys_chunks)
    result.distinct = len(seen)
    return result
