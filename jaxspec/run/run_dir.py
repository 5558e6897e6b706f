"""The guard every training command runs on its run directory before any compute: no run is
overwritten without --resume, and no run resumes under settings that would change its training."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from jaxspec.config_io import defaults, to_dict


def flatten(tree, prefix: str = "") -> dict:
    """{"section.key": value} of a nested config dict."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


@dataclasses.dataclass(frozen=True)
class FixedKeys:
    """The config keys a resumed run must keep: every key of the named `sections`, or, with
    `all_but`, every dotted key except those (the ones that may change on resume)."""

    sections: tuple[str, ...] = ()
    all_but: frozenset[str] | None = None

    def __contains__(self, key: str) -> bool:
        if self.all_but is not None:
            return key not in self.all_but
        return key.split(".")[0] in self.sections

    def hint(self) -> str:
        """What may change instead, for the error message."""
        if self.all_but is not None:
            return f"only {sorted(self.all_but)} may change on resume"
        *rest, last = self.sections
        return f"resume with the same {', '.join(rest) + ' and ' if rest else ''}{last} settings"


def check_run_dir(run_dir: Path, resume: bool, config, fixed: FixedKeys) -> None:
    """ValueError when `run_dir` holds checkpoints and `resume` is false, or when resuming with a
    `config` (the command's dataclass config) whose value at a key in `fixed` differs from the
    run's saved config.yaml: the message names the section, the key, both values and what may
    change instead. A key the saved file lacks (added to jaxspec after the run started) counts as
    its default, so a run resumes under a newer jaxspec unless the key is set to something else."""
    checkpoints = run_dir / "checkpoints"
    if not resume and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise ValueError(f"{run_dir} already holds checkpoints; pass --resume or choose a new --run-dir")
    saved_file = run_dir / "config.yaml"
    if not (resume and saved_file.exists()):
        return
    saved = {**flatten(defaults(type(config))), **flatten(yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {})}
    current = flatten(to_dict(config))
    changed = sorted(k for k in set(saved) | set(current) if k in fixed and saved.get(k) != current.get(k))
    if changed:
        key = changed[0]
        raise ValueError(
            f"--resume: {key} is {current.get(key)!r} but the run in {run_dir} used {saved.get(key)!r} "
            f"(the {key.split('.')[0]} section differs from the run's {saved_file.name}); {fixed.hint()}"
        )
