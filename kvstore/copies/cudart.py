"""The CUDA runtime calls the CUDA engine makes itself: 1-D and 2-D async copies.

torch exposes no ``cudaMemcpy2DAsync``; kvstore calls it through ``ctypes`` in
the very ``libcudart`` torch has loaded (found in ``/proc/self/maps`` once CUDA
is initialised), so streams, devices and the context are torch's own. ctypes
releases the GIL for each call. Where the library cannot be found the engine
copies with torch's ``copy_`` instead (slower for strided host copies, same
bytes); :func:`load` says why once, in the log.

Nothing here runs at import; :func:`load` needs CUDA initialised.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import logging
import os
import threading

import torch

from kvstore.copies.rows import Rows
from kvstore.errors import KVStoreError

__all__ = ["CudaRuntime", "load"]

log = logging.getLogger(__name__)

#: cudaMemcpyKind: the runtime infers the direction from the (unified) addresses.
_DEFAULT_KIND = 4


class _Calls:
    """The copy functions of ``lib``, typed."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        size, ptr = ctypes.c_size_t, ctypes.c_void_p
        self.copy = lib.cudaMemcpyAsync
        self.copy.argtypes = [ptr, ptr, size, ctypes.c_int, ptr]
        self.copy.restype = ctypes.c_int
        self.copy2d = lib.cudaMemcpy2DAsync
        self.copy2d.argtypes = [ptr, size, ptr, size, size, size, ctypes.c_int, ptr]
        self.copy2d.restype = ctypes.c_int


class CudaRuntime:
    """``cudaMemcpyAsync`` and ``cudaMemcpy2DAsync`` of one loaded ``libcudart``.

    Called through ``ctypes.CDLL``, which releases the GIL for each call. (Keeping it,
    with ``ctypes.PyDLL``, measured worse on an H100: layer saves took twice as long
    and their callers waited four times as long for the GIL.)
    """

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        self._calls = _Calls(lib)
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    def copy(self, rows: Rows, stream: int) -> None:
        """Queue ``rows`` on the stream with handle ``stream``; raise on a refusal."""
        calls = self._calls
        if rows.contiguous:
            nbytes = rows.width * rows.height
            code = calls.copy(rows.dst, rows.src, nbytes, _DEFAULT_KIND, stream)
            what = "cudaMemcpyAsync"
        else:
            code = calls.copy2d(
                rows.dst,
                rows.dpitch,
                rows.src,
                rows.spitch,
                rows.width,
                rows.height,
                _DEFAULT_KIND,
                stream,
            )
            what = "cudaMemcpy2DAsync"
        if code:
            message = self._error_string(code) or b"unknown error"
            raise KVStoreError(f"{what} failed: {message.decode(errors='replace')} ({code})")


class _Loaded:
    """The process's runtime, found once (``_lock`` guards the first search)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._runtime: CudaRuntime | None = None

    def get(self) -> CudaRuntime | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                self._runtime = _find()
            return self._runtime


def _candidates() -> list[str]:
    """Where torch's libcudart may be: what the process has mapped first."""
    found: list[str] = []
    # No /proc (not Linux): the searches below still apply.
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if "libcudart.so" in os.path.basename(path) and path not in found:
                found.append(path)
    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    for pattern in (
        os.path.join(torch_dir, "lib", "libcudart.so*"),
        os.path.join(site, "nvidia", "*", "lib", "libcudart.so*"),
        os.path.join(site, "nvidia", "*", "*", "lib", "libcudart.so*"),
    ):
        found.extend(p for p in sorted(glob.glob(pattern)) if p not in found)
    found.append("libcudart.so")
    return found


def _find() -> CudaRuntime | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # type: ignore[no-untyped-call]  # torch loads libcudart here: /proc/self/maps then names it
    errors = []
    for path in _candidates():
        try:
            return CudaRuntime(path)
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    log.warning(
        "kvstore: libcudart not found (%s); GPU copies use torch's copy_ (strided host "
        "copies stage through a temporary)",
        "; ".join(errors) or "no candidates",
    )
    return None


_LOADED = _Loaded()


def load() -> CudaRuntime | None:
    """The process's ``libcudart`` wrapper, or None where it cannot be loaded (logged once)."""
    return _LOADED.get()
