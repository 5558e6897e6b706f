"""Griffe extension for the API reference (mkdocs.yml, mkdocstrings' `extensions`).

jaxspec's docstrings document parameters, fields and members as lines "name: text" (or
"a / b: text"); Markdown would run those lines together into one paragraph, so each such line
that names a parameter or member of the object starts a paragraph of its own. "<" outside code
spans becomes an entity, so that "<run-dir>" is shown rather than taken for an HTML tag.
"""

from __future__ import annotations

import re

import griffe

_NAMES = re.compile(r"^(?P<names>\w+(?: ?/ ?\w+)*)(?: \([^)]*\))?: ")


def paragraphs(text: str, names: set[str]) -> str:
    """`text` with a blank line before every unindented line that starts with one of `names`
    (several joined by " / ") and a colon, outside fenced code."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else _NAMES.match(line)
        if match and set(re.split(r" ?/ ?", match["names"])) <= names and out and out[-1].strip():
            out.append("")
        out.append(line if fenced else _escape_angle(line))
    return "\n".join(out)


def _escape_angle(line: str) -> str:
    parts = re.split(r"(`[^`]*`)", line)
    return "".join(p if p.startswith("`") and len(p) > 1 else p.replace("<", "&lt;") for p in parts)


class FieldParagraphs(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None or obj.is_alias:
            return
        names = set(obj.members)
        parameters = getattr(obj, "parameters", None)
        if parameters is not None:
            names |= {p.name for p in parameters}
        obj.docstring.value = paragraphs(obj.docstring.value, names)
