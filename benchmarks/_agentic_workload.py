"""The agentic workload of bench_agentic.py: sessions of growing prompts with tool time
between turns, their interleaved schedule, the simulated clock, the restore buffer, and the
per-turn records with their percentiles."""

from __future__ import annotations

import contextlib
import heapq
import math
import mmap
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore import KVLayout

# --------------------------------------------------------------------------- workload

VOCAB = 32000


@dataclass(frozen=True)
class Workload:
    """Every parameter of the workload and the store (the JSON's ``workload``)."""

    sessions: int = 24
    turns: int = 12
    seed: int = 0
    block_tokens: int = 256
    num_layers: int = 8
    num_kv_heads: int = 4
    head_dim: int = 128
    system_chunks: int = 4  #: the shared system prompt (tool definitions)
    task_tokens: tuple[int, int] = (256, 512)
    answer_tokens: tuple[int, int] = (64, 320)
    tool_tokens: tuple[int, int] = (128, 640)
    decode_tokens_per_s: float = 50.0  #: simulated: the answer's decode time
    short_gap_s: tuple[float, float] = (2.0, 20.0)
    long_gap_s: tuple[float, float] = (60.0, 300.0)  #: log-uniform
    long_gap_fraction: float = 0.5
    start_spread_s: float = 120.0
    prefill_tokens_per_s: float = 8000.0
    fast_fraction: float = 0.25  #: host tier / all the sessions' chunks
    idle_s: float = 30.0  #: hinted: a tool time this long demotes the session
    lead_s: float = 2.0  #: hinted: prefetch this long before the next turn
    retain_s: float = 600.0
    priority: int = 50

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_tokens=self.block_tokens,
            dtype=torch.bfloat16,
        )


@dataclass
class Turn:
    """One turn of one session: when it arrives, its prompt, what it appends."""

    session: int
    index: int
    arrive_s: float
    end_s: float  #: the answer decoded; the tool starts
    prompt_tokens: int
    answer_tokens: int
    gap_before_s: float | None  #: the tool time before this turn (None: the first turn)
    gap_after_s: float | None  #: the tool time after it (None: the last turn)


@dataclass
class Schedule:
    """The whole timeline, fixed before anything runs."""

    turns: list[Turn]
    tokens: list[np.ndarray]  #: per session, every token it will ever send
    total_chunks: int  #: distinct chunks all sessions store (the shared prompt once)


def make_schedule(w: Workload) -> Schedule:
    """Seeded sessions, turns and gaps (see the module docstring)."""
    rng = random.Random(w.seed)
    gen = np.random.default_rng(w.seed)
    bt = w.block_tokens
    system = gen.integers(0, VOCAB, w.system_chunks * bt, dtype=np.int64)
    turns: list[Turn] = []
    tokens: list[np.ndarray] = []
    total = w.system_chunks
    for s in range(w.sessions):
        now = rng.uniform(0.0, w.start_spread_s)
        length = w.system_chunks * bt + rng.randint(*w.task_tokens)
        gap_before: float | None = None
        for t in range(w.turns):
            answer = rng.randint(*w.answer_tokens)
            end = now + answer / w.decode_tokens_per_s
            gap_after: float | None = None
            if t + 1 < w.turns:
                if rng.random() < w.long_gap_fraction:
                    lo, hi = w.long_gap_s
                    gap_after = math.exp(rng.uniform(math.log(lo), math.log(hi)))
                else:
                    gap_after = rng.uniform(*w.short_gap_s)
            turns.append(Turn(s, t, now, end, length, answer, gap_before, gap_after))
            if gap_after is None:
                length += answer
                break
            length += answer + rng.randint(*w.tool_tokens)
            now, gap_before = end + gap_after, gap_after
        own = gen.integers(0, VOCAB, length - len(system), dtype=np.int64)
        tokens.append(np.concatenate([system, own]))
        total += length // bt - w.system_chunks
    return Schedule(turns, tokens, total)


# --------------------------------------------------------------------------- the run


class Clock:
    """The store's clock: simulated seconds, set by the event loop (never goes back)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.start = start
        self.now = start

    def __call__(self) -> float:
        return self.now

    def at(self, sim_s: float) -> None:
        self.now = max(self.now, self.start + sim_s)


class Buffer:
    """A page-aligned, pre-touched CPU buffer; ``view(n)`` is a contiguous tensor of
    ``layout.tensor_shape(n)`` over its start (where O_DIRECT reads may land)."""

    def __init__(self, layout: KVLayout, max_chunks: int, fill: bool) -> None:
        self.layout = layout
        self._map = mmap.mmap(-1, max(1, max_chunks) * layout.block_nbytes)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        if fill:  # random bytes for puts (what is stored is never looked at)
            gen = torch.Generator().manual_seed(1)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        else:
            flat.fill_(0)  # fault every page in now, not in a timed restore
        self.flat = flat.view(layout.dtype)

    def view(self, n: int) -> torch.Tensor:
        shape = self.layout.tensor_shape(n)
        return self.flat[: math.prod(shape)].view(shape)

    def close(self) -> None:
        del self.flat
        with contextlib.suppress(BufferError):
            self._map.close()


def events(schedule: Schedule, w: Workload) -> Iterator[tuple[float, str, Turn]]:
    """The timeline: (simulated seconds, what, turn), in order. ``arrive``: the turn's
    request; ``end``: its answer is done (put, and hints); ``prefetch``: ``lead_s``
    before the session's next turn (never before the gap starts)."""
    heap: list[tuple[float, int, str, Turn]] = []
    seq = 0
    for turn in schedule.turns:
        heap.append((turn.arrive_s, seq, "arrive", turn))
        heap.append((turn.end_s, seq + 1, "end", turn))
        if turn.gap_after_s is not None:
            nxt = turn.end_s + turn.gap_after_s
            heap.append((max(turn.end_s, nxt - w.lead_s), seq + 2, "prefetch", turn))
        seq += 3
    heapq.heapify(heap)
    while heap:
        at, _, kind, turn = heapq.heappop(heap)
        yield at, kind, turn


@dataclass
class TurnResult:
    session: int
    index: int
    gap_before_s: float | None
    prompt_tokens: int
    stored_chunks: int  #: leading chunks stored when the turn arrived
    restored: int
    in_memory: int  #: of the restored chunks, those the host tier held
    shared_restored: int
    shared_in_memory: int
    restore_s: float
    recompute_s: float
    wait_s: float  #: hinted: the prefetch wait, all of it
    counted_wait_s: float  #: the part past lead_s, in ttft_s
    put_s: float
    settle_s: float  #: the drain of background work before the turn (not in TTFT)
    settle_past_sim_gap: bool  #: that drain took longer than the simulated time since
    #: the previous event: the simulation compressed time past what the store kept up with
    tail_tokens: int = 0  #: tokens restored from a tail after the restored chunks

    @property
    def ttft_s(self) -> float:
        return self.restore_s + self.recompute_s + self.counted_wait_s


@dataclass
class ModeRun:
    mode: str
    turns: list[TurnResult] = field(default_factory=list)
    answers: Counter[str] = field(default_factory=Counter)
    answer_blocks: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    hint_seconds: dict[str, list[float]] = field(default_factory=dict)  #: per kind, each call
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation, numpy's default)."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else math.nan


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
