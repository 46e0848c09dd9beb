#!/usr/bin/env python3
"""Write docs/config-reference.md from the config dataclasses in ``kvstore.config``.

    python scripts/gen_config_reference.py            # (re)write the file
    python scripts/gen_config_reference.py --check    # exit 1, with a diff, if it is stale

Every key of every section comes from the frozen dataclasses themselves: its YAML
path, type (from the field's parser, else its annotation), default, the environment
variable that sets it, and its description. A description is, in this order:

1. the ``#:`` comment right above the field in the class body;
2. the paragraphs of the docstring (of the class, else of the nearest base class that
   mentions the field) that *start* with the field's name in double backquotes
   (``name``: ..., or a run such as ``token`` / ``token_file``: ...);
3. else the paragraphs that mention ``name`` anywhere;
4. for a field that is a section of its own, the summary line of that section's class.

A field with none of these is undocumented: the script fails and names it, so a new
setting cannot ship without a description. The output depends on nothing but the code
(no environment, no clock, no host name).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

import kvstore.config as config_pkg  # noqa: E402
from kvstore.config import StoreConfig, TierConfig, tier_config_class  # noqa: E402
from kvstore.config import server as server_mod  # noqa: E402
from kvstore.config import values as _values  # noqa: E402
from kvstore.config.kinds import tier_kinds  # noqa: E402
from kvstore.config.restore import parse_tier_speeds  # noqa: E402
from kvstore.format.codecs import codec_names  # noqa: E402

OUTPUT = ROOT / "docs" / "config-reference.md"
SCRIPT = "scripts/gen_config_reference.py"
ENV_PREFIX = "KVSTORE_"

#: Dataclasses in kvstore.config that are not settings a user writes, and why.
EXCLUDED: dict[str, str] = {
    "Credential": "a token read at run time (server.token / server.tokens[] build it)",
    "ClusterTierConfig": "built by the store from the cluster: section; never listed in tiers",
    "DaemonConfig": "kvstore-server's config by role: a StoreConfig and its server: section",
}

#: Tier kinds in the order the docs list them (fastest first); unknown kinds follow, sorted.
KIND_ORDER = ("device", "host", "disk", "remote", "redis", "s3")

#: Defaults that depend on the machine, or that a value cannot say by itself.
DEFAULT_TEXT: dict[tuple[str, str], str] = {
    ("StoreConfig", "tiers"): "a `host` tier over a `disk` tier",
    ("RestoreConfig", "tier_speeds"): "`{}` (each tier's own figures)",
    ("DiskTierConfig", "path"): "`$XDG_CACHE_HOME/kvstore`, else `~/.cache/kvstore`",
    ("DiskTierConfig", "page_cache"): "`keep` (`bypass` when `o_direct: true`)",
    ("DeviceTierConfig", "capacity"): "required",
    ("S3TierConfig", "bucket"): "required",
    ("ClusterConfig", "node_id"): "the host name",
    ("EncryptionConfig", "tiers"): "`[disk, redis, s3]`",
}


def _choices() -> dict[tuple[str, str], tuple[str, ...]]:
    """Fields whose value is one of a list the code keeps."""
    from kvstore.config.tiers import PAGE_CACHE_MODES
    from kvstore.policy import policy_names

    return {
        ("TierConfig", "policy"): tuple(policy_names()),
        ("DiskTierConfig", "page_cache"): PAGE_CACHE_MODES,
        ("PrefetchConfig", "policy"): config_pkg.PREFETCH_POLICIES,
    }


_TYPE_OF_PARSER: dict[Callable[..., Any], str] = {
    _values.parse_size: "size",
    _values.parse_bool: "bool",
    _values.parse_optional_bool: "bool or null",
    _values.parse_int: "int",
    _values.parse_float: "float",
    _values.parse_optional_float: "float or null",
    _values.parse_str: "string",
    _values.parse_optional_str: "string or null",
    _values.parse_codec: "codec",
    # A tuple of tuples inside, written (and read from the environment) as a mapping.
    parse_tier_speeds: "mapping of tier id to [GB/s, ms]",
}


class Undocumented(Exception):
    """Fields that have no description."""


@dataclass(frozen=True)
class Row:
    """One key of one section."""

    owner: type[Any]  # the dataclass whose field this is
    name: str
    type: str
    default: str
    env: str
    description: str


@dataclass(frozen=True)
class Section:
    """One mapping of the YAML (a tier kind is a section of its own)."""

    path: str  # the YAML path, e.g. "server.tokens[]" ("" for the top level)
    title: str  # Markdown
    anchor: str
    intro: str
    rows: tuple[Row, ...]
    classes: tuple[type[Any], ...]  # the dataclasses whose fields the rows are


# -- descriptions ------------------------------------------------------------------------


def _docstring(cls: type[Any]) -> str:
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(cls.__name__ + "("):  # the signature dataclasses writes in
        return ""
    return inspect.cleandoc(doc)


def _paragraphs(doc: str) -> list[str]:
    """Prose paragraphs of a docstring, each joined onto one line (literal blocks dropped)."""
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = block.splitlines()
        if not lines or all(line.startswith((" ", "\t")) for line in lines):
            continue  # a literal block (an example), not prose
        out.append(" ".join(line.strip() for line in lines).replace(" ::", ":").rstrip(":") or "")
    return [p for p in out if p]


_LEAD = re.compile(r"^((?:``\w+``)(?:\s*(?:/|,|and|or)\s*``\w+``)*)")


def _leading_names(paragraph: str) -> set[str]:
    match = _LEAD.match(paragraph)
    return set(re.findall(r"``(\w+)``", match.group(1))) if match else set()


@functools.cache
def _field_comments(cls: type[Any]) -> dict[str, str]:
    """``#:`` comments right above the fields of ``cls``'s own body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                above.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            if above:
                comments[node.target.id] = " ".join(above)
    return comments


