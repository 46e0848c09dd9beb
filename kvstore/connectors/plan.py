"""Scheduler-side arithmetic: which chunks a request hits, and what each step loads and saves.

Engine-independent (no vLLM import), so it is tested with plain values. The
vLLM connector feeds it the numbers it gets from the scheduler and ships the
resulting :class:`StepPlan` to its workers.

Terms: a *chunk* is ``chunk_tokens`` tokens, the unit kvstore keys and stores
(a multiple of the engine's *block* size, the unit of its paged cache). Only
full chunks of the prompt get a key; a prompt ending mid-chunk leaves its tail
to the engine. An engine may keep several block tables per request (vLLM's KV
cache *groups*: full attention, sliding window, ...); block ids are kept per
group, in the engine's group order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.connectors.tails import Tail, output_tail
from kvstore.errors import ConfigError
from kvstore.hints import Hint
from kvstore.keys import BlockKey
from kvstore.restore import PlannedLoad

__all__ = [
    "DEFAULT_MIN_CHUNK_TOKENS",
    "Planner",
    "RequestState",
    "Scheduled",
    "StepPlan",
    "TransferSpec",
    "FinishedOutput",
    "Found",
    "HintSpec",
    "chunk_tokens_for",
    "matched_tokens",
]

#: The default chunk is the smallest multiple of the engine block size >= this.
DEFAULT_MIN_CHUNK_TOKENS = 256

#: ``keys_for(token_ids, adapter, salt) -> {tp_rank: keys of every full chunk}``.
KeyFn = Callable[[Sequence[int], str | None, str | None], dict[int, list[BlockKey]]]
#: ``lookup(keys_by_rank, prompt_len, num_computed) -> what is stored and worth loading``.
LookupFn = Callable[[dict[int, list[BlockKey]], int, int], "Found"]
#: ``(keys, prompt tokens, loaded chunks)`` -> the stored tail after those chunks, if any.
TailFn = Callable[[dict[int, list[BlockKey]], Sequence[int], int], "Tail | None"]
#: A request's block ids, one list per KV cache group.
GroupBlocks = tuple[list[int], ...]


def chunk_tokens_for(block_size: int, configured: int | None = None) -> int:
    """The chunk size: ``configured`` (checked), else the smallest multiple of
    ``block_size`` that is at least :data:`DEFAULT_MIN_CHUNK_TOKENS`."""
    if type(block_size) is not int or block_size <= 0:
        raise ConfigError(f"engine block size must be a positive int, got {block_size!r}")
    if configured is None:
        return -(-DEFAULT_MIN_CHUNK_TOKENS // block_size) * block_size
    if type(configured) is not int or configured <= 0 or configured % block_size:
        raise ConfigError(
            f"chunk_tokens: must be a positive multiple of the engine block size "
            f"{block_size}, got {configured!r}"
        )
    return configured


def matched_tokens(hit_chunks: int, chunk_tokens: int, prompt_len: int, num_computed: int) -> int:
    """Tokens the store can provide beyond the engine's own ``num_computed``.

    The engine must compute at least the last prompt token itself (it needs
    that token's logits), so a hit covering the whole prompt gives all but one.
    """
    hit = min(hit_chunks * chunk_tokens, prompt_len - 1)
    return max(0, hit - num_computed)


@dataclass(frozen=True)
class Found:
    """What a lookup found for one prompt: the leading chunks stored for every rank
    (``stored``), how many of them are worth loading (``load``: the restore plan) and
    the plan's expected seconds to load them (None: not planned)."""

    stored: int
    load: int
    load_s: float | None = None
    planned: PlannedLoad[str] | None = None  # what the plan expects of the load


@dataclass
class TransferSpec:
    """One request's load or save in one step (shipped scheduler -> workers).

    Chunks ``first_chunk .. first_chunk + len(keys[rank]) - 1`` of the
    request move; of those, tokens ``[token_start, token_end)`` are written to
    (load) or read from (save) the engine's blocks. ``block_ids[g]`` are the
    request's engine blocks of KV cache group ``g`` from block ``block_offset``
    on. ``whole``: a load done at once before the request computes, reported
    per request (the engine's asynchronous-load protocol) rather than layer by
    layer with per-block errors.

    ``token_ids`` (saves, when the store has a kvstore-server behind it): the
    token ids of the spec's chunks, and ``parents[rank]`` the key of the chunk
    before them, so the server's KV events carry the tokens. ``planned_s`` (loads):
    the restore plan's expected load seconds, to compare with the actual; ``planned``
    (loads): what the plan expects of the load per tier, which the engine's wait
    corrects (:meth:`~kvstore.restore.stats.PlannedLoad.scale`).
    ``step_end`` (saves): the tokens the request has computed by the end of this
    step (a recurrent state, kept per step, is that of this position only). ``tail``:
    the spec's last chunk is a tail block (its key a :func:`~kvstore.keys.tail_key`),
    whose first ``token_end - its start`` tokens are the KV (the rest are zeros).
    """

    req_id: str
    keys: dict[int, list[BlockKey]]
    first_chunk: int
    token_start: int
    token_end: int
    block_ids: GroupBlocks
    block_offset: int = 0
    whole: bool = False
    token_ids: list[int] | None = None
    parents: dict[int, BlockKey | None] | None = None
    planned_s: float | None = None
    planned: PlannedLoad[str] | None = None
    step_end: int | None = None
    tail: bool = False  # the last chunk is a tail: its tokens up to token_end only

    def blocks_of(self, start: int, end: int, block_size: int, group: int = 0) -> list[int]:
        """Engine block ids of ``group`` holding any of tokens ``[start, end)``."""
        if start >= end:
            return []
        first, last = start // block_size, (end - 1) // block_size
        ids = self.block_ids[group]
        return ids[first - self.block_offset : last - self.block_offset + 1]


@dataclass(frozen=True)
class HintSpec:
    """A session hint for a finished request's chunks (shipped scheduler -> workers):
    each worker applies ``hint`` to its rank's ``keys`` (``store.hint``)."""

    keys: dict[int, list[BlockKey]]
    hint: Hint
    session: str | None = None


@dataclass(frozen=True)
class FinishedOutput:
    """A finished request's computed tokens (prompt and output: those whose KV the
    engine holds) and its blocks per KV cache group, for saving the chunks its output
    completed. ``needs_hint``: save them only if the request carried a session hint (the
    session goes on, so its next prompt starts with this output)."""

    tokens: list[int]
    block_ids: GroupBlocks
    needs_hint: bool = True


@dataclass
class StepPlan:
    """Everything the workers move in one engine step.

    ``finishing``: saves of finished requests' output chunks, whose blocks the engine
    keeps until the workers report them done (vLLM's delayed free, ``finished_sending``).
    """

    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)
    hints: list[HintSpec] = field(default_factory=list)
    finishing: list[TransferSpec] = field(default_factory=list)
    #: Shadow verification (verify.py): request -> its namespace, for the saves whose
    #: stored chunks the workers compare with the engine's recompute.
    verify: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.hints or self.finishing)


