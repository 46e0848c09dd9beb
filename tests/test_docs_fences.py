"""Every fenced code block in the README and the docs is closed: one left open turns the rest
of the page into code when it renders (README.md's Python example once swallowed its
command line section)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# A fence, as CommonMark reads one: at most three spaces, then ``` or ~~~ (three or more),
# then an info string (the language) on an opening fence only.
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def _fence_errors(text: str) -> list[str]:
    """What is wrong with the page's fences: a block left open at the end, or a fence with
    a language inside a block (meant to open the next block, it is read as the open block's
    content, and that block runs on)."""
    errors: list[str] = []
    opened: tuple[int, str] | None = None  # (line, fence) of the block we are in
    for n, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match is None:
            continue
        fence, info = match.groups()
        if opened is None:
            opened = (n, fence)
        elif fence[0] != opened[1][0] or len(fence) < len(opened[1]):
            continue  # shorter or other fences are the block's content
        elif info.strip():
            errors.append(f"line {n}: {line.strip()!r} inside the block opened at line {opened[0]}")
        else:
            opened = None
    if opened is not None:
        errors.append(f"line {opened[0]}: the block opened here is never closed")
    return errors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_code_block_is_closed(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    fences = [line for line in text.splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: {len(fences)} ``` fences, an odd number"
    assert _fence_errors(text) == [], page.name


def test_an_unclosed_block_is_found() -> None:
    # README.md as it was: the Python block not closed before the next section's bash block.
    text = "```python\nx = 1\n\n## Command line\n\n```bash\nkvstore demo\n```\n"
    assert _fence_errors(text) == ["line 6: '```bash' inside the block opened at line 1"]
    assert _fence_errors("```bash\nls\n") == ["line 1: the block opened here is never closed"]
    assert _fence_errors("````md\n```python\n```\n````\n") == []  # a longer fence nests