def _describe(cls: type[Any], name: str, section_cls: type[Any] | None) -> str | None:
    """The description of field ``name`` of ``cls`` (None: undocumented)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in _field_comments(klass):
            return _markdown(_field_comments(klass)[name])
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        mentioning = [p for p in _paragraphs(_docstring(klass)) if f"``{name}``" in p]
        if mentioning:
            leading = [p for p in mentioning if name in _leading_names(p)]
            return _markdown(" ".join(_drop_lead(p, name) for p in leading or mentioning))
    if section_cls is not None:
        paragraphs = _paragraphs(_docstring(section_cls))
        if paragraphs:
            return _markdown(paragraphs[0])
    return None


def _drop_lead(paragraph: str, name: str) -> str:
    """``name``: text -> Text (the key column already says the name)."""
    lead = f"``{name}``: "
    if not paragraph.startswith(lead):
        return paragraph
    rest = paragraph[len(lead) :]
    return rest[:1].upper() + rest[1:] if rest[:1].isalpha() else rest


def _markdown(text: str) -> str:
    """RST inline markup to Markdown, safe inside a table cell."""
    text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    text = re.sub(r"\bNone\b", "`null`", text)  # the reader writes YAML
    return text.replace("|", "\\|")


# -- types, defaults, environment --------------------------------------------------------


@functools.cache
def _hints(cls: type[Any]) -> dict[str, Any]:
    module = sys.modules[cls.__module__]
    return typing.get_type_hints(cls, vars(module))


def _section_class(annotation: Any) -> type[Any] | None:
    """The dataclass a field holds (a section), if it holds one."""
    return (
        annotation
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation)
        else None
    )


def _list_item_class(annotation: Any) -> type[Any] | None:
    """``X`` for a field of type ``tuple[X, ...]`` where X is a dataclass."""
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return _section_class(args[0])
    return None


def _type_text(f: dataclasses.Field[Any], annotation: Any, owner: type[Any] | None = None) -> str:
    for klass in owner.__mro__ if owner else ():
        choices = _choices().get((klass.__name__, f.name))
        if choices:
            return "one of " + ", ".join(f"`{c}`" for c in choices)
    parser = f.metadata.get("parse")
    if parser in _TYPE_OF_PARSER:
        return _TYPE_OF_PARSER[parser]
    if _section_class(annotation):
        return "mapping"
    if _list_item_class(annotation):
        return "list of mappings"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple:
        return "list of strings" if args[:1] == (str,) else "list"
    optional = origin in (typing.Union, getattr(types, "UnionType", None))
    if optional and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return (
            " or ".join(_SIMPLE.get(a, getattr(a, "__name__", str(a))) for a in inner) + " or null"
        )
    return _SIMPLE.get(annotation, getattr(annotation, "__name__", str(annotation)))


_SIMPLE = {bool: "bool", int: "int", float: "float", str: "string"}


def _size_text(n: int) -> str:
    for unit, factor in (("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    if n and n % 1024 == 0:
        return f"{n // 1024}KiB"
    return str(n)


def _value_text(value: Any, type_text: str) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if type_text == "size" and isinstance(value, int):
        return f"`{_size_text(value)}`"
    if isinstance(value, (tuple, list)) and not value:
        return "`[]`"
    if isinstance(value, str) and not value:
        return '`""`'
    return f"`{value}`"


def _default_text(cls: type[Any], f: dataclasses.Field[Any], type_text: str) -> str:
    for klass in cls.__mro__:
        if (klass.__name__, f.name) in DEFAULT_TEXT:
            return DEFAULT_TEXT[(klass.__name__, f.name)]
    if f.default is not dataclasses.MISSING:
        return _value_text(f.default, type_text)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "see below"
        return _value_text(value, type_text)
    return "required"


def _env(path: tuple[str, ...], scalar: bool) -> str:
    """``KVSTORE_<PATH>`` for a scalar reachable through the environment, else ''."""
    return f"`{ENV_PREFIX}{'_'.join(path).upper()}`" if scalar and path else ""


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", path.lower().replace(" ", "-").replace(".", "-"))


def _server_flags() -> dict[str, str]:
    """ServerConfig field -> the ``kvstore-server`` flag that overrides it."""
    from kvstore.server.cli import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    names = {f.name for f in dataclasses.fields(config_pkg.ServerConfig)}
    return {
        action.dest: action.option_strings[0]
        for action in parser._actions
        if action.dest in names and action.option_strings
    }


# -- walking the dataclasses -------------------------------------------------------------


def field_rows(
    cls: type[Any],
    fields: list[dataclasses.Field[Any]],
    env_path: tuple[str, ...] | None,
    missing: list[str],
    defaults_from: type[Any] | None = None,
) -> list[Row]:
    """The reference rows of ``cls``'s ``fields``: type, default (from ``defaults_from``
    if given), the variable that sets each under ``env_path`` (None: none does) and the
    description from the class docstring; fields it does not describe go to ``missing``
    as ``Class.field``."""
    hints = _hints(cls)
    flags = _server_flags() if cls is config_pkg.ServerConfig else {}
    rows = []
    for f in fields:
        annotation = hints[f.name]
        sub = _section_class(annotation)
        type_text = _type_text(f, annotation, cls)
        description = _describe(cls, f.name, sub)
        if description is None:
            missing.append(f"{cls.__name__}.{f.name}")
            description = ""
        elif sub is not None:
            description += f" Its keys: [`{f.name}`](#{_anchor(f.name)})."
        scalar = sub is None and _list_item_class(annotation) is None
        if (
            typing.get_origin(annotation) is tuple
            and f.metadata.get("parse") not in _TYPE_OF_PARSER
        ):
            scalar = False
        env = _env((*env_path, f.name), scalar) if env_path is not None else ""
        if f.name in flags:
            env = f"{env}, `{flags[f.name]}`" if env else f"`{flags[f.name]}`"
        default = _default_text(defaults_from or cls, f, type_text)
        rows.append(Row(cls, f.name, type_text, default, env, description))
    return rows


def _kind_default(f: dataclasses.Field[Any], kinds: list[str]) -> str:
    """A common tier field's default: one value, or one per kind where they differ."""
    texts = {}
    for kind in kinds:
        cls = tier_config_class(kind)
        g = next(g for g in dataclasses.fields(cls) if g.name == f.name)
        texts[kind] = _default_text(cls, g, _type_text(g, _hints(cls)[g.name], cls))
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"{kind} {text}" for kind, text in texts.items())


