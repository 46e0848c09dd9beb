"""The plots of ``run_all.py``, drawn with matplotlib (Agg: files only) from the benchmarks' JSON.

Each plot reads the results of one or more benchmarks (``{name: entry}`` as in
``results.json``, an entry's ``result`` being the script's JSON object) and
either writes its PNG or says why it could not (a benchmark skipped, failed or
not run). :func:`resolve` reads a figure out of a result by a dotted path.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Results = Mapping[str, Mapping[str, Any]]
_MISSING = object()


# -- reading figures ----------------------------------------------------------------------------
def _segments(path: str) -> list[str]:
    """``a.b[k=v,w=x].c`` -> ``["a", "b", "[k=v,w=x]", "c"]`` (no split inside brackets)."""
    out: list[str] = []
    for token in re.findall(r"\[[^\]]*\]|[^.\[]+", path):
        out.append(token)
    return out


def _select(items: Sequence[Any], selector: str) -> Any:
    """The first dict in ``items`` whose fields match ``[k=v,...]`` (compared as strings)."""
    wanted = dict(pair.split("=", 1) for pair in selector[1:-1].split(",") if pair)
    for item in items:
        if isinstance(item, Mapping) and all(str(item.get(k)) == v for k, v in wanted.items()):
            return item
    return _MISSING


def resolve(obj: Any, path: str, default: Any = None) -> Any:
    """The value at ``path`` in ``obj``, or ``default`` where it is absent.

    Dots separate keys; a key that itself holds dots (``hit_rate.lru.0.05``: the
    key ``"0.05"``) is matched greedily, longest first. A list is indexed by a
    number or by ``[field=value,...]`` (the first element whose fields match).
    """
    value = _walk(obj, _segments(path))
    return default if value is _MISSING else value


def _walk(obj: Any, parts: list[str]) -> Any:
    if not parts:
        return obj
    head = parts[0]
    if head.startswith("["):
        if not isinstance(obj, Sequence) or isinstance(obj, str):
            return _MISSING
        found = _select(obj, head)
        return _MISSING if found is _MISSING else _walk(found, parts[1:])
    if isinstance(obj, Mapping):
        plain = len(parts) if not any(p.startswith("[") for p in parts) else _first_bracket(parts)
        for n in range(plain, 0, -1):  # the longest dotted key that exists
            key = ".".join(parts[:n])
            if key in obj:
                found = _walk(obj[key], parts[n:])
                if found is not _MISSING:
                    return found
        return _MISSING
    if isinstance(obj, Sequence) and not isinstance(obj, str) and head.lstrip("-").isdigit():
        index = int(head)
        return _walk(obj[index], parts[1:]) if -len(obj) <= index < len(obj) else _MISSING
    return _MISSING


def _first_bracket(parts: list[str]) -> int:
    return next(i for i, p in enumerate(parts) if p.startswith("["))


def result_of(results: Results, name: str) -> dict[str, Any] | None:
    """The JSON of benchmark ``name`` where it ran and was not skipped, else None."""
    entry = results.get(name)
    if not entry or entry.get("status") != "ok":
        return None
    result = entry.get("result")
    return result if isinstance(result, dict) else None


def why_missing(results: Results, name: str) -> str:
    """Why benchmark ``name`` has no result (for a plot that needs it)."""
    entry = results.get(name)
    if not entry:
        return f"{name} was not run"
    status = entry.get("status")
    detail = entry.get("reason") or entry.get("error") or ""
    return f"{name} {status}" + (f": {detail}" if detail else "")


# -- the plots ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plot:
    """One PNG: its file name, its title, the benchmarks it reads and how it is drawn."""

    file: str
    title: str
    needs: tuple[str, ...]
    draw: Callable[[Results, Any], Any]  # (results, pyplot) -> the figure


#: (bar group, benchmark, kvstore's figure, the raw medium's figure, raw label, to GB/s)
THROUGHPUT: tuple[tuple[str, str, str, str, str, float], ...] = (
    ("host put", "host_tier", "put_gbps", "memcpy_gbps", "memcpy", 1.0),
    ("host get", "host_tier", "get_gbps", "memcpy_gbps", "memcpy", 1.0),
    ("disk write", "disk_tier", "tier_write_gbps", "raw_write_gbps", "pwrite", 1.0),
    ("disk read cold", "disk_tier", "tier_read_cold_gbps", "raw_read_cold_gbps", "preadv", 1.0),
    ("disk read warm", "disk_tier", "tier_read_warm_gbps", "raw_read_warm_gbps", "preadv", 1.0),
    ("S3 put", "remote_tiers", "s3_put_mbps", "s3_raw_put_mbps", "boto3", 1e-3),
    ("S3 get", "remote_tiers", "s3_get_mbps", "s3_raw_get_mbps", "boto3", 1e-3),
    ("Redis put", "remote_tiers", "redis_put_mbps", "redis_raw_put_mbps", "redis-py", 1e-3),
    ("Redis get", "remote_tiers", "redis_get_mbps", "redis_raw_get_mbps", "redis-py", 1e-3),
    ("server TCP put", "server", "tcp_put_gbps", "gbps.large.socket.tcp.put.c1", "socket", 1.0),
    ("server TCP get", "server", "tcp_get_gbps", "socket_tcp_get_gbps", "socket", 1.0),
    ("server shm get", "server", "shm_get_gbps", "memcpy_gbps", "memcpy", 1.0),
)


def draw_throughput(results: Results, plt: Any) -> Any:
    """Grouped bars: kvstore's GB/s next to its raw medium's, ratio on top (log scale)."""
    groups = []
    for label, bench, mine, raw, raw_label, scale in THROUGHPUT:
        result = result_of(results, bench)
        a, b = (resolve(result, f) if result else None for f in (mine, raw))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
            groups.append((f"{label}\nvs {raw_label}", a * scale, b * scale))
    fig, ax = plt.subplots(figsize=(max(8, 1.0 * len(groups) + 2), 4.8))
    xs = range(len(groups))
    ax.bar([x - 0.2 for x in xs], [g[1] for g in groups], 0.4, label="kvstore", color="C0")
    ax.bar([x + 0.2 for x in xs], [g[2] for g in groups], 0.4, label="raw medium", color="0.6")
    for x, (_, a, b) in zip(xs, groups, strict=True):
        ax.annotate(f"{a / b:.2f}x", (x, max(a, b)), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [g[0] for g in groups], fontsize=8)
    ax.set_ylabel("GB/s (log scale)")
    ax.set_title("Throughput per tier vs its raw medium (label: kvstore / raw)")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def draw_hit_rates(results: Results, plt: Any) -> Any:
    """Hit rate vs cache size, a line per policy (dotted: hot-block replication on)."""
    result = result_of(results, "policies") or {}
    rows, repl = result.get("results") or [], result.get("with_replication") or []
    bound = resolve(result, "trace.max_hit_rate")
    from bench_policies import hit_rate_figure  # its own plot, from its JSON

    fig = hit_rate_figure(rows, repl, bound if isinstance(bound, float) else None, plt)
    fig.suptitle("Hit rate per eviction policy and cache size (bench_policies)")
    return fig


def draw_prefetch(results: Results, plt: Any) -> Any:
    """Per layer: when its load step ran and when its compute ran (one pipelined rep)."""
    result = result_of(results, "prefetch") or {}
    layers = resolve(result, "timeline.layers")
    if not layers:
        raise _NoData("prefetch ran without a timeline (an older bench_prefetch.py)")
    fig, ax = plt.subplots(figsize=(10, max(3.5, 0.16 * len(layers) + 1.5)))
    for row in layers:
        y = row["layer"]
        if row["load_start_ms"] is not None:
            span = row["load_end_ms"] - row["load_start_ms"]
            ax.broken_barh([(row["load_start_ms"], span)], (y - 0.4, 0.38), color="C0")
        span = row["compute_end_ms"] - row["compute_start_ms"]
        ax.broken_barh([(row["compute_start_ms"], span)], (y + 0.02, 0.38), color="C1")
    ax.invert_yaxis()
    ax.set_xlabel("ms since store.prefetch()")
    ax.set_ylabel("layer")
    ax.bar([0], [0], color="C0", label="load (prefetch step)")
    ax.bar([0], [0], color="C1", label="compute")
    ax.legend(fontsize=8, loc="upper right")
    eff, total = result.get("overlap_efficiency"), resolve(result, "timeline.total_ms")
    title = f"Layerwise prefetch, {result.get('blocks')} blocks on {result.get('device')}"
    if isinstance(eff, float):
        title += f": overlap efficiency {eff:.3f} (median of the timed reps)"
    if isinstance(total, float):
        title += f"; this rep {total:.1f} ms"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def draw_ttft(results: Results, plt: Any) -> Any:
    """Median TTFT of the hit turns per configuration, and every request's TTFT."""
    result = result_of(results, "vllm") or {}
    configs = (
        ("nocache", "ttft_nocache_s"),
        ("kvstore", "ttft_hit_s"),
        ("offload", "ttft_offload_s"),
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.3))
    names = [c for c, f in configs if isinstance(result.get(f), (int, float))]
    values = [result[f] for c, f in configs if c in names]
    left.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    for x, v in enumerate(values):
        left.annotate(f"{v:.2f} s", (x, v), ha="center", va="bottom", fontsize=8)
    nocache = result.get("ttft_nocache_s")
    if isinstance(nocache, (int, float)):
        left.axhline(0.5 * nocache, color="grey", ls="--", lw=0.8, label="target: 0.5x no cache")
        left.legend(fontsize=8)
    missing = [c for c, f in configs if c not in names]
    note = f" ({', '.join(missing)}: did not run)" if missing else ""
    left.set_title(f"median TTFT, turns after a session's first{note}", fontsize=9)
    left.set_ylabel("seconds")
    for i, (config, _) in enumerate(configs):
        turns = _first_turns(result, config)
        if turns:
            labels = [f"s{t['session']}t{t['turn']}" for t in turns]
            right.plot(labels, [t["ttft_s"] for t in turns], "-o", color=f"C{i}", label=config)
    right.set_title("TTFT per request (first round)", fontsize=9)
    right.set_xlabel("request (session, turn)")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("vLLM time to first token with and without kvstore (bench_vllm)")
    return fig


