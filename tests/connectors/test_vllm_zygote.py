"""The fork server the vLLM tests run engine scripts through (vllm_zygote.py): each run is
a child with its own argv, environment, working directory and log, concurrent runs are
kept apart, exit codes come back, and a run past its timeout is killed with its children."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
from vllm_venv import VLLM_PYTHON, run_engine, vllm_marks

pytestmark = vllm_marks(300)

SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_PROBE"), "cwd", os.getcwd())
print("pid", os.getpid(), "pgid", os.getpgid(0), file=sys.stderr)
if sys.argv[1] == "sleep":
    subprocess = __import__("subprocess")
    child = subprocess.Popen(["sleep", "300"])
    print("grandchild", child.pid, flush=True)
    time.sleep(300)
sys.exit(int(sys.argv[2]))
"""


def test_runs_are_children_with_their_own_argv_env_log_and_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    results: dict[int, int] = {}

    def one(i: int) -> None:
        env = {"ZYGOTE_PROBE": f"value-{i}", "PATH": "/usr/bin:/bin"}
        cmd = [str(VLLM_PYTHON), str(script), "exit", str(i)]
        results[i] = run_engine(cmd, env, tmp_path / f"run{i}.log", timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: 0, 1: 1, 2: 2, 3: 3}
    pids = set()
    for i in range(4):
        log = (tmp_path / f"run{i}.log").read_text()
        assert f"argv ['exit', '{i}'] env value-{i} cwd {tmp_path}" in log
        pid_line = next(line for line in log.splitlines() if line.startswith("pid "))
        _, pid, _, pgid = pid_line.split()
        assert pid == pgid  # a process group of its own: a timeout kills it whole
        pids.add(pid)
    assert len(pids) == 4


def test_a_run_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    log = tmp_path / "sleep.log"
    with pytest.raises(subprocess.TimeoutExpired):
        run_engine([str(VLLM_PYTHON), str(script), "sleep", "0"], {}, log, timeout=5)
    grandchild = next(line for line in log.read_text().splitlines() if "grandchild" in line)
    pid = int(grandchild.split()[1])
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or "Z" in _state(pid):
            break
        threading.Event().wait(0.1)
    else:
        pytest.fail(f"the run's child {pid} outlived its timeout")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except OSError:
        return "Z"
