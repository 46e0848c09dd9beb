"""Shared memory between kvstore-server and clients on the same host.

The server's host tier lives in a memfd (:class:`~kvstore.tiers.slab.SharedSegment`).
A client of that store maps the same memory and copies blocks in and out of
their slots itself: one ``memcpy`` per block, with only small control frames
on the socket. The memfd reaches the client one of two ways:

- over a Unix socket, as the file descriptor itself (``SCM_RIGHTS``): works
  across users and containers that share the socket;
- over TCP on the same host, as ``/proc/<server pid>/fd/<n>``: the kernel lets
  only the server's own user (or root) open it.

The client checks it is on the server's host (the kernel's boot id) and that
what it opened is the server's segment (inode and size), or it falls back to
moving bytes over the socket. Nothing is named in ``/dev/shm``, so nothing is
left behind when the server is killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import ProtocolError

__all__ = ["Mapping", "attach", "boot_id", "describe_segment", "receive_fd"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This kernel's boot id ('' where unknown): equal only on the same host and boot."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def describe_segment(fd: int, nbytes: int) -> dict[str, Any]:
    """What a client needs to find and check the segment behind ``fd``."""
    st = os.fstat(fd)
    return {
        "pid": os.getpid(),
        "fd": fd,
        "nbytes": nbytes,
        "inode": st.st_ino,
        "boot_id": boot_id(),
    }


def receive_fd(sock: socket.socket, nbytes: int) -> tuple[bytes, int | None]:
    """Read ``nbytes`` (a frame header) and the file descriptor sent with them, if any."""
    data, fds, _flags, _addr = socket.recv_fds(sock, nbytes, 1)
    for extra in fds[1:]:
        os.close(extra)
    return data, (fds[0] if fds else None)


@dataclass
class Mapping:
    """A client's mapping of the server's segment, as one uint8 tensor."""

    region: mmap.mmap
    tensor: torch.Tensor
    #: The segment's random id (the server's OPEN reply names the one to use).
    ident: str = ""

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes at ``offset`` (checked against the segment's size)."""
        if offset < 0 or offset + nbytes > self.tensor.numel():
            raise ProtocolError(f"shared-memory range {offset}+{nbytes} outside the segment")
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap (views still alive keep the memory mapped until they die)."""
        with contextlib.suppress(BufferError):
            self.region.close()


def attach(info: dict[str, Any], fd: int | None) -> Mapping:
    """Map the segment ``info`` describes: through ``fd`` (passed over a Unix socket)
    or by opening the server's descriptor in /proc. OSError or ProtocolError when
    this client cannot (another host, another user): it then uses the socket."""
    nbytes, inode = int(info["nbytes"]), int(info["inode"])
    if fd is None:
        if not info.get("boot_id") or info["boot_id"] != boot_id():
            raise ProtocolError("the server runs on another host (its boot id differs)")
        fd = os.open(f"/proc/{int(info['pid'])}/fd/{int(info['fd'])}", os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_ino != inode or st.st_size != nbytes:
            raise ProtocolError("the shared-memory segment opened is not the server's")
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the memory
    return Mapping(region, torch.frombuffer(region, dtype=torch.uint8), str(info.get("id", "")))
