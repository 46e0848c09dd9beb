"""What a config's disk tiers hold, read without opening a store (``kvstore stats``).

Opening a :class:`~kvstore.store.KVStore` to report on one would change what it
reports on: a disk tier creates its layout's directory (and 256 below it), probes
it with a file and sweeps dead writers' temp files; a cluster member registers as a
node. And a store opens one layout, while a disk holds blocks of every layout (and,
under a server, of every namespace) it was given. So this module only reads:

- every layout directory under each disk tier's path: ``<path>/kvstore-v1/<fingerprint>/``
  (a store's own) and ``<path>/ns-<namespace>/kvstore-v1/<fingerprint>/`` (a
  kvstore-server's, one per namespace);
- in each, the block files, counted and sized, and one block header: the layout's
  layer count and chunk size (a header does not carry the heads, head size, chunk
  tokens or dtype: those come from the layout flags when they are given).

Nothing is created, deleted or rewritten. The other tiers are described from the
config: a memory tier holds nothing in a process that just started (a server's live
figures are on its ``/metrics``); S3, Redis, a server and a cluster's peers are not
read. Capacities are counted as the tiers count them: a tier's ``capacity`` bytes
divided by what one block takes there -- the chunk in memory, S3 or Redis; the chunk
plus its header, padded to 4 KiB, in a disk tier's block file (clamped, as the disk
tier clamps it when it opens, to 95% of the free space).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import DaemonConfig, DiskTierConfig, ServerConfig, StoreConfig, TierConfig
from kvstore.errors import CorruptBlockError, InvalidInputError
from kvstore.format import header_size, read_header
from kvstore.layout import KVLayout
from kvstore.restore import PrefillSpeed, ReadSpeed
from kvstore.tiers import FORMAT_DIR, Tree

__all__ = ["LayoutDir", "StoreSurvey", "find_layouts", "format_survey", "survey"]

#: Block files are padded to this (the disk tier's page: O_DIRECT-aligned payloads).
_PAGE = 4096
#: What the disk tier keeps of the free space when it opens (``DiskTier`` clamps to it).
_FREE_FRACTION = 0.95
#: Bytes read from a block file to parse its header (4096 layers fit).
_HEADER_READ = header_size(4096)
#: Block files tried for a readable header before a layout's geometry is called unknown.
_HEADER_TRIES = 8
_NAMESPACE_DIR = "ns-"
_MEMORY_KINDS = frozenset({"host", "device"})


@dataclass(frozen=True)
class LayoutDir:
    """One layout directory of a disk tier, as found on disk."""

    root: str  #: the disk tier's configured path
    namespace: str | None  #: a server's namespace (``ns-<name>``); None: a store's own
    fingerprint: str
    path: str
    blocks: int
    nbytes: int  #: bytes of its block files
    num_layers: int | None  #: from a block header (None: no readable header)
    block_nbytes: int | None  #: a chunk's KV bytes, from the same header
    keys: tuple[bytes, ...] = field(default=(), repr=False)


def _layout_dirs(base: Path) -> list[Path]:
    """The ``<fingerprint>`` directories under ``base/kvstore-v1`` (none if it is absent)."""
    try:
        with os.scandir(base / FORMAT_DIR) as entries:
            found = [Path(e.path) for e in entries if _is_fingerprint(e.name) and e.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found)


def _is_fingerprint(name: str) -> bool:
    return len(name) == 16 and all(c in "0123456789abcdef" for c in name)


def _namespace_dirs(root: Path) -> list[tuple[str, Path]]:
    """A server's ``ns-<namespace>`` directories under ``root``."""
    try:
        with os.scandir(root) as entries:
            found = [
                (e.name[len(_NAMESPACE_DIR) :], Path(e.path))
                for e in entries
                if e.name.startswith(_NAMESPACE_DIR) and e.is_dir()
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found)