@dataclass
class RequestState:
    """What the scheduler side remembers of one request between steps."""

    keys: dict[int, list[BlockKey]]
    prompt_len: int
    hit_chunks: int = 0  # leading chunks to load (the restore plan)
    stored_chunks: int = 0  # leading chunks stored (at least hit_chunks)
    planned_load_s: float | None = None
    planned_load: PlannedLoad[str] | None = None
    local_tokens: int = 0  # the engine's own hit, as passed to the last match()
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_chunks: int = 0  # chunks [0, saved_chunks) are stored or planned for saving
    expected_computed: int = 0  # computed tokens the engine should report next step
    pending_load: tuple[int, int] | None = None  # token range to load in the next step
    load_failed: bool = False  # a whole load failed: recompute, never offer a hit again
    adapter: str | None = None  # what the keys were hashed with (an output's keys too)
    salt: str | None = None
    tail: Tail | None = None  # a stored tail after the hit's chunks, loaded with them


@dataclass(frozen=True)
class Scheduled:
    """A request the engine scheduled this step, as it reports it.

    ``block_ids`` (one list per KV cache group) are the request's blocks when
    ``replace_blocks`` (a new or resumed request), else the blocks newly
    appended (None: none).
    """

    req_id: str
    block_ids: GroupBlocks | None
    replace_blocks: bool
    num_computed: int
    num_scheduled: int


