"""The eviction-policy interface.

A policy orders the keys resident in one tier. The manager tells it what
arrived (``insert``), what was used (``touch``) and what left (``remove``),
and asks for ``candidates`` -- keys in the order they should go. Whether a
candidate may actually go (it may be pinned) is the manager's business, so a
policy stays a few lines of bookkeeping. Not thread-safe: the manager calls
it under its own lock. The clock is injectable so tests are deterministic.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey

__all__ = ["Clock", "EvictionPolicy", "make_policy", "register_policy"]

Clock = Callable[[], float]


class EvictionPolicy(ABC):
    """Orders one tier's keys for eviction."""

    name: str = ""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock

    @abstractmethod
    def insert(self, key: BlockKey) -> None:
        """``key`` now has a copy in the tier."""

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """``key`` was read (or written again)."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """``key`` left the tier (absent keys are ignored)."""

    @abstractmethod
    def candidates(self) -> Iterator[BlockKey]:
        """Keys in eviction order, first to go first. Do not mutate while iterating."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""


_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make ``cls`` available by ``cls.name`` in configs."""
    _POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, clock: Clock = time.monotonic) -> EvictionPolicy:
    """A new policy instance by name (``"lru"``, ...)."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(_POLICIES))}"
        ) from None
    return cls(clock)