def find_layouts(root: str | os.PathLike[str]) -> list[LayoutDir]:
    """Every layout directory under a disk tier's ``root`` (a store's own, then each
    server namespace's), with its blocks counted and its geometry read off a header.

    Reads only. Raises :class:`OSError` for a root that cannot be listed (permissions).
    """
    base = Path(root).expanduser()
    places: list[tuple[str | None, Path]] = [(None, base), *_namespace_dirs(base)]
    found = []
    for namespace, place in places:
        for directory in _layout_dirs(place):
            found.append(_read_layout_dir(str(root), namespace, place, directory.name))
    return found


def _read_layout_dir(root: str, namespace: str | None, place: Path, fp: str) -> LayoutDir:
    tree = Tree(place, fp)
    keys, _ = tree.scan()  # no ops: nothing is swept
    nbytes = 0
    for key in keys:
        with contextlib.suppress(FileNotFoundError):  # deleted by a writer meanwhile
            nbytes += os.stat(tree.block_path(key)).st_size
    geometry = _geometry(tree, keys)
    layers, block = geometry if geometry is not None else (None, None)
    return LayoutDir(
        root, namespace, fp, str(tree.base), len(keys), nbytes, layers, block, tuple(keys)
    )


def _geometry(tree: Tree, keys: Sequence[bytes]) -> tuple[int, int] | None:
    """``(layers, chunk bytes)`` from the header of one of the newest blocks."""
    for key in reversed(keys[-_HEADER_TRIES:]):
        try:
            with open(tree.block_path(key), "rb") as f:
                header = read_header(f.read(_HEADER_READ))
        except (OSError, CorruptBlockError):
            continue
        if header.layout_fp.hex() == tree.layout_hex:
            return header.num_layers, header.raw_nbytes
    return None


