"""Runtime helpers every layer may use; they import nothing of kvstore but its errors.

- :mod:`kvstore.runtime.memory` -- ``SlabAllocator`` (fixed slots in one preallocated
  buffer per memory tier), ``cuda_available``, ``trim_heap``
- :mod:`kvstore.runtime.pools` -- thread pools that run inline once the interpreter exits
- :mod:`kvstore.runtime.lifetimes` -- stores left open are closed at exit
- :mod:`kvstore.runtime.retry` -- the one backoff helper and the circuit breaker
- :mod:`kvstore.runtime.registry` -- ``Registry``, the shape of every plug-in registry
- :mod:`kvstore.runtime.masking` -- secrets masked in configs, URLs and reports
- :mod:`kvstore.runtime.dist` -- the distribution's name and ``pip install`` hints
- :mod:`kvstore.runtime.args` -- argument parsing shared by the ``kvstore`` and
  ``kvstore-server`` commands (one-line errors)
- :mod:`kvstore.runtime.exports` -- ``load_export``: a package's front door, imported
  on first use
- :mod:`kvstore.runtime.aliases` -- the deprecated aliases of module paths that moved

Code outside this package imports its names from here; importing it imports only
``exports`` and ``aliases`` (the standard library's, nothing heavy), the rest on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.runtime.aliases import install as install_aliases
from kvstore.runtime.aliases import warn_renamed
from kvstore.runtime.exports import load_export

if TYPE_CHECKING:
    from kvstore.runtime.aliases import MOVED
    from kvstore.runtime.args import OneLineParser, check_counts
    from kvstore.runtime.dist import DISTRIBUTION, install_hint
    from kvstore.runtime.lifetimes import close_at_exit, forget
    from kvstore.runtime.masking import MASK, SECRET_KEYS, mask_config, mask_text, mask_url
    from kvstore.runtime.memory import SlabAllocator, cuda_available, madvise, trim_heap
    from kvstore.runtime.pools import call_or_inline, map_or_inline
    from kvstore.runtime.registry import Entry, Registry, check_target, import_target
    from kvstore.runtime.retry import Backoff, Breaker, retry_async, retry_call

__all__ = [
    "Backoff",
    "Breaker",
    "DISTRIBUTION",
    "Entry",
    "MASK",
    "MOVED",
    "OneLineParser",
    "Registry",
    "SECRET_KEYS",
    "SlabAllocator",
    "call_or_inline",
    "check_counts",
    "check_target",
    "close_at_exit",
    "cuda_available",
    "forget",
    "import_target",
    "install_aliases",
    "install_hint",
    "load_export",
    "madvise",
    "map_or_inline",
    "mask_config",
    "mask_text",
    "mask_url",
    "retry_async",
    "retry_call",
    "trim_heap",
    "warn_renamed",
]

_EXPORTS = {
    "Backoff": "kvstore.runtime.retry",
    "Breaker": "kvstore.runtime.retry",
    "DISTRIBUTION": "kvstore.runtime.dist",
    "Entry": "kvstore.runtime.registry",
    "MASK": "kvstore.runtime.masking",
    "MOVED": "kvstore.runtime.aliases",
    "OneLineParser": "kvstore.runtime.args",
    "Registry": "kvstore.runtime.registry",
    "SECRET_KEYS": "kvstore.runtime.masking",
    "SlabAllocator": "kvstore.runtime.memory",
    "call_or_inline": "kvstore.runtime.pools",
    "check_counts": "kvstore.runtime.args",
    "check_target": "kvstore.runtime.registry",
    "close_at_exit": "kvstore.runtime.lifetimes",
    "cuda_available": "kvstore.runtime.memory",
    "forget": "kvstore.runtime.lifetimes",
    "import_target": "kvstore.runtime.registry",
    "install_hint": "kvstore.runtime.dist",
    "madvise": "kvstore.runtime.memory",
    "map_or_inline": "kvstore.runtime.pools",
    "mask_config": "kvstore.runtime.masking",
    "mask_text": "kvstore.runtime.masking",
    "mask_url": "kvstore.runtime.masking",
    "retry_async": "kvstore.runtime.retry",
    "retry_call": "kvstore.runtime.retry",
    "trim_heap": "kvstore.runtime.memory",
}


def __getattr__(name: str) -> Any:
    """Each name imported on first use (see the module docstring)."""
    return load_export(globals(), _EXPORTS, name)
