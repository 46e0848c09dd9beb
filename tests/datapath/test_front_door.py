"""The data path has one front door: code outside ``kvstore/datapath/`` imports only
``kvstore.datapath`` and ``kvstore.datapath.contracts``, never another module of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATAPATH = REPO / "kvstore" / "datapath"
FRONT_DOOR = {"kvstore.datapath", "kvstore.datapath.contracts"}
INTERNALS = (
    {f"kvstore.datapath.{p.stem}" for p in DATAPATH.glob("*.py")}
    - {"kvstore.datapath.__init__"}
    - FRONT_DOOR
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, tree: ast.AST) -> set[str]:
    """Every module ``path`` imports (``from package import module`` counts the module)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def outside_modules() -> list[Path]:
    roots = [REPO / "kvstore", REPO / "benchmarks", REPO / "examples"]
    return [
        p
        for root in roots
        if root.is_dir()
        for p in sorted(root.rglob("*.py"))
        if DATAPATH not in p.parents
    ]


def test_internals_are_found() -> None:
    """The check knows the data path's modules (a rename cannot empty it silently)."""
    assert {"kvstore.datapath.manager", "kvstore.datapath.books"} <= INTERNALS
    assert len(outside_modules()) > 50


@pytest.mark.parametrize("path", outside_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_outside_imports_data_path_internals(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    reaches = sorted(imported(path, tree) & INTERNALS)
    assert not reaches, (
        f"{path.relative_to(REPO)} imports {', '.join(reaches)}: use kvstore.datapath "
        "or kvstore.datapath.contracts (add the name there if it is missing)"
    )


def test_the_check_sees_a_reach() -> None:
    """Each form of import of an internal module is caught, relative ones included."""
    server = REPO / "kvstore" / "server" / "example.py"
    for source in (
        "from kvstore.datapath.lending import Loan",
        "import kvstore.datapath.manager",
        "from kvstore.datapath import books",
        "from ..datapath.prefetch import PrefetchHandle",
    ):
        assert imported(server, ast.parse(source)) & INTERNALS, source
    assert not imported(server, ast.parse("from ..datapath import Loan")) & INTERNALS
    assert not imported(server, ast.parse("from kvstore.datapath.contracts import Medium")) & (
        INTERNALS
    )
