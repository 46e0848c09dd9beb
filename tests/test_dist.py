"""The name kvstore installs under: ``kvstore-tiers`` (``kvstore`` on the public package index
is an unrelated 2016 package). The installed metadata carries it, the messages that say how
to install an extra name it, and no page tells a user to install the other one."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import kvstore
from kvstore.runtime.dist import DISTRIBUTION, install_hint

REPO = Path(__file__).resolve().parent.parent

# `pip install kvstore`, `pip install -U kvstore==0.1`: the unrelated package, by its name.
_PLAIN_OLD = re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?kvstore(?![\w./\[-])")
# `'kvstore[server]'` anywhere: an extra of the unrelated package (a path such as
# `/path/to/kvstore[s3]` or `kvstore-tiers[s3]` is not one).
_OLD_EXTRAS = re.compile(r"(?<![\w./-])kvstore\[")


def _user_facing_files() -> list[Path]:
    """The pages, scripts, Dockerfiles and package source that may tell a user what to
    install (the changelog, which records the old name, aside)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    files += sorted((REPO / "scripts").glob("*.sh"))
    files += sorted(p for p in REPO.rglob("Dockerfile*") if ".venv" not in str(p))
    files += sorted((REPO / "kvstore").rglob("*.py"))
    return files


def test_the_distribution_is_kvstore_tiers_and_imports_as_kvstore() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project = pyproject.split("[project]", 1)[1]
    name = re.search(r'^name = "([^"]+)"', project, re.MULTILINE)
    assert name and name.group(1) == DISTRIBUTION == "kvstore-tiers"
    installed = metadata.distribution("kvstore-tiers")
    assert installed.metadata["Name"] == "kvstore-tiers"
    assert installed.version == kvstore.__version__
    # (once or twice: the checkout's own kvstore_tiers.egg-info is seen from its root)
    assert set(metadata.packages_distributions()["kvstore"]) == {"kvstore-tiers"}, (
        "another distribution owns the kvstore package: an install under the old name, or "
        "its kvstore.egg-info in the checkout, is left (scripts/setup.sh removes both)"
    )


def test_no_page_tells_a_user_to_install_the_unrelated_kvstore() -> None:
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in _user_facing_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _PLAIN_OLD.search(line) or _OLD_EXTRAS.search(line)
    ]
    assert not found, "install commands that name the unrelated package:\n" + "\n".join(found)
    for page in ("docs/quickstart.md", "docs/server.md"):  # and they say what to install
        assert "kvstore-tiers[server]" in (REPO / page).read_text(encoding="utf-8"), page


def test_a_missing_extra_names_the_command_that_installs_it(tmp_path: Path) -> None:
    # boto3 is installed here; the store opens in a process that cannot import it (what a
    # user without the s3 extra sees).
    script = (
        "import sys\n"
        "sys.modules['boto3'] = None\n"
        "from kvstore import KVStore\n"
        "from kvstore.errors import ConfigError\n"
        "from kvstore.testing.data import small_layout\n"
        "config = {'tiers': [{'kind': 's3', 'bucket': 'b', 'endpoint_url': 'http://127.0.0.1:1'}]}\n"
        "try:\n"
        "    KVStore(small_layout(), config)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert install_hint("s3") == "pip install 'kvstore-tiers[s3]'"
    assert "pip install 'kvstore-tiers[s3]'" in done.stdout, done.stdout + done.stderr
