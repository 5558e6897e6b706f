"""Strict YAML -> nested frozen dataclass loading, shared by every command.

    cfg = load_config(PretrainConfig, "configs/pretrain_tiny.yaml", overrides=["train.steps=100"])

Rules: every key in the file must be a field of the dataclass (unknown keys are errors, with the
dotted key and the file named); values must match the field's annotation (int, float (an int is
accepted), bool, str, None, Optional/Union, Literal, tuple[X, ...], tuple[X, Y], list[X],
dict[str, X], nested dataclasses; a float field also takes "1e-3", which PyYAML reads as a
string); fields without a default must be given. Overrides are
"dotted.key=value" strings whose value is parsed with `yaml.safe_load` ("3" -> 3, "[1, 2]" ->
list, "null" -> None) and applied before validation; an error in a value an override set names
the override ("command-line override 'train.steps=abc': key 'train.steps': expected int ..."),
any other names the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
# PyYAML reads "1e-3" (no dot) as a string; float fields accept that spelling.
_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def load_config(cls: type[T], path, overrides: Sequence[str] = ()) -> T:
    """Reads YAML file `path` into dataclass `cls`, after applying `overrides`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    for override in overrides:
        apply_override(data, override)
    return from_dict(cls, data, source=_Source(str(path), _overridden(overrides)))


def _overridden(overrides: Sequence[str]) -> dict[str, str]:
    """{dotted key: the override that set it last}; an override of a mapping hides earlier ones of
    the keys inside it."""
    overridden: dict[str, str] = {}
    for override in overrides:
        key = override.partition("=")[0].strip()
        overridden = {k: v for k, v in overridden.items() if not k.startswith((f"{key}.", f"{key}["))}
        overridden[key] = override
    return overridden


@contextlib.contextmanager
def naming_overrides(path, overrides: Sequence[str]) -> Iterator[None]:
    """Around a config's range checks (`validate(cfg, path)`, whose errors read "PATH: key: ..."):
    re-raises an error about a key an override set as "command-line override 'key=value': key: ..."."""
    try:
        yield
    except ValueError as err:
        prefix, message = f"{path}: ", str(err)
        if message.startswith(prefix):
            key = message[len(prefix) :].split(":", 1)[0]
            where = _Source(str(path), _overridden(overrides)).of(key)
            if where != str(path):
                raise ValueError(f"{where}: {message[len(prefix) :]}") from None
        raise


