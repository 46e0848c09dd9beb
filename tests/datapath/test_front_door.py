"""Every package of kvstore has one front door: code outside a package (in ``kvstore/``,
``benchmarks/``, ``examples/`` and the harnesses of ``kvharness/``) imports only the
package's ``__init__`` and its contract module (``contracts.py``, or ``base.py`` where that
is the declared contract), never another of its modules. Tests are exempt: they test internals.

Each package's ``__init__`` re-exports what outside code needs, most of it imported on
first use from a table (``_EXPORTS``); the checks below also hold every such table to
the names its modules really have and to what type checkers are shown."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KVSTORE = REPO / "kvstore"
#: Module names that are a package's declared contract, importable from outside.
CONTRACTS = {"contracts", "base"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def packages() -> dict[str, Path]:
    """Every package below ``kvstore`` (dotted name -> directory)."""
    return {
        module_name(init): init.parent
        for init in sorted(KVSTORE.rglob("__init__.py"))
        if init.parent != KVSTORE
    }


PACKAGES = packages()


def internals(package: Path) -> set[str]:
    """The modules of ``package`` no code outside it may import: all but its ``__init__``
    and contract, compiled extensions (and their stubs) included."""
    dotted = module_name(package / "__init__.py")
    names = {p.name.split(".")[0] for p in package.iterdir() if p.is_file()}
    names |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    modules = {
        n
        for n in names
        if (package / f"{n}.py").is_file()
        or (package / f"{n}.pyi").is_file()
        or (package / n / "__init__.py").is_file()
        or any(package.glob(f"{n}.*.so"))
    }
    return {f"{dotted}.{n}" for n in modules - {"__init__"} - CONTRACTS}


INTERNALS = {name: internals(path) for name, path in PACKAGES.items()}


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


def checked_modules() -> list[Path]:
    roots = [KVSTORE, REPO / "benchmarks", REPO / "examples", REPO / "kvharness"]
    return [p for root in roots if root.is_dir() for p in sorted(root.rglob("*.py"))]


def reaches(path: Path, found: set[str]) -> list[str]:
    """The internal modules of other packages among ``found``."""
    out = []
    for package, directory in PACKAGES.items():
        if directory in path.parents:
            continue
        out.extend(sorted(found & INTERNALS[package]))
    return out


def test_every_package_is_checked() -> None:
    """The check knows the packages and their modules (a rename cannot empty it silently)."""
    expected = {
        "kvstore.cli",
        "kvstore.client",
        "kvstore.cluster",
        "kvstore.config",
        "kvstore.connectors",
        "kvstore.copies",
        "kvstore.datapath",
        "kvstore.events",
        "kvstore.format",
        "kvstore.native",
        "kvstore.placement",
        "kvstore.policy",
        "kvstore.restore",
        "kvstore.runtime",
        "kvstore.server",
        "kvstore.testing",
        "kvstore.tiers",
        "kvstore.wire",
    }
    assert expected <= set(PACKAGES)
    assert {"kvstore.datapath.manager", "kvstore.datapath.books"} <= INTERNALS["kvstore.datapath"]
    assert "kvstore.datapath.contracts" not in INTERNALS["kvstore.datapath"]
    assert "kvstore.tiers.base" not in INTERNALS["kvstore.tiers"]
    assert {"kvstore.tiers.disk", "kvstore.format.codec", "kvstore.restore.planner"} <= set().union(
        *INTERNALS.values()
    )
    assert len(checked_modules()) > 150


@pytest.mark.parametrize("path", checked_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_imports_another_package_internals(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = reaches(path, imported(path, tree))
    assert not found, (
        f"{path.relative_to(REPO)} imports {', '.join(found)}: import the name from the "
        "package (its __init__, adding it to the package's exports if it is missing) or "
        "from its contracts module"
    )


def test_the_check_sees_a_reach() -> None:
    """Each form of import of an internal module is caught, relative ones included, in
    every package; the front door and the contracts are not."""
    server = KVSTORE / "server" / "example.py"
    for source in (
        "from kvstore.datapath.lending import Loan",
        "import kvstore.datapath.manager",
        "from kvstore.datapath import books",
        "from ..datapath.prefetch import PrefetchHandle",
        "from kvstore.tiers.disk import DiskTier",
        "from kvstore.format import codec",
        "from ..restore.planner import plan_restore",
        "import kvstore.native._chain",
        "from kvstore.wire.protocol import Op",
    ):
        assert reaches(server, imported(server, ast.parse(source))), source
    for source in (
        "from ..datapath import Loan",
        "from kvstore.datapath.contracts import Medium",
        "from kvstore.tiers.base import Tier",
        "from kvstore.format import BlockHeader",
        "from kvstore.restore.contracts import RestorerParts",
        "from kvstore.server.handlers import handle",  # its own package
    ):
        assert not reaches(server, imported(server, ast.parse(source))), source


# -- the front doors' tables ---------------------------------------------------------------
def export_tables() -> list[tuple[str, dict[str, str]]]:
    """``(package, _EXPORTS)`` of every ``__init__`` (the top one too) that has a table."""
    out = []
    for init in [KVSTORE / "__init__.py", *(p / "__init__.py" for p in PACKAGES.values())]:
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
            ):
                out.append((module_name(init), ast.literal_eval(node.value)))
    return out


def type_checking_names(init: Path) -> dict[str, str]:
    """What ``init`` imports under ``if TYPE_CHECKING:``: the name bound -> its source
    (``module`` where it keeps its name, else ``module:attr``)."""
    names = {}
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module:
                    for a in imp.names:
                        bound = a.asname or a.name
                        names[bound] = imp.module if bound == a.name else f"{imp.module}:{a.name}"
    return names


def init_of(package: str) -> Path:
    return KVSTORE / "__init__.py" if package == "kvstore" else PACKAGES[package] / "__init__.py"


def _table_id(value: object) -> str:
    return value if isinstance(value, str) else "table"


def test_export_tables_are_found() -> None:
    found = dict(export_tables())
    assert {"kvstore", "kvstore.datapath", "kvstore.tiers", "kvstore.format", "kvstore.cli"} <= set(
        found
    )


@pytest.mark.parametrize(
    "package,table", export_tables(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_lazy_exports_are_listed_and_typed(package: str, table: dict[str, str]) -> None:
    """Every lazily exported name is in ``__all__`` and imported under ``TYPE_CHECKING``
    from the same place, so type checkers see exactly what the package hands out."""
    module = importlib.import_module(package)
    missing = sorted(set(table) - set(module.__all__))
    assert not missing, f"{package}.__all__ lacks {missing}"
    typed = type_checking_names(init_of(package))
    wrong = sorted(n for n, target in table.items() if typed.get(n) != target)
    assert not wrong, f"{package}: {wrong} are not imported under TYPE_CHECKING as _EXPORTS says"


@pytest.mark.parametrize(
    "package,table", export_tables(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_lazy_exports_resolve(package: str, table: dict[str, str]) -> None:
    """Each name of the table is what its module holds (modules needing an engine that is
    not installed here, such as vllm, are skipped)."""
    module = importlib.import_module(package)
    for name, target in table.items():
        source, _, attr = target.partition(":")
        try:
            holder = importlib.import_module(source)
        except ModuleNotFoundError as exc:  # an optional engine or dependency
            assert exc.name is not None and not exc.name.startswith("kvstore"), exc
            continue
        assert getattr(module, name) is getattr(holder, attr or name), f"{package}.{name}"


def test_a_missing_name_is_an_attribute_error() -> None:
    import kvstore.tiers

    with pytest.raises(AttributeError, match=r"kvstore\.tiers.*no_such_name"):
        kvstore.tiers.no_such_name  # noqa: B018
