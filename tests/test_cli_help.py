"""``kvstore demo --help`` says every default, and what each option does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

KVSTORE = str(Path(sys.executable).with_name("kvstore"))


def test_demo_help_shows_defaults_and_describes_every_option() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    result = subprocess.run(
        [KVSTORE, "demo", "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps at the terminal's width
    for option, default in (
        ("--sessions SESSIONS", "16"),
        ("--turns TURNS", "4"),
        ("--system-tokens SYSTEM_TOKENS", "2048"),
        ("--layers LAYERS", "32"),
        ("--seed SEED", "0"),
    ):
        described = re.search(re.escape(option) + r" (.*?)\(default: ([^,)]+)", text)
        assert described is not None, option
        assert described.group(1).strip() and described.group(2) == default, option
    assert "--seed SEED seed of the random prompts" in text
    assert "--cache-dir CACHE_DIR disk tier directory (default: a scratch directory" in text