def apply_override(data: dict, override: str) -> None:
    """Sets data[a][b] = yaml value for "a.b=value" (intermediate mappings are created)."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form dotted.key=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"override {override!r}: invalid YAML value: {e}") from None
    set_dotted(data, key, value, f"override {override!r}")


def set_dotted(data: dict, key: str, value: Any, source: str = "override") -> None:
    """Sets data[a][b] = value for key "a.b" (intermediate mappings are created); `source` names
    the override in errors."""
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"{source}: {'.'.join(parts[: i + 1])} is not a mapping")
        node = child
    node[parts[-1]] = value


class _Source:
    """Where config values come from: a file, and command-line overrides by dotted key."""

    def __init__(self, file: str, overrides: dict[str, str] | None = None):
        self.file, self.overrides = file, overrides or {}

    def of(self, key: str) -> str:
        """The override that set `key` (or a mapping or list above it), else the file."""
        while key:
            if key in self.overrides:
                return f"command-line override {self.overrides[key]!r}"
            parent = re.sub(r"(\[\d+\]|\.?[^.\[]*)$", "", key, count=1)
            if parent == key:
                break
            key = parent
        return self.file


def from_dict(cls: type[T], data: Any, source: str | _Source = "<dict>", prefix: str = "") -> T:
    """Builds dataclass `cls` from nested mappings, checking keys and types (see module doc).
    source: the file name errors start with."""
    source = source if isinstance(source, _Source) else _Source(source)
    where = f"key {prefix[:-1]!r}" if prefix else "top level"
    if not isinstance(data, dict):
        raise ValueError(
            f"{source.of(prefix[:-1])}: {where}: expected a mapping for {cls.__name__}, got {_type_name(data)}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(
            f"{source.of(prefix + str(unknown[0]))}: unknown key {prefix + str(unknown[0])!r}; "
            f"valid keys{' under ' + prefix[:-1] if prefix else ''}: {sorted(fields)}"
        )
    kwargs = {}
    for name, field in fields.items():
        key = prefix + name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], source, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{source.file}: missing required key {key!r}")
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Plain YAML-safe data (dicts, lists, scalars) of a dataclass config; tuples become lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj


def defaults(cls: type) -> dict:
    """The defaults of dataclass config `cls` as plain nested data (`to_dict`'s form); required
    keys (no default) are absent, a required section holds its own keys' defaults."""
    hints, out = typing.get_type_hints(cls), {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            out[field.name] = to_dict(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = to_dict(field.default_factory())
        elif dataclasses.is_dataclass(hints[field.name]):
            out[field.name] = defaults(hints[field.name])
    return out


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is None:
        return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))
    return str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, source: _Source, key: str) -> Any:
    def fail() -> typing.NoReturn:
        raise ValueError(
            f"{source.of(key)}: key {key!r}: expected {_describe(tp)}, got {_type_name(value)} ({value!r})"
        )

    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source, key)
            except ValueError:
                continue
        fail()
    if origin is typing.Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ValueError(f"{source.of(key)}: key {key!r}: expected one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, key + ".")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            fail()
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ValueError(
                    f"{source.of(key)}: key {key!r}: expected {len(args)} items ({_describe(tp)}), got {len(value)}"
                )
            items = [_convert(a, v, source, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_type = args[0] if args else Any
            items = [_convert(item_type, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            fail()
        key_type, value_type = args if args else (Any, Any)
        return {
            _convert(key_type, k, source, f"{key}.{k}"): _convert(value_type, v, source, f"{key}.{k}")
            for k, v in value.items()
        }
    if tp is type(None):
        if value is not None:
            fail()
        return None
    if tp is bool:
        if not isinstance(value, bool):
            fail()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail()
        return value
    if tp in (Path, os.PathLike):
        if not isinstance(value, str):
            fail()
        return Path(value)
    raise TypeError(f"{source.of(key)}: key {key!r}: config_io does not support annotation {tp!r}")


def load_validated(cls, validate: Callable, args) -> object:
    """The config of a training command's parsed `args` (`run_parser`): `cls` from --config with the
    overrides applied, checked by `validate(cfg, path)` with errors naming the override that set a
    key (`naming_overrides`)."""
    cfg = load_config(cls, args.config, args.overrides)
    with naming_overrides(args.config, args.overrides):
        validate(cfg, args.config)
    return cfg


def run_command(prog: str, prepare: Callable[[], object], run: Callable[[object], dict]) -> int:
    """A training command's exit status: prepare() loads and checks everything before any compute
    (a foreseen error prints one line `prog: error: ...` and returns the status of its kind,
    `jaxspec.exits`); run(its result) trains and returns the run's summary, whose "preempted"
    (stopped by SIGTERM, Ctrl-C or the job's time limit after checkpointing) returns
    EXIT_CHECKPOINTED, else 0. The run's own errors reach `jaxspec.cli.main`, which maps them alike."""
    from jaxspec.exits import EXIT_CHECKPOINTED, EXIT_ERROR, exit_status

    try:
        prepared = prepare()
    except Exception as err:
        status, message = exit_status(err)
        if status == EXIT_ERROR:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        return status
    return EXIT_CHECKPOINTED if run(prepared)["preempted"] else 0


def run_parser(prog: str, description: str, example_config: str, run_dir_holds: str):
    """The argument parser every training command shares: `--config PATH --run-dir DIR [--resume]
    [dotted.key=value ...]`. example_config: a shipped config to point at; run_dir_holds: what the
    run directory receives (for the help text)."""
    import argparse

    from jaxspec.exits import EPILOG

    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=EPILOG)
    parser.add_argument("--config", required=True, help=f"YAML config (see {example_config})")
    parser.add_argument("--run-dir", required=True, help=f"directory for {run_dir_holds}")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the run's newest checkpoint that restores (damaged newer ones are "
        "moved aside); without a checkpoint, say so and start a new run",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=100")
    return parser


def requirement(source: str) -> Callable[[bool, str, str], None]:
    """need(ok, key, msg) for a config's range checks: ValueError "<source>: <key>: <msg>" unless
    ok (every command's `validate` names the file or override and the dotted key)."""

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ValueError(f"{source}: {key}: {msg}")

    return need
