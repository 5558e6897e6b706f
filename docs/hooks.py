"""mkdocs hooks (mkdocs.yml `hooks:`): the configuration reference, generated from the config
dataclasses at build time, and the figures of the pages that include files from outside docs/.

A page line `<!-- config-reference jaxspec.rl.config:GRPOConfig -->` becomes that class's reference
(`config_reference.render`); a class with an undocumented field fails the build naming the field.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import config_reference
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"^<!-- config-reference (?P<module>[\w.]+):(?P<name>\w+) -->$", re.M)
# Files that pages include (pymdownx.snippets) whose relative links point outside docs/.
INCLUDED = ("BENCHMARKS.md",)
_LINK = re.compile(r"\]\((?P<target>[^)#\s]+)\)")


def on_config(config):
    if str(ROOT) not in sys.path:  # the reference describes this checkout's code
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files, config):
    """Adds the repository files that the included files link to (their figures) at the same
    relative paths, so that those links resolve in the site."""
    for included in INCLUDED:
        for target in _LINK.findall((ROOT / included).read_text(encoding="utf-8")):
            path = ROOT / target
            if "://" not in target and path.is_file() and files.get_file_from_path(target) is None:
                files.append(File.generated(config, target, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    def expand(match: re.Match) -> str:
        try:
            cls = getattr(importlib.import_module(match["module"]), match["name"])
            return config_reference.render(cls)
        except (ImportError, AttributeError, config_reference.UndocumentedFields) as err:
            raise PluginError(f"{page.file.src_uri}: {match[0]}: {err}") from None

    return PLACEHOLDER.sub(expand, markdown)
