"""``kvstore bench``: its usage line names it, its outputs go to ./kvstore-bench/ (never
the tracked docs/benchmarks/ unless asked), and a benchmark whose optional dependency is
missing is skipped, with the reason, and leaves the exit status 0.

Real measurements run in two tests only (2 shared cores): ``kvstore bench --quick`` of the
benchmarks that failed under that command (issue 50: a ``KVSTORE_*`` variable it put in
the scripts' environment, a script that refused ``--json``) and of those that skip here
(~40 s); and the whole ``kvstore bench --quick`` (8-9 minutes here: marked slow and run
with ``BENCH_QUICK_ALL=1``, not a ``KVSTORE_*`` name, which the stores would read as a
setting). The rest are stand-in scripts, and the vLLM one run where it cannot find vLLM."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402  (benchmarks/ is not a package)

KVSTORE = str(Path(sys.executable).with_name("kvstore"))


def kvstore(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [KVSTORE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def results() -> dict[str, object]:
    """A results.json of one benchmark, enough to render a table."""
    entry = {
        "script": "bench_prefetch.py",
        "args": ["--json", "--quick"],
        "status": "ok",
        "seconds": 1.0,
        "result": {"overlap_efficiency": 0.9},
    }
    machine = {"date": "today", "git_commit": "abc", "cores": 2, "python": "3.11"}
    return {"mode": "quick", "machine": machine, "benchmarks": {"prefetch": entry}}


def test_usage_names_kvstore_bench(tmp_path: Path) -> None:
    result = kvstore("bench", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: kvstore bench ")
    assert "run_all.py" not in result.stdout.splitlines()[0]
    assert "kvstore-bench/ in the current directory" in " ".join(result.stdout.split())


def test_outputs_go_to_the_current_directory_not_the_tracked_docs(tmp_path: Path) -> None:
    source = tmp_path / "in.json"
    source.write_text(json.dumps(results()))
    tracked = {p: p.stat().st_mtime_ns for p in (ROOT / "docs" / "benchmarks").iterdir()}
    result = kvstore("bench", "--from-json", str(source), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "kvstore-bench"
    assert (out / "README.md").exists() and (out / "results.json").exists()
    assert f"wrote {out}/README.md" in result.stderr  # it says where
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs" / "benchmarks").iterdir()} == tracked
    relative = kvstore("bench", "--from-json", str(source), "--out", "elsewhere", cwd=tmp_path)
    assert relative.returncode == 0, relative.stderr
    assert (tmp_path / "elsewhere" / "README.md").exists()  # relative to the caller


def test_vllm_tier_without_vllm_is_skipped_with_the_reason(tmp_path: Path) -> None:
    """bench_vllm_tier.py where neither this interpreter nor a .venv-vllm beside the
    checkout has vLLM: a skip, not a failure."""
    copy = tmp_path / "benchmarks" / "bench_vllm_tier.py"
    copy.parent.mkdir()
    shutil.copy(BENCH / "bench_vllm_tier.py", copy)  # its .venv-vllm would be tmp_path's
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - vLLM in the test interpreter itself
        pytest.skip("vLLM is importable here")
    bench = run_all.Bench("vllm_tier", str(copy), (), quick_timeout_s=120)
    entry = run_all.run_bench(bench, True, tmp_path)
    assert entry["status"] == "skipped", entry
    assert "needs vLLM" in entry["reason"] and "setup-vllm.sh" in entry["reason"]


def script(path: Path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_missing_optional_dependency_is_a_skip_and_the_run_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fig = run_all.Figure("speed", "", "", "x")
    module = script(tmp_path / "module.py", "import lmcache_not_installed_here\n")
    binary = script(
        tmp_path / "binary.py",
        """
        from kvstore.cli.servers import require_binary
        require_binary("no-such-server-binary")
        """,
    )
    ours = script(tmp_path / "ours.py", "import kvstore.no_such_module\n")
    registry = (
        run_all.Bench("module", module, (fig,)),
        run_all.Bench("binary", binary, (fig,)),
    )
    monkeypatch.setattr(run_all, "REGISTRY", registry)
    out = tmp_path / "out"
    assert run_all.main(["--quick", "--out", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["benchmarks"]
    assert runs["module"]["status"] == "skipped"
    assert runs["module"]["reason"] == "needs lmcache_not_installed_here (not installed)"
    assert runs["binary"] == {**runs["binary"], "status": "skipped"}
    assert runs["binary"]["reason"] == "needs no-such-server-binary (not installed)"
    # A module of this repository missing is a failure, not a skip: exit status 1.
    monkeypatch.setattr(run_all, "REGISTRY", (run_all.Bench("ours", ours, (fig,)),))
    assert run_all.main(["--quick", "--out", str(out)]) == 1
    ours_run = json.loads((out / "results.json").read_text())["benchmarks"]["ours"]
    assert ours_run["status"] == "failed"


def check_quick_run(result: subprocess.CompletedProcess[str], out: Path) -> dict[str, Any]:
    """A ``kvstore bench --quick`` run exited 0, and its last lines name each benchmark it
    skipped or did not run, with why; its results.json's runs."""
    doc = json.loads((out / "results.json").read_text())
    runs = doc["benchmarks"]
    failed = {n: (e.get("error"), e.get("stderr_tail", "")[-1500:]) for n, e in runs.items()}
    assert result.returncode == 0, {n: f for n, f in failed.items() if runs[n]["status"] != "ok"}
    for name, entry in runs.items():
        assert entry["status"] in ("ok", "skipped"), (name, entry)
        if entry["status"] == "skipped":
            assert entry["reason"], entry
            assert f"run_all: skipped: {name}: {entry['reason']}" in result.stderr
    for name, why in doc["not_run"].items():
        assert f"run_all: not run: {name}: {why}" in result.stderr
    return runs


@pytest.mark.slow  # ~40 s of benchmark scripts
@pytest.mark.timeout(600)
def test_quick_bench_of_the_scripts_that_failed_under_kvstore_bench_exits_0(
    tmp_path: Path,
) -> None:
    """disk_tier, prefetch and events open stores, which refused the KVSTORE_BENCH_PROG the
    command put in their environment; bench_gpu_model.py refused the --json run_all passes.
    Without a GPU, gpu and gpu_model are skipped (and lmcache without LMCache): named, with
    why, at the end."""
    only = "disk_tier,prefetch,events,lmcache,gpu,gpu_model"
    result = kvstore("bench", "--quick", "--only", only, "--out", "out", cwd=tmp_path, timeout=540)
    runs = check_quick_run(result, tmp_path / "out")
    assert list(runs) == only.split(",")
    for name in ("disk_tier", "prefetch", "events"):
        assert runs[name]["status"] == "ok", runs[name]
    assert runs["gpu_model"]["args"] == ["--json", "--quick"]
    if not torch.cuda.is_available():
        for name in ("gpu", "gpu_model"):
            assert "no CUDA device" in runs[name]["reason"], runs[name]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    os.environ.get("BENCH_QUICK_ALL") != "1",
    reason="the whole kvstore bench --quick takes 8-9 minutes on 2 cores: run with "
    "BENCH_QUICK_ALL=1 (the scripts that failed under it run above, in ~40 s)",
)
def test_the_whole_quick_bench_exits_0_and_names_what_it_skipped(tmp_path: Path) -> None:
    result = kvstore("bench", "--quick", "--out", "out", cwd=tmp_path, timeout=1440)
    runs = check_quick_run(result, tmp_path / "out")
    quick = [b.name for b in run_all.REGISTRY if b.quick_args is not None]
    assert list(runs) == quick
    assert "Traceback" not in result.stderr
