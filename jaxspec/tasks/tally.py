"""The `tally` problem kind: long, heavy-tailed worked solutions with controlled uncertainty.

A quantity starts at some value and changes every day by a fixed amount, plus a second amount
every p days (and, in half the problems, a third every q days); the question asks for its value
after N days. The worked solution writes one line per day, then the boxed answer (variation 0.7):

    A bank balance starts at 291 dollars. Each day it goes up by 11 dollars. Every 2 days it also
    goes down by 24 dollars. What is the balance after 6 days?

    At first it is 291.
    Day 1: we add 11, so we get 291 + 11 makes 302. Good.
    Day 2, we get 11 and minus 24 dollars, that makes 302 - 24 = 278, then 278 + 11 = 289. That looks right.
    Day 3; today we add 11, leaving 300.
    ...
    At day 6: add 11; minus 24, leaving 298 + 11 - 24 = 285.
    After 6 days it is \\boxed{285}.

N is drawn from a heavy-tailed law (`StepLaw`, lognormal or Pareto, truncated), so responses run
from ~100 to ~20k tokens of the task tokenizer (a line is ~20-40 tokens). Every line can be
written in many equivalent ways (openers, verbs, connectors, the order of the day's terms, the
equation in full, chained or just its result, optional remarks), drawn at generation time with
one knob, `variation` (`jaxspec.tasks.phrasing`): a policy trained on these texts is genuinely
uncertain at those choice points, as a real model is. The numbers themselves are determined by
the question, and every phrasing ends in the same exact answer, which the `arithmetic` reward
grades (`jaxspec.rewards.math_reward`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Literal

from jaxspec.tasks.phrasing import Expr, Writer, alt, seq

# Every value a solution writes stays within this bound (rules are redrawn otherwise).
MAX_ABS_VALUE = 9999


@dataclasses.dataclass(frozen=True)
class StepLaw:
    """The number of days N of a problem (its solution has one line per day).

    law: "lognormal": N = round(median * exp(sigma * Z)), Z standard normal.
         "pareto": N = min_steps + round(s * ((1 - U)^(-1 / alpha) - 1)), U uniform on [0, 1): a
             Pareto II (Lomax) law from min_steps with tail index alpha, its scale s set so that
             the median is `median` (P(N > n) falls like n^-alpha).
    median: the law's median number of days (before truncation).
    sigma: the lognormal law's spread (the standard deviation of log N).
    alpha: the Pareto law's tail index (smaller: a heavier tail).
    min_steps / max_steps: the fewest and most days a problem has. Draws outside [min_steps,
        max_steps] are drawn again: the law is truncated, not clipped (`cdf` gives its exact
        distribution function).
    """

    law: Literal["lognormal", "pareto"] = "lognormal"
    median: float = 50.0
    sigma: float = 0.8
    alpha: float = 1.5
    min_steps: int = 3
    max_steps: int = 800

    def _untruncated_cdf(self, n: float) -> float:
        """P(N <= n) before truncation, for integer n (rounding: N <= n iff the draw is < n + 0.5)."""
        if self.law == "lognormal":
            if n + 0.5 <= 0:
                return 0.0
            return 0.5 * math.erfc(-math.log((n + 0.5) / self.median) / (self.sigma * math.sqrt(2)))
        if n < self.min_steps:
            return 0.0
        return 1.0 - (1.0 + (n - self.min_steps + 0.5) / self._pareto_scale()) ** -self.alpha

    def _pareto_scale(self) -> float:
        return (self.median - self.min_steps) / (2.0 ** (1.0 / self.alpha) - 1.0)

    def cdf(self, n: int) -> float:
        """P(N <= n) of the truncated law."""
        low, high = self._untruncated_cdf(self.min_steps - 1), self._untruncated_cdf(self.max_steps)
        clipped = min(max(n, self.min_steps - 1), self.max_steps)
        return (self._untruncated_cdf(clipped) - low) / (high - low)

    def draw(self, rng: random.Random) -> int:
        while True:
            if self.law == "lognormal":
                n = round(rng.lognormvariate(math.log(self.median), self.sigma))
            else:
                n = self.min_steps + round(self._pareto_scale() * ((1.0 - rng.random()) ** (-1.0 / self.alpha) - 1.0))
            if self.min_steps <= n <= self.max_steps:
                return n


@dataclasses.dataclass(frozen=True)
class TallyConfig:
    """The `tally` problem kind (config key `data.tally`; used where `data.kinds` names it).

    steps: the law of the number of days, i.e. solution lines (see `StepLaw`).
    variation: the phrasing knob in [0, 1] (`jaxspec.tasks.phrasing`): 0 writes every choice
        point canonically (the solution is a function of the question), 1 draws every choice
        uniformly. `jaxspec data stats` prints its effect: the data's entropy per token and the
        acceptance length an ideal drafter would reach.
    """

    steps: StepLaw = StepLaw()
    variation: float = 0.7


def describe(cfg: TallyConfig) -> str:
    """One line: the step law and the variation."""
    s = cfg.steps
    shape = f"sigma {s.sigma:g}" if s.law == "lognormal" else f"alpha {s.alpha:g}"
    return f"{s.law} days (median {s.median:g}, {shape}) in [{s.min_steps}, {s.max_steps}], variation {cfg.variation:g}"


def config_errors(cfg: TallyConfig) -> list[tuple[str, str]]:
    """(key under the tally section, message) for every out-of-range value."""
    s, errors = cfg.steps, []
    if not 0.0 <= cfg.variation <= 1.0:
        errors.append(("variation", f"must be in [0, 1], got {cfg.variation}"))
    if s.min_steps < 1:
        errors.append(("steps.min_steps", f"must be >= 1, got {s.min_steps}"))
    if s.max_steps < s.min_steps:
        errors.append(("steps.max_steps", f"must be >= steps.min_steps={s.min_steps}, got {s.max_steps}"))
    if not s.min_steps <= s.median <= s.max_steps:
        errors.append(
            (
                "steps.median",
                f"must be in [steps.min_steps, steps.max_steps] = [{s.min_steps}, {s.max_steps}], got {s.median}",
            )
        )
    elif s.law == "pareto" and s.median == s.min_steps:
        errors.append(("steps.median", f"must exceed steps.min_steps={s.min_steps} for the pareto law"))
    if s.law == "lognormal" and s.sigma <= 0:
        errors.append(("steps.sigma", f"must be > 0, got {s.sigma}"))
    if s.law == "pareto" and s.alpha <= 0:
        errors.append(("steps.alpha", f"must be > 0, got {s.alpha}"))
    return errors


_SCENARIOS = (  # (subject, unit, what the question asks for)
    ("A game score", "points", "the score"),
    ("A bank balance", "dollars", "the balance"),
    ("A hiker's altitude above the camp", "meters", "the altitude"),
    ("A robot's position on a rail", "steps", "the position"),
)

# Choice points of a day's line, canonical phrasing first. Amounts and values are written after
# these as literals, so the same expressions serve every problem.
_START = alt("Start:", "We start at", "It starts at", "At first it is")
_OPENER = alt("Day", "On day", "For day", "Then day", "Next, day", "Now day", "At day", "Moving on, day")
_MARK = alt(":", ",", ";", " now,")
_ASIDE = alt("", " today", " this time")
_ACTION = {
    1: alt(" we add", " add", " it gains", " plus", " it goes up by", " we get"),
    -1: alt(" we subtract", " subtract", " it loses", " minus", " it goes down by", " we lose"),
}
_JOINER = alt(" and", ",", " then", ";")
_PAUSE = alt(",", ";", " -")
_CONNECTOR = alt(
    " so we get", " which gives", " that makes", " leaving", " for a total of", " and now we have", " giving"
)
_EQUALS = alt(" =", " is", " makes")
_ENDING = alt(
    ".\n",
    seq(".", alt(" Good", " Okay", " Fine", " Right", " Next"), alt(".", "!"), "\n"),
    seq(". That", alt(" checks out", " looks right", " seems fine"), ".\n"),
    ", as expected.\n",
)


def _term(t: int) -> str:
    return f" + {t}" if t > 0 else f" - {-t}"


def _equation(value: int, terms: list[int]) -> Expr:
    """The day's arithmetic: in full in the rules' order (canonical), just the result, in full in
    any other order of the terms, or chained one term at a time; "=" may be written as words."""
    result = value + sum(terms)
    orders = list(itertools.permutations(terms))
    full = [seq(f" {value}{''.join(_term(t) for t in order)}", _EQUALS, f" {result}") for order in orders]
    options = [full[0], f" {result}"] + full[1:]
    if len(terms) > 1:
        for order in orders:
            parts, v = [], value
            for t in order:
                parts.append(f"{v}{_term(t)} = {v + t}")
                v += t
            options.append(" " + ", then ".join(parts))
    return alt(*options)


def _rules(rng: random.Random, days: int) -> tuple[int, list[tuple[int, int]]] | None:
    """(start, [(period, amount), ...]) with the daily rule first, or None when a value would leave
    [-MAX_ABS_VALUE, MAX_ABS_VALUE] or a day's change would be zero (the caller draws again).

    A periodic amount is a multiple of its period and the daily amount cancels the periodic ones
    on average up to at most 1 per day, so values stay small (mostly 2-3 digits) over hundreds
    of days.
    """
    start = rng.randint(20, 300)
    periods = [rng.randint(2, 6)]
    if rng.random() < 0.5:
        periods.append(rng.choice([q for q in range(3, 10) if q != periods[0]]))
    rates = [rng.choice((-1, 1)) * rng.randint(2, 12) for _ in periods]
    periodic = [(period, period * rate) for period, rate in zip(periods, rates)]
    daily = -sum(rates) + rng.choice((-1, 0, 1))
    if daily == 0:
        return None
    rules = [(1, daily)] + periodic
    value = start
    for day in range(1, days + 1):
        change = sum(amount for period, amount in rules if day % period == 0)
        if change == 0:
            return None
        value += change
        if abs(value) > MAX_ABS_VALUE:
            return None
    return start, rules


def _question(rng: random.Random, start: int, rules: list[tuple[int, int]], days: int) -> tuple[str, str]:
    """(the question, its unit: "points", ...)."""
    subject, unit, asked = rng.choice(_SCENARIOS)

    def move(amount: int) -> str:
        return f"goes {'up' if amount > 0 else 'down'} by {abs(amount)} {_unit(unit, amount)}"

    (_, daily), (p, e), *third = rules
    text = f"{subject} starts at {start} {unit}. Each day it {move(daily)}. Every {p} days it also {move(e)}"
    if third:
        q, f = third[0]
        text += f", and every {q} days it {move(f)}"
    return text + f". What is {asked} after {days} days?", unit


def _unit(unit: str, amount: int) -> str:
    return unit[:-1] if abs(amount) == 1 else unit


def tally_problem(rng: random.Random, cfg: TallyConfig, writer_record: bool = False) -> tuple[str, str, str, Writer]:
    """(question, worked solution ending in \\boxed{answer}, answer, the writer that wrote it).

    writer_record: keep every choice point's distribution in the writer (`Writer.segments`).
    """
    days = cfg.steps.draw(rng)
    drawn = None
    while drawn is None:
        drawn = _rules(rng, days)
    start, rules = drawn
    question, unit = _question(rng, start, rules, days)
    out = Writer(rng, cfg.variation, record=writer_record)
    out.write(_START)
    out.write(f" {start}.\n")
    value = start
    for day in range(1, days + 1):
        terms = [amount for period, amount in rules if day % period == 0]
        out.write(_OPENER)
        out.write(f" {day}")
        out.write(_MARK)
        out.write(_ASIDE)
        for j, t in enumerate(terms):
            if j:
                out.write(_JOINER)
            out.write(_ACTION[1 if t > 0 else -1])
            out.write(f" {abs(t)}")
            out.write(alt("", f" {_unit(unit, t)}"))
        out.write(_PAUSE)
        out.write(_CONNECTOR)
        out.write(_equation(value, terms))
        out.write(_ENDING)
        value += sum(terms)
    out.write(
        alt(
            *(
                seq(lead, f"\\boxed{{{value}}}.")
                for lead in ("The answer is ", "So the answer is ", "Final answer: ", f"After {days} days it is ")
            )
        )
    )
    return question, out.text, str(value), out
