"""kvstore's compiled helpers (csrc/, built by the install: setup.py), each optional.

- :data:`chain` -- ``kvstore.native._chain`` (csrc/chain.c): the chained chunk keys of
  :func:`kvstore.keys.chain_keys` in one C loop over xxHash's XXH3.
- :data:`memcopy` -- ``kvstore.native._memcopy`` (csrc/memcopy.c): many host-memory copies
  in one call with the GIL released once, for the copy engine (:mod:`kvstore.copies`) and
  the client's copies out of shared memory (:mod:`kvstore.client.receive`); and copies
  that verify XXH3 checksums in the same pass, for decoding (:mod:`kvstore.format.codec`).

Each is None where the install could not compile it (no C compiler, no Python headers);
kvstore then uses its pure-Python paths, which give the same results, slower.
"""

from __future__ import annotations

try:  # compiled by the install (setup.py); optional
    from kvstore.native import _chain as chain
except ImportError:  # pragma: no cover - exercised by test_keys in a subprocess
    chain = None  # type: ignore[assignment]

try:  # compiled by the install (setup.py); optional
    from kvstore.native import _memcopy as memcopy
except ImportError:  # pragma: no cover - an install without a C compiler
    memcopy = None  # type: ignore[assignment]

__all__ = ["chain", "memcopy"]
