"""Module paths that moved, kept for one release as deprecated aliases.

Issue 52 sorted the top of ``kvstore/`` by feature: ``kvstore.codec`` became
``kvstore.format.codec``, ``kvstore.memory`` ``kvstore.runtime.memory``, and so on
(:data:`MOVED`). ``import kvstore`` installs one finder (:func:`install`) that answers an
import of an old path with the module now holding its code -- the same module object, so
a patch through either name is seen by both -- and warns :class:`DeprecationWarning`
once, naming the new path. An old module whose names went to several new ones (its
format and its tier wiring, say) is answered with a read-only view that finds each name
in those modules, in order. Nothing is imported until an old path is.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.abc import Loader, MetaPathFinder
else:  # importlib.abc costs ~20 ms to import: the protocols are kept by duck typing
    Loader = MetaPathFinder = object

__all__ = ["MOVED", "AliasFinder", "install", "warn_renamed"]

#: Old module path -> the module(s) that hold its names now, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    "kvstore.block_header": ("kvstore.format.header",),
    "kvstore.cli_args": ("kvstore.runtime.args",),
    "kvstore.codec": ("kvstore.format.codec",),
    "kvstore.codecs": ("kvstore.format.codecs",),
    "kvstore.crypt": (
        "kvstore.format.sealing",
        "kvstore.format.keyring",
        "kvstore.tiers.encryption",
    ),
    "kvstore.demo": ("kvstore.cli.demo",),
    "kvstore.lifetimes": ("kvstore.runtime.lifetimes",),
    "kvstore.live_report": ("kvstore.cli.live_report",),
    "kvstore.local_cluster": ("kvstore.cli.local_cluster",),
    "kvstore.masking": ("kvstore.runtime.masking",),
    "kvstore.memory": ("kvstore.runtime.memory",),
    "kvstore.opening": ("kvstore.tiers.opening",),
    "kvstore.pools": ("kvstore.runtime.pools",),
    "kvstore.quota": ("kvstore.datapath.quota",),
    "kvstore.registry": ("kvstore.runtime.registry",),
    "kvstore.restore_stats": ("kvstore.restore.stats",),
    "kvstore.retry": ("kvstore.runtime.retry",),
    "kvstore.speeds": ("kvstore.restore.speeds", "kvstore.restore.prefill"),
    "kvstore.survey": ("kvstore.cli.survey",),
    "kvstore.testing.kvserver": ("kvstore.cli.kvserver",),
    # Its FaultProxy re-export moved with the proxy to the repository's kvharness/ (no wheel).
    "kvstore.testing.servers": ("kvstore.cli.servers",),
    "kvstore._chain": ("kvstore.native._chain",),
    "kvstore._memcopy": ("kvstore.native._memcopy",),
}


def _merged(old: str, targets: Sequence[str]) -> types.ModuleType:
    """A module named ``old`` whose attributes are found in ``targets``, in order."""
    modules = [importlib.import_module(t) for t in targets]
    view = types.ModuleType(old, f"Deprecated alias of {', '.join(targets)}.")

    def find(name: str) -> Any:
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    view.__dict__["__getattr__"] = find
    view.__dict__["__all__"] = [n for m in modules for n in getattr(m, "__all__", ())]
    return view


class _AliasLoader(Loader):
    """Puts the new module (or a view of several) in ``sys.modules`` under the old name."""

    def __init__(self, targets: tuple[str, ...]) -> None:
        self.targets = targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a blank module, replaced in exec_module

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        warnings.warn(
            f"{old} moved to {' and '.join(self.targets)}; import it from there "
            "(the old path goes away in the next release)",
            DeprecationWarning,
            stacklevel=2,  # the importer's line (importlib's own frames are skipped)
        )
        if len(self.targets) == 1:
            new = importlib.import_module(self.targets[0])
        else:
            new = _merged(old, self.targets)
        sys.modules[old] = new  # what the import statement gets back


class AliasFinder(MetaPathFinder):
    """The meta-path finder of :data:`MOVED`'s old paths (every other name: None)."""

    def __init__(self, moved: dict[str, tuple[str, ...]]) -> None:
        self.moved = moved

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old path, loaded by :class:`_AliasLoader`; None for the rest."""
        targets = self.moved.get(fullname)
        if targets is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(targets))


def install() -> AliasFinder:
    """Put the finder first on ``sys.meta_path`` (once: a second call finds it there)."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            return finder
    finder = AliasFinder(MOVED)
    # First: an old path must not be found as a stale file on a path entry behind it.
    sys.meta_path.insert(0, finder)
    return finder


def warn_renamed(old: str, new: str) -> None:
    """Warn :class:`DeprecationWarning` that ``old`` (a method or setting kept one release
    as an alias) is now ``new``; the warning names the caller's line."""
    warnings.warn(
        f"{old} is deprecated and goes away in the next release; use {new}",
        DeprecationWarning,
        stacklevel=3,  # the line that called the alias
    )
