"""Plug-in registries: one per kind of plug-in (tier kinds, eviction policies, codecs).

A :class:`Registry` maps names to plug-ins. An entry's target is either the object
itself or ``"package.module:Attr"``, imported the first time the name is used (so
``import kvstore`` imports no optional dependency; a failed import is a
:class:`~kvstore.errors.ConfigError` carrying the entry's install hint, such as
``pip install 'kvstore-tiers[s3]'``). A name registered already is refused unless
``clobber=True``: two plug-ins of one name would silently shadow each other.
:attr:`Registry.view` is a read-only mapping of the entries.

Installed packages bring plug-ins through an entry-point group per registry
(``kvstore.tiers``, ``kvstore.policies``, ``kvstore.codecs``)::

    [project.entry-points."kvstore.policies"]
    newest = "mypkg.policies:NewestFirst"     # the plug-in itself, registered as "newest"
    [project.entry-points."kvstore.tiers"]
    mem2 = "mypkg.kvstore_tiers:register"     # or a function that registers its plug-ins

The group is read the first time a name the registry does not know is looked up,
never on import; each entry point runs once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from kvstore.errors import ConfigError

__all__ = ["Entry", "Registry", "check_target", "import_target"]

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered plug-in.

    ``target``: the plug-in, or ``"package.module:Attr"`` until first loaded.
    ``install_hint``: what a failed import of ``target`` tells the user to do.
    ``options``: what the plug-in comes paired with (a tier kind's config dataclass).
    """

    name: str
    target: T | str
    install_hint: str = ""
    options: Any = None

    @property
    def loaded(self) -> bool:
        """Whether ``target`` is the plug-in itself (imported already)."""
        return not isinstance(self.target, str)


def check_target(what: str, name: str, target: object) -> None:
    """Raise :class:`ConfigError` unless a string ``target`` reads ``package.module:Attr``."""
    if not isinstance(target, str):
        return
    module, sep, attr = target.partition(":")
    if not (module and sep and all(part.isidentifier() for part in attr.split("."))):
        raise ConfigError(
            f"{what} {name!r}: target must be 'package.module:ClassName', got {target!r}"
        )


