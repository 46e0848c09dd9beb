"""``kvstore bench``: its usage line names it, its outputs go to ./kvstore-bench/ (never
the tracked docs/benchmarks/ unless asked), and a benchmark whose optional dependency is
missing is skipped, with the reason, and leaves the exit status 0. Nothing here runs a
real benchmark's measurements (2 shared cores): the vLLM one is run where it cannot find
vLLM, and the rest are stand-in scripts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402  (benchmarks/ is not a package)

KVSTORE = str(Path(sys.executable).with_name("kvstore"))


def kvstore(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [KVSTORE, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
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
        from kvstore.testing.servers import require_binary
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
