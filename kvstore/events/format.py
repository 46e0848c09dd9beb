"""vLLM's KV event messages, byte for byte, without importing vLLM.

These msgspec structs mirror ``vllm.distributed.kv_events`` of vLLM 0.32.0
field for field (same class names, which are the msgpack tags; same field
order, defaults and struct options), so kvstore's payloads decode with vLLM's
own ``KVEventBatch`` decoder, NVIDIA Dynamo's ZMQ listener and llm-d's KV
event pool, and encode to the very bytes vLLM would send for the same events:

- a batch is an array ``[ts, events, data_parallel_rank]`` (``array_like``;
  ``data_parallel_rank`` omitted when None: ``omit_defaults``);
- each event is a map tagged ``{"type": "BlockStored", ...}`` (``tag=True``,
  not array-like), fields that have a default and still hold it are omitted.

A block hash (vLLM's ``ExternalBlockHash``) is ``bytes`` or ``int``; kvstore
sends signed 64-bit ints (what Dynamo reads).

Importing this module imports msgspec; without it :class:`EventsUnavailableError`
says how to install it.
"""

from typing import Any

from kvstore.events._deps import INSTALL_HINT, EventsUnavailableError

try:
    import msgspec
except ImportError:  # pragma: no cover - depends on the install
    raise EventsUnavailableError(
        f"events: publishing KV events needs 'msgspec'; install it with: {INSTALL_HINT}"
    ) from None

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

#: vLLM's ``ExternalBlockHash``.
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged by class name under ``"type"``)."""


class BlockStored(KVCacheEvent):
    """Blocks now held: ``block_hashes[i]`` covers ``token_ids[i*block_size:(i+1)*block_size]``,
    chained from ``parent_block_hash`` (None: the prompt's first block)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held in ``medium``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block this publisher announced is gone."""


#: One of the three events.
Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """A batch of KV cache events (vLLM's ``KVEventBatch``)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_decoder: msgspec.msgpack.Decoder[KVEventBatch] | None = None


def encode_batch(ts: float, events: list[Event], dp_rank: int | None = None) -> bytes:
    """The msgpack payload vLLM's publisher would send for ``events`` at time ``ts``."""
    return msgspec.msgpack.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read a payload (from kvstore or vLLM) back into a :class:`KVEventBatch`."""
    global _decoder
    if _decoder is None:
        _decoder = msgspec.msgpack.Decoder(KVEventBatch)
    return _decoder.decode(payload)