def import_target(what: str, entry: Entry[Any], accept: Callable[[object], bool]) -> Any:
    """Import the plug-in ``entry`` names as ``"package.module:Attr"`` (or return it, loaded
    already): a failed import is a :class:`ConfigError` with the entry's install hint, and
    so is an object ``accept`` refuses. ``what`` names the kind in messages."""
    if entry.loaded:
        return entry.target
    module_name, _, attr = str(entry.target).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; {entry.install_hint}" if entry.install_hint else ""
        raise ConfigError(
            f"{what} {entry.name!r} needs a missing dependency ({exc.name}){hint}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise ConfigError(f"{what} {entry.name!r}: module {module_name} has no {attr}")
    if not accept(obj):
        raise ConfigError(f"{what} {entry.name!r}: {entry.target} is not a {what}")
    return obj


@dataclass(frozen=True)
class _Spec(Generic[T]):
    """What a registry checks: ``accept(obj)`` says whether ``obj`` is a plug-in of this
    kind (an entry point naming one is registered under its name; anything else an entry
    point names is called, as a registration function); ``check_name`` raises for a
    name the kind cannot have."""

    what: str
    group: str
    accept: Callable[[object], bool]
    check_name: Callable[[str], object] | None = None


class Registry(Generic[T]):
    """Plug-ins of one kind by name (see the module's docstring). Thread-safe."""

    def __init__(
        self,
        what: str,
        group: str,
        accept: Callable[[object], bool],
        check_name: Callable[[str], object] | None = None,
    ) -> None:
        """``what``: the kind, as messages name it (``"tier kind"``); ``group``: its
        entry-point group; ``accept``: whether an object is a plug-in of this kind;
        ``check_name``: raises :class:`ConfigError` for a name this kind cannot have."""
        self._spec: _Spec[T] = _Spec(what, group, accept, check_name)
        self._entries: dict[str, Entry[T]] = {}
        self._lock = threading.RLock()  # owned here; re-entered by plug-ins that register
        self._ran: set[str] = set()  # "name=value" of each entry point run (or tried)
        self._view: Mapping[str, Entry[T]] = MappingProxyType(self._entries)

    @property
    def view(self) -> Mapping[str, Entry[T]]:
        """The entries by name, read-only (a live view: later registrations show)."""
        return self._view

    @property
    def what(self) -> str:
        """The kind of plug-in, as messages name it."""
        return self._spec.what

    @property
    def group(self) -> str:
        """The entry-point group installed packages declare plug-ins of this kind in."""
        return self._spec.group

    def register(
        self,
        name: str,
        target: T | str,
        *,
        install_hint: str = "",
        options: Any = None,
        clobber: bool = False,
    ) -> Entry[T]:
        """Register ``target`` (the plug-in, or ``"package.module:Attr"``) as ``name``.

        A name registered already raises :class:`ConfigError` unless ``clobber``, or
        unless ``target`` is what the entry holds already (a module imported again
        registering its class, or a lazy entry's own class being loaded)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.what}: a name must be a non-empty string, got {name!r}")
        if self._spec.check_name is not None:
            self._spec.check_name(name)
        check_target(self.what, name, target)
        if not isinstance(target, str) and not self._spec.accept(target):
            raise ConfigError(f"{self.what} {name!r}: {target!r} is not a {self.what} plug-in")
        entry = Entry(name, target, install_hint, options)
        with self._lock:
            known = self._entries.get(name)
            if known is not None and not clobber:
                if not _same(known, entry):
                    raise ConfigError(
                        f"{self.what} {name!r} is registered already "
                        f"({_describe(known.target)}); pass clobber=True to replace it"
                    )
                # The same plug-in again: keep the entry, loaded if this call brings it.
                entry = known if isinstance(target, str) else replace(known, target=target)
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        """The registered names, sorted (entry points not read yet are not among them)."""
        with self._lock:
            return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def has(self, name: str) -> bool:
        """Whether ``name`` is registered, reading the entry points first if it is not."""
        if name not in self._entries:
            self.load_plugins()
        return name in self._entries

    def entry(self, name: str) -> Entry[T]:
        """The entry of ``name`` (reading the entry points first if it is unknown), else
        :class:`ConfigError` listing the known names."""
        if not self.has(name):
            raise ConfigError(f"unknown {self.what} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

    def load(self, name: str) -> T:
        """The plug-in registered as ``name``, imported if it is not yet."""
        entry = self.entry(name)
        if entry.loaded:
            return entry.target  # type: ignore[return-value]
        obj: T = import_target(self.what, entry, self._spec.accept)
        with self._lock:  # cache it, unless replaced meanwhile
            if self._entries.get(name) is entry:
                self._entries[name] = replace(entry, target=obj)
        return obj

    def load_plugins(self) -> list[str]:
        """Run each entry point of :attr:`group` not run yet; the names of those that ran.
        One that fails to import or to register is a :class:`ConfigError` naming it (and
        is not tried again)."""
        ran: list[str] = []
        with self._lock:
            for point in importlib.metadata.entry_points(group=self.group):
                ident = f"{point.name}={point.value}"
                if ident in self._ran:
                    continue
                self._ran.add(ident)
                try:
                    self._adopt(point.name, point.load())
                except Exception as exc:
                    raise ConfigError(
                        f"{self.what.removesuffix(' kind')} plugin {point.name!r} ({point.value}) "
                        f"failed to register: {exc}"
                    ) from exc
                ran.append(point.name)
        return ran

    def _adopt(self, name: str, obj: object) -> None:
        """Register what an entry point named: a plug-in under the entry point's name,
        or call a registration function."""
        if self._spec.accept(obj):
            self.register(name, obj)  # type: ignore[arg-type]
        elif callable(obj):
            obj()
        else:
            raise ConfigError(f"{obj!r} is neither a {self.what} nor a function")

    @contextmanager
    def scoped(self) -> Iterator[Registry[T]]:
        """Within the block, registrations are undone on exit (for tests): the entries
        as they were come back, and entry points run inside may run again."""
        with self._lock:
            saved, ran = dict(self._entries), set(self._ran)
        try:
            yield self
        finally:
            with self._lock:
                self._entries.clear()
                self._entries.update(saved)
                self._ran.clear()
                self._ran.update(ran)


def _same(known: Entry[Any], new: Entry[Any]) -> bool:
    """Whether two entries are one plug-in: one target (an object, or its
    ``module:qualname``) and no other options."""
    if new.options is not None and known.options is not new.options:
        return False
    return known.target is new.target or _describe(known.target) == _describe(new.target)


def _describe(target: object) -> str:
    """``module:qualname`` of a plug-in, or the target string itself."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "?")
    return f"{module}:{getattr(target, '__qualname__', repr(target))}"
