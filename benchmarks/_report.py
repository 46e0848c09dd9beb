"""The written side of ``run_all.py``: the machine, the table of figures and ``README.md``.

:func:`render` writes ``results.json``, the plots (:mod:`_plots`) and the
README into a directory, from a ``results.json`` document and the registry of
``run_all.py`` (whose :class:`Figure` rows, defined here, say what to tabulate).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from _plots import draw_all, resolve

ROOT = Path(__file__).resolve().parents[1]


# -- the registry's rows: data only (run_all.REGISTRY lists them) --------------------------
@dataclass(frozen=True)
class Figure:
    """One row of the table: a figure of a script's JSON and its bar."""

    path: str  #: dotted path into the JSON (see ``_plots.resolve``)
    baseline: str = ""  #: what the figure is compared with ("" for an absolute figure)
    target: str = ""  #: ``">= 0.8"``, ``"<= 1"``; "" for none
    unit: str = ""  #: ``"x"`` for ratios, ``"ms"``, ``"GB/s"``, ``"B"`` ...
    baseline_path: str = ""  #: the baseline's own figure in the same JSON, shown beside it
    baseline_unit: str = ""


@dataclass(frozen=True)
class Bench:
    """One benchmark script: how to run it, fully and with ``--quick``, and what to tabulate."""

    name: str
    script: str  #: a file in benchmarks/ (or an absolute path)
    figures: tuple[Figure, ...]
    args: tuple[str, ...] = ()  #: a full run's arguments (``{tmp}``: a scratch directory)
    quick_args: tuple[str, ...] | None = ("--quick",)  #: None: not part of ``--quick``
    timeout_s: float = 900.0
    quick_timeout_s: float = 180.0
    note: str = ""  #: shown in the README (why it is not in ``--quick``, say)


def minutes(seconds: float) -> str:
    """``seconds`` as ``4m05s``."""
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# -- the machine ---------------------------------------------------------------------------------
def _proc_field(path: str, prefix: str, sep: str = ":") -> str | None:
    """The value of the first ``prefix<sep>value`` line of a text file, if any."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(prefix):
                return line.split(sep, 1)[-1].strip().strip('"')
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's commit, ``+dirty`` with local changes (read-only: no index refresh)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = ["git", *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else None


def machine() -> dict[str, Any]:
    """What ran the benchmarks, without naming the host."""
    mem = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or None,
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "os": _proc_field("/etc/os-release", "PRETTY_NAME=", "=") or platform.system(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(m: dict[str, Any]) -> str:
    """The machine in one line."""
    return (
        f"{m.get('cpu_model') or 'unknown CPU'}, {m.get('cores')} cores, "
        f"{m.get('memory_gib')} GiB, {m.get('os')} (kernel {m.get('kernel')}, {m.get('arch')}), "
        f"Python {m.get('python')}, torch {m.get('torch')}"
    )


# -- the table ----------------------------------------------------------------------------------
def check(value: Any, target: str) -> str:
    """``pass`` / ``fail`` against ``target`` (``">= 0.8"``); ``—`` with no value or target."""
    if not target or not isinstance(value, (int, float)) or isinstance(value, bool):
        return "—"
    op, _, bar = target.partition(" ")
    ops = {
        ">=": value >= float(bar),
        "<=": value <= float(bar),
        ">": value > float(bar),
        "<": value < float(bar),
    }
    if op not in ops:
        raise ValueError(f"target {target!r}: expected '>= N', '<= N', '> N' or '< N'")
    return "pass" if ops[op] else "**fail**"


def fmt(value: Any, unit: str = "") -> str:
    """A figure for the table."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if unit == "x":
        return f"{text}x"
    return f"{text} {unit}".strip()


def figure_row(bench: Bench, fig: Figure, result: dict[str, Any]) -> list[str]:
    """One table row: benchmark, figure, value, baseline, target, pass/fail."""
    absent = object()
    value = resolve(result, fig.path, absent)
    baseline = fig.baseline
    if fig.baseline_path:
        base = resolve(result, fig.baseline_path)
        baseline = f"{baseline}: {fmt(base, fig.baseline_unit)}" if baseline else fmt(base)
    if value is absent:
        shown, value = "— (not in the JSON)", None
    elif value is None:
        shown = "— (null)"
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        shown = fmt(value, fig.unit)
    else:
        shown, value = f"— (not a number: {type(value).__name__})", None
    target = f"{fig.target} {'' if fig.unit == 'x' else fig.unit}".strip() if fig.target else ""
    return [
        bench.name,
        f"`{fig.path}`",
        shown,
        baseline or "—",
        target or "—",
        check(value, fig.target),
    ]


