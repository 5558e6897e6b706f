"""The configuration reference: Markdown tables of a config dataclass's keys, read from the code.

A config class documents its fields in its docstring, each in a sentence or paragraph that starts
with the field's name (or several names joined by " / ") and a colon, e.g.

    max_staleness (async): how many updates older than the trained policy ...
    eps_low / eps_high: ratio clip range [1 - eps_low, 1 + eps_high] ...

at the start of a line or after a sentence's full stop. A field's text runs to the next field's
name, a blank line, or (when its continuation lines are indented) the first line back at its own
indentation; whatever no field claims is the class's description. An inherited field takes its
text from the nearest class that documents it. A field whose type is a config dataclass is a
section of its own (its class's docstring describes it). `render` refuses a class with a field
that nothing documents (`UndocumentedFields`), so a new key cannot reach a run's YAML file
without reaching the reference.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import types
import typing

# The HTML class around each table (md_in_html), for the site's stylesheet.
TABLE_CLASS = "config-keys"


class UndocumentedFields(ValueError):
    """Config fields that no docstring documents; the message names each one's class and file."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of the reference: a dotted YAML key with its annotation, default and text."""

    key: str
    type: str
    default: str
    doc: str


@dataclasses.dataclass(frozen=True)
class Section:
    """A config dataclass at a dotted key ("" for the file's top level): its description, its
    keys, and the sections it holds."""

    key: str
    cls: type
    doc: str
    keys: list[Key]
    sections: list[Section]


def parse_docstring(doc: str | None, names: typing.Iterable[str]) -> tuple[str, dict[str, str]]:
    """(the description, {field name: text}) of a class docstring whose fields are `names`; texts
    are joined into single lines."""
    names = sorted(names, key=len, reverse=True)
    lines = inspect.cleandoc(doc or "").splitlines()
    if not names:
        return " ".join(" ".join(lines).split()), {}
    name = "|".join(map(re.escape, names))
    marker = re.compile(
        rf"(?:^|(?<=\. )(?<!e\.g\. )(?<!i\.e\. ))(?P<names>(?:{name})(?: ?/ ?(?:{name}))*)"
        rf"(?: \([^)]*\))?: "
    )
    chunks: dict[str | None, list[str]] = {None: []}
    owner: tuple[str, ...] | None = None  # the names whose text the current line continues
    owner_indent, indented = 0, False

    def add(text: str) -> None:
        chunks.setdefault(owner, []).append(text)

    for line in lines:
        indent, text = len(line) - len(line.lstrip()), line.strip()
        if not text:
            owner = None
            continue
        if owner is not None and indent == owner_indent and indented and not marker.match(text):
            owner = None  # back at the marker's indentation after indented continuation lines
        elif owner is not None and indent > owner_indent:
            indented = True
        start = 0
        for match in marker.finditer(text):
            add(text[start : match.start()])
            owner, owner_indent, indented = tuple(re.split(r" ?/ ?", match["names"])), indent, False
            start = match.end()
        add(text[start:])
    docs = {}
    for names_, parts in chunks.items():
        text = " ".join(" ".join(parts).split())
        for field in names_ or ():
            docs[field] = f"{docs[field]} {text}" if field in docs else text
    return " ".join(" ".join(chunks[None]).split()), docs


def field_docs(cls: type) -> dict[str, str]:
    """{field name: text} for every field of dataclass `cls` that it or a base class documents."""
    docs: dict[str, str] = {}
    for klass in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        own = [f.name for f in dataclasses.fields(klass)]
        docs.update(parse_docstring(klass.__dict__.get("__doc__"), own)[1])
    return docs


def description(cls: type) -> str:
    """The part of `cls`'s own docstring that documents no field."""
    return parse_docstring(cls.__dict__.get("__doc__"), [f.name for f in dataclasses.fields(cls)])[0]


def section(cls: type, key: str = "") -> Section:
    """The reference of dataclass `cls` at dotted `key`; UndocumentedFields names every field below
    it that no docstring documents."""
    missing: list[str] = []
    built = _section(cls, key, "", missing)
    if missing:
        raise UndocumentedFields(
            "config fields without documentation (document each in its class's docstring as "
            "'name: text'): " + ", ".join(missing)
        )
    return built


def _section(cls: type, key: str, doc: str, missing: list[str]) -> Section:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    keys, sections = [], []
    for f in dataclasses.fields(cls):
        dotted = f"{key}.{f.name}" if key else f.name
        text = docs.get(f.name, "")
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append(_section(hints[f.name], dotted, text, missing))
            continue
        if not text:
            missing.append(f"{cls.__qualname__}.{f.name} ({_source(cls)})")
        keys.append(Key(dotted, yaml_type(hints[f.name]), _default(f), text))
    own = description(cls)
    if not (doc or own or keys):
        missing.append(f"{cls.__qualname__} ({_source(cls)})")
    return Section(key, cls, " ".join(filter(None, (doc, own))), keys, sections)


def render(cls: type, level: int = 2) -> str:
    """Markdown reference of config dataclass `cls`: its top-level keys, then one heading of depth
    `level` per section with a table of its keys (key, type, default, text)."""
    return "\n".join(_render(section(cls), level)) + "\n"


def _render(sec: Section, level: int) -> typing.Iterator[str]:
    if sec.key:
        yield f"{'#' * level} `{sec.key}`\n"
        level += 1
    where = f"`{sec.cls.__module__}.{sec.cls.__qualname__}`"
    yield f"{_escape(sec.doc)} ({where})\n" if sec.doc else f"{where}\n"
    if sec.keys:
        yield f'<div class="{TABLE_CLASS}" markdown>\n'
        yield "| key | type | default | description |"
        yield "|---|---|---|---|"
        for k in sec.keys:
            # a pipe inside a code span does not split the table's cell
            yield f"| `{k.key}` | `{k.type}` | `{k.default}` | {_escape(k.doc)} |"
        yield "\n</div>\n"
    for sub in sec.sections:
        yield from _render(sub, level)


def yaml_type(tp) -> str:
    """A field's type as its YAML value is written: `int`, `"float32" | "bfloat16"`, `list[int]`,
    `[int, int]`, `str | null`, a dataclass's name."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(yaml_type(a) for a in args)
    if origin in (tuple, list):
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return f"list[{yaml_type(args[0])}]"
        return "[" + ", ".join(yaml_type(a) for a in args) + "]"
    if origin is dict:
        return f"mapping[{yaml_type(args[0])}, {yaml_type(args[1])}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return json.dumps(value)  # YAML's flow syntax (tuples become lists)


def _source(cls: type) -> str:
    return cls.__module__.replace(".", "/") + ".py"


_SPECIAL = re.compile(r"([\\*_\[\]|])")


def _escape(text: str) -> str:
    """Prose for a table cell: Markdown's special characters escaped outside `code` spans, and "<"
    as an HTML entity (Markdown would take "<run-dir>" for a tag)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(
        p if p.startswith("`") and len(p) > 1 else _SPECIAL.sub(r"\\\1", p).replace("<", "&lt;") for p in parts
    )
