"""Remote tier: a ``kvstore-server`` (same host or another), as a tier of any store.

``{"kind": "remote", "address": "127.0.0.1:7070" | "unix:/path", "namespace": ...,
"token": ..., "shared_memory": true}``. Several engine processes (a prefill and
a decode process, TP ranks, hosts) that name the same server and namespace
share its blocks. Bytes move over the socket, verified on both ends, or --
on the server's host -- through its shared memory with one copy.

The server outlives this process and holds blocks others wrote, so the tier
is ``persistent`` (the manager lists what it holds on open and flushes into
it at close) and ``shared`` (keys the index lacks are asked about). The
server evicts by itself; ``capacity`` (1 TiB by default) only bounds what
this process counts as stored there.

A server that is down or restarting makes calls raise
:class:`~kvstore.errors.TierError` within the timeouts (the manager serves a
miss and keeps its books); the client probes once per ``retry_interval`` and
reconnects by itself.

A token the server refuses -- wrong, missing, or not opening the namespace --
is a configuration mistake: the tier asks the server when it opens and raises
:class:`~kvstore.errors.AccessDeniedError` (one line naming the server); a
store opened while the server is down opens (nothing answered yet). A token
refused later (the server restarted with other tokens) makes calls raise
``AccessDeniedError``, which the store turns into misses, logged once: its
lookups stop counting what only the server holds, and a get into a buffer
that needed the blocks names the refusal. A server that will not open the
store (it hosts ``server.max_stores`` already) makes calls raise
:class:`~kvstore.errors.StoreLimitError`, a TierError the store treats the
same way (misses, logged once, naming the setting). An address that answers in
another protocol -- a kvstore-server of another wire version, or no
kvstore-server at all -- is a mistake of the same kind: the tier raises
:class:`~kvstore.errors.ProtocolError` when it opens, one line naming the address.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvstore.client._common import ClientOptions
from kvstore.client.sync import Client
from kvstore.config import RemoteTierConfig, TierConfig
from kvstore.errors import AccessDeniedError, ClosedError, ConfigError, ProtocolError, TierError
from kvstore.hints import Hint
from kvstore.keys import BlockKey, ChunkTokens
from kvstore.layout import KVLayout
from kvstore.tiers import check_get_args, check_put_args
from kvstore.tiers.base import LayerRange, Tier

__all__ = ["RemoteTier"]


class RemoteTier(Tier):
    """Blocks on a kvstore-server (see the module docstring)."""

    kind = "remote"
    persistent = True
    shared = True
    local = False

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        if not isinstance(config, RemoteTierConfig):
            raise ConfigError(f"remote tier needs a RemoteTierConfig, got {type(config).__name__}")
        config.validate("remote")
        super().__init__(config, layout)
        self.cfg = config
        self._capacity = self.blocks_in(config.capacity)
        # Quiet: the store's tier I/O says an outage once, naming this tier (and the
        # client's reason: the calls its breaker holds back carry it).
        self._client = Client(layout, ClientOptions.from_config(config), quiet=True)
        self._closed = False
        #: Why the server did not answer when the tier opened ("": it answered).
        self.unreachable_at_open = ""
        try:
            self._client.ping()
        except (AccessDeniedError, ProtocolError):  # refused, or another protocol: one line
            self.close()
            raise
        except TierError as exc:  # down or restarting: the store opens, reads miss until
            # it answers; the tier's first failing call says so in the log, once
            self.unreachable_at_open = str(exc)

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def client(self) -> Client:
        """The client this tier talks through."""
        return self._client

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[bool]:
        self._check_open()
        check_put_args(self.layout, keys, blocks)
        return self._client.put(keys, blocks)

    def get(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor], layers: LayerRange = None
    ) -> list[bool]:
        self._check_open()
        check_get_args(self.layout, keys, outs, layers)
        return self._client.get(keys, outs, layers)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self._check_open()
        self._client.delete(keys)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self._check_open()
        return self._client.exists(keys)

    def note_tokens(self, tokens: ChunkTokens) -> None:
        """The server's KV events carry these chunks' tokens."""
        self._check_open()
        self._client.note_tokens(tokens)

    def hint(self, keys: Sequence[BlockKey], hint: Hint) -> None:
        """Pass a session hint on to the server, for these keys (never a session name:
        the two sessions tables would drift apart)."""
        self._check_open()
        self._client.hint(
            list(keys),
            retain_s=hint.retain_s,
            priority=hint.priority,
            prefetch=hint.prefetch,
            demote=hint.demote,
        )

    def stored_keys(self) -> Iterator[BlockKey]:
        # A server down at open raises here: the store's tier I/O logs it once, marks
        # the tier down and adopts nothing yet (a listing that hid the failure would
        # read as the server answering).
        self._check_open()
        return iter(self._client.list_keys(self._capacity))

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.cfg.address,
            "namespace": self.cfg.namespace,
            "shared_memory": self._client.shared_memory,
            "unreachable_at_open": self.unreachable_at_open,
            **self._client.stats,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the remote tier is closed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
