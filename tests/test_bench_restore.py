"""benchmarks/bench_restore.py: its calibration and log parsing (fast), and its ``--quick``
mode on a real vLLM (.venv-vllm; three vLLM processes, about three minutes on two cores):
the JSON line has every field, with sane values. No targets: a smoke run's ratios mean
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvstore.config.restore import check_prefill_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "connectors"))

import bench_restore  # noqa: E402  (benchmarks/ is not a package)
from vllm_venv import vllm_marks  # noqa: E402

F = TypeVar("F", bound=Callable[..., Any])


def vllm_test(timeout_s: int) -> Callable[[F], F]:
    """The marks of the slow vLLM tests (skip without .venv-vllm, slow, a timeout)."""

    def mark(fn: F) -> F:
        for m in vllm_marks(timeout_s):
            fn = m(fn)
        return fn

    return mark


def test_calibration_fits_a_rising_table_through_noise() -> None:
    # TTFT = 50 ms + 0.3 ms/token + 1e-7 s/token^2, +-10% noise that makes raw medians fall.
    true = {n: 0.05 + 3e-4 * n + 1e-7 * n * n for n in (1056, 1856, 2112, 2368)}
    noise = [1.1, 0.9, 1.0, 0.92, 1.08]
    samples = [(n, s * k) for n, s in true.items() for k in noise]
    samples += [(2112, true[2112] * 0.8), (1856, true[1856] * 1.2)]
    table, fit = bench_restore.calibration(samples)
    check_prefill_table(tuple((int(t), float(s)) for t, s in table), "table")
    assert [t for t, _ in table] == [1056, 1856, 2112, 2368]
    assert fit["samples"] == len(samples) and fit["intercept_ms"] >= 0
    for tokens, seconds in table:  # the marginal part: the per-request constant left out
        assert seconds == pytest.approx(true[int(tokens)] - fit["intercept_ms"] / 1e3, rel=0.15)


def test_prefill_samples_skip_the_cold_first_request() -> None:
    def req(n: int, s: float) -> dict[str, Any]:
        return {"prompt_tokens": n, "ttft_s": s}

    result = {"repetitions": [[req(300, 9.0), req(300, 0.1), req(600, 0.3)], [req(300, 0.1)]]}
    assert bench_restore.prefill_samples(result) == [(300, 0.1), (600, 0.3), (300, 0.1)]


def test_kv_metrics_and_tier_reads_from_vllm_log_lines() -> None:
    log = "\n".join(
        [
            "(MainProcess pid=1) INFO 11-27 23:59:58 [metrics.py:103] KV Transfer metrics: "
            "load_requests=1, tier_reads/s3:0/bytes=2097152.0, tier_reads/s3:0/seconds=0.5, "
            "tier_reads/s3:0/calls=2",
            "(MainProcess pid=1) INFO 11-27 23:59:59 [loggers.py:335] Engine 000: ...",
            "(MainProcess pid=1) INFO 11-27 00:00:01 [metrics.py:103] KV Transfer metrics: "
            "tier_reads/s3:0/bytes=2097152.0, tier_reads/s3:0/seconds=0.5, "
            "tier_reads/s3:0/calls=2, tier_reads/disk:0/bytes=1000.0, "
            "tier_reads/disk:0/seconds=0.001, tier_reads/disk:0/calls=1",
        ]
    )
    intervals = bench_restore.kv_metrics(log)
    assert [t for t, _ in intervals] == [86398.0, 86401.0]  # past midnight
    reads = bench_restore.tier_reads(intervals)
    assert reads["s3:0"]["calls"] == 4 and reads["s3:0"]["ms_per_call"] == 250.0
    assert reads["s3:0"]["mib_per_call"] == 1.0 and reads["disk:0"]["calls"] == 1
    learned = bench_restore.learned_speed(intervals, "s3:0", (0.02, 50.0))
    assert learned is not None and learned["intervals"] == 2
    # Calls of one size: the prior's 50 ms stands, the rest is bandwidth.
    assert learned["read_latency_ms"] == pytest.approx(50.0)
    assert learned["read_gbps"] == pytest.approx(2**20 / 0.2 / 1e9, rel=1e-3)


def test_paired_figures_pair_each_round_prompt_by_prompt() -> None:
    import _restore_lockstep

    def result(reps: list[list[float]]) -> dict[str, Any]:
        warm = [{"ttft_s": 9.0}] * bench_restore.WARMUP  # never counted
        return {"repetitions": [warm + [{"ttft_s": t} for t in rep] for rep in reps]}

    # two rounds of two prompts: test / base, repetition by repetition
    test = [result([[1.0, 2.2], [0.5, 0.5]]), result([[3.0, 1.0], [1.0, 1.0]])]
    base = [result([[1.0, 2.0], [1.0, 1.0]]), result([[2.0, 1.0], [2.0, 2.0]])]
    figures = _restore_lockstep.paired_figures(test, base)
    assert figures["rounds"] == 2
    assert figures["first_pairs"] == [1.0, 1.1, 1.5, 1.0]
    assert figures["first"] == pytest.approx(1.05)
    assert figures["first_per_round"] == [1.05, 1.25]
    low, high = figures["first_ci90"]
    assert 1.0 <= low <= 1.05 <= high <= 1.5
    assert figures["second"] == 0.5 and figures["second_per_round"] == [0.5, 0.5]
    assert figures["all_pairs"] == [1.0, 1.1, 0.5, 0.5, 1.5, 1.0, 0.5, 0.5]


def test_drift_figures_pair_the_planned_engine_with_the_right_one_place_by_place() -> None:
    import _restore_drift

    def result(ttft: list[float], cached: list[int] | None = None) -> dict[str, Any]:
        warm = [{"ttft_s": 9.0, "num_cached_tokens": 0}] * bench_restore.WARMUP
        cached = cached or [0] * len(ttft)
        reqs = [{"ttft_s": t, "num_cached_tokens": n} for t, n in zip(ttft, cached, strict=True)]
        return {"repetitions": [warm + reqs]}

    # Two phases of two requests, two rounds. Phase 1: recomputing is right (nocache
    # faster); phase 2: loading is, and round 2's planned engine followed a request late.
    rounds = [
        {
            "nocache_drift": result([1.0, 2.0, 1.0, 2.0]),
            "unplanned_drift": result([3.0, 3.0, 0.5, 0.5], [256] * 4),
            "planned_drift": result([1.1, 2.0, 0.5, 0.6], [0, 0, 256, 256]),
        },
        {
            "nocache_drift": result([2.0, 2.0, 1.0, 1.0]),
            "unplanned_drift": result([3.0, 3.0, 0.5, 0.5], [256] * 4),
            "planned_drift": result([2.0, 3.0, 1.0, 0.5], [0, 0, 0, 256]),
        },
    ]
    figures = _restore_drift.drift_figures(rounds, [0.02, 0.2], per_phase=2)
    first, second = figures["phases"]
    assert first["load_pays"] is False and second["load_pays"] is True
    assert first["planned_vs_best_pairs"] == [1.1, 1.0, 1.0, 1.5]
    assert first["planned_vs_best"] == pytest.approx(1.05)
    assert first["planned_vs_best_of_medians"] == pytest.approx(2.0 / 2.0)
    assert second["planned_vs_best_pairs"] == [1.0, 1.2, 2.0, 1.0]
    assert second["follow_requests_per_round"] == [0, 1] and second["follow_requests"] == 1
    assert second["planned_loaded"] == [[256, 256], [0, 256]]
    assert figures["planned_vs_best_worst_phase"] == pytest.approx(1.1)
    assert figures["follow_requests_worst"] == 1 and figures["rounds"] == 2


def test_lockstep_turns_are_taken_one_request_at_a_time(tmp_path: Path) -> None:
    """The bench's side of ``--lockstep`` (``Engine.take``) against the driver's
    (``vllm_offline.Lockstep``): each request starts only when its turn is given."""
    import threading
    import time

    import _restore_lockstep

    sys.path.insert(0, str(ROOT / "examples"))
    import vllm_offline

    log: list[str] = []

    def driver() -> None:
        turn = vllm_offline.Lockstep(tmp_path)
        for n in range(3):
            turn.wait()
            log.append(f"run {n}")
            turn.done()

    class Running:
        returncode = None

        def poll(self) -> None:
            return None

    thread = threading.Thread(target=driver)
    thread.start()
    run = bench_restore.Run("r", [], None)
    engine = _restore_lockstep.Engine(run, Running(), tmp_path)
    while not engine.ready():
        time.sleep(0.01)
    engine.take(2, timeout=10)
    assert log == ["run 0", "run 1"] and engine.n == 2
    time.sleep(0.05)
    assert log == ["run 0", "run 1"]  # the third waits for its turn
    engine.take(1, timeout=10)
    thread.join(timeout=10)
    assert log == ["run 0", "run 1", "run 2"]


@pytest.mark.skipif(
    os.environ.get("KVSTORE_BENCH_SMOKE") != "1",
    reason="vLLM processes for 8-12 min on 2 cores: run with KVSTORE_BENCH_SMOKE=1 "
    "(the suite keeps its time; the calibration and log parsing above always run)",
)
@vllm_test(1200)
def test_quick_run_reports_every_field(tmp_path: Path) -> None:
    out = tmp_path / "restore.json"
    script = ROOT / "benchmarks" / "bench_restore.py"
    args = ["--quick", "--json", "--out", str(out), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1190,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # one JSON line, progress on stderr
    result = json.loads(lines[0])
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "restore" and result["quick"] is True
    assert result["errors"] is None, result["errors"]

    # Headline figures: present; the ones --quick runs are positive, the others null.
    assert result["ttft_nocache_ms"] > 0
    for name in ("slow_planned_vs_nocache", "slow_second_request_vs_nocache"):
        assert result[name] > 0, name
    for name in (
        "slow_unplanned_vs_nocache",
        "slow_planned_undeclared_vs_nocache",
        "fast_planned_vs_unplanned",
        "fast_planned_vs_nocache",
        "estimate_error_median",  # needs slow_unplanned and fast_unplanned
    ):
        assert name in result and result[name] is None, name
    assert set(result["not_run"]) == set(bench_restore.QUICK_SKIPS)
    assert set(result["targets"]) == set(result["pass"]) == set(bench_restore.TARGETS)
    assert isinstance(result["pass"]["slow_planned_vs_nocache"], bool)
    assert result["pass"]["fast_planned_vs_unplanned"] is None

    # The calibration: a table the config accepts, at the two lengths nocache ran.
    table = result["prefill_table"]
    check_prefill_table(tuple((int(t), float(s)) for t, s in table), "prefill_table")
    assert [t for t, _ in table] == [300, 544]  # the warm-up prompt, the 512 + 32 one

    # Cached tokens: none without a connector; whole chunks of the prefix with one.
    cached = result["cached_tokens"]
    assert set(cached) == {
        "nocache",
        "store",
        "nocache_paired",
        "slow_planned",
        "slow_second_request",
        "nocache_contended",
        "slow_planned_contended",
        "nocache_drift",
        "unplanned_drift",
        "planned_drift",
    }
    assert cached["nocache_paired"] == [[0]]  # a paired round's nocache engine
    assert cached["nocache"] == [[0]] and cached["store"] == [[0]]
    for name in ("slow_planned", "slow_second_request"):
        assert cached[name][0][0] in (0, 256, 512), cached
    # The rounds under changing conditions: contended (busy processes), drift (three
    # phases of the link's speed, three requests each in --quick).
    assert result["contended_planned_vs_nocache"] > 0
    assert result["paired"]["slow_planned_contended"]["rounds"] == 1
    drift = result["drift"]
    assert [p["gbps"] for p in drift["phases"]] == [0.02, 0.2, 0.02]
    assert drift["rounds"] == 1
    for phase in drift["phases"]:
        assert phase["planned_vs_best"] > 0 and 0 <= phase["follow_requests"] <= 3
        assert len(phase["planned_loaded"]) == 1 and len(phase["planned_loaded"][0]) == 3
        assert len(phase["planned_vs_best_pairs"]) == 3
    assert result["drift_planned_vs_best"] == max(p["planned_vs_best"] for p in drift["phases"])
    assert isinstance(result["pass"]["drift_follow_requests"], bool)
    assert cached["unplanned_drift"][0][0] in (256, 512)  # planning off: every chunk loads
    assert cached["nocache_drift"] == [[0] * 9]
    paired = result["paired"]["slow_planned"]
    assert paired["rounds"] == 1 and len(paired["idle_before_second_s"]) == 1
    counters = result["configs"]["slow_planned"]["counters"][0]["scheduler"]  # per round
    assert counters["lookup_requests"] >= 4  # the warm-up twice, the prompt twice
    assert result["warming"]["prefix_chunks"] == 2
    assert 0 <= result["warming"]["on_disk_after_slow_planned"] <= 2

    # This process's store found every chunk vLLM stored (same keys, same layout), and
    # planned every load against the declared speed.
    get_prefix = result["estimate_error"]["get_prefix"]
    assert get_prefix["found_every_chunk"] is True
    assert len(get_prefix["loads"]) == 2 and all(x["chunks"] == 2 for x in get_prefix["loads"])
    assert -1 < result["estimate_error_get_prefix_median"] < 10
    assert result["s3_lookup_ms_slow_link"] > 0
    speeds = result["tier_speeds"]
    assert speeds["s3_declared"] == {"read_gbps": 0.02, "read_latency_ms": 50.0}
    assert speeds["s3_learned_by_get_prefix_store"]["read_speed_source"] == "measured"
