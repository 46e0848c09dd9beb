"""The eviction-policy interface.

A policy orders the keys resident in one tier. The manager tells it what
arrived (``insert``), what was used (``touch``) and what left (``remove``),
and asks for ``candidates`` -- keys in the order they should go. Whether a
candidate may actually go (it may be pinned) is the manager's business, so a
policy stays a few lines of bookkeeping. Not thread-safe: the books
(:mod:`kvstore.datapath.books`, :mod:`kvstore.datapath.room`) call it under their lock. The
clock is injectable so tests are deterministic.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar, overload

from kvstore.errors import ConfigError
from kvstore.runtime import Registry

if TYPE_CHECKING:  # keys import torch; policies need only the type
    from kvstore.keys import BlockKey

__all__ = [
    "POLICIES",
    "Clock",
    "EvictionPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]

Clock = Callable[[], float]


class EvictionPolicy(ABC):
    """Orders one tier's keys for eviction."""

    name: str = ""

    def __init__(self, capacity: int = 0, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity  # blocks the tier holds (policies that size queues use it)
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
        """Keys in eviction order, first to go first.

        The manager skips candidates it may not evict (pinned ones) and calls
        :meth:`remove` for those it evicts, after the iteration. A policy may
        update its own state while the iterator runs (S3-FIFO moves a block
        with hits to its main queue instead of yielding it); the manager
        calls no other method of the policy until the iteration ends.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""


def _is_policy_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, EvictionPolicy)


#: The eviction policies by name: the built-in ones (imported on first use), those
#: registered, and (once a config names one not registered) those installed packages
#: declare in the ``kvstore.policies`` entry points (:mod:`kvstore.runtime.registry`).
POLICIES: Registry[type[EvictionPolicy]] = Registry(
    "eviction policy", "kvstore.policies", _is_policy_class
)
POLICIES.register("lru", "kvstore.policy.lru:LRUPolicy")
POLICIES.register("s3fifo", "kvstore.policy.s3fifo:S3FIFOPolicy")
POLICIES.register("arc", "kvstore.policy.arc:ARCPolicy")


_P = TypeVar("_P", bound="type[EvictionPolicy]")


@overload
def register_policy(cls: _P, *, replace: bool = False, clobber: bool = False) -> _P: ...


@overload
def register_policy(
    cls: None = None, *, replace: bool = False, clobber: bool = False
) -> Callable[[_P], _P]: ...


def register_policy(
    cls: _P | None = None, *, replace: bool = False, clobber: bool = False
) -> _P | Callable[[_P], _P]:
    """Class decorator: make ``cls`` available by ``cls.name`` in configs (``policy:``).

    ``@register_policy`` or ``@register_policy(clobber=True)`` (``replace`` is the older
    spelling). A name registered already (``lru``, ``s3fifo``, ``arc`` included) raises
    :class:`ConfigError` unless ``clobber=True``: two policies of one name would
    silently shadow each other. The registry itself: :data:`POLICIES`.
    """

    def register(policy: _P) -> _P:
        if not _is_policy_class(policy):
            raise ConfigError(f"register_policy: {policy!r} is not an EvictionPolicy subclass")
        name = policy.name
        if not isinstance(name, str) or not name:
            raise ConfigError(f"register_policy: {policy.__name__} needs a name (name = ...)")
        POLICIES.register(name, policy, clobber=replace or clobber)
        return policy

    return register if cls is None else register(cls)


def policy_names() -> list[str]:
    """Names of the registered eviction policies."""
    return POLICIES.names()


def make_policy(name: str, capacity: int = 0, clock: Clock = time.monotonic) -> EvictionPolicy:
    """A new policy instance by name (``"lru"``, ...) for a tier of ``capacity`` blocks."""
    return POLICIES.load(name)(capacity, clock)
