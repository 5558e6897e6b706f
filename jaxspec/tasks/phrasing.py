"""Texts with choice points: a small phrase grammar, drawn with one knob of variation.

An expression is a `str` (literal text), a `Seq` (its parts one after another) or an `Alt` (a
choice point between equivalent phrasings; its first option is the canonical one). Drawing an
`Alt` of m options with variation v in [0, 1] takes the canonical option with probability 1 - v
and otherwise one of the m options uniformly (the canonical one included):

    P(option 0) = 1 - v + v / m,    P(option j) = v / m  (j > 0).

v = 0 writes the canonical text (no uncertainty); v = 1 draws every choice uniformly. Only
`random.Random` calls drive the draws, so a seed gives the same text on every platform.

A `Writer` writes a text one top-level expression (a *segment*) at a time. With `record=True`
it also keeps each segment's distribution: every text the segment could have been, with its
probability, and the text drawn (`jaxspec.tasks.workload` turns these into token-level entropy
and the acceptance of an ideal drafter). Without it only the drawn text is rendered, which is
what generating a large corpus needs.
"""

from __future__ import annotations

import dataclasses
import functools
import random


@dataclasses.dataclass(frozen=True)
class Alt:
    """A choice point: options[0] is the canonical phrasing."""

    options: tuple[Expr, ...]


@dataclasses.dataclass(frozen=True)
class Seq:
    parts: tuple[Expr, ...]


Expr = str | Alt | Seq


def alt(*options: Expr) -> Expr:
    """A choice between `options` (the first canonical); one option is just that option."""
    if not options:
        raise ValueError("a choice needs at least one option")
    return options[0] if len(options) == 1 else Alt(tuple(options))


def seq(*parts: Expr) -> Expr:
    return parts[0] if len(parts) == 1 else Seq(tuple(parts))


def option_probs(m: int, variation: float) -> tuple[float, ...]:
    """Probabilities of the m options of an `Alt` under `variation` (see the module docstring)."""
    other = variation / m
    return (1.0 - variation + other,) + (other,) * (m - 1)


def draw(expr: Expr, rng: random.Random, variation: float) -> str:
    """One text of `expr`, choices drawn from `rng`."""
    if isinstance(expr, str):
        return expr
    if isinstance(expr, Seq):
        return "".join(draw(part, rng, variation) for part in expr.parts)
    index = rng.randrange(len(expr.options)) if rng.random() < variation else 0
    return draw(expr.options[index], rng, variation)


@functools.lru_cache(maxsize=4096)
def distribution(expr: Expr, variation: float) -> tuple[tuple[str, float], ...]:
    """Every text of `expr` with its probability (one entry per path through the choices; two
    paths may give the same text)."""
    if isinstance(expr, str):
        return ((expr, 1.0),)
    if isinstance(expr, Seq):
        texts: tuple[tuple[str, float], ...] = (("", 1.0),)
        for part in expr.parts:
            texts = tuple((a + b, p * q) for a, p in texts for b, q in distribution(part, variation))
        return texts
    probs = option_probs(len(expr.options), variation)
    return tuple((text, p * q) for option, p in zip(expr.options, probs) for text, q in distribution(option, variation))


@dataclasses.dataclass(frozen=True)
class Segment:
    """One written segment: the texts it could have been with their probabilities (summing to 1),
    and the text that was drawn."""

    texts: tuple[str, ...]
    probs: tuple[float, ...]
    drawn: str


class Writer:
    """Accumulates a text segment by segment (see the module docstring)."""

    def __init__(self, rng: random.Random, variation: float, record: bool = False):
        if not 0.0 <= variation <= 1.0:
            raise ValueError(f"variation must be in [0, 1], got {variation}")
        self.rng, self.variation = rng, variation
        self.parts: list[str] = []
        self.segments: list[Segment] | None = [] if record else None

    def write(self, expr: Expr) -> str:
        """Draws one text of `expr`, appends it and returns it."""
        text = draw(expr, self.rng, self.variation)
        self.parts.append(text)
        if self.segments is not None:
            texts, probs = zip(*distribution(expr, self.variation))
            self.segments.append(Segment(texts, probs, text))
        return text

    @property
    def text(self) -> str:
        return "".join(self.parts)