def table_rows(doc: dict[str, Any], registry: Sequence[Bench]) -> list[list[str]]:
    """Every registry figure of every benchmark in ``doc`` (one row for one without results)."""
    rows: list[list[str]] = []
    for bench in registry:
        entry = doc["benchmarks"].get(bench.name)
        if entry is None:
            if bench.name in doc.get("not_run", {}):
                rows.append([bench.name, "—", "not run", doc["not_run"][bench.name], "—", "—"])
            continue
        if entry["status"] != "ok":
            why = entry.get("reason") or entry.get("error") or ""
            rows.append([bench.name, "—", entry["status"], _cell(why), "—", "—"])
            continue
        rows.extend(figure_row(bench, fig, entry["result"]) for fig in bench.figures)
    return rows


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_readme(
    doc: dict[str, Any], plots: list[dict[str, Any]], out: Path, registry: Sequence[Bench]
) -> str:
    """The README.md text."""
    rows = table_rows(doc, registry)
    verdicts = [r[5] for r in rows]
    counts = {k: verdicts.count(v) for k, v in (("pass", "pass"), ("fail", "**fail**"))}
    statuses = [e["status"] for e in doc["benchmarks"].values()]
    by_status = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
    m = doc["machine"]
    lines = [
        "# Benchmark results",
        "",
        "<!-- generated by benchmarks/run_all.py — do not edit -->",
        "_Generated by `benchmarks/run_all.py` — do not edit; re-run `kvstore bench --out "
        "docs/benchmarks` (`--quick` for a smoke run) or `python benchmarks/run_all.py "
        "--from-json docs/benchmarks/results.json --out docs/benchmarks` to re-render._",
        "",
        f"**Run:** {doc['mode']}, {m.get('date')}, commit `{m.get('git_commit')}`, "
        f"{minutes(doc.get('seconds') or 0)} in all.  ",
        f"**Machine:** {machine_line(m)}.",
        "",
        "Every value is the script's own figure (a median over its reps) from this one run; "
        "a ratio compares kvstore with its baseline measured in the same run "
        "([benchmarks/README.md](../../benchmarks/README.md) says what each measures). "
        "`—`: no target, or no value.",
        "",
        f"**{counts['pass']} pass, {counts['fail']} fail** of the figures with a target; "
        f"benchmarks: {by_status or 'none'}.",
        "",
        "| benchmark | figure | value | baseline | target | result |",
        "|---|---|---|---|---|---|",
        *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows),
        "",
        *_bench_section(doc),
        *_plot_section(plots),
        *_extra_section(out),
    ]
    return "\n".join(lines).rstrip() + "\n"


def _bench_section(doc: dict[str, Any]) -> list[str]:
    lines = [
        "## Scripts",
        "",
        "| benchmark | script and arguments | status | seconds |",
        "|---|---|---|---|",
    ]
    for name, e in doc["benchmarks"].items():
        status = e["status"]
        why = e.get("reason") or e.get("error")
        status += f": {why}" if why else ""
        status += f" (re-run {e['rerun']})" if e.get("rerun") else ""
        cmd = f"`{e['script']} {' '.join(e.get('args', []))}`".replace(" `", "`")
        lines.append(f"| {name} | {_cell(cmd)} | {_cell(status)} | {e.get('seconds', 0):.0f} |")
    for name, why in doc.get("not_run", {}).items():
        lines.append(f"| {name} | — | not run: {_cell(why)} | — |")
    return [*lines, ""]


def _plot_section(plots: list[dict[str, Any]]) -> list[str]:
    lines = ["## Plots", ""]
    for p in plots:
        lines.append(f"### {p['title']}")
        lines.append("")
        if p["drawn"]:
            lines.append(f"![{p['title']}]({p['file']})")
        else:
            lines.append(f"_Not drawn: {_cell(p['reason'] or '', 400)}._")
        lines.append("")
    return lines


def _extra_section(out: Path) -> list[str]:
    lines = [
        "## Also here",
        "",
        "- [results.json](results.json): every script's whole JSON, "
        "its arguments and seconds, and the machine.",
    ]
    if (out / "policies.md").exists():
        extra = " ([policies.png](policies.png))" if (out / "policies.png").exists() else ""
        lines.append(
            f"- [policies.md](policies.md): the eviction policies on a serving trace{extra}."
        )
    return [*lines, ""]


def render(doc: dict[str, Any], out: Path, registry: Sequence[Bench]) -> list[dict[str, Any]]:
    """Write ``results.json``, the plots and ``README.md`` into ``out``; the plot outcomes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    plots = draw_all(doc["benchmarks"], out)
    (out / "README.md").write_text(render_readme(doc, plots, out, registry))
    return plots
