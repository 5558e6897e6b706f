import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from jaxspec.config_io import apply_override, from_dict, load_config, naming_overrides, to_dict


@dataclasses.dataclass(frozen=True)
class Inner:
    size: int
    rate: float = 0.5
    name: str | None = None


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    levels: tuple[int, ...] = (1, 2)
    pair: tuple[str, int] = ("a", 1)
    tags: list[str] = dataclasses.field(default_factory=list)
    mode: Literal["fast", "slow"] = "fast"
    flag: bool = False
    either: int | str = 0
    maybe: Inner | None = None
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    out: Path | None = None


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_full_load_with_nested_and_container_types(tmp_path):
    path = _write(
        tmp_path,
        """
inner: {size: 3, rate: 1e-3, name: x}
levels: [3, 4]
pair: [b, 2]
tags: [p, q]
mode: slow
flag: true
either: word
maybe: {size: 9}
weights: {a: 1, b: 2.5}
out: runs/x
""",
    )
    cfg = load_config(Outer, path)
    assert cfg == Outer(
        inner=Inner(3, 0.001, "x"),
        levels=(3, 4),
        pair=("b", 2),
        tags=["p", "q"],
        mode="slow",
        flag=True,
        either="word",
        maybe=Inner(9),
        weights={"a": 1.0, "b": 2.5},
        out=Path("runs/x"),
    )
    assert isinstance(cfg.inner.rate, float) and isinstance(cfg.weights["a"], float)
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_overrides(tmp_path):
    path = _write(tmp_path, "inner: {size: 3}\n")
    cfg = load_config(
        Outer, path, ["inner.size=7", "levels=[5]", "inner.name=null", "maybe.size=2", "mode=slow", "inner.rate=2"]
    )
    assert cfg.inner == Inner(7, 2.0, None)
    assert cfg.levels == (5,) and cfg.maybe == Inner(2) and cfg.mode == "slow"
    with pytest.raises(ValueError, match=r"^command-line override 'inner\.sise=4': unknown key 'inner\.sise'"):
        load_config(Outer, path, ["inner.sise=4"])
    with pytest.raises(ValueError, match="dotted.key=value"):
        load_config(Outer, path, ["inner.size"])
    with pytest.raises(ValueError, match="inner.size is not a mapping"):
        apply_override({"inner": {"size": 3}}, "inner.size.x=1")


@pytest.mark.parametrize(
    "override, message",
    [
        ("inner.size=abc", "command-line override 'inner.size=abc': key 'inner.size': expected int, got str ('abc')"),
        ("levels=[1, x]", "command-line override 'levels=[1, x]': key 'levels[1]': expected int, got str"),
        (
            "inner={size: 3, rate: fast}",
            "command-line override 'inner={size: 3, rate: fast}': key 'inner.rate': expected float",
        ),
        ("mode=medium", "command-line override 'mode=medium': key 'mode': expected one of ['fast', 'slow']"),
        ("inner=5", "command-line override 'inner=5': key 'inner': expected a mapping for Inner, got int"),
        ("weights.a=x", "command-line override 'weights.a=x': key 'weights.a': expected float"),
    ],
)
def test_override_errors_name_the_override_not_the_file(tmp_path, override, message):
    path = _write(tmp_path, "inner: {size: 3}\nweights: {b: 1.0}\n")
    with pytest.raises(ValueError) as err:
        load_config(Outer, path, ["inner.rate=2", override])
    assert str(err.value).startswith(message) and "c.yaml" not in str(err.value)


def test_range_check_errors_name_the_override_that_set_the_key():
    overrides = ["inner.size=0", "mode=slow"]
    with pytest.raises(ValueError, match=r"^command-line override 'inner\.size=0': inner\.size: must be > 0$"):
        with naming_overrides("c.yaml", overrides):
            raise ValueError("c.yaml: inner.size: must be > 0")
    with pytest.raises(ValueError, match=r"^c\.yaml: inner\.rate: must be > 0$"):
        with naming_overrides("c.yaml", overrides):
            raise ValueError("c.yaml: inner.rate: must be > 0")


def test_file_errors_next_to_overrides_name_the_file(tmp_path):
    path = _write(tmp_path, "inner: {size: 3, rate: fast}\n")
    with pytest.raises(ValueError, match=r"c\.yaml: key 'inner\.rate': expected float"):
        load_config(Outer, path, ["inner.size=4", "levels=[1]"])


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "inner: {size: 3, colour: red}",
            r"c\.yaml: unknown key 'inner\.colour'; valid keys under inner: "
            r"\['name', 'rate', 'size'\]",
        ),
        ("inner: {size: 3}\nextra: 1", r"unknown key 'extra'"),
        ("inner: {size: three}", r"key 'inner\.size': expected int, got str \('three'\)"),
        ("inner: {size: 3.5}", r"key 'inner\.size': expected int, got float"),
        ("inner: {size: true}", r"key 'inner\.size': expected int, got bool"),
        ("inner: {size: 3}\nflag: 1", r"key 'flag': expected bool, got int"),
        ("inner: {size: 3, rate: fast}", r"key 'inner\.rate': expected float, got str"),
        ("inner: {size: 3}\nlevels: [1, x]", r"key 'levels\[1\]': expected int, got str"),
        ("inner: {size: 3}\nlevels: 3", r"key 'levels': expected tuple\[int, \.\.\.\], got int"),
        ("inner: {size: 3}\npair: [a]", r"key 'pair': expected 2 items"),
        ("inner: {size: 3}\nmode: medium", r"key 'mode': expected one of \['fast', 'slow'\], got 'medium'"),
        (
            "inner: {size: 3}\neither: [1]",
            r"key 'either': expected Union\[int, str\]|key 'either': expected int \| str",
        ),
        ("inner: 5", r"key 'inner': expected a mapping for Inner, got int"),
        ("inner: {rate: 1.0}", r"missing required key 'inner\.size'"),
        ("levels: [1]", r"missing required key 'inner'"),
        ("- 1\n- 2", r"top level must be a mapping"),
        ("inner: {size: [}", r"invalid YAML"),
    ],
)
def test_errors_name_key_file_and_types(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_config(Outer, _write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.yaml"):
        load_config(Outer, tmp_path / "absent.yaml")
