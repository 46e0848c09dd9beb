"""benchmarks/bench_agentic.py: ``--quick`` runs and prints one JSON line with its
documented fields, and the figures are sane. No timing or target assertions (noisy
machines)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_agentic  # noqa: E402  (benchmarks/ is not a package)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("agentic") / "sub" / "agentic.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_agentic.py"), "--quick", "--json", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # one JSON line, nothing else
    doc = json.loads(lines[0])
    assert isinstance(doc, dict)
    assert json.loads(out.read_text()) == doc  # --out writes the same line
    return doc


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(120)
def test_quick_run_prints_the_documented_fields(result: dict[str, Any]) -> None:
    assert result["benchmark"] == "agentic" and result["quick"] is True
    for name in (
        "turn_ttft_p50_hinted_vs_plain",
        "turn_ttft_p99_hinted_vs_plain",
        "restore_p50_hinted_vs_plain",
        "restore_p99_hinted_vs_plain",
    ):
        assert finite(result[name]) and result[name] > 0, name
    for name in ("fast_tier_hit_rate_hinted", "fast_tier_hit_rate_plain"):
        assert finite(result[name]) and 0 <= result[name] <= 1, name
    assert result["targets"] == {"turn_ttft_p99_hinted_vs_plain": "<= 0.7"}
    assert set(result["pass"]) == set(result["targets"])
    assert all(isinstance(v, bool) for v in result["pass"].values())
    work = result["workload"]
    assert (work["sessions"], work["turns"], result["rounds"]) == (6, 5, 1)
    assert work["prefill_tokens_per_s"] == 8000.0 and work["fast_fraction"] == 0.25
    assert work["host_tier_chunks"] < work["total_chunks"]
    assert result["environment"]["cpus"] and result["seconds"] > 0
    assert "bypass" in result["page_cache"]


@pytest.mark.timeout(120)
def test_quick_figures_are_sane(result: dict[str, Any]) -> None:
    work = result["workload"]
    turns = work["sessions"] * work["turns"]
    for mode in ("plain", "hinted", "answers"):
        fig = result["modes"][mode]
        assert fig["turns"] == turns
        ttft, restore = result["ttft_ms"][mode], result["restore_ms"][mode]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= ttft["max"]
        assert 0 < restore["p50"] <= restore["p99"]
        assert ttft["p50"] >= fig["recompute_ms_p50"] > 0  # TTFT = restore + recompute (+ wait)
        assert 0 < result["prefix_hit_rate"][mode] < 1  # the tool result is never stored
        parts = fig["by_gap_before"]
        assert sum(p["turns"] for p in parts.values()) == turns
        assert parts["first_turn"]["turns"] == work["sessions"]
        assert fig["restored_chunks"] > 0
        tiers = result["store"][mode]["tiers"]
        assert [t["kind"] for t in tiers] == ["host", "disk"]
        assert tiers[0]["capacity_blocks"] == work["host_tier_chunks"]
    # Saving the answers (hinted, answers) is the same in both modes that do it: only the
    # restore differs between them; a plain turn recomputes its answer's chunks too.
    modes = result["modes"]
    assert modes["answers"]["recompute_ms_p50"] == modes["hinted"]["recompute_ms_p50"]
    assert modes["plain"]["recompute_ms_p50"] > modes["hinted"]["recompute_ms_p50"]
    assert result["prefix_hit_rate"]["plain"] < result["prefix_hit_rate"]["hinted"]
    assert result["prefix_hit_rate"]["answers"] == result["prefix_hit_rate"]["hinted"]
    for name in ("turn_ttft_p50_hinted_vs_answers", "turn_ttft_p99_hinted_vs_answers"):
        assert result[name] > 0, name


@pytest.mark.timeout(120)
def test_quick_hints_were_given_and_answered(result: dict[str, Any]) -> None:
    work = result["workload"]
    turns, gaps = work["sessions"] * work["turns"], work["gaps"]
    answers = result["hints"]["answers"]
    assert answers["retain_accepted"] == turns  # one per turn, every block stored
    assert answers.get("prefetch_accepted", 0) == gaps
    assert answers.get("demote_accepted", 0) == work["long_gaps"] > 0
    assert not any(k.endswith("_rejected") for k in answers)
    calls = result["hints"]["call_ms"]
    assert set(calls) == {"retain", "demote", "prefetch"}
    assert all(0 <= c["p50"] <= c["p99"] <= c["max"] for c in calls.values())
    blocks = result["hints"]["blocks"]
    assert blocks["demoted"] > 0 and blocks["prefetching"] > 0
    counted = result["store"]["hinted"]["hints"]
    assert counted["hints_accepted"] == turns + gaps + work["long_gaps"]
    assert result["store"]["plain"]["hints"]["hints_accepted"] == 0  # plain gives none
    wait = result["prefetch_wait"]
    assert wait["turns"] == gaps and wait["lead_s"] == 2.0
    assert 0 <= wait["turns_past_lead"] <= gaps and wait["counted_ms_total"] >= 0
    # demote + prefetch put a session's chunks in memory before its turn
    assert result["fast_tier_hit_rate_hinted"] > result["fast_tier_hit_rate_plain"]


def test_schedule_is_seeded_interleaved_and_prompts_grow() -> None:
    w = bench_agentic.Workload(sessions=5, turns=6)
    one, two = bench_agentic.make_schedule(w), bench_agentic.make_schedule(w)
    assert [(t.arrive_s, t.prompt_tokens) for t in one.turns] == [
        (t.arrive_s, t.prompt_tokens) for t in two.turns
    ]
    other = bench_agentic.make_schedule(bench_agentic.Workload(sessions=5, turns=6, seed=1))
    assert [t.arrive_s for t in other.turns] != [t.arrive_s for t in one.turns]
    system = w.system_chunks * w.block_tokens
    for s in range(w.sessions):
        mine = [t for t in one.turns if t.session == s]
        assert len(mine) == w.turns and mine[-1].gap_after_s is None
        for a, b in itertools.pairwise(mine):
            assert b.arrive_s == pytest.approx(a.end_s + (a.gap_after_s or 0))
            grown = b.prompt_tokens - a.prompt_tokens - a.answer_tokens
            assert w.tool_tokens[0] <= grown <= w.tool_tokens[1]  # + answer + tool result
        assert (one.tokens[s][:system] == one.tokens[0][:system]).all()  # shared prompt
    order = [t.session for t in sorted(one.turns, key=lambda t: t.arrive_s)]
    assert order != sorted(order)  # sessions' turns interleave
    kinds = [k for _, k, _ in bench_agentic.events(one, w)]
    assert kinds.count("arrive") == kinds.count("end") == len(one.turns)
    assert kinds.count("prefetch") == sum(t.gap_after_s is not None for t in one.turns)
    times = [at for at, _, _ in bench_agentic.events(one, w)]
    assert times == sorted(times)
