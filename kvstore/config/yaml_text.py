"""YAML as kvstore reads it: safe, and a key given twice in one mapping is an error.

PyYAML's ``safe_load`` keeps the last of two equal keys without a word, so a config
with ``capacity: 1GiB`` and, further down the same tier, ``capacity: 64GiB`` silently
means 64 GiB -- or a tier list given twice keeps only the second. Every YAML kvstore
reads (config files, ``KVSTORE_TIERS``, keyrings, a prefill table given as text) goes
through :func:`load_yaml`, which refuses that with a :class:`ConfigError` naming the key
and both lines.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvstore.errors import ConfigError

__all__ = ["DuplicateKeyError", "load_yaml", "yaml_problem"]


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that names one key twice (a :class:`yaml.YAMLError`, so callers that
    catch YAML errors catch it; :func:`load_yaml` turns it into a ConfigError)."""

    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=again)
        self.key = key
        self.first_line = first.line + 1
        self.line = again.line + 1

    def __str__(self) -> str:
        return (
            f"line {self.line}: duplicate key {self.key!r} (first on line {self.first_line}); "
            "give each key once"
        )


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping naming one key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor`` merges, by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader says so itself below
                continue
            if first is not None:
                raise DuplicateKeyError(key, first, key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's several-line report as one line: where (line and column, from 1) and what."""
    if isinstance(exc, DuplicateKeyError):
        return str(exc)
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).replace("\n", " ")
    context = getattr(exc, "context", None)
    what = f"{problem} ({context})" if context else problem
    if mark is None:
        return what
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


def load_yaml(text: str, where: str, what: str = "is not valid YAML", detail: bool = True) -> Any:
    """The document in ``text``; a :class:`ConfigError` ``"<where> <what>: line L, column
    C: ..."`` for text that is not YAML (``detail=False``: without where and why, for text
    holding secrets: PyYAML may quote it), ``"<where>: line L: duplicate key 'k' (first on
    line F); give each key once"`` for a key given twice in one mapping."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no objects
    except DuplicateKeyError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        problem = f": {yaml_problem(exc)}" if detail else ""
        raise ConfigError(f"{where} {what}{problem}") from None
