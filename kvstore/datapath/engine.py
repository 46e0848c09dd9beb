"""``Engine``: a store's engine side (``KVStore.engine``), what integrations ask of it.

The connectors (vLLM, SGLang), the server, a cluster node and the CLI need more of a store
than an application does: its data path, the restore planner's feedback (prefill steps,
waits, loads and reads measured in other processes), the tokens behind the chunks for KV
events, zero-copy loans and in-place puts, re-encryption. Those live here, apart from
:class:`~kvstore.KVStore`'s public face; code outside sees them as the
:class:`~kvstore.datapath.contracts.EngineSide` protocol. Arguments are checked as the
store checks its own: bad input raises :class:`~kvstore.errors.InvalidInputError` and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.datapath.contracts import DataPath, EngineSide, Loan, PendingPut
from kvstore.errors import InvalidInputError
from kvstore.keys import BlockKey, ChunkTokens, check_keys
from kvstore.restore import LoadSample, PlannedLoad, RestorePlan, Restoring

if TYPE_CHECKING:
    from kvstore.datapath.manager import BlockManager

__all__ = ["Engine"]


class Engine(EngineSide):
    """The :class:`EngineSide` of one store, over its manager and its restorer.

    ``on_tokens`` is the store's own KV-event book (None: it publishes none); the tiers
    are told the tokens through the manager either way.
    """

    def __init__(
        self,
        manager: BlockManager,
        restorer: Restoring,
        on_tokens: Callable[[ChunkTokens], None] | None = None,
    ) -> None:
        self._manager = manager
        self._restorer = restorer
        self._on_tokens = on_tokens

    @property
    def datapath(self) -> DataPath:
        """The store's data path (:class:`~kvstore.datapath.contracts.DataPath`)."""
        return self._manager

    def note_tokens(self, tokens: ChunkTokens) -> None:
        """Record which tokens the chunks ``tokens.keys`` hold, for KV events: this
        store's own publisher (``events:`` in the config) and a kvstore-server behind a
        remote tier both carry them. Call before the chunks are put (``put(...,
        tokens=...)`` does); build ``tokens`` with :meth:`ChunkTokens.of`."""
        if not isinstance(tokens, ChunkTokens):
            raise InvalidInputError(f"tokens must be ChunkTokens, got {type(tokens).__name__}")
        block_tokens = self._manager.layout.block_tokens
        if tokens.block_tokens != block_tokens:
            raise InvalidInputError(
                f"tokens: chunks of {tokens.block_tokens} tokens; this layout's have {block_tokens}"
            )
        if self._on_tokens is not None:
            self._on_tokens(tokens)
        self._manager.note_tokens(tokens)

    def note_prefill_step(self, tokens: int, seconds: float) -> None:
        """One engine step computed ``tokens`` in ``seconds``: what a learned prefill
        speed is fitted to (ignored when ``restore`` declares one)."""
        self._restorer.observe_prefill_step(tokens, seconds)

    def waited(self, plan: RestorePlan, waited_s: float) -> None:
        """The engine waited ``waited_s`` for a load of ``plan`` under compute (its
        prefetch's ``handle.waited_s``): the tiers' prices follow what it cost."""
        self._restorer.waited(plan, waited_s)

    def planned_load(self, plan: RestorePlan) -> PlannedLoad[str]:
        """What ``plan`` expects of its load, per tier id: for a process that loads it
        (vLLM's workers), whose :class:`~kvstore.restore.LoadSample` come back through
        :meth:`observe_loads`."""
        load = PlannedLoad.of(plan, self._manager.layout.block_nbytes)
        return load.named(self._manager.tier_ids())

    def observe_loads(self, loads: Mapping[str, LoadSample]) -> None:
        """Restores another process loaded (``{tier id: LoadSample}``): the matching tiers'
        prices follow what they cost (:mod:`kvstore.restore.speeds`)."""
        self._manager.observe_tier_loads(dict(loads))

    def read_totals(self) -> dict[str, tuple[float, float, int]]:
        """Every read so far per tier (``kind:n``): ``(bytes, seconds, calls)``."""
        return self._manager.read_totals()

    def observe_reads(self, reads: Mapping[str, tuple[float, float, int]]) -> None:
        """Feed another process's :meth:`read_totals` into this store's tier speeds."""
        self._manager.observe_reads(dict(reads))

    def restore_speeds(self) -> dict[str, Any]:
        """What a cluster node publishes for routers: per kind of medium (``memory``,
        ``disk``, ``shared`` storage such as S3) the live ``[GB/s, ms a call]`` of this
        store's fastest tier of that kind, and ``prefill_tokens_per_s`` (None: unknown)."""
        return self._restorer.published_speeds()

    def lend(self, keys: Sequence[BlockKey], lease_s: float | None = None) -> Loan:
        """Pin the stored blocks among ``keys`` and lend views of the host memory
        holding them, to send or copy in place; ``loan.release()`` when done (the
        lease of ``lease_s`` seconds ends it otherwise). See
        :class:`~kvstore.datapath.contracts.Loan`."""
        if lease_s is not None and (not isinstance(lease_s, (int, float)) or lease_s <= 0):
            raise InvalidInputError(f"lease_s must be > 0, got {lease_s!r}")
        return self._manager.lend(check_keys(keys), lease_s)

    def begin_put(self, keys: Sequence[BlockKey]) -> PendingPut:
        """Reserve room for new blocks, to fill in place (``put.views``) and then
        ``put.commit(ok)``: the two-step form of :meth:`KVStore.put`."""
        return self._manager.begin_put(check_keys(keys))

    def reencrypt(self) -> int:
        """Rewrite blocks sealed under older keys with the active key, in the background
        (a store does it at open when ``encryption.reencrypt`` is on); how many blocks
        are queued to be checked. Progress: ``reencrypt_pending`` and ``reencrypted``
        in each encrypting tier's ``stats()``."""
        return self._manager.reencrypt()
