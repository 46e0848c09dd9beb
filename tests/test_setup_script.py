"""``scripts/setup.sh`` on a fresh clone says what it does and no more (issue 50: setuptools'
10-line "Editable installation" banner, which recent pip shows from the build backend, came
with every set-up).

The script runs as a user runs it, in a copy of the checkout, into a virtualenv of its own
(``KVSTORE_VENV``), with the ``server`` extra only (``KVSTORE_EXTRAS``). To spare a
gigabyte of unpacking, the virtualenv is made first with this one's torch and what torch
requires in it (hard links: the files are shared, none is written), so the script's
``pip install torch==...`` finds it installed; everything else -- the pip upgrade, the
editable build of kvstore and its C extensions, the other dependencies -- runs as on a
user's machine. 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "NOTICE", "MANIFEST.in")


def fresh_clone(dest: Path) -> Path:
    """What a clone has that the set-up reads, without build outputs."""
    dest.mkdir()
    for name in SOURCES:
        shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("kvstore", "csrc"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    (dest / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "setup.sh", dest / "scripts" / "setup.sh")
    return dest


def link_distribution(name: str, site: Path, done: set[str]) -> None:
    """Hard-link the installed distribution ``name`` and those it requires (extras aside)
    into ``site``: every file of its RECORD under site-packages."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in done:
        return
    done.add(key)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return  # an optional or platform requirement not installed here: pip's to fetch
    base = Path(str(dist.locate_file(""))).resolve()
    for file in dist.files or ():
        source = Path(str(dist.locate_file(file))).resolve()
        if not source.is_file() or base not in source.parents:
            continue  # scripts in bin/, files a package removed
        target = site / source.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.link(source, target)
    for requirement in dist.requires or ():
        if "extra ==" not in requirement:
            link_distribution(re.split(r"[^A-Za-z0-9._-]", requirement, maxsplit=1)[0], site, done)


def venv_with_this_torch(venv: Path, python: str) -> None:
    """A virtualenv whose site-packages holds this interpreter's torch and what it requires,
    hard-linked."""
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    link_distribution("torch", next(venv.glob("lib/python*/site-packages")), set())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_setup_on_a_fresh_clone_shows_no_editable_install_banner(tmp_path: Path) -> None:
    clone = fresh_clone(tmp_path / "clone")
    venv = tmp_path / "venv"
    python = getattr(sys, "_base_executable", None) or "python3"
    venv_with_this_torch(venv, python)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update(KVSTORE_VENV=str(venv), KVSTORE_EXTRAS="server", PYTHON=python)
    ran = subprocess.run(
        ["bash", "scripts/setup.sh"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    said = ran.stdout + ran.stderr
    assert ran.returncode == 0, said[-6000:]
    assert "setup: creating" in ran.stderr and "kvstore-tiers[server]" in ran.stderr
    assert "Editable installation" not in said, said
    assert "*" * 40 not in said, said  # the banner's frame
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kvstore; print(kvstore.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert where.stdout.strip() == str(clone / "kvstore" / "__init__.py")