def _ordered_kinds() -> list[str]:
    known = tier_kinds()
    first = [k for k in KIND_ORDER if k in known]
    return first + sorted(k for k in known if k not in first)


def sections() -> tuple[list[Section], list[str]]:
    """Every section of the config, and the fields left undocumented."""
    missing: list[str] = []
    out: list[Section] = []
    store_fields = dataclasses.fields(StoreConfig)
    hints = _hints(StoreConfig)
    top = []
    for row in field_rows(StoreConfig, list(store_fields), (), missing):
        if row.name == "tiers":
            row = dataclasses.replace(row, type="list of tiers", env=f"`{ENV_PREFIX}TIERS`")
        top.append(row)
    out.append(
        Section(
            "",
            "Top level",
            "top-level",
            "The keys of a config file (or dict). `KVSTORE_CONFIG=/path/store.yaml` names the "
            "file that `KVStore(layout)` and the `kvstore` commands read when given no config.",
            tuple(top),
            (StoreConfig,),
        )
    )

    kinds = _ordered_kinds()
    common = [f for f in dataclasses.fields(TierConfig)]
    common_rows = []
    for row, f in zip(field_rows(TierConfig, common, ("<kind>",), missing), common, strict=True):
        common_rows.append(dataclasses.replace(row, default=_kind_default(f, kinds)))
    kind_row = Row(
        TierConfig,
        "kind",
        "string",
        "required",
        "",
        "The medium: " + ", ".join(f"`{k}`" for k in kinds) + ". Each kind's own keys follow.",
    )
    out.append(
        Section(
            "tiers[]",
            "`tiers[]`: keys of every kind",
            "tiers",
            "`tiers` is a list, fastest first; eviction demotes blocks down the list. "
            f"`{ENV_PREFIX}<KIND>_<KEY>` sets a key of the *first* tier of that kind "
            f"(`{ENV_PREFIX}HOST_CAPACITY=16GiB`); `{ENV_PREFIX}TIERS` (YAML or JSON) "
            "replaces the whole list.",
            (kind_row, *common_rows),
            (TierConfig,),
        )
    )
    common_names = {f.name for f in common}
    for kind in kinds:
        cls = tier_config_class(kind)
        doc = _docstring(cls)
        own = [
            f
            for f in dataclasses.fields(cls)
            if f.name not in common_names or f"``{f.name}``" in doc  # said more about here
        ]
        summary = _markdown(_paragraphs(doc)[0]) if _paragraphs(doc) else ""
        out.append(
            Section(
                f"tiers[] (kind: {kind})",
                f"`tiers[]` with `kind: {kind}`",
                f"tiers-{kind}",
                summary,
                tuple(field_rows(cls, own, (kind,), missing)),
                (cls,),
            )
        )

    for f in store_fields:
        sub = _section_class(hints[f.name])
        if sub is None:
            continue
        out.extend(_section(sub, (f.name,), missing))
    return out, missing


