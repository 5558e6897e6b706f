"""Templated word problems (shopping, rates, ages, splitting, percentages, temperatures).

Each template takes a `random.Random` and a level and returns (question, solution lines, answer).
Higher levels use larger numbers and more steps. Fractional answers appear from level 3
(splitting) and level 4 (rates, percentages); negative answers from level 2 (temperatures).
Every quantity is built so that the answer is an exact integer or fraction; the solution shows
one arithmetic step per line.

Levels 6 and 7 are day-by-day processes instead (a savings jar, a shop's stock, the temperature):
a fixed change every day plus a second one every few days, asked after many days. The question
stays short (~50 tokens) while the solution has one line per day, ~300-700 tokens at level 6 and
~900-1600 at level 7, like the long arithmetic levels. Their answers are integers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction

from jaxspec.rewards.math_verifier import format_number

_NAMES = (
    ("Ana", "She", "her"),
    ("Ben", "He", "his"),
    ("Chen", "He", "his"),
    ("Dara", "She", "her"),
    ("Eli", "He", "his"),
    ("Fatima", "She", "her"),
    ("Goran", "He", "his"),
    ("Hana", "She", "her"),
    ("Ivan", "He", "his"),
    ("Jun", "She", "her"),
    ("Kofi", "He", "his"),
    ("Lena", "She", "her"),
)
_ITEMS = (
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("apple", "apples"),
    ("ticket", "tickets"),
    ("book", "books"),
    ("cup", "cups"),
    ("shirt", "shirts"),
    ("plant", "plants"),
)
_VEHICLES = ("car", "train", "bus", "cyclist", "boat", "truck")
_RELATIVES = ("mother", "father", "aunt", "uncle", "grandmother", "grandfather")
_THINGS = ("cookies", "marbles", "stickers", "candies", "cards", "coins")
_BILLS = (5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)

Template = Callable[[random.Random, int], tuple[str, list[str], Fraction]]


def _hi(level: int) -> int:
    """Largest base quantity used at `level`."""
    return {1: 9, 2: 20, 3: 40, 4: 80, 5: 200}[level]


def _f(x: Fraction | int) -> str:
    return format_number(Fraction(x))


def shopping(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    name, _, _ = rng.choice(_NAMES)
    (_, items), (item2, _) = rng.sample(_ITEMS, 2)
    n, p = rng.randint(2, min(20, _hi(level))), rng.randint(2, _hi(level))
    cost = n * p
    lines = [f"{n} {items} cost {n} * {p} = {cost} dollars."]
    question = f"{name} buys {n} {items} at ${p} each"
    if level == 1:
        return f"{question}. How many dollars does {name} spend?", lines, Fraction(cost)
    q = rng.randint(2, _hi(level))
    total = cost + q
    lines.append(f"Together with the {item2}: {cost} + {q} = {total} dollars.")
    question += f" and a {item2} for ${q}"
    if level == 2:
        return f"{question}. How many dollars does {name} spend in total?", lines, Fraction(total)
    bill = next(b for b in _BILLS if b > total)
    change = bill - total
    lines.append(f"The change is {bill} - {total} = {change} dollars.")
    return (
        f"{question}. {name} pays with a ${bill} bill. How many dollars of change does {name} get?",
        lines,
        Fraction(change),
    )


def rates(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    if level <= 2:
        vehicle = rng.choice(_VEHICLES)
        s1, h1 = rng.randint(2, 3 * _hi(level)), rng.randint(2, 9)
        d1 = s1 * h1
        lines = [f"In {h1} hours it travels {s1} * {h1} = {d1} km."]
        question = f"A {vehicle} travels at {s1} km per hour"
        if level == 1:
            return f"{question}. How many km does it travel in {h1} hours?", lines, Fraction(d1)
        s2, h2 = rng.randint(2, 3 * _hi(level)), rng.randint(2, 9)
        d2 = s2 * h2
        lines += [f"Then it travels {s2} * {h2} = {d2} km.", f"In total: {d1} + {d2} = {d1 + d2} km."]
        return (
            f"{question} for {h1} hours and then at {s2} km per hour for {h2} hours. "
            f"How many km does it travel in total?",
            lines,
            Fraction(d1 + d2),
        )
    rate = rng.randint(2, _hi(level) // 2)
    already = rng.randint(1, 5 * _hi(level))
    if level == 3:
        remaining = rate * rng.randint(2, 3 * _hi(level) // rate + 2)
    else:
        remaining = rng.randint(rate + 1, 10 * _hi(level))
    capacity = already + remaining
    minutes = Fraction(remaining, rate)
    lines = [
        f"The tank still needs {capacity} - {already} = {remaining} liters.",
        f"At {rate} liters per minute that takes {remaining} / {rate} = {_f(minutes)} minutes.",
    ]
    return (
        f"A pump fills {rate} liters per minute. A tank holds {capacity} liters and already contains "
        f"{already} liters. How many minutes does it take to fill the tank?",
        lines,
        minutes,
    )


def ages(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    name, _, poss = rng.choice(_NAMES)
    relative = rng.choice(_RELATIVES)
    a = rng.randint(3, max(9, _hi(level) // 2))
    if level == 1:
        d = rng.randint(2, 30)
        return (
            f"{name} is {a} years old. {poss.capitalize()} {relative} is {d} years older. "
            f"How old is {poss} {relative}?",
            [f"{a} + {d} = {a + d}."],
            Fraction(a + d),
        )
    k, y = rng.randint(2, 5), rng.randint(2, 20)
    b = a * k
    lines = [f"{poss.capitalize()} {relative} is {a} * {k} = {b} years old."]
    question = f"{name} is {a} years old. {poss.capitalize()} {relative} is {k} times as old."
    if level == 2:
        lines.append(f"In {y} years: {b} + {y} = {b + y}.")
        return f"{question} How old will {poss} {relative} be in {y} years?", lines, Fraction(b + y)
    lines += [
        f"In {y} years {name} will be {a} + {y} = {a + y}.",
        f"In {y} years {poss} {relative} will be {b} + {y} = {b + y}.",
        f"Together: {a + y} + {b + y} = {a + b + 2 * y}.",
    ]
    return (f"{question} What will the sum of their ages be in {y} years?", lines, Fraction(a + b + 2 * y))


def splitting(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    things = rng.choice(_THINGS)
    name, pron, _ = rng.choice(_NAMES)
    k = rng.randint(2, min(12, _hi(level)))
    if level == 1:
        q = rng.randint(1, 9)
        n = k * q
        return (
            f"{n} {things} are shared equally among {k} friends. How many {things} does each friend get?",
            [f"{n} / {k} = {q}."],
            Fraction(q),
        )
    if level == 2:
        q, e = rng.randint(1, _hi(level)), rng.randint(1, _hi(level))
        rest = k * q
        n = rest + e
        return (
            f"{name} has {n} {things} and gives {e} to a teacher. {pron} shares the rest equally among "
            f"{k} friends. How many {things} does each friend get?",
            [f"{n} - {e} = {rest} are left.", f"{rest} / {k} = {q}."],
            Fraction(q),
        )
    drunk = rng.randint(1, _hi(level))
    rest = rng.randint(1, 3 * _hi(level))
    while rest % k == 0:
        rest += 1
    total = rest + drunk
    share = Fraction(rest, k)
    return (
        f"{name} has {total} liters of juice, drinks {drunk} liters and pours the rest equally into {k} "
        f"bottles. How many liters are in each bottle?",
        [f"{total} - {drunk} = {rest} liters are left.", f"{rest} / {k} = {_f(share)} liters per bottle."],
        share,
    )


def percentages(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    pct = rng.choice((10, 20, 25, 50) if level <= 2 else (5, 10, 15, 20, 25, 30, 40, 50, 60, 75))
    unit = 100 // math.gcd(pct, 100) if level <= 3 else 1  # levels >= 4 allow fractional results
    price = unit * rng.randint(1, max(2, 10 * _hi(level) // unit))
    off = Fraction(price * pct, 100)
    if level == 1:
        return (f"What is {pct}% of {price}?", [f"{pct}% of {price} is {price} * {pct} / 100 = {_f(off)}."], off)
    (item, _) = rng.choice(_ITEMS)
    sale = price - off
    lines = [
        f"The discount is {price} * {pct} / 100 = {_f(off)} dollars.",
        f"The sale price is {price} - {_f(off)} = {_f(sale)} dollars.",
    ]
    question = f"A {item} costs ${price} and is on sale for {pct}% off."
    if level == 2:
        return f"{question} What is the sale price in dollars?", lines, sale
    n = rng.randint(2, 9)
    total = n * sale
    lines.append(f"{n} of them cost {n} * {_f(sale)} = {_f(total)} dollars.")
    return f"{question} How many dollars do {n} of them cost at the sale price?", lines, total


def temperatures(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    if level == 1:
        t = rng.randint(1, _hi(level))
        d = rng.randint(1, t)
    else:
        t, d = rng.randint(-_hi(level), _hi(level)), rng.randint(1, 2 * _hi(level))
    now = t - d
    lines = [f"{t} - {d} = {now}."]
    question = f"The temperature is {t} degrees. It drops by {d} degrees overnight."
    if level == 1:
        return f"{question} What is the temperature now?", lines, Fraction(now)
    r = rng.randint(1, 2 * _hi(level))
    lines = [f"After the drop: {t} - {d} = {now} degrees.", f"After the rise: {now} + {r} = {now + r} degrees."]
    return (
        f"{question} In the morning it rises by {r} degrees. What is the temperature in the morning?",
        lines,
        Fraction(now + r),
    )


TEMPLATES: dict[str, Template] = {
    "shopping": shopping,
    "rates": rates,
    "ages": ages,
    "splitting": splitting,
    "percentages": percentages,
    "temperatures": temperatures,
}

# Range of days (hours) simulated by the long levels; the solution has one line per day.
_DAYS = {6: (24, 40), 7: (72, 86)}


def _simulate(label: str, start: int, steps: int, every: int, daily: int, extra: int) -> tuple[list[str], int]:
    """Lines "{label} i: v + daily [+ extra] = v'." for i = 1..steps, extra on every `every`-th one.

    A negative change is written as a subtraction. Returns (lines, final value).
    """

    def term(x: int) -> str:
        return f"+ {x}" if x >= 0 else f"- {-x}"

    lines, value = [], start
    for i in range(1, steps + 1):
        new = value + daily
        text = f"{value} {term(daily)}"
        if i % every == 0:
            new += extra
            text += f" {term(extra)}"
        lines.append(f"{label} {i}: {text} = {new}.")
        value = new
    return lines, value


def savings(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    name, pron, poss = rng.choice(_NAMES)
    start, earn, every = rng.randint(10, 100), rng.randint(2, 20), rng.randint(2, 5)
    spend = rng.randint(earn + 1, earn * every)  # at most what a period earns: never below `start`
    days = rng.randint(*_DAYS[level])
    lines, end = _simulate("Day", start, days, every, earn, -spend)
    return (
        f"{name} has {start} dollars in {poss} jar. Each day {pron.lower()} puts in {earn} dollars, and every "
        f"{every} days {pron.lower()} also takes out {spend} dollars. How many dollars are in the jar after "
        f"{days} days?",
        lines,
        Fraction(end),
    )


def stock(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    (_, items) = rng.choice(_ITEMS)
    sold, every = rng.randint(2, 20), rng.randint(2, 5)
    start = rng.randint(sold * every, 200)  # enough to last until the first delivery
    delivered = rng.randint(sold * every, sold * every + 50)
    days = rng.randint(*_DAYS[level])
    lines, end = _simulate("Day", start, days, every, -sold, delivered)
    return (
        f"A shop has {start} {items}. It sells {sold} {items} each day, and every {every} days a delivery "
        f"brings {delivered} more. How many {items} does the shop have after {days} days?",
        lines,
        Fraction(end),
    )


def weather(rng: random.Random, level: int) -> tuple[str, list[str], Fraction]:
    start, drop, every = rng.randint(-20, 30), rng.randint(1, 9), rng.randint(2, 5)
    rise = rng.randint(max(1, drop * every - 5), drop * every + 5)  # the net drift per period stays small
    hours = rng.randint(*_DAYS[level])
    lines, end = _simulate("Hour", start, hours, every, -drop, rise)
    return (
        f"At midnight the temperature is {start} degrees. Each hour it drops by {drop} degrees, and every "
        f"{every} hours a warm wind raises it by {rise} degrees. What is the temperature after {hours} "
        f"hours?",
        lines,
        Fraction(end),
    )


LONG_TEMPLATES: dict[str, Template] = {"savings": savings, "stock": stock, "weather": weather}


def word_problem(rng: random.Random, level: int) -> tuple[str, str, str]:
    """(question, step-by-step solution ending in \\boxed{answer}, answer) for `level`."""
    templates = LONG_TEMPLATES if level in _DAYS else TEMPLATES
    template = templates[rng.choice(sorted(templates))]
    question, lines, answer = template(rng, level)
    text = format_number(answer)
    return question, "\n".join(lines + [f"The answer is \\boxed{{{text}}}."]), text