def _first_turns(result: Mapping[str, Any], config: str) -> list[dict[str, Any]]:
    """The per-request figures of ``config``'s first good round."""
    runs = resolve(result, f"configs.{config}.runs") or []
    run = next((r for r in runs if r.get("ok")), None)
    return [t for t in (run or {}).get("turns", []) if t.get("ttft_s") is not None]


def draw_index(results: Results, plt: Any) -> Any:
    """Lookup cost and index memory vs stored blocks (in-process, and the cluster's Redis)."""
    hashed, index, cluster = (result_of(results, n) for n in ("hash", "index", "cluster"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.3))
    points = resolve(hashed, "prefix_lookup_scaling") if hashed else None
    if points:
        xs = [p["stored_blocks"] for p in points]
        left.plot(xs, [p["hash_and_lookup_ms"] for p in points], "-o", label="hash + lookup")
        left.plot(xs, [p["lookup_only_ms"] for p in points], "-s", label="lookup only")
    remote = resolve(cluster, "index_scaling") if cluster else None
    if remote:
        xs = [p["blocks"] for p in remote]
        ys = [p["locate_ms_p50"] for p in remote]
        left.plot(xs, ys, ":^", color="C3", label="cluster index in Redis: locate p50")
    left.axhline(1.0, color="grey", ls="--", lw=0.8, label="target 1 ms (hash + lookup)")
    missing = f"{why_missing(results, 'hash')}; {why_missing(results, 'cluster')}"
    _panel(
        left,
        "128K-token prompt (512 keys), ms",
        "lookup cost",
        None if points or remote else missing,
    )
    mem = resolve(index, "index_scaling") if index else None
    if mem:
        xs = [p["stored_blocks"] for p in mem]
        right.plot(xs, [p["traced_bytes_per_block"] for p in mem], "-o", label="tracemalloc")
        right.plot(xs, [p["rss_bytes_per_block"] for p in mem], "-s", label="RSS growth")
    if remote:
        xs = [p["blocks"] for p in remote]
        ys = [p["redis_bytes_per_block"] for p in remote]
        right.plot(xs, ys, ":^", color="C3", label="cluster index: Redis used_memory")
    right.axhline(256, color="grey", ls="--", lw=0.8, label="target 256 B (in-process)")
    missing = f"{why_missing(results, 'index')}; {why_missing(results, 'cluster')}"
    _panel(right, "bytes per stored block", "index memory", None if mem or remote else missing)
    if not (points or mem):
        raise _NoData(f"{why_missing(results, 'hash')}; {why_missing(results, 'index')}")
    fig.suptitle("Lookup cost and index memory vs number of stored blocks")
    return fig


