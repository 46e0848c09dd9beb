"""docs/config-reference.md: generated from the config dataclasses, complete, not stale."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvstore.config import StoreConfig, apply_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"
DOC = ROOT / "docs" / "config-reference.md"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_committed_reference_is_up_to_date() -> None:
    """CI's drift check: the committed file is exactly what the generator writes."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, (
        "docs/config-reference.md is stale; run: python scripts/gen_config_reference.py\n"
        + proc.stdout[-4000:]
        + proc.stderr[-2000:]
    )


def test_check_mode_reports_a_stale_file_with_a_diff(tmp_path: Path) -> None:
    stale = tmp_path / "ref.md"
    stale.write_text(DOC.read_text().replace("## Sections", "## Old sections", 1))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--output", str(stale)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "-## Old sections" in proc.stdout and "+## Sections" in proc.stdout
    assert "stale" in proc.stderr


def _tables(text: str) -> dict[str, set[str]]:
    """Section anchor -> the keys of its table."""
    out: dict[str, set[str]] = {}
    anchor = None
    for line in text.splitlines():
        found = re.fullmatch(r'<a id="([\w-]+)"></a>', line)
        if found:
            anchor = found.group(1)
            out[anchor] = set()
        row = re.match(r'\| <a id="[\w-]+"></a>`(\w+)` \|', line)
        if row and anchor is not None:
            out[anchor].add(row.group(1))
    return out


def test_every_field_of_every_config_dataclass_is_in_the_reference(gen: Any) -> None:
    sections, missing = gen.sections()
    assert missing == []
    classes = gen.config_dataclasses()
    documented = gen.documented_classes(sections)
    # Every dataclass of kvstore/config/ is covered or excluded with a reason.
    uncovered = {name for name, cls in classes.items() if cls not in documented}
    assert uncovered == set(gen.EXCLUDED), sorted(uncovered ^ set(gen.EXCLUDED))
    tables = _tables(DOC.read_text())
    for cls in documented:
        # A field is in the table of a section of its class, or (inherited) of a base.
        anchors = [s.anchor for s in sections if set(s.classes) & set(cls.__mro__)]
        assert anchors, cls
        for f in dataclasses.fields(cls):
            assert any(f.name in tables[a] for a in anchors), f"{cls.__name__}.{f.name}"
    for s in sections:
        assert {r.name for r in s.rows} == tables[s.anchor], s.anchor
        assert all(r.description for r in s.rows), s.anchor


def test_every_environment_variable_listed_sets_its_key(gen: Any) -> None:
    """The names in the environment column are the ones the loader routes."""
    sections, _ = gen.sections()
    seen = 0
    for s in sections:
        for row in s.rows:
            names = re.findall(r"`(KVSTORE_\w+)`", row.env)
            if not names or "<KIND>" in names[0]:
                continue
            (name,) = names
            seen += 1
            if s.path == "" and row.name == "tiers":
                data = apply_env({}, {name: '[{"kind": "host"}]'}, "KVSTORE_", {})
                assert data["tiers"] == [{"kind": "host"}], name
            elif s.path == "":
                data = apply_env({}, {name: "7"}, "KVSTORE_", {})
                assert data[row.name] == "7", name
            elif s.path.startswith("tiers[]"):
                kind = re.search(r"kind: (\w+)", s.path).group(1)  # type: ignore[union-attr]
                data = apply_env({"tiers": [{"kind": kind}]}, {name: "7"}, "KVSTORE_", {})
                assert data["tiers"][0][row.name] == "7", name
            else:
                data = apply_env({}, {name: "7"}, "KVSTORE_", {})
                assert data[s.path][row.name] == "7", name
    assert seen > 60


def test_common_tier_keys_are_set_per_kind_through_the_environment() -> None:
    env = {"KVSTORE_HOST_CAPACITY": "1GiB", "KVSTORE_DISK_HIGH_WATERMARK": "0.8"}
    config = StoreConfig.from_dict({"tiers": [{"kind": "host"}, {"kind": "disk"}]}, environ=env)
    assert config.tiers[0].capacity == 1024**3 and config.tiers[1].high_watermark == 0.8


def test_output_does_not_depend_on_the_machine(gen: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    first = gen.render()
    monkeypatch.setenv("HOME", "/somewhere/else")
    monkeypatch.setenv("XDG_CACHE_HOME", "/another/cache")
    monkeypatch.setenv("KVSTORE_HOST_CAPACITY", "1GiB")
    assert gen.render() == first


def test_an_undocumented_field_fails_the_generator(gen: Any) -> None:
    @dataclasses.dataclass(frozen=True)
    class Documented:
        """A section.

        ``known``: described here.
        """

        known: int = 1
        hidden: int = 2

    missing: list[str] = []
    rows = gen.field_rows(Documented, list(dataclasses.fields(Documented)), ("x",), missing)
    assert missing == ["Documented.hidden"]
    assert rows[0].description == "Described here." and rows[0].env == "`KVSTORE_X_KNOWN`"
