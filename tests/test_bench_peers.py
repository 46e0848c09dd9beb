"""The peer benchmarks: LMCache side by side (bench_lmcache.py), vLLM's own hashing
(bench_hash.py's ``vllm_real_*`` fields) and every peer at once (bench_peers.py: its
intervals, rows and table in-process on made-up timings; its quick runs, marked slow,
against the real peers). Structure only, no timing assertions.

LMCache needs its own venv (``bash benchmarks/peers/setup_lmcache.sh``); its real runs are
opt-in (``KVSTORE_BENCH_LMCACHE=1``). vLLM's runs where ``.venv-vllm`` exists, Mooncake's
where ``.venv-mooncake`` does (``bash benchmarks/peers/setup_mooncake.sh``).
"""

from __future__ import annotations

import importlib.util
import itertools
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
LMCACHE_VENV = Path(os.environ.get("KVSTORE_LMCACHE_VENV", ROOT / ".venv-lmcache"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LMCACHE_HERE = importlib.util.find_spec("lmcache") is not None


def run_script(
    script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``benchmarks/<script> --json *args``; return the one JSON object it prints."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)  # the whole of stdout is exactly one JSON document
    assert isinstance(result, dict), f"{script} printed {type(result).__name__}, not an object"
    return result


def assert_number(value: Any, name: str, positive: bool = True) -> None:
    """``value`` is a finite int/float (and > 0 with ``positive``)."""
    assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, value)
    assert math.isfinite(value), (name, value)
    assert value > 0 or not positive, (name, value)


# -- bench_lmcache.py ------------------------------------------------------------
@pytest.mark.skipif(LMCACHE_HERE, reason="lmcache imports in this interpreter: nothing to skip")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_bench_lmcache_skips_without_lmcache(tmp_path: Path, how: str) -> None:
    missing = tmp_path / "no-venv"
    args = ["--quick", "--lmcache-venv", str(missing)] if how == "flag" else ["--quick"]
    env = {"KVSTORE_LMCACHE_VENV": str(missing)} if how == "env" else {}
    env["BENCH_LMCACHE_REEXEC"] = ""  # a re-run (set by a parent) would skip too
    result = run_script("bench_lmcache.py", *args, timeout=60, env=env)
    assert result["benchmark"] == "lmcache"
    assert result["skipped"] is True
    assert "setup_lmcache.sh" in result["reason"] and str(missing) in result["reason"]


LMCACHE_RATIOS = (
    "lmcache_put_ratio",
    "lmcache_put_first_fill_ratio",
    "lmcache_get_ratio",
    "lmcache_disk_get_cold_ratio",
    "lmcache_disk_get_warm_ratio",
    "lmcache_lookup_ratio",
)
LMCACHE_RAW = tuple(
    f"{side}_{figure}"
    for side in ("kvstore", "lmcache")
    for figure in (
        "put_gbps",
        "put_first_fill_gbps",
        "get_gbps",
        "disk_get_cold_gbps",
        "disk_get_warm_gbps",
        "lookup_ms",
        "open_s",
    )
)


@pytest.mark.skipif(
    os.environ.get("KVSTORE_BENCH_LMCACHE") != "1",
    reason="LMCache side by side is opt-in: KVSTORE_BENCH_LMCACHE=1 (after "
    "bash benchmarks/peers/setup_lmcache.sh)",
)
@pytest.mark.engine
@pytest.mark.timeout(300)
def test_bench_lmcache_quick_run() -> None:
    if not LMCACHE_HERE and not (LMCACHE_VENV / "bin" / "python").exists():
        pytest.skip(f"no {LMCACHE_VENV}: run bash benchmarks/peers/setup_lmcache.sh")
    result = run_script("bench_lmcache.py", "--quick", timeout=300)
    assert result["benchmark"] == "lmcache"
    assert "skipped" not in result, result.get("reason")
    assert result["lmcache_version"] == "0.5.6"
    for name in (*LMCACHE_RATIOS, *LMCACHE_RAW, "memcpy_gbps", "lmcache_get_nocopy_ms"):
        assert name in result, f"missing field {name!r}"
        assert_number(result[name], name)
    assert result["lmcache_put_ratio"] == pytest.approx(
        result["kvstore_put_gbps"] / result["lmcache_put_gbps"]
    )
    assert result["lmcache_lookup_ratio"] == pytest.approx(
        result["lmcache_lookup_ms"] / result["kvstore_lookup_ms"]
    )
    assert result["targets"] == {
        "put": 3,
        "put_first_fill": 3,
        "get": 1.5,
        "disk_get_cold": 1,
        "disk_get_warm": 1,
    }
    assert set(result["meets_target"]) == set(result["targets"])
    assert all(isinstance(v, bool) for v in result["meets_target"].values())
    assert all(isinstance(n, int) and n > 0 for n in result["reps"].values())


# -- bench_hash.py: vLLM's own hashing ---------------------------------------------
HASH_TINY = ("--quick", "--kv-reps", "2", "--slow-reps", "1", "--rounds", "1")
VLLM_FIELDS = (
    "vllm_real_ms_per_128k",
    "ratio_vs_vllm_real",
    "ratio_vs_vllm_real_kvstore_256",
    "vllm_real_kvstore_ms_per_128k",
    "vllm_real_hash_algo",
    "vllm_real_version",
)


def assert_hash_fields_unchanged(result: dict[str, Any]) -> None:
    """The fields bench_hash.py had before the vLLM-real part are still there."""
    assert result["benchmark"] == "hash"
    for name in ("kvstore_tokens_per_s", "vllm_sha256_tokens_per_s", "ratio", "ms_per_128k"):
        assert_number(result[name], name)
    assert result["target_ratio"] == 30 and result["num_keys"] == 512
    assert set(result["meets_target"]) == {
        "ratio",
        "ratio_block16",
        "ms_per_128k",
        "ratio_list_input",
    }


@pytest.mark.timeout(120)
def test_bench_hash_vllm_real_skipped(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    result = run_script("bench_hash.py", *HASH_TINY, "--vllm-python", str(missing))
    assert_hash_fields_unchanged(result)
    for name in VLLM_FIELDS:
        assert name in result and result[name] is None, (name, result.get(name))
    assert str(missing) in result["vllm_real_skipped"]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (bash scripts/setup-vllm.sh)")
@pytest.mark.engine
@pytest.mark.timeout(300)
def test_bench_hash_vllm_real() -> None:
    result = run_script("bench_hash.py", *HASH_TINY, timeout=300)
    assert_hash_fields_unchanged(result)
    assert result["vllm_real_skipped"] is None
    assert result["vllm_real_hash_algo"] == "sha256"  # vLLM 0.32's default
    assert result["vllm_real_version"].startswith("0.32")
    for name in VLLM_FIELDS[:4]:
        assert set(result[name]) == {"16", "256"}, (name, result[name])
        for size, value in result[name].items():
            assert_number(value, f"{name}[{size}]")
    ms, kv = result["vllm_real_ms_per_128k"], result["vllm_real_kvstore_ms_per_128k"]
    assert result["ratio_vs_vllm_real"]["16"] == pytest.approx(ms["16"] / kv["16"])
    assert set(result["vllm_real_other_algos_ms_per_128k"]) == {"sha256_cbor"}
    # bench_hash.py's reimplementation, seeded as vLLM seeds it, gives vLLM's own hashes.
    assert result["vllm_real_reimplementation_matches"] is True


# -- setup_lmcache.sh ----------------------------------------------------------------
@pytest.mark.timeout(60)
def test_setup_lmcache_fails_clearly(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": str(tmp_path / "no-python"),
        "KVSTORE_LMCACHE_VENV": str(tmp_path / "v"),
    }
    proc = subprocess.run(
        ["bash", str(BENCH / "peers" / "setup_lmcache.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode != 0
    assert "setup_lmcache: FAILED" in proc.stderr


# -- bench_peers.py: every peer side by side ------------------------------------------------
MOONCAKE_VENV = Path(os.environ.get("KVSTORE_MOONCAKE_VENV", ROOT / ".venv-mooncake"))
MOONCAKE_HERE = (MOONCAKE_VENV / ".kvstore-mooncake-installed").exists()
#: A small quick run: 64 MiB per rep, 2 client processes (4 by default).
PEERS_QUICK = ("--quick", "--rep-mib", "64", "--clients", "2")
STATS = ("median", "lo", "hi")


def run_peers(*args: str, timeout: float = 600, ok: bool = True) -> tuple[int, dict[str, Any], str]:
    """Run ``bench_peers.py --json *args``; (exit status, its JSON object, stderr)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_peers.py"), "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if ok:
        assert proc.returncode == 0, f"bench_peers failed:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)  # exactly one JSON document, whatever the exit status
    assert result["benchmark"] == "peers"
    return proc.returncode, result, proc.stderr


def assert_row(row: dict[str, Any]) -> None:
    """A row that ran: both sides' figures and their ratio, each a median in its interval."""
    for side in ("kvstore", "baseline"):
        stats = row[side]
        for name in STATS:
            assert_number(stats[name], f"{row['id']}.{side}.{name}")
        assert stats["lo"] <= stats["median"] <= stats["hi"], (row["id"], side, stats)
        assert isinstance(stats["n"], int) and stats["n"] >= 1
    ratio = row["ratio"]
    for name in STATS:
        assert_number(ratio[name], f"{row['id']}.ratio.{name}")
    assert ratio["lo"] <= ratio["median"] <= ratio["hi"], (row["id"], ratio)
    assert ratio["median"] == pytest.approx(row["kvstore"]["median"] / row["baseline"]["median"])
    assert row["unit"] == ("keys/s" if row["op"] == "lookup" else "GB/s")


def mooncake_ids(clients: int) -> set[str]:
    ids = set()
    for path in ("tcp", "shm"):
        for op in ("put", "get"):
            for size in ("32MiB", "1MiB"):
                ids |= {f"mooncake_{path}_{op}_{size}_c{k}" for k in (1, clients)}
        ids |= {f"mooncake_{path}_first_fill_{size}_c1" for size in ("32MiB", "1MiB")}
        ids.add(f"mooncake_{path}_lookup_1MiB_c1")
    return ids


@pytest.mark.slow
@pytest.mark.skipif(
    not MOONCAKE_HERE, reason="no .venv-mooncake: bash benchmarks/peers/setup_mooncake.sh"
)
@pytest.mark.timeout(600)
def test_bench_peers_quick_runs_mooncake_and_emits_every_row() -> None:
    _, result, _ = run_peers(*PEERS_QUICK, "--only", "mooncake")
    assert result["skipped"] == {} and result["failed"] == {} and result["failed_rows"] == []
    assert result["versions"]["mooncake"] == "0.3.13.post1"
    rows = {r["id"]: r for r in result["rows"]}
    assert set(rows) == mooncake_ids(2)
    for row in rows.values():
        assert row["status"] == "ok", row
        assert_row(row)
        assert result["ratios"][row["id"]] == row["ratio"]["median"]
        if row["path"] == "shm" and row["op"] in ("put", "get"):
            assert_number(row["memcpy"]["median"], "memcpy")
            assert row["kvstore_vs_memcpy"]["median"] == pytest.approx(
                row["kvstore"]["median"] / row["memcpy"]["median"]
            )
    assert set(result["vs_memcpy"]) == {"mooncake_shm_put_1MiB_c1", "mooncake_shm_get_1MiB_c1"}
    assert set(result["meets_target"]) == set(rows)
    assert set(result["behind"]) == {i for i, ok in result["meets_target"].items() if not ok}


@pytest.mark.slow
@pytest.mark.skipif(
    not MOONCAKE_HERE, reason="no .venv-mooncake: bash benchmarks/peers/setup_mooncake.sh"
)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("system", ["mooncake", "kvstore"])
def test_bench_peers_byte_check_fails_the_rows_of_a_planted_wrong_byte(system: str) -> None:
    # The wrapper in store_worker.py flips one byte of what each get of ``system`` returned;
    # neither store is touched. Every row that read those bytes must fail, loudly.
    code, result, stderr = run_peers(
        *PEERS_QUICK, "--only", "mooncake", "--plant-wrong-byte", system, ok=False
    )
    assert code == 1
    rows = {r["id"]: r for r in result["rows"]}
    assert set(rows) == mooncake_ids(2)
    failed = {i for i, r in rows.items() if r["status"] == "failed"}
    assert failed == set(result["failed_rows"])
    assert {i for i in rows if "_get_" in i or "_put_" in i or "first_fill" in i} == failed
    for i in failed:
        assert rows[i]["ratio"] is None and i not in result["ratios"]
        assert f"{system} " in rows[i]["error"] and "byte" in rows[i]["error"]
    assert all(rows[i]["status"] == "ok" for i in rows if "lookup" in i)
    assert "FAILED ROW mooncake_shm_get_1MiB_c1" in stderr


@pytest.mark.timeout(120)
def test_bench_peers_reports_absent_peers_as_skipped_with_why(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    _, result, stderr = run_peers(
        "--quick",
        "--mooncake-venv",
        str(missing / "mooncake"),
        "--vllm-python",
        str(missing / "vllm" / "bin" / "python"),
        "--lmcache-venv",
        str(missing / "lmcache"),
        timeout=120,
    )
    assert result["rows"] == [] and result["failed"] == {}
    assert set(result["skipped"]) == {"mooncake", "vllm_fs", "lmcache"}
    assert "setup_mooncake.sh" in result["skipped"]["mooncake"]
    assert str(missing / "mooncake") in result["skipped"]["mooncake"]
    assert "setup-vllm.sh" in result["skipped"]["vllm_fs"]
    assert "setup_lmcache.sh" in result["skipped"]["lmcache"]
    for peer in result["skipped"]:
        assert f"skipped: {peer}" in stderr


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (bash scripts/setup-vllm.sh)")
@pytest.mark.timeout(600)
def test_bench_peers_quick_runs_vllms_fs_tier() -> None:
    _, result, _ = run_peers("--quick", "--rep-mib", "16", "--only", "vllm_fs")
    rows = {r["id"]: r for r in result["rows"]}
    ops = ("put", "get", "lookup")
    assert set(rows) == {f"vllm_fs_disk_{op}_{s}_c1" for op in ops for s in ("32MiB", "1MiB")}
    for row in rows.values():
        assert row["status"] == "ok"
        assert_row(row)
        assert row["kvstore"]["n"] == row["baseline"]["n"] == 2  # --quick: 2 repetitions
    assert result["versions"]["vllm_fs"].startswith("0.32")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KVSTORE_BENCH_LMCACHE") != "1",
    reason="LMCache side by side is opt-in: KVSTORE_BENCH_LMCACHE=1 (after "
    "bash benchmarks/peers/setup_lmcache.sh)",
)
@pytest.mark.timeout(600)
def test_bench_peers_quick_runs_lmcache() -> None:
    if not LMCACHE_HERE and not (LMCACHE_VENV / "bin" / "python").exists():
        pytest.skip(f"no {LMCACHE_VENV}: run bash benchmarks/peers/setup_lmcache.sh")
    _, result, _ = run_peers("--quick", "--rep-mib", "64", "--only", "lmcache")
    rows = {r["id"]: r for r in result["rows"]}
    want = {"lmcache_host_lookup_64keys_c1"}  # --quick: 64 keys
    for size in ("32MiB", "1MiB"):
        want |= {f"lmcache_host_{op}_{size}_c1" for op in ("put", "get", "first_fill")}
        want |= {f"lmcache_{path}_get_{size}_c1" for path in ("disk_cold", "disk_warm")}
    assert set(rows) == want
    for row in rows.values():
        assert row["status"] == "ok"
        assert_row(row)
    assert result["versions"]["lmcache"] == "0.5.6"


def test_byte_check_names_the_first_wrong_byte() -> None:
    sys.path.insert(0, str(BENCH / "peers"))
    import store_worker

    src = [store_worker.block_bytes("1MiB", 4096, i) for i in range(3)]
    assert not any((a == b).all() for a, b in itertools.pairwise(src))  # blocks differ
    assert (store_worker.block_bytes("1MiB", 4096, 2) == src[2]).all()  # and are reproducible
    dst = [s.copy() for s in src]
    assert store_worker.check_blocks(dst, src, first=10) is None
    dst[1][777] ^= 1
    found = store_worker.check_blocks(dst, src, first=10)
    assert found is not None and found.startswith("block 11 byte 777:")


def test_kvstore_bench_peers_runs_only_the_peers_after_their_set_up() -> None:
    sys.path.insert(0, str(BENCH))
    import run_all

    assert run_all.parse_args(["--peers"]).peers is True
    (bench,) = run_all.peers_only()
    assert bench.name == "peers" and bench.script == "bench_peers.py"
    assert bench.args[-1] == "--setup" and bench.quick_args == ("--quick", "--setup")
    registered = {b.name: b for b in run_all.REGISTRY}
    # In the full set; not in a plain --quick (three venvs, ~10 min): --peers --quick runs it.
    assert registered["peers"].quick_args is None
    assert [b.name for b in run_all.select("peers")] == ["peers"]
    with pytest.raises(SystemExit) as exc:
        run_all.parse_args(["--peers", "--only", "hash"])
    assert exc.value.code == 2


def test_peer_plots_one_per_operation(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH))
    from _intervals import ratio_summary, summary
    from _peers_plots import draw_peer_plots

    kv, them = [3.0, 3.2, 2.9, 3.1], [3.6, 3.5, 3.8, 3.7]
    row = {
        "id": "mooncake_shm_put_1MiB_c1",
        "peer": "mooncake",
        "path": "shm",
        "op": "put",
        "block": "1MiB",
        "clients": 1,
        "unit": "GB/s",
        "kvstore": summary(kv),
        "baseline": summary(them),
        "ratio": ratio_summary(kv, them),
        "status": "ok",
    }
    assert row["ratio"]["lo"] <= row["ratio"]["median"] <= row["ratio"]["hi"] < 1
    outcomes = draw_peer_plots({"rows": [row], "skipped": {"lmcache": "absent"}}, tmp_path)
    assert outcomes["peers_put.png"] is None
    assert (tmp_path / "peers_put.png").read_bytes().startswith(b"\x89PNG")
    for op in ("get", "first_fill", "lookup"):
        assert outcomes[f"peers_{op}.png"] == f"no {op} rows"
        assert not (tmp_path / f"peers_{op}.png").exists()


@pytest.mark.timeout(120)
def test_bench_peers_setup_that_fails_is_a_skip_with_its_error(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": str(tmp_path / "no-python")}
    args = ["--json", "--quick", "--setup", "--only", "mooncake"]
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_peers.py"),
            *args,
            "--mooncake-venv",
            str(tmp_path / "mc"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["rows"] == [] and list(result["skipped"]) == ["mooncake"]
    why = result["skipped"]["mooncake"]
    assert "setup_mooncake.sh" in why and "setup_mooncake: FAILED" in why
    assert not (tmp_path / "mc").exists()  # it failed before making anything


# -- bench_peers.py's arithmetic: intervals, rows, the table (in-process, no peers) ---------
def peers_module() -> Any:
    """``benchmarks/bench_peers.py`` imported as a module."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import bench_peers

    return bench_peers


def test_intervals_bracket_the_median_and_are_reproducible() -> None:
    peers_module()
    from _intervals import ratio_summary, summary

    values = [3.0, 3.4, 2.8, 3.1, 3.3, 2.9]
    stats = summary(values)
    assert stats["median"] == pytest.approx(3.05) and stats["n"] == 6
    assert min(values) <= stats["lo"] <= stats["median"] <= stats["hi"] <= max(values)
    assert stats["lo"] < stats["hi"]  # six different figures: a real interval
    assert summary(values) == stats  # seeded: the same JSON gives the same interval
    assert summary([2.5]) == {"median": 2.5, "lo": 2.5, "hi": 2.5, "n": 1}
    with pytest.raises(ValueError):
        summary([])
    # Noise widens the interval; a constant ratio has none.
    tight = summary([3.0, 3.01, 2.99, 3.0, 3.02, 2.98])
    assert stats["hi"] - stats["lo"] > tight["hi"] - tight["lo"]
    assert ratio_summary([4.0, 4.0, 4.0], [2.0, 2.0, 2.0]) == {"median": 2.0, "lo": 2.0, "hi": 2.0}
    ratio = ratio_summary(values, [1.0, 1.1, 0.9, 1.0])
    assert ratio["median"] == pytest.approx(3.05)
    assert ratio["lo"] < ratio["median"] < ratio["hi"]


def small_plan(peers: Any, clients: int = 2) -> Any:
    return peers.ServerPlan(
        rep_bytes=64 << 20,
        clients=clients,
        capacity=512 << 20,
        rounds=3,
        reps=1,
        first_fill_reps=1,
        lookup_reps=5,
    )


def synthetic_times(peers: Any, plan: Any) -> dict[str, list[float]]:
    """Every subject's seconds: kvstore twice as fast as Mooncake, memcpy twice kvstore."""
    from _peers_mooncake import subject

    times = {}
    for path, op, size, clients in peers.row_keys(plan):
        times[subject("kvstore", path, op, size, clients)] = [0.1, 0.11, 0.09]
        times[subject("mooncake", path, op, size, clients)] = [0.2, 0.2, 0.2]
        times[subject("kvstore", "local", "memcpy", size, clients)] = [0.05, 0.05, 0.05]
    return times


def test_mooncake_rows_from_timings() -> None:
    peers = peers_module()
    plan = small_plan(peers)
    data = {"times": synthetic_times(peers, plan), "wrong": {}}
    rows = {r["id"]: r for r in peers.mooncake_rows(plan, data)}
    assert set(rows) == mooncake_ids(2)
    for row in rows.values():
        assert row["status"] == "ok"
        assert_row(row)
        assert row["ratio"]["median"] == pytest.approx(2.0)
        assert ("memcpy" in row) == (row["path"] == "shm" and row["op"] in ("put", "get"))
    # 64 MiB per rep over 2 clients of 32 MiB blocks: one block each, 64 MiB in all.
    put = rows["mooncake_tcp_put_32MiB_c2"]
    assert put["kvstore"]["median"] == pytest.approx((64 << 20) / 0.1 / 1e9)
    assert put["baseline"]["median"] == pytest.approx((64 << 20) / 0.2 / 1e9)
    # A first fill is one worker putting the whole get set.
    fill = rows["mooncake_shm_first_fill_1MiB_c1"]
    assert fill["kvstore"]["median"] == pytest.approx((64 << 20) / 0.1 / 1e9)
    # Lookups: the 64 keys of the 1 MiB get set, 5 lookups per rep.
    lookup = rows["mooncake_tcp_lookup_1MiB_c1"]
    assert lookup["unit"] == "keys/s" and lookup["kvstore"]["median"] == pytest.approx(3200)
    shm_get = rows["mooncake_shm_get_1MiB_c1"]
    assert shm_get["kvstore_vs_memcpy"]["median"] == pytest.approx(0.5)
    assert shm_get["baseline_vs_memcpy"]["median"] == pytest.approx(0.25)


def test_a_wrong_byte_fails_exactly_the_rows_that_read_it() -> None:
    peers = peers_module()
    plan = small_plan(peers)
    wrong = {
        "mooncake/shm/get/1MiB/c2": ["worker 1: block 40 byte 7: read 0x00, wrote 0x11"],
        "kvstore/tcp/fill/32MiB/c1": ["block 0 byte 3: read 0x00, wrote 0x22"],
    }
    rows = {
        r["id"]: r
        for r in peers.mooncake_rows(plan, {"times": synthetic_times(peers, plan), "wrong": wrong})
    }
    failed = {i for i, r in rows.items() if r["status"] == "failed"}
    # The get rep's own row; the fill's finding fails every put and get of that path and size.
    tcp32 = {f"mooncake_tcp_{op}_32MiB_c{k}" for op in ("put", "get") for k in (1, 2)}
    assert failed == {"mooncake_shm_get_1MiB_c2"} | tcp32
    assert rows["mooncake_shm_get_1MiB_c2"]["ratio"] is None
    assert (
        "mooncake shm get 1MiB c2: worker 1: block 40 byte 7"
        in rows["mooncake_shm_get_1MiB_c2"]["error"]
    )
    assert "kvstore tcp fill 32MiB c1" in rows["mooncake_tcp_get_32MiB_c1"]["error"]
    result = peers.build_result(
        peers.parse_args(["--quick"]),
        plan,
        {"rows": list(rows.values()), "skipped": {}, "failed": {}, "versions": {}, "seconds": {}},
    )
    assert set(result["failed_rows"]) == failed
    assert not failed & set(result["ratios"]) and not failed & set(result["meets_target"])
    lines = peers.table(result)
    verdicts = {(ln[0], ln[1], ln[2], ln[3], ln[4]): ln[9] for ln in lines[1:]}
    assert verdicts[("mooncake", "shm", "get", "1MiB", 2)] == "FAILED"
    assert verdicts[("mooncake", "shm", "put", "1MiB", 2)] == "yes"


def vllm_result(kv: float, fs: float) -> dict[str, Any]:
    def rep(x: float) -> dict[str, float]:
        return {"store_gbps": x, "load_gbps": 2 * x, "lookups_per_s": 1000 * x}

    return {
        "vllm_version": "0.32.0",
        "per_rep": {"kvstore_disk": [rep(kv), rep(kv)], "vllm_fs": [rep(fs), rep(fs)]},
    }


def lmcache_result(keys: int = 512) -> dict[str, Any]:
    times = {
        f"{side}_{op}": [0.1 if side == "kv" else 0.08] * 3
        for side in ("kv", "lmc")
        for op in ("put", "get", "first_fill", "disk_cold", "disk_warm")
    }
    times.update(kv_lookup=[0.002] * 3, lmc_lookup_batched=[0.004] * 3, lmc_lookup_loop=[0.001] * 3)
    return {
        "lmcache_version": "0.5.6",
        "bytes_per_rep": 1 << 28,
        "times": times,
        "lookup_keys": keys,
    }


def test_script_rows_of_vllm_and_lmcache() -> None:
    peers = peers_module()
    vllm = peers.script_rows(
        "vllm_fs", {"by_size": {"32MiB": vllm_result(1.0, 2.0), "1MiB": vllm_result(3.0, 1.0)}}
    )
    rows = {r["id"]: r for r in vllm}
    ops = ("put", "get", "lookup")
    assert set(rows) == {f"vllm_fs_disk_{op}_{s}_c1" for op in ops for s in ("32MiB", "1MiB")}
    assert rows["vllm_fs_disk_get_32MiB_c1"]["kvstore"]["median"] == 2.0
    assert rows["vllm_fs_disk_get_32MiB_c1"]["ratio"]["median"] == pytest.approx(0.5)
    assert rows["vllm_fs_disk_lookup_1MiB_c1"]["ratio"]["median"] == pytest.approx(3.0)
    assert rows["vllm_fs_disk_lookup_1MiB_c1"]["unit"] == "keys/s"
    by_size = {"32MiB": lmcache_result(), "1MiB": lmcache_result()}
    rows = {r["id"]: r for r in peers.script_rows("lmcache", {"by_size": by_size})}
    want = {"lmcache_host_lookup_512keys_c1"}  # lookups: from the 32 MiB run only
    for size in ("32MiB", "1MiB"):
        want |= {f"lmcache_host_{op}_{size}_c1" for op in ("put", "get", "first_fill")}
        want |= {f"lmcache_{path}_get_{size}_c1" for path in ("disk_cold", "disk_warm")}
    assert set(rows) == want
    for row in rows.values():
        assert_row(row)
    put = rows["lmcache_host_put_32MiB_c1"]
    assert put["kvstore"]["median"] == pytest.approx((1 << 28) / 0.1 / 1e9)
    assert put["ratio"]["median"] == pytest.approx(0.8)
    # LMCache's faster lookup (here its contains loop) is the one compared.
    assert rows["lmcache_host_lookup_512keys_c1"]["ratio"]["median"] == pytest.approx(0.5)


def test_result_and_table_say_who_is_behind_and_what_was_skipped() -> None:
    peers = peers_module()
    plan = small_plan(peers)
    rows = peers.script_rows(
        "vllm_fs", {"by_size": {"32MiB": vllm_result(1.0, 2.0), "1MiB": vllm_result(3.0, 1.0)}}
    )
    rows += peers.mooncake_rows(plan, {"times": synthetic_times(peers, plan), "wrong": {}})
    out = {
        "rows": rows,
        "skipped": {
            "lmcache": "no LMCache venv at /x: run bash benchmarks/peers/setup_lmcache.sh\nmore"
        },
        "failed": {},
        "versions": {"vllm_fs": "0.32.0"},
        "seconds": {},
    }
    result = peers.build_result(peers.parse_args(["--quick"]), plan, out)
    behind = {f"vllm_fs_disk_{op}_32MiB_c1" for op in ("put", "get", "lookup")}
    assert set(result["behind"]) == behind
    assert {i for i, ok in result["meets_target"].items() if not ok} == behind
    assert result["vs_memcpy"] == {
        "mooncake_shm_put_1MiB_c1": pytest.approx(0.5),
        "mooncake_shm_get_1MiB_c1": pytest.approx(0.5),
    }
    assert result["targets"] == {"ratio": 1.0, "same_host_1MiB_vs_memcpy": 0.8}
    json.dumps(result)  # the JSON the script prints
    lines = peers.table(result)
    assert lines[0] == list(peers.HEADER)
    assert len(lines) == 1 + len(rows) + 1 and all(len(ln) == len(lines[0]) for ln in lines)
    by_id = {f"{ln[0]}_{ln[1]}_{ln[2]}_{ln[3]}_c{ln[4]}": ln for ln in lines[1:-1]}
    assert by_id["vllm_fs_disk_put_32MiB_c1"][9] == "NO"
    assert by_id["vllm_fs_disk_put_1MiB_c1"][9] == "yes"
    assert by_id["vllm_fs_disk_put_1MiB_c1"][8] == "3 [3, 3]"
    assert by_id["mooncake_shm_get_1MiB_c1"][10].startswith("0.5 [")
    assert by_id["mooncake_tcp_get_1MiB_c1"][10] == "-"  # memcpy: same-host rows only
    assert lines[-1][0] == "lmcache"
    assert (
        lines[-1][-1]
        == "skipped: no LMCache venv at /x: run bash benchmarks/peers/setup_lmcache.sh"
    )


def test_quick_defaults_and_the_rep_size_check_of_the_mooncake_rows_only() -> None:
    peers = peers_module()
    args = peers.parse_args(["--quick"])
    assert args.peers == ["mooncake", "vllm_fs", "lmcache"]
    assert (args.rep_mib, args.rounds, args.first_fill_reps) == (128, 1, 1)
    assert (args.vllm_reps, args.lmcache_rounds, args.capacity) == (2, 1, 512 << 20)
    assert peers.make_plan(args).problem() is None  # the quick defaults fit 4 clients
    full = peers.parse_args([])
    assert (full.rep_mib, full.rounds, full.capacity) == (256, 6, 1 << 30)
    assert peers.make_plan(full).problem() is None
    # 16 MiB per rep cannot give 4 clients a 32 MiB block each: a problem of the Mooncake
    # rows only; vLLM's and LMCache's scripts size their own runs.
    small = ["--quick", "--rep-mib", "16"]
    assert (
        peers.make_plan(peers.parse_args([*small, "--only", "vllm_fs,lmcache"])).rep_bytes
        == 16 << 20
    )
    with pytest.raises(SystemExit) as exc:
        peers.make_plan(peers.parse_args([*small, "--only", "mooncake"]))
    assert str(exc.value) == (
        "bench_peers: --rep-mib 16 is too small for the Mooncake rows: "
        "4 clients of 32MiB blocks need at least 128"
    )
    with pytest.raises(SystemExit) as exc:
        peers.make_plan(peers.parse_args(["--quick", "--rep-mib", "256"]))
    assert "--capacity 512MiB must hold" in str(exc.value)
    assert peers.parse_args(["--only", "lmcache, vllm_fs"]).peers == ["vllm_fs", "lmcache"]
    with pytest.raises(SystemExit) as exc:
        peers.parse_args(["--only", "mooncake,redis"])
    assert exc.value.code == 2


@pytest.mark.timeout(120)
def test_bench_peers_small_rep_without_mooncake_runs(tmp_path: Path) -> None:
    # Was: "--rep-mib is too small for 4 clients of 32MiB" with --only vllm_fs.
    missing = tmp_path / "no-vllm" / "bin" / "python"
    code, result, stderr = run_peers(
        "--quick",
        "--rep-mib",
        "16",
        "--only",
        "vllm_fs",
        "--vllm-python",
        str(missing),
        timeout=120,
    )
    assert code == 0 and result["rows"] == [] and list(result["skipped"]) == ["vllm_fs"]
    assert str(missing) in result["skipped"]["vllm_fs"]
    assert "skipped: vllm_fs" in stderr
    assert result["settings"]["rep_bytes"] == 16 << 20
