"""Every attribute README.md and docs/*.md name on a public type exists (issue 50:
docs/restore.md named ``RestorePlan.load_ms``, ``recompute_ms``, ``ready_ms`` and
``nocache_ms``; the attributes are ``load_s``, ... and ``_ms`` only the keys of
``as_dict()``).

A public type is a name in the ``__all__`` of a kvstore module (``kvstore.__all__`` and
those of its packages and modules; found by reading the source, imported only when a doc
names it). The docs name an attribute in two ways, both checked:

- ``Type.attr`` in code (```RestorePlan.tier_load_s```, ```KVStore.prefetch```);
- ```Record`: `attr`, ... `attr`.``: a record type (a dataclass, a named tuple), a colon,
  then the fields it has, up to the end of that sentence, the next colon (where a list of
  values such as ``reason``'s begins), the table cell or the parenthesis it stands in.

An attribute exists when the class (or an object) has it, declares it (annotations,
dataclass fields, slots) or assigns ``self.attr`` in its source.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: ``Type.attr`` inside a code span.
DOTTED = re.compile(r"(?<![\w.])([A-Z][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\b")
#: A field's name alone in a code span.
FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


# -- what the docs name ---------------------------------------------------------------------
def paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """(first line, text joined on one line) of each paragraph outside fenced blocks; each
    row of a table is one."""
    lines, start, inside = [], 0, False
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            line = ""
        if not inside and line.lstrip().startswith("|"):
            if lines:
                yield start, " ".join(lines)
            lines = []
            yield n, line.strip()
            continue
        if inside or not line.strip():
            if lines:
                yield start, " ".join(lines)
            lines = []
            continue
        if not lines:
            start = n
        lines.append(line.strip())


def spans(paragraph: str) -> list[tuple[bool, str]]:
    """The paragraph as (in a code span?, text) pieces, in order."""
    return [(i % 2 == 1, piece) for i, piece in enumerate(paragraph.split("`"))]


def listed_fields(paragraph: str, names: set[str]) -> Iterator[tuple[str, str]]:
    """(type, field) for each ```Type`: `field` ...`` list of a paragraph: the bare names
    after the colon, up to the end of the sentence or the next colon."""
    pieces = spans(paragraph)
    for i, (code, piece) in enumerate(pieces):
        if not (code and piece in names and i + 1 < len(pieces) and is_record(piece)):
            continue
        after = pieces[i + 1][1]
        if not after.startswith(":"):
            continue
        depth = 0  # a list inside parentheses ends where they close
        for is_code, text in [(False, after[1:]), *pieces[i + 2 :]]:
            if is_code:
                if FIELD.match(text):
                    yield piece, text
                continue
            end = re.search(r"[.:](\s|$)|\|", text)
            depth += text[: end.start() if end else None].count("(") - text.count(")")
            if end or depth < 0:
                break


def named_attributes(text: str, names: set[str]) -> Iterator[tuple[int, str, str]]:
    """(line, type, attribute) for every attribute ``text`` names on one of ``names``."""
    for line, paragraph in paragraphs(text):
        for code, piece in spans(paragraph):
            for m in DOTTED.finditer(piece) if code else ():
                if m.group(1) in names:
                    yield line, m.group(1), m.group(2)
        for kind, field in listed_fields(paragraph, names):
            yield line, kind, field


# -- the public types -------------------------------------------------------------------------
@cache
def public_names() -> dict[str, tuple[str, ...]]:
    """Each name in the ``__all__`` of a kvstore module -> the modules that export it."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if ".testing" in module:
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.Assign):
                continue
            if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                continue
            for name in ast.literal_eval(node.value):
                if name[:1].isupper():
                    found.setdefault(name, []).append(module)
    return {name: tuple(modules) for name, modules in found.items()}


def attributes(obj: Any) -> set[str]:
    """Every attribute ``obj`` (a class, or any object) has, declares or assigns."""
    names = set(dir(obj))
    if not inspect.isclass(obj):
        return names
    for klass in obj.__mro__:
        if klass is object:
            continue
        names |= set(vars(klass).get("__annotations__", {}))
        names |= set(vars(klass).get("__slots__", ()))
        if dataclasses.is_dataclass(klass):
            names |= {f.name for f in dataclasses.fields(klass)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def exported(name: str) -> Iterator[Any]:
    """The objects the modules exporting ``name`` give it; none from a module that needs an
    engine not installed here (the vLLM connector's, in .venv-vllm only)."""
    for module in public_names()[name]:
        try:  # a package's front door imports its names on first use: getattr may import
            imported = importlib.import_module(module)
            obj = getattr(imported, name, None)
        except ImportError as exc:
            if (exc.name or "kvstore").startswith("kvstore"):
                raise
            continue
        if obj is not None and not inspect.ismodule(obj):
            yield obj


def is_record(name: str) -> bool:
    """Whether ``name`` is a record type (a dataclass or a named tuple): the kind a doc
    describes by listing its fields."""
    return any(dataclasses.is_dataclass(o) or hasattr(o, "_fields") for o in exported(name))


def has_attribute(name: str, attr: str) -> bool:
    """Whether the public ``name`` (any module exporting it) has ``attr``; true where no
    module exporting it imports here (nothing to check it against)."""
    found = list(exported(name))
    return not found or any(attr in attributes(obj) for obj in found)


def missing(text: str) -> list[str]:
    """``line: Type.attr`` for each attribute ``text`` names that does not exist."""
    names = set(public_names())
    return [
        f"{line}: {kind}.{attr}"
        for line, kind, attr in named_attributes(text, names)
        if not has_attribute(kind, attr)
    ]


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_attribute_the_docs_name_exists(page: Path) -> None:
    assert missing(page.read_text(encoding="utf-8")) == [], page.name


def test_the_pages_name_attributes_of_public_types() -> None:
    """The check has something to check: restore.md names RestorePlan's fields."""
    names = set(public_names())
    text = (ROOT / "docs" / "restore.md").read_text(encoding="utf-8")
    fields = {attr for _, kind, attr in named_attributes(text, names) if kind == "RestorePlan"}
    assert {"stored", "load", "load_s", "recompute_s", "ready_s", "nocache_s"} <= fields


def test_issue_50s_paragraph_is_caught() -> None:
    """docs/restore.md as it was: the four ``_ms`` names are found missing, nothing else."""
    old = (
        "`store.plan(keys, prompt_tokens=...)` answers a\n"
        "`RestorePlan`: of the `stored` leading chunks, load the first `load`; `load_ms` "
        "(expected),\n`recompute_ms` (the same tokens prefilled instead), `ready_ms` and "
        "`nocache_ms` (time to a\nready prompt), chunks per tier, and the `reason`:\n"
        "`all` (everything stored pays), `pays` (a shorter prefix pays), `off`.\n\n"
        "Its `RestorePlan.tier_load_s` and `RestorePlan.load_ms`.\n"
    )
    assert missing(old) == [
        "1: RestorePlan.load_ms",
        "1: RestorePlan.recompute_ms",
        "1: RestorePlan.ready_ms",
        "1: RestorePlan.nocache_ms",
        "7: RestorePlan.load_ms",
    ]