def _section(cls: type[Any], path: tuple[str, ...], missing: list[str]) -> Iterator[Section]:
    """A section for dataclass ``cls`` at YAML ``path``, then its nested sections."""
    title = ".".join(path)
    doc = _paragraphs(_docstring(cls))
    intro = _markdown(doc[0]) if doc else ""
    in_env = not any(p.endswith("[]") for p in path)
    fields = list(dataclasses.fields(cls))
    yield Section(
        title,
        f"`{title}`",
        _anchor(title),
        intro,
        tuple(field_rows(cls, fields, path if in_env else None, missing)),
        (cls,),
    )
    hints = _hints(cls)
    for f in fields:
        item = _list_item_class(hints[f.name])
        sub = _section_class(hints[f.name])
        if item is not None:
            yield from _section(item, (*path[:-1], f"{path[-1]}.{f.name}[]"), missing)
        elif sub is not None:
            yield from _section(sub, (*path, f.name), missing)


def documented_classes(secs: list[Section]) -> set[type[Any]]:
    """The dataclasses the reference covers (for the test)."""
    return {cls for s in secs for cls in s.classes} | {tier_config_class(k) for k in tier_kinds()}


def config_dataclasses() -> dict[str, type[Any]]:
    """Every dataclass defined in the kvstore.config package, by name."""
    import kvstore.config.cluster
    import kvstore.config.events
    import kvstore.config.tiers

    found: dict[str, type[Any]] = {}
    modules = (
        config_pkg,
        kvstore.config.tiers,
        server_mod,
        kvstore.config.cluster,
        kvstore.config.events,
    )
    for module in modules:
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and dataclasses.is_dataclass(obj)
                and obj.__module__.startswith("kvstore.config")
            ):
                found[obj.__name__] = obj
    return found


