"""bench_peers.py's plots: one per operation (put, get, first fill, lookup).

Each plot is a horizontal bar per row of that operation: kvstore / the peer (median, the
whisker its 90% interval), a line at 1 (ahead to the right), the label naming the peer,
path, block size and clients, and both systems' figures. ``run_all.py`` draws them from
its ``results.json`` (:data:`_plots.PLOTS`); ``bench_peers.py --out DIR`` beside its JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

OPS = {
    "put": "put / store",
    "get": "get / load",
    "first_fill": "first fill (a store opened just before)",
    "lookup": "lookup (prefix of stored keys)",
}
FILES = {op: f"peers_{op}.png" for op in OPS}


def label(row: Mapping[str, Any]) -> str:
    """``mooncake shm 1MiB c4: 3.1 vs 3.6 GB/s``."""
    unit = row["unit"]
    kv, them = row["kvstore"]["median"], row["baseline"]["median"]
    return (
        f"{row['peer']} {row['path']} {row['block']} c{row['clients']}: "
        f"{kv:.3g} vs {them:.3g} {unit}"
    )


def draw_op(result: Mapping[str, Any], op: str, plt: Any) -> Any:
    """The figure of operation ``op`` (rows that failed or were skipped are left out)."""
    rows = [r for r in result.get("rows", []) if r["op"] == op and r.get("ratio")]
    if not rows:
        raise ValueError(f"no {op} rows")
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.6))
    ys = range(len(rows))
    meds = [r["ratio"]["median"] for r in rows]
    err = [
        [m - r["ratio"]["lo"] for m, r in zip(meds, rows, strict=True)],
        [r["ratio"]["hi"] - m for m, r in zip(meds, rows, strict=True)],
    ]
    colors = ["C2" if r["ratio"]["median"] >= 1 else "C3" for r in rows]
    ax.barh(list(ys), meds, xerr=err, color=colors, alpha=0.8, capsize=3)
    ax.axvline(1.0, color="0.3", lw=1, ls="--")
    ax.set_yticks(list(ys), [label(r) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kvstore / peer (median, 90% interval; > 1: kvstore ahead)")
    skipped = ", ".join(sorted(result.get("skipped", {})))
    note = f" (skipped: {skipped})" if skipped else ""
    ax.set_title(f"Peers side by side: {OPS[op]}{note}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def draw_peer_plots(result: Mapping[str, Any], out: Path) -> dict[str, str | None]:
    """Every operation's PNG into ``out``; per file None (drawn) or why not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes: dict[str, str | None] = {}
    for op, name in FILES.items():
        try:
            fig = draw_op(result, op, plt)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            outcomes[name] = None
        except ValueError as exc:
            (out / name).unlink(missing_ok=True)
            outcomes[name] = str(exc)
        finally:
            plt.close("all")
    return outcomes
