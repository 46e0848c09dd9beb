"""Release packaging: ``python -m build`` makes an sdist and, from it, a wheel that
installs into a fresh virtualenv and runs ``kvstore demo`` and ``kvstore --version``.

The wheel is platform-specific: it carries the compiled ``kvstore.native._chain`` and
``kvstore.native._memcopy`` (csrc/, built by setup.py), and the installed copy must hash with
the first (``kvstore.keys.CHAIN_IMPL``).

The build runs in build's isolated environment (it fetches ``setuptools>=77`` from the
package index, as a release build would); the fresh venv gets kvstore's dependencies from
the index too, torch pinned the way ``scripts/setup.sh`` pins it. About 45 s on 2 cores.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The CPU-only torch that scripts/setup.sh pins when a local wheel provides it.
TORCH_PIN = "torch==2.13.0"
# A workload small enough to run in seconds: 2 sessions x 2 turns of a 2-layer model.
DEMO_ARGS = ["--sessions", "2", "--turns", "2", "--system-tokens", "512", "--layers", "2"]
# The distribution "kvstore-tiers" as file names spell it (the package imports as kvstore).
DIST = "kvstore_tiers"
# What the wheel ships of kvstore.testing for tier and policy authors: the conformance
# suites and the policy driver, the fault wrappers, the lock checker, test data.
KIT = ("conformance", "policy_conformance", "policies", "faults", "lockcheck", "data")
# Our own harnesses (the repository's kvharness/): never in the wheel.
HARNESS_WORDS = ("chaos", "fuzz", "soak", "proxy", "throttle", "kvharness")


def _source_version() -> str:
    """The ``__version__`` literal in ``kvstore/version.py`` (the version's one source)."""
    tree = ast.parse((REPO / "kvstore" / "version.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise AssertionError("kvstore/version.py: no `__version__ = '...'` literal")


def _pip_env() -> dict[str, str]:
    """The environment for pip in the fresh venv: the user's (pip reads its config from
    HOME), without KVSTORE_* settings or a PYTHONPATH into the source tree. pip's cache is
    the user's default one -- not the temporary XDG cache the suite's fixture sets -- so
    repeated runs install from it."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVSTORE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    return env


def _run_env(tmp: Path) -> dict[str, str]:
    """The environment for the installed ``kvstore``: HOME, the XDG cache and TMPDIR
    under ``tmp``, so that nothing is written into the cache of the user running the tests."""
    env = _pip_env()
    for name, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "xdg-cache"), ("TMPDIR", "tmp")):
        path = tmp / sub
        path.mkdir()
        env[name] = str(path)
    return env


def _run(
    cmd: Sequence[str | Path], *, cwd: Path, env: dict[str, str] | None = None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; fail the test with its output if it exits non-zero."""
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def _install_torch(pip: list[str], tmp: Path, env: dict[str, str]) -> None:
    """Pin torch as scripts/setup.sh does: when a local wheel provides the CPU build
    (pip's find-links), install that first, so that kvstore's ``torch>=2.4`` range does
    not pull a multi-GB CUDA build; otherwise leave torch to the wheel's dependencies."""
    probe = subprocess.run(
        [*pip, "download", "--no-index", "--no-deps", "-d", str(tmp / "torch-probe"), TORCH_PIN],
        cwd=tmp,
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )
    if probe.returncode == 0:
        _run([*pip, "install", TORCH_PIN], cwd=tmp, env=env, timeout=600)


def _wheel_tag() -> str:
    """The tag of a wheel with a C extension built here: ``cp311-cp311-linux_x86_64``."""
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return f"{py}-{py}-{platform}"


def _license_deprecations(log: str) -> list[str]:
    """Lines of a build log that warn about a deprecated way of declaring the license."""
    return [
        line for line in log.splitlines() if "deprecat" in line.lower() and "licen" in line.lower()
    ]


def _check_wheel(wheel: Path, version: str) -> None:
    """The wheel holds the package, its stub and compiled extension, and the licence files."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = email.parser.Parser().parsestr(
            zf.read(f"{DIST}-{version}.dist-info/METADATA").decode()
        )
    assert "kvstore/py.typed" in names
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    for module in ("_chain", "_memcopy"):
        assert f"kvstore/native/{module}.pyi" in names
        assert f"kvstore/native/{module}{ext}" in names, (
            f"the wheel lacks the compiled kvstore.native.{module}"
        )
    licenses = ["LICENSE", "NOTICE", "csrc/xxhash/LICENSE"]
    for name in licenses:
        assert f"{DIST}-{version}.dist-info/licenses/{name}" in names
    assert {n.split("/")[0] for n in names} == {"kvstore", f"{DIST}-{version}.dist-info"}, (
        "the wheel holds only the kvstore package (no tests/, benchmarks/, examples/, kvharness/)"
    )
    # What tier and policy authors need ships; our own harnesses (kvharness/) do not.
    for module in KIT:
        assert f"kvstore/testing/{module}.py" in names, f"the wheel lacks kvstore.testing.{module}"
    harnesses = [n for n in names if any(word in n for word in HARNESS_WORDS)]
    assert not harnesses, f"the wheel holds our own harnesses: {harnesses}"
    assert metadata["Name"] == "kvstore-tiers"  # the import name stays kvstore
    assert metadata["Version"] == version
    assert metadata["License-Expression"] == "Apache-2.0 AND BSD-2-Clause"
    assert metadata.get_all("License-File") == licenses


def _check_sdist(sdist: Path, version: str) -> None:
    """The sdist holds what a wheel build needs (the C sources too), and nothing compiled."""
    with tarfile.open(sdist) as tf:
        members = set(tf.getnames())
    root = f"{DIST}-{version}"
    for path in (
        *("pyproject.toml", "setup.py", "README.md", "LICENSE", "NOTICE", "kvstore/py.typed"),
        *("csrc/chain.c", "csrc/memcopy.c", "csrc/xxhash/xxhash.h", "csrc/xxhash/LICENSE"),
    ):
        assert f"{root}/{path}" in members, f"sdist lacks {path}"
    assert not [m for m in members if m.endswith(".so")], "the sdist holds no compiled files"
    assert not [m for m in members if f"{root}/kvharness/" in m], "the sdist holds kvharness/"


# Where the installed package is, and which chain_keys it runs ("c": the compiled one).
_WHERE = "import kvstore, kvstore.keys as k; print(kvstore.__file__, k.CHAIN_IMPL)"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installs_and_runs_demo_in_fresh_venv(tmp_path: Path) -> None:
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: it is in the dev extra (run scripts/setup.sh)")
    version = _source_version()

    # sdist first, then the wheel from the unpacked sdist (build's default), which also
    # shows that the sdist holds everything a wheel needs.
    dist = tmp_path / "dist"
    built = _run([sys.executable, "-m", "build", "--outdir", dist, REPO], cwd=tmp_path, timeout=600)
    log = built.stdout + built.stderr
    assert not _license_deprecations(log), "\n".join(_license_deprecations(log))
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"{DIST}-{version}-{_wheel_tag()}.whl"]
    assert [s.name for s in sdists] == [f"{DIST}-{version}.tar.gz"]
    wheel = wheels[0]

    _check_wheel(wheel, version)
    _check_sdist(sdists[0], version)

    # A fresh venv: torch pinned first, then the wheel with its dependencies from the index.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    _install_torch(pip, tmp_path, _pip_env())
    _run([*pip, "install", wheel], cwd=tmp_path, env=_pip_env(), timeout=600)
    env = _run_env(tmp_path)

    # The installed copy runs, not the source tree (cwd is outside the repository).
    where = _run([venv / "bin" / "python", "-c", _WHERE], cwd=tmp_path, env=env, timeout=60)
    package, impl = where.stdout.split()
    assert Path(package).is_relative_to(venv), where.stdout
    assert impl == "c", "the installed kvstore hashes without its compiled kvstore.native._chain"

    # The kit tier authors use imports from the wheel alone (no checkout on the path).
    kit = "from kvstore.testing import FaultyTier, LockCheckedTier, random_blocks, small_layout"
    _run([venv / "bin" / "python", "-c", kit], cwd=tmp_path, env=env, timeout=120)

    shown = _run([venv / "bin" / "kvstore", "--version"], cwd=tmp_path, env=env, timeout=60)
    assert shown.stdout.strip() == f"kvstore {version}"

    demo = _run([venv / "bin" / "kvstore", "demo", *DEMO_ARGS], cwd=tmp_path, env=env, timeout=300)
    report = demo.stdout
    for line in ("kvstore demo: 2 sessions x 2 turns", "prefill tokens saved", "after a restart"):
        assert line in report, report
    # Its disk tier was a scratch directory under TMPDIR, removed at the end: nothing
    # was left there, in HOME or in the XDG cache.
    for name in ("TMPDIR", "XDG_CACHE_HOME", "HOME"):
        left = sorted(p.name for p in Path(env[name]).iterdir())
        assert left == [], f"the demo left {left} in {name}"


def test_harnesses_live_outside_the_package() -> None:
    """kvstore/testing/ keeps the kit (the rest moved to kvharness/, which the wheel
    leaves out: ``packages.find`` takes ``kvstore*`` only), and no module of kvstore
    imports kvharness: the installed package must not need a folder it does not ship."""
    testing = REPO / "kvstore" / "testing"
    shipped = {p.stem for p in testing.glob("*.py")}
    assert set(KIT) <= shipped
    assert not [m for m in shipped if any(word in m for word in HARNESS_WORDS)], shipped
    assert (REPO / "kvharness" / "__init__.py").is_file()
    importers = []
    for path in sorted((REPO / "kvstore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "kvharness" or n.startswith("kvharness.") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert not importers, f"kvstore imports kvharness: {importers}"