# -- rendering ---------------------------------------------------------------------------

HEADER = f"""\
# Configuration reference

<!-- Generated by {SCRIPT} from the dataclasses in kvstore/config/ and their docstrings.
     Do not edit by hand: change the docstrings, then run
     `python {SCRIPT}`. tests/config/test_reference_doc.py fails when this file is stale. -->

Every key kvstore reads, generated from the frozen dataclasses in `kvstore/config/`
(`StoreConfig` and the classes it holds). For a guided tour see
[configuration.md](configuration.md); for the server's and the cluster's keys in context,
[server.md](server.md) and [cluster.md](cluster.md); for KV events, [events.md](events.md).

**Where a config comes from.** `KVStore(layout, config)` takes a `StoreConfig`, a dict or a
YAML path; with none, the file named by `KVSTORE_CONFIG`, else the embedded default (a 4 GiB
host tier over a 32 GiB disk tier). Environment variables then override single keys of a
file or the default (the *environment* column; values are read as in YAML: `16GiB`, `true`,
`0.5`); over an explicit dict they only fill keys it leaves unset, and each variable whose
key the dict gives is left out with a warning naming it. Any other
`KVSTORE_*` variable is an error, as is an unknown key or an impossible value: a
`ConfigError` naming the key (`tiers[1].capacity`). `kvstore config [--config FILE]` prints
the resolved configuration with secrets hidden. For `kvstore-server`, a command-line flag
(listed with the environment variable) overrides both.

**Values.** *size*: bytes as an int or a string — `512MiB`, `2GiB`, `1.5GB`
(`KiB`/`MiB`/`GiB`/`TiB` are powers of 1024, `KB`/`MB`/`GB`/`TB` of 1000, `k`/`m`/`g`/`t`
alone mean KiB/MiB/GiB/TiB). *bool*: `true`/`false` (also `yes`/`no`, `on`, `1`/`0`).
*codec*: {", ".join(f"`{c}`" for c in codec_names())}. *null*: YAML `null` (left out means
the default). Times are in seconds.
"""


def render() -> str:
    """The whole reference, as Markdown (raises Undocumented when a field lacks docs)."""
    secs, missing = sections()
    if missing:
        raise Undocumented(", ".join(sorted(set(missing))))
    parts = [HEADER, "## Sections\n"]
    parts += [f"- [{s.title}](#{s.anchor})" for s in secs]
    parts.append("")
    for s in secs:
        parts.append(f'<a id="{s.anchor}"></a>\n\n## {s.title}\n')
        if s.intro:
            parts.append(s.intro + "\n")
        parts.append("| key | type | default | environment | description |")
        parts.append("|---|---|---|---|---|")
        for r in s.rows:
            env = r.env or "—"
            parts.append(
                f'| <a id="{s.anchor}-{_anchor(r.name)}"></a>`{r.name}` | {r.type} '
                f"| {r.default} | {env} | {r.description} |"
            )
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT}")
    args = parser.parse_args(argv)
    try:
        text = render()
    except Undocumented as exc:
        print(
            f"{SCRIPT}: undocumented config fields: {exc}\n"
            "Describe each in its dataclass's docstring (a paragraph starting with ``name``)"
            " or in a #: comment above the field.",
            file=sys.stderr,
        )
        return 2
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                text.splitlines(keepends=True),
                f"{args.output.name} (committed)",
                f"{args.output.name} (generated)",
            )
        )
        print(f"\n{args.output} is stale: run python {SCRIPT}", file=sys.stderr)
        return 1
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
