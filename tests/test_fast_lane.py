"""The fast lane's selection (``scripts/test.sh --fast``): its ``-m`` expression, read from the
script itself, keeps a fast module and leaves out the engine and slow ones. Collection
only (``pytest --collect-only`` in a subprocess): nothing selected runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "test.sh"

#: Records what collection kept and what ``-m`` deselected, as JSON in ``$SELECTION_OUT``.
PLUGIN = """
import json, os

kept, dropped = [], []

def pytest_deselected(items):
    dropped.extend(item.nodeid for item in items)

def pytest_collection_finish(session):
    kept.extend(item.nodeid for item in session.items)
    with open(os.environ["SELECTION_OUT"], "w") as f:
        json.dump({"kept": kept, "dropped": dropped}, f)
"""

FAST = "tests/test_keys.py"
DYNAMO = "tests/events/test_dynamo_indexer.py"  # engine, not slow: the engine mark alone
VLLM = "tests/connectors/test_vllm_e2e.py"
SOAK = "tests/test_soak_short.py"
DOCS = "tests/test_docs_snippets.py"


def fast_lane() -> str:
    """The expression scripts/test.sh gives ``pytest -m`` under ``--fast``."""
    found = re.findall(r'^FAST_LANE="([^"]+)"$', SCRIPT.read_text(), re.MULTILINE)
    assert len(found) == 1, f"{SCRIPT}: no single FAST_LANE=... line"
    return found[0]


def select(tmp_path: Path, expression: str, *files: str) -> dict[str, list[str]]:
    """What ``pytest -m expression files`` would run and what it leaves out."""
    (tmp_path / "selection_plugin.py").write_text(PLUGIN)
    out = tmp_path / "selection.json"
    env = {**os.environ, "SELECTION_OUT": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), env.get("PYTHONPATH"))))
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    cmd += ["-p", "selection_plugin", "-m", expression, *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]
    selection: dict[str, list[str]] = json.loads(out.read_text())
    return selection


def modules(nodeids: list[str]) -> set[str]:
    return {nodeid.split("::")[0] for nodeid in nodeids}


@pytest.mark.timeout(300)
def test_the_fast_lane_keeps_fast_modules_and_leaves_out_engines_and_slow_ones(
    tmp_path: Path,
) -> None:
    got = select(tmp_path, fast_lane(), FAST, DYNAMO, VLLM, SOAK, DOCS)
    kept, dropped = modules(got["kept"]), modules(got["dropped"])
    assert FAST in kept and FAST not in dropped
    for module in (DYNAMO, VLLM, SOAK):
        assert module in dropped and module not in kept, module
    # The docs: the quick blocks stay (every yaml block parses); the sessions that run an
    # engine's venv or take tens of seconds go.
    docs_kept = [n for n in got["kept"] if n.startswith(DOCS)]
    docs_dropped = [n for n in got["dropped"] if n.startswith(DOCS)]
    assert any("test_yaml_blocks_parse" in n for n in docs_kept), docs_kept[:5]
    assert any("test_docs_session_runs_as_written[quickstart.md:" in n for n in docs_dropped)
    assert any("test_docs_session_runs_as_written[restore.md:" in n for n in docs_dropped)
