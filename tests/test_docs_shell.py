"""A shell block of the docs, pasted into a user's shell, leaves that shell as it was
(issue 50: docs/tenants.md's ``mkdir -p /tmp/kvt && umask 077`` left every file the user
made afterwards private). Each block that sets a umask runs in ``bash`` as a user's shell
would run it, after ``umask 022``: the shell's umask afterwards is still 022, and the files
the block made still have the umask it meant (nothing for group or others)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
UMASK = re.compile(r"\bumask\s+(0?[0-7]{3})\b")


def shell_blocks(page: Path) -> list[tuple[int, str, list[str]]]:
    """(line, text, the mark's ``tmp=`` paths) of each bash block of ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() not in ("```bash", "```sh", "```shell"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        mark = MARK.match(lines[i - 1]) if i else None
        tmps = []
        for word in shlex.split(mark.group(1)) if mark else []:
            if word.startswith("tmp="):
                tmps += word.removeprefix("tmp=").split(",")
        blocks.append((i + 1, "\n".join(lines[i + 1 : end]), tmps))
        i = end + 1
    return blocks


UMASK_BLOCKS = [
    (page, line, text, tmps)
    for page in PAGES
    for line, text, tmps in shell_blocks(page)
    if UMASK.search(text)
]


def test_the_docs_have_a_block_that_sets_a_umask() -> None:
    """What the test below checks is there (docs/tenants.md makes its tokens private)."""
    assert any(page.name == "tenants.md" for page, *_ in UMASK_BLOCKS)


@pytest.mark.parametrize(
    ("page", "line", "text", "tmps"),
    UMASK_BLOCKS,
    ids=[f"{p.name}:{n}" for p, n, _, _ in UMASK_BLOCKS],
)
def test_a_block_leaves_the_users_umask_as_it_was(
    page: Path, line: int, text: str, tmps: list[str], tmp_path: Path
) -> None:
    for n, path in enumerate(tmps):
        text = text.replace(path, str(tmp_path / f"tmp{n}"))
    wanted = int(UMASK.findall(text)[-1], 8)
    script = f'umask 022\n{text}\necho "umask after: $(umask)"\n'
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env["HOME"] = str(tmp_path)
    ran = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert "umask after: 0022" in ran.stdout.splitlines(), (page.name, line, ran.stdout)
    made = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert made, f"{page.name}:{line} made no file"
    for path in made:  # the block's own umask still applied to what it made
        assert path.stat().st_mode & wanted == 0, (path, oct(path.stat().st_mode))
