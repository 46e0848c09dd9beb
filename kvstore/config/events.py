"""The ``events:`` section: publishing the store's blocks as vLLM-format KV events.

::

    events:
      enabled: true
      endpoint: tcp://127.0.0.1:5557  # ZMQ PUB socket (what Dynamo / llm-d subscribe to);
                                      # the default, tcp://*:5557, binds every interface
      replay_endpoint: tcp://127.0.0.1:5558   # ZMQ ROUTER socket serving missed batches
      topic: ""                       # the first frame of every message
      block_size: 16                  # tokens per published block (the consumer's block size)
      buffer_steps: 10000             # batches kept for replay
      hwm: 100000                     # ZMQ high-water mark of the PUB socket
      interval_s: 0.01                # how often changes are gathered into one batch
      heartbeat_s: 1.0                # an empty batch when idle (subscribers see gaps)
      token_journal: /var/lib/kvstore/tokens.journal
      data_parallel_rank: null

See docs/events.md for what is published and how consumers use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvstore.config._fields import build, check_positive, opt
from kvstore.config.values import parse_bool, parse_float, parse_int, parse_optional_str, parse_str
from kvstore.errors import ConfigError

__all__ = ["EventsConfig"]

_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _parse_topic(value: Any, key: str) -> str:
    """A topic may be empty (subscribers then match every message)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _parse_optional_int(value: Any, key: str) -> int | None:
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
        return None
    return parse_int(value, key)


def _check_endpoint(endpoint: str, key: str) -> None:
    """Raise :class:`ConfigError` unless ``endpoint`` is a ZMQ address this publisher can use."""
    if not endpoint.startswith(_SCHEMES):
        raise ConfigError(f"{key}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if endpoint.startswith("tcp://"):
        _, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{key}: expected tcp://HOST:PORT (port 0-65535), got {endpoint!r}")


@dataclass(frozen=True)
class EventsConfig:
    """Publishing of the store's block changes as vLLM ``KVEventBatch`` messages over ZMQ.

    ``enabled``: publish at all (off by default; needs ``pip install 'kvstore-tiers[events]'``).

    ``endpoint``: the PUB socket. Wildcard (``tcp://*:5557``), loopback, port 0,
    ``ipc://`` and ``inproc://`` addresses are bound; any other ``tcp://HOST:PORT``
    is connected to (a proxy's XSUB socket), as vLLM does.

    ``replay_endpoint``: the ROUTER socket serving missed batches (always bound);
    None: no replay.

    ``topic``: the first frame of every published message ("" by default).

    ``block_size``: tokens per published block; every stored chunk of
    ``block_tokens`` tokens becomes ``block_tokens / block_size`` blocks, so it
    must divide the layout's ``block_tokens``. Set it to the consumer's block
    size (Dynamo's ``--block-size``, llm-d's ``blockSize``).

    ``buffer_steps``: published batches kept for replay.

    ``hwm``: ZMQ high-water mark of the PUB socket (messages queued per
    subscriber before ZMQ drops; 0: no limit).

    ``interval_s``: how often the store's changes are gathered and published
    as one batch.

    ``heartbeat_s``: with nothing to publish for this long, an empty batch is
    sent, so a subscriber that (re)connected after batches it missed sees the gap
    in the sequence and asks the replay socket for them; 0: no heartbeats.

    ``token_journal``: a file keeping the tokens of stored blocks across
    restarts (so blocks the disk tier kept can be published again); None: in
    memory only.

    ``data_parallel_rank``: sent in every batch (vLLM's ``data_parallel_rank``);
    None: omitted.
    """

    enabled: bool = opt(False, parse_bool)
    endpoint: str = opt("tcp://*:5557", parse_str)
    replay_endpoint: str | None = opt(None, parse_optional_str)
    topic: str = opt("", _parse_topic)
    block_size: int = opt(16, parse_int)
    buffer_steps: int = opt(10000, parse_int)
    hwm: int = opt(100000, parse_int)
    interval_s: float = opt(0.01, parse_float)
    heartbeat_s: float = opt(1.0, parse_float)
    token_journal: str | None = opt(None, parse_optional_str)
    data_parallel_rank: int | None = opt(None, _parse_optional_int)

    def __post_init__(self) -> None:
        self.validate("events")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, path: str = "events") -> EventsConfig:
        """Read the section from a plain mapping (YAML); unknown keys and bad values
        raise :class:`ConfigError` naming ``path.key``."""
        config: EventsConfig = build(cls, data or {}, path)
        return config

    def validate(self, path: str) -> None:
        """Raise :class:`ConfigError` (naming ``path.key``) for impossible values."""
        _check_endpoint(self.endpoint, f"{path}.endpoint")
        if self.replay_endpoint is not None:
            _check_endpoint(self.replay_endpoint, f"{path}.replay_endpoint")
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
                raise ConfigError(f"{path}.replay_endpoint: must differ from endpoint")
        check_positive(self, path, "block_size", "buffer_steps", "interval_s")
        if self.heartbeat_s < 0:
            raise ConfigError(f"{path}.heartbeat_s: must be >= 0 (0: no heartbeats)")
        if self.hwm < 0:
            raise ConfigError(f"{path}.hwm: must be >= 0, got {self.hwm}")
        if self.data_parallel_rank is not None and self.data_parallel_rank < 0:
            raise ConfigError(f"{path}.data_parallel_rank: must be >= 0")

    def check_block_tokens(self, block_tokens: int, path: str = "events") -> int:
        """Published blocks per stored chunk of ``block_tokens`` tokens; a
        :class:`ConfigError` unless ``block_size`` divides ``block_tokens``."""
        if block_tokens <= 0 or block_tokens % self.block_size:
            raise ConfigError(
                f"{path}.block_size: {self.block_size} must divide the layout's "
                f"block_tokens ({block_tokens}); published blocks cover whole chunks"
            )
        return block_tokens // self.block_size

    def to_dict(self) -> dict[str, Any]:
        """Plain dict that :meth:`from_mapping` reads back to an equal section."""
        return asdict(self)