class Planner:
    """Per-request state machine of the scheduler side.

    Args:
        chunk_tokens: tokens per stored chunk.
        block_size: the engine's block size (divides ``chunk_tokens``).
        keys_for: computes every rank's keys of a prompt's full chunks.
        lookup: leading chunks of those keys stored for every rank.
        tails: finds a stored tail after the chunks a hit loads (None: tails are
            neither looked for nor saved).
    """

    def __init__(
        self,
        chunk_tokens: int,
        block_size: int,
        keys_for: KeyFn,
        lookup: LookupFn,
        tails: TailFn | None = None,
    ) -> None:
        if chunk_tokens % block_size:
            raise ConfigError(f"chunk size {chunk_tokens} is not a multiple of {block_size}")
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self._keys_for = keys_for
        self._lookup = lookup
        self._tails = tails
        self.requests: dict[str, RequestState] = {}
        self._whole_loads: list[TransferSpec] = []
        self._hints: list[HintSpec] = []
        self._finishing: list[TransferSpec] = []

    def _state(
        self, req_id: str, tokens: Sequence[int], adapter: str | None, salt: str | None
    ) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            keys = self._keys_for(tokens, adapter, salt)
            state = RequestState(keys, len(tokens), adapter=adapter, salt=salt)
            self.requests[req_id] = state
        return state

    def match(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        num_computed: int,
        adapter: str | None = None,
        salt: str | None = None,
        verify: bool = False,
    ) -> int:
        """Tokens beyond ``num_computed`` (the engine's own hit) the store can load.

        ``verify``: shadow verification (verify.py) sampled the request: whatever is
        stored is not loaded (0 tokens) but saved again, so the workers compare the
        engine's recompute with the stored chunks.
        """
        state = self._state(req_id, prompt_token_ids, adapter, salt)
        found = Found(0, 0)
        if state.keys and not state.load_failed:
            found = self._lookup(state.keys, state.prompt_len, num_computed)
        state.hit_chunks, state.stored_chunks = (0 if verify else found.load), found.stored
        state.planned_load_s, state.planned_load = found.load_s, found.planned
        state.local_tokens = num_computed
        state.tail = None
        if not verify:
            # Chunks found stored need no save; a failed load rolls this back (see step()).
            state.saved_chunks = max(state.saved_chunks, found.stored)
            if self._tails is not None and 0 < found.load == found.stored:
                state.tail = self._tails(state.keys, prompt_token_ids, found.load)
        hit = state.hit_chunks * self.chunk_tokens + (state.tail.tokens if state.tail else 0)
        return max(0, min(hit, state.prompt_len - 1) - num_computed)

    def allocated(
        self, req_id: str, num_external: int, block_ids: GroupBlocks | None = None
    ) -> None:
        """The engine allocated blocks for ``num_external`` tokens to load (0: none).

        With ``block_ids`` (the request's blocks per group) the load is *whole*:
        planned now, done by the next step's workers before the request computes
        (the engine's asynchronous loads); without, it rides along with the
        request's first scheduled step.
        """
        state = self.requests.get(req_id)
        if state is None or num_external <= 0:
            return
        start = state.local_tokens
        if block_ids is None:
            state.pending_load = (start, start + num_external)
            return
        state.block_ids = [list(ids) for ids in block_ids]
        spec = self._load_spec(req_id, state, start, start + num_external)
        if spec is not None:
            spec.whole = True
            self._whole_loads.append(spec)
            # The engine schedules the request once loaded, computed up to here.
            state.expected_computed = start + num_external

    def load_failed(self, req_id: str) -> None:
        """A whole load failed: the engine recomputes the request from its start."""
        state = self.requests.get(req_id)
        if state is None:
            return
        state.load_failed = True
        state.hit_chunks = state.stored_chunks = 0
        state.tail = None
        state.saved_chunks = 0  # what is still stored is skipped when saving
        state.expected_computed = 0

    def finished(
        self,
        req_id: str,
        hint: tuple[Hint, str | None] | None = None,
        output: FinishedOutput | None = None,
    ) -> bool:
        """Forget a finished request; with a ``(hint, session)``, the next step's workers
        apply it to the request's chunks (its saves are done by now). With ``output``
        (and a hint where it needs one), the next step's workers also save the chunks its
        output completed: True, the engine must keep its blocks until they report it."""
        state = self.requests.pop(req_id, None)
        if state is None or not state.keys:
            return False
        queued = False
        if output is not None and (hint is not None or not output.needs_hint):
            specs = self._output_specs(req_id, state, output)
            self._finishing.extend(specs)
            queued = bool(specs)
        if hint is not None:
            self._hints.append(HintSpec(state.keys, hint[0], hint[1]))
        return queued

    def step(self, scheduled: Sequence[Scheduled]) -> StepPlan:
        """The loads and saves of one step, from what the engine scheduled.

        Requests never seen by :meth:`match` are left alone: their keys would
        lack the request's salt and adapter, so nothing of theirs is stored.
        """
        plan = StepPlan(loads=self._whole_loads, hints=self._hints, finishing=self._finishing)
        self._whole_loads, self._hints, self._finishing = [], [], []
        for req in scheduled:
            state = self.requests.get(req.req_id)
            if state is None:
                continue
            if req.replace_blocks:
                state.block_ids = [list(ids) for ids in req.block_ids or ()]
            elif req.block_ids:
                if not state.block_ids:
                    state.block_ids = [[] for _ in req.block_ids]
                for ids, new in zip(state.block_ids, req.block_ids, strict=True):
                    ids.extend(new)
            self._plan_request(req.req_id, state, req.num_computed, req.num_scheduled, plan)
        return plan

    def _plan_request(
        self, req_id: str, state: RequestState, computed: int, scheduled: int, plan: StepPlan
    ) -> None:
        if computed < state.expected_computed:
            # The engine rolled the request back (a failed load it recomputes, or a
            # preemption): chunks from there on must be saved again once recomputed.
            state.saved_chunks = min(state.saved_chunks, computed // self.chunk_tokens)
        state.expected_computed = computed + scheduled
        if state.pending_load is not None:
            load = self._load_spec(req_id, state, *state.pending_load)
            state.pending_load = None
            if load is not None:
                plan.loads.append(load)
        save = self._save_spec(req_id, state, computed + scheduled)
        if save is not None:
            plan.saves.append(save)

    def _load_spec(
        self, req_id: str, state: RequestState, start: int, end: int
    ) -> TransferSpec | None:
        c = self.chunk_tokens
        first, last = start // c, -(-end // c)
        tail = state.tail
        hit = state.hit_chunks * c + (tail.tokens if tail else 0)
        if start >= end or end > hit:
            return None  # nothing, or more than was found: never load what is not there
        ends_in_tail = tail is not None and last > state.hit_chunks
        spec = self._spec(req_id, state, first, last, start, end, tail if ends_in_tail else None)
        if spec is not None:
            spec.planned_s, spec.planned = state.planned_load_s, state.planned_load
        return spec

    def _save_spec(self, req_id: str, state: RequestState, done: int) -> TransferSpec | None:
        """Full prompt chunks computed by the end of this step and not yet saved."""
        last = min(done, state.prompt_len) // self.chunk_tokens
        last = min(last, len(next(iter(state.keys.values()), [])))
        first = state.saved_chunks
        if last <= first:
            return None
        c = self.chunk_tokens
        spec = self._spec(req_id, state, first, last, first * c, last * c)
        if spec is not None:
            state.saved_chunks = last
            spec.step_end = done
        return spec

    def _output_specs(
        self, req_id: str, state: RequestState, output: FinishedOutput
    ) -> list[TransferSpec]:
        """The saves of the full chunks past the saved ones that ``output``'s tokens fill
        (the prompt's keys go on as the chain of the longer token list), and, where
        tails are on, of the tail after them; the hint that follows covers the chunks."""
        keys = self._keys_for(output.tokens, state.adapter, state.salt)
        c = self.chunk_tokens
        last = min(len(output.tokens) // c, len(next(iter(keys.values()), [])))
        first = min(state.saved_chunks, len(next(iter(state.keys.values()))))
        state.keys, state.block_ids = keys, [list(ids) for ids in output.block_ids]
        specs = []
        if last > first:
            spec = self._spec(req_id, state, first, last, first * c, last * c)
            if spec is not None:
                spec.token_ids = list(output.tokens[first * c : last * c])
                spec.parents = {r: ks[first - 1] if first else None for r, ks in keys.items()}
                specs.append(spec)
        sizes = (self.chunk_tokens, self.block_size)
        tail = output_tail(keys, output.tokens, last, sizes) if self._tails else None
        if tail is not None:
            spec = self._spec(req_id, state, last, last + 1, last * c, last * c + tail.tokens, tail)
            if spec is not None:
                specs.append(spec)
        return specs

    def _spec(
        self,
        req_id: str,
        state: RequestState,
        first: int,
        last: int,
        start: int,
        end: int,
        tail: Tail | None = None,
    ) -> TransferSpec | None:
        """Chunks ``first..last-1`` (``tail``: the last one is that tail) moving tokens
        ``[start, end)`` of the request's blocks."""
        lo, hi = start // self.block_size, -(-end // self.block_size)
        if not state.block_ids or any(hi > len(ids) for ids in state.block_ids):
            return None  # the engine gave fewer blocks than the tokens need: skip, never guess
        keys = {rank: ks[first:last] for rank, ks in state.keys.items()}
        if tail is not None:
            keys = {rank: [*ks[: last - 1 - first], tail.keys[rank]] for rank, ks in keys.items()}
        blocks = tuple(ids[lo:hi] for ids in state.block_ids)
        return TransferSpec(req_id, keys, first, start, end, blocks, lo, tail=tail is not None)