def block_file_nbytes(num_layers: int, block_nbytes: int) -> int:
    """Bytes of one raw block file: the header padded to a page, then the chunk."""
    return -(-header_size(num_layers) // _PAGE) * _PAGE + block_nbytes


@dataclass
class StoreSurvey:
    """One (namespace, layout) store of a config: what its disk tiers hold."""

    namespace: str | None
    fingerprint: str
    num_layers: int | None
    block_nbytes: int | None
    layout: KVLayout | None = None  #: known when the layout flags named it
    dirs: list[LayoutDir] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        """Distinct blocks over its disk tiers."""
        if len(self.dirs) == 1:
            return self.dirs[0].blocks
        return len({k for d in self.dirs for k in d.keys})


def survey(
    config: StoreConfig | DaemonConfig, layout: KVLayout | None = None, only: str | None = None
) -> dict[str, Any]:
    """The report ``kvstore stats`` prints: per store found on disk (or named by
    ``layout``), each tier's blocks and capacity (and, for a server's config, its
    tenants'); ``only``: a fingerprint (or a unique prefix of one) to report alone.
    Reads only."""
    settings = DaemonConfig.of(config)
    config = settings.store
    disks = [t for t in config.tiers if isinstance(t, DiskTierConfig)]
    notes: list[str] = []
    dirs, disk_report = _scan_disks(disks, notes)
    stores = _stores(dirs)
    stores = _choose(stores, layout, only, notes, [t.path for t in disks])
    reports = [_store_report(s, config) for s in stores]
    report = {
        "disk_tiers": disk_report,
        "stores": reports,
        "restore": _restore(config),
        "notes": notes,
    }
    if settings.server.tenants:
        report["tenants"] = _tenants(reports, settings.server)
    return report


def _tenants(stores: list[dict[str, Any]], server: ServerConfig) -> dict[str, dict[str, Any]]:
    """Per tenant of ``server.tenants`` (and ``default``: namespaces none owns): the disk
    blocks and bytes of its namespaces, and its disk quota (share, limit)."""
    owners = server.owners()
    out: dict[str, dict[str, Any]] = {
        t.name: {"namespaces": list(t.namespaces), "blocks": 0, "bytes": 0} for t in server.tenants
    }
    for tenant in server.tenants:
        for quota in tenant.quotas:
            if quota.tier == "disk":
                out[tenant.name].update(share=quota.share, limit=quota.limit)
    for store in stores:
        if store["namespace"] is None:
            continue
        mine = out.setdefault(
            owners.get(store["namespace"], "default"), {"namespaces": [], "blocks": 0, "bytes": 0}
        )
        mine["blocks"] += store["blocks"]
        mine["bytes"] += store["bytes"]
    return out


def _scan_disks(
    disks: Sequence[DiskTierConfig], notes: list[str]
) -> tuple[list[tuple[int, LayoutDir]], list[dict[str, Any]]]:
    dirs: list[tuple[int, LayoutDir]] = []
    report = []
    for i, tier in enumerate(disks):
        try:
            found = find_layouts(tier.path)
        except OSError as exc:
            notes.append(f"disk tier {tier.path}: cannot be read ({exc.strerror or exc})")
            report.append({"path": tier.path, "layouts": 0, "error": exc.strerror or str(exc)})
            continue
        dirs += [(i, d) for d in found]
        report.append({"path": tier.path, "layouts": len(found), "error": None})
    return dirs, report


def _stores(dirs: Sequence[tuple[int, LayoutDir]]) -> list[StoreSurvey]:
    stores: dict[tuple[str | None, str], StoreSurvey] = {}
    for _, d in dirs:
        key = (d.namespace, d.fingerprint)
        store = stores.setdefault(key, StoreSurvey(d.namespace, d.fingerprint, None, None))
        store.dirs.append(d)
        if store.num_layers is None and d.num_layers is not None:
            store.num_layers, store.block_nbytes = d.num_layers, d.block_nbytes
    return list(stores.values())


def _choose(
    stores: list[StoreSurvey],
    layout: KVLayout | None,
    only: str | None,
    notes: list[str],
    paths: Sequence[str],
) -> list[StoreSurvey]:
    """The stores to report: those holding blocks (``only``'s, when given), and the
    flags' layout's (found, empty, or not on disk at all)."""
    held = [s for s in stores if s.blocks]  # an empty directory: a store that never wrote
    if only is not None:
        held = _matching(held, only, paths)
    if layout is None:
        if held:
            return held
        layout = KVLayout(32, 8, 128)  # nothing on disk: the flags' defaults (Llama-3-8B)
        where = ", ".join(paths) or "no disk tier in this config"
        notes.append(f"no blocks on disk ({where}); showing layout {layout.fingerprint_hex}")
    named = [s for s in stores if s.fingerprint == layout.fingerprint_hex]
    if not any(s.blocks for s in named) and held:
        notes.append(
            f"layout {layout.fingerprint_hex} (the layout flags) has no blocks on disk; "
            f"on disk: {', '.join(_label(s) for s in held)}"
        )
    if not named:
        named = [StoreSurvey(None, layout.fingerprint_hex, layout.num_layers, layout.block_nbytes)]
    for store in named:
        store.layout, store.num_layers = layout, layout.num_layers
        store.block_nbytes = layout.block_nbytes
    return [*held, *(s for s in named if s not in held)]


def _matching(stores: list[StoreSurvey], only: str, paths: Sequence[str]) -> list[StoreSurvey]:
    """The stores whose fingerprint ``only`` is (or uniquely begins)."""
    wanted = only.lower()
    fps = sorted({s.fingerprint for s in stores if s.fingerprint.startswith(wanted)})
    if len(fps) == 1:
        return [s for s in stores if s.fingerprint == fps[0]]
    held = ", ".join(sorted({s.fingerprint for s in stores})) or "none"
    if not fps:
        where = ", ".join(paths) or "no disk tier"
        raise InvalidInputError(
            f"--layout {only}: no such layout on disk ({where}); on disk: {held}"
        )
    raise InvalidInputError(
        f"--layout {only}: names several layouts ({', '.join(fps)}); give more of it"
    )


def _label(store: StoreSurvey) -> str:
    where = f"namespace {store.namespace} " if store.namespace is not None else ""
    layers = f", {store.num_layers} layers" if store.num_layers is not None else ""
    return f"{where}layout {store.fingerprint} ({store.blocks} blocks{layers})"


def _store_report(store: StoreSurvey, config: StoreConfig) -> dict[str, Any]:
    kinds = [t.kind for t in config.tiers]
    ids = [f"{kind}:{kinds[:i].count(kind)}" for i, kind in enumerate(kinds)]  # as TierIO
    tiers = [_tier_report(t, store, config, i) for t, i in zip(config.tiers, ids, strict=True)]
    if config.cluster.enabled:
        at = next(
            (i for i, t in enumerate(config.tiers) if t.kind not in ("host", "device", "disk")),
            len(tiers),
        )
        tiers.insert(at, {"kind": "cluster", "inspected": False, "blocks": None})
    return {
        "namespace": store.namespace,
        "fingerprint": store.fingerprint,
        "layout": store.layout.describe() if store.layout is not None else None,
        "num_layers": store.num_layers,
        "block_nbytes": store.block_nbytes,
        "blocks": store.blocks,
        "bytes": sum(d.nbytes for d in store.dirs),
        "tiers": tiers,
    }


def _tier_report(
    tier: TierConfig, store: StoreSurvey, config: StoreConfig, tier_id: str
) -> dict[str, Any]:
    restore = config.restore
    gbps, ms = restore.declared_speed(tier_id) or (tier.read_gbps, tier.read_latency_ms)
    speed = ReadSpeed(
        gbps,
        ms,
        restore.speed_half_life_s,
        restore.speed_stale_s,
        lambda: 0.0,
    )
    out: dict[str, Any] = {"kind": tier.kind, "capacity": tier.capacity, **speed.prior.as_stats()}
    if isinstance(tier, DiskTierConfig):
        out.update(_disk_report(tier, store))
    elif tier.kind in _MEMORY_KINDS:
        out.update(inspected=True, blocks=0, bytes=0, unit_nbytes=store.block_nbytes)
    else:
        out.update(inspected=False, blocks=None, bytes=None, unit_nbytes=store.block_nbytes)
    unit = out["unit_nbytes"]
    if unit is not None and "capacity_blocks" not in out:
        out["capacity_blocks"] = tier.capacity // unit
    return out


def _disk_report(tier: DiskTierConfig, store: StoreSurvey) -> dict[str, Any]:
    found = next((d for d in store.dirs if d.root == tier.path), None)
    blocks = found.blocks if found is not None else 0
    path = Path(found.path) if found is not None else Path(tier.path).expanduser()
    write_error = _write_error(path)
    out: dict[str, Any] = {
        "inspected": True,
        "root": tier.path,
        "path": str(path),
        "writable": write_error is None,
        "write_error": write_error,
        "blocks": blocks,
        "bytes": found.nbytes if found is not None else 0,
        "unit_nbytes": None,
        "capacity_blocks": None,
        "clamped_to_free_space": False,
    }
    if store.num_layers is None or store.block_nbytes is None:
        return out
    unit = block_file_nbytes(store.num_layers, store.block_nbytes)
    wanted = tier.capacity // unit
    room = _room(path, unit, blocks)
    out.update(unit_nbytes=unit, capacity_blocks=wanted)
    if room is not None and room < wanted:
        out.update(capacity_blocks=max(1, room), clamped_to_free_space=True)
    return out


def _write_error(path: Path) -> str | None:
    """Why the disk tier could not write at ``path`` (the nearest directory that
    exists: where it would create the rest), or None; asked of ``access(2)``, which
    answers for read-only mounts and permissions without writing anything."""
    place = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if place is None or not place.is_dir():
        return f"{place} is not a directory" if place is not None else "no such directory"
    if not os.access(place, os.W_OK | os.X_OK):
        return os.strerror(errno.EROFS if _read_only_mount(place) else errno.EACCES)
    return None


def _read_only_mount(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    return False


def _room(path: Path, unit: int, held: int) -> int | None:
    """Blocks of ``unit`` bytes the disk tier would allow itself at ``path`` (None: unknown)."""
    for place in (path, *path.parents):
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(place).free
            return int(_FREE_FRACTION * (free + held * unit)) // unit
    return None


def _restore(config: StoreConfig) -> dict[str, Any]:
    """Restore planning as a store of this config starts with it."""
    restore = config.restore
    prefill = PrefillSpeed(
        restore.prefill_table,
        restore.prefill_tokens_per_s,
        restore.learn_prefill,
        restore.speed_half_life_s,
        lambda: 0.0,
    )
    return {"planning": restore.planning, **prefill.estimate().as_stats()}


# -- the human report ------------------------------------------------------------------
def format_survey(report: dict[str, Any]) -> str:
    """``kvstore stats``'s text: notes, each disk tier, then per store its tiers."""
    from kvstore.config import format_size

    lines = [f"note: {note}" for note in report["notes"]]
    for disk in report["disk_tiers"]:
        found = f"cannot be read ({disk['error']})" if disk["error"] else _layouts(disk["layouts"])
        lines.append(f"disk tier {disk['path']}: {found}")
    for store in report["stores"]:
        lines.append(_store_line(store, format_size))
        lines += [_tier_line(t, format_size) for t in store["tiers"]]
    for name, tenant in sorted(report.get("tenants", {}).items()):
        quota = ""
        if "share" in tenant:
            limit = "none" if tenant["limit"] is None else format_size(tenant["limit"])
            quota = f" (share {format_size(tenant['share'])}, limit {limit})"
        lines.append(
            f"tenant {name}: {tenant['blocks']:,} blocks, {format_size(tenant['bytes'])} on disk"
            + quota
        )
    lines.append(_restore_line(report["restore"]))
    return "\n".join(lines)


def _layouts(n: int) -> str:
    return f"{n or 'no'} layout director{'y' if n == 1 else 'ies'}"


def _store_line(store: dict[str, Any], size: Any) -> str:
    where = f"namespace {store['namespace']}, " if store["namespace"] is not None else ""
    desc = store["layout"]
    if desc is not None:
        what = (
            f"{desc['num_layers']} layers, {desc['num_kv_heads']} KV heads x {desc['head_dim']}, "
            f"{desc['block_tokens']} tokens, {desc['dtype']}: {size(store['block_nbytes'])} a chunk"
        )
    elif store["num_layers"] is not None:
        what = (
            f"{store['num_layers']} layers, {size(store['block_nbytes'])} a chunk; "
            "its heads, chunk tokens and dtype are not on disk"
        )
    else:
        what = "no readable block header"
    return f"{where}layout {store['fingerprint']}: {store['blocks']:,} blocks stored ({what})"


def _tier_line(tier: dict[str, Any], size: Any) -> str:
    """``kind  blocks / capacity blocks, bytes / capacity bytes, bytes a block``: the same
    capacity twice, as blocks and as bytes (blocks x the bytes one takes there)."""
    if tier["kind"] == "cluster":
        return "  cluster  (the peers' blocks: not read; `kvstore route` ranks the nodes)"
    blocks = "?" if tier["blocks"] is None else f"{tier['blocks']:,}"
    room = "?" if tier.get("capacity_blocks") is None else f"{tier['capacity_blocks']:,}"
    held = "?" if tier["bytes"] is None else size(tier["bytes"])
    line = f"  {tier['kind']:<7} {blocks:>9} / {room} blocks, {held} / {size(tier['capacity'])}"
    if tier["unit_nbytes"] is not None:
        line += f", {size(tier['unit_nbytes'])} each"
    if tier.get("clamped_to_free_space"):
        line += " (clamped to 95% of the free space)"
    if tier["kind"] in _MEMORY_KINDS:
        line += " (memory: empty at start)"
    elif not tier["inspected"]:
        line += " (not read: kvstore stats reads local disk tiers only)"
    if tier.get("writable") is False:
        line += " [READ-ONLY]"
    return (
        f"{line}  reads {tier['read_gbps_estimate']:.2f} GB/s, "
        f"{tier['read_latency_ms_estimate']:.2f} ms a call ({tier['read_speed_source']})"
    )


def _restore_line(restore: dict[str, Any]) -> str:
    """Restore planning: on or off, the prefill speed it weighs loads against."""
    rate = restore.get("prefill_tokens_per_s")
    speed = f"{rate:,.0f} tokens/s" if rate else "not known yet (every stored chunk loads)"
    state = "on" if restore.get("planning") else "off (every stored chunk loads)"
    return f"restore planning {state}; prefill {speed} ({restore.get('prefill_source')})"