def _panel(ax: Any, ylabel: str, title: str, missing: str | None) -> None:
    """Axes of one scaling panel; ``missing``: why it has no data (said in the panel)."""
    ax.set_xlabel("stored blocks")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if missing:
        ax.cla()
        ax.set_axis_off()
        ax.set_title(f"{title}: no data", fontsize=9)
        ax.text(0.5, 0.5, missing, ha="center", va="center", wrap=True, transform=ax.transAxes)
        return
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _draw_peers(op: str) -> Callable[[Results, Any], Any]:
    """The peers' plot of operation ``op`` (bench_peers.py; drawn by _peers_plots)."""

    def draw(results: Results, plt: Any) -> Any:
        from _peers_plots import draw_op

        try:
            return draw_op(result_of(results, "peers") or {}, op, plt)
        except ValueError as exc:  # no row of that operation ran
            raise _NoData(f"peers: {exc}") from None

    return draw


PLOTS: tuple[Plot, ...] = (
    Plot(
        "throughput.png",
        "Throughput per tier vs its raw medium",
        ("host_tier", "disk_tier", "remote_tiers", "server"),
        draw_throughput,
    ),
    Plot("hit_rates.png", "Hit rate per policy and cache size", ("policies",), draw_hit_rates),
    Plot(
        "prefetch_timeline.png",
        "Prefetch timeline: load vs compute per layer",
        ("prefetch",),
        draw_prefetch,
    ),
    Plot("ttft.png", "TTFT with and without kvstore (vLLM)", ("vllm",), draw_ttft),
    Plot(
        "index_scaling.png",
        "Lookup cost and index memory vs stored blocks",
        ("hash", "index", "cluster"),
        draw_index,
    ),
    *(
        Plot(
            f"peers_{op}.png",
            f"Peers side by side: {op.replace('_', ' ')}",
            ("peers",),
            _draw_peers(op),
        )
        for op in ("put", "get", "first_fill", "lookup")
    ),
)


class _NoData(Exception):
    """A plot has nothing to draw (raised by a draw function)."""


def draw_all(results: Results, out: Path) -> list[dict[str, Any]]:
    """Draw every plot whose data is there into ``out``; per plot, drawn or why not."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for plot in PLOTS:
        have = [n for n in plot.needs if result_of(results, n) is not None]
        reason = None
        if not have:
            reason = "; ".join(why_missing(results, n) for n in plot.needs)
        else:
            try:
                fig = plot.draw(results, plt)
                fig.tight_layout()
                fig.savefig(out / plot.file, dpi=110)
            except _NoData as exc:
                reason = str(exc)
            except Exception as exc:  # a figure of an unexpected shape: say so, draw the rest
                reason = f"drawing it failed: {type(exc).__name__}: {exc}"
                print(f"run_all: {plot.file}: {reason}", file=sys.stderr)
            finally:
                plt.close("all")
        if reason is not None:
            (out / plot.file).unlink(missing_ok=True)  # never leave a stale plot behind
        outcomes.append(
            {"file": plot.file, "title": plot.title, "drawn": reason is None, "reason": reason}
        )
    return outcomes
