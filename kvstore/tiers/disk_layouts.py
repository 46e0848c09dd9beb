"""The layouts a disk directory holds blocks of, named so a person can tell them apart.

A disk tier keeps each layout's blocks in a directory of their own,
``<path>/kvstore-v1/<layout fingerprint>/``, and reads only its store's: a block of
another layout (another dtype, head count, chunk size...) is never misread -- and
never found. So a store opened with a layout other than the one its blocks were
written with (a float16 writer, a bfloat16 reader on one directory) sees an empty
disk. To say so, each layout directory records the layout it holds
(``layout.json``, :func:`record_layout`), and a tier that opens on a directory with
none of its own blocks but blocks of other layouts names them
(:func:`foreign_layouts`, :func:`mismatch_line`) in one warning per layout.

Directories written before ``layout.json`` existed are named from a block header
(layers and chunk bytes: a header carries no dtype or head shapes).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import CorruptBlockError, InvalidInputError
from kvstore.format import header_size, read_header
from kvstore.layout import KVLayout
from kvstore.tiers.files import BLOCK_SUFFIX, FORMAT_DIR

__all__ = [
    "DESCRIPTOR",
    "MAX_NAMED",
    "ForeignLayout",
    "describe_layout",
    "foreign_layouts",
    "mismatch_line",
    "record_layout",
]

#: The file in a layout directory that names its layout.
DESCRIPTOR = "layout.json"
#: Fields of a layout worth naming when two differ, in the order people read them.
_FIELDS = ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens", "kv_factor")
#: Other layouts named in one tier's warnings at most (the rest are counted).
MAX_NAMED = 4


@dataclass(frozen=True)
class ForeignLayout:
    """Another layout with blocks in the same disk directory."""

    fingerprint: str
    #: Its description (:meth:`KVLayout.describe`); None where only a header told.
    description: dict[str, Any] | None
    #: ``(layers, chunk bytes)`` from a block header when there is no description.
    geometry: tuple[int, int] | None = None


def describe_layout(desc: dict[str, Any], fingerprint: str) -> str:
    """``float16, 3 layers x 2 KV heads x 16 head_dim, 8-token chunks (layout 1a2b...)``."""
    mla = "" if desc.get("kv_factor", 2) == 2 else f", kv_factor {desc['kv_factor']}"
    return (
        f"{desc['dtype']}, {desc['num_layers']} layers x {desc['num_kv_heads']} KV heads x "
        f"{desc['head_dim']} head_dim, {desc['block_tokens']}-token chunks{mla} "
        f"(layout {fingerprint})"
    )


def record_layout(base: Path, layout: KVLayout) -> None:
    """Write ``base/layout.json`` naming ``layout``, once (an existing one stays); a
    directory that refuses writes is left as it is (it is said elsewhere)."""
    target = base / DESCRIPTOR
    if target.exists():
        return
    text = json.dumps({**layout.describe(), "fingerprint": layout.fingerprint_hex}, indent=1)
    # Named as the tier's temps are (.<what>.<pid>.<nonce>.tmp): one a crash left is swept.
    temp = base / f".layout.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        temp.write_text(text + "\n", encoding="utf-8")
        os.replace(temp, target)  # whole or absent, for readers in other processes
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink()


def _recorded(directory: Path) -> dict[str, Any] | None:
    """The layout ``directory/layout.json`` describes, if it is one whose fingerprint is
    the directory's name (anything else is ignored)."""
    try:
        desc = json.loads((directory / DESCRIPTOR).read_text(encoding="utf-8"))
        layout = KVLayout.from_description(desc)
    except (OSError, ValueError, TypeError, InvalidInputError):
        return None
    return layout.describe() if layout.fingerprint_hex == directory.name else None


def _a_block(directory: Path) -> Path | None:
    """One block file under a layout directory, or None if it holds none."""
    with contextlib.suppress(OSError), os.scandir(directory) as fans:
        for fan in fans:
            if len(fan.name) != 2 or not fan.is_dir():
                continue
            with contextlib.suppress(OSError), os.scandir(fan.path) as entries:
                for entry in entries:
                    if entry.name.endswith(BLOCK_SUFFIX) and not entry.name.startswith("."):
                        return Path(entry.path)
    return None


def _geometry(block: Path, fingerprint: str) -> tuple[int, int] | None:
    """``(layers, chunk bytes)`` from ``block``'s header, if it is one of ``fingerprint``."""
    try:
        with open(block, "rb") as f:
            header = read_header(f.read(header_size(4096)))
    except (OSError, CorruptBlockError):
        return None
    if header.layout_fp.hex() != fingerprint:
        return None
    return header.num_layers, header.raw_nbytes


def foreign_layouts(root: Path, layout: KVLayout) -> list[ForeignLayout]:
    """The layouts other than ``layout`` with at least one block under ``root`` (a disk
    tier's path), named from their ``layout.json`` or else a block header. Reads only."""
    found = []
    with contextlib.suppress(OSError), os.scandir(root / FORMAT_DIR) as entries:
        names = sorted(e.name for e in entries if e.is_dir())
        for name in names:
            if name == layout.fingerprint_hex or len(name) != 16:
                continue
            block = _a_block(root / FORMAT_DIR / name)
            if block is None:
                continue
            desc = _recorded(root / FORMAT_DIR / name)
            geometry = None if desc is not None else _geometry(block, name)
            found.append(ForeignLayout(name, desc, geometry))
    return found


def mismatch_line(root: Path, layout: KVLayout, other: ForeignLayout) -> str:
    """One line: this tier holds none of ``layout``'s blocks but some of ``other``'s,
    what each is, how they differ, and what to do."""
    own = layout.describe()
    here = describe_layout(own, layout.fingerprint_hex)
    if other.description is not None:
        there = describe_layout(other.description, other.fingerprint)
        differs = [
            f"{name} {other.description[name]} there, {own[name]} here"
            for name in _FIELDS
            if other.description.get(name) != own.get(name)
        ]
        how = f"; they differ in {', '.join(differs)}" if differs else ""
    else:
        layers, nbytes = other.geometry or (None, None)
        shape = f"{layers} layers, {nbytes}-byte chunks" if layers else "its shapes unrecorded"
        there = f"layout {other.fingerprint} ({shape}; its dtype is not recorded)"
        how = ""
    return (
        f"disk tier {root}: holds blocks of another layout, {there}, and none of this "
        f"store's, {here}{how}; a store reads only blocks of its own layout, so those are "
        "misses here: open the store with the layout they were written with (same dtype, "
        "model shapes and chunk tokens), or expect it to start empty"
    )
