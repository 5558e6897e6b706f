"""Multi-step integer arithmetic problems with line-by-line worked solutions.

An expression is a binary tree over + - * / with integer leaves. Division is always exact (the
dividend is built as divisor * quotient). The solution rewrites the expression once per step,
reducing the leftmost operation whose operands are both numbers (in the tree, so precedence and
parentheses are respected):

    3 + 4 * (5 - 2)
    = 3 + 4 * 3
    = 3 + 12
    = 15
    The answer is \\boxed{15}.

Since every step rewrites the remaining expression, a solution of k operations has ~k^2 / 2 terms.
Levels 1..5 grow the operands and the operators; levels 6 and 7 keep small operands and no
division but use many operations, so their solutions are long like reasoning traces (~300-700 and
~900-1600 tokens of the task tokenizer; the question stays near 60 and 90 tokens).
"""

from __future__ import annotations

import dataclasses
import random
from fractions import Fraction

from jaxspec.rewards.math_verifier import format_number


@dataclasses.dataclass(frozen=True)
class ArithmeticLevel:
    """Difficulty knobs: number of operations, operand range, operators, parentheses, negatives."""

    min_ops: int
    max_ops: int
    max_operand: int
    ops: str
    parens: bool
    negatives: bool
    max_abs_value: int  # bound on every intermediate result


LEVELS = {
    1: ArithmeticLevel(1, 1, 9, "+-", parens=False, negatives=False, max_abs_value=20),
    2: ArithmeticLevel(2, 2, 20, "+-*", parens=False, negatives=False, max_abs_value=200),
    3: ArithmeticLevel(2, 3, 30, "+-*/", parens=True, negatives=False, max_abs_value=1000),
    4: ArithmeticLevel(3, 4, 60, "+-*/", parens=True, negatives=True, max_abs_value=5000),
    5: ArithmeticLevel(4, 5, 200, "+-*/", parens=True, negatives=True, max_abs_value=50000),
    # No "/" at the long levels: a divisor is a whole subtree that must come out small and nonzero,
    # which a subtree of many operations rarely does (most draws would be rejected).
    6: ArithmeticLevel(12, 16, 20, "+-*", parens=True, negatives=True, max_abs_value=10000),
    7: ArithmeticLevel(22, 25, 20, "+-*", parens=True, negatives=True, max_abs_value=10000),
}

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_QUESTION_TEMPLATES = ("Compute {}.", "What is {}?", "Evaluate {}.", "Calculate {}.")


@dataclasses.dataclass(frozen=True)
class Num:
    value: int


@dataclasses.dataclass(frozen=True)
class Op:
    op: str
    left: Num | Op
    right: Num | Op


Expr = Num | Op


def _apply(op: str, a: Fraction | int, b: Fraction | int) -> Fraction | int:
    """a op b, exact (an int for + - * on ints: cheaper than Fraction)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return Fraction(a) / b


def evaluate(expr: Expr) -> Fraction:
    if isinstance(expr, Num):
        return Fraction(expr.value)
    return _apply(expr.op, evaluate(expr.left), evaluate(expr.right))


def render(expr: Expr, top: bool = True) -> str:
    """Infix text with the parentheses precedence requires; negative numbers inside are "(-3)"."""
    if isinstance(expr, Num):
        return str(expr.value) if top or expr.value >= 0 else f"({expr.value})"
    prec = _PRECEDENCE[expr.op]
    left = render(expr.left, top=False)
    right = render(expr.right, top=False)
    if isinstance(expr.left, Op) and _PRECEDENCE[expr.left.op] < prec:
        left = f"({left})"
    # A right operand of equal precedence is parenthesised even where associativity would allow
    # dropping them, so the text reads left to right in exactly the tree's evaluation order.
    if isinstance(expr.right, Op) and _PRECEDENCE[expr.right.op] <= prec:
        right = f"({right})"
    return f"{left} {expr.op} {right}"


def reduce_once(expr: Op) -> Expr:
    """Evaluates the leftmost operation whose two operands are numbers."""
    if isinstance(expr.left, Num) and isinstance(expr.right, Num):
        return Num(int(evaluate(expr)))
    if isinstance(expr.left, Op):
        return Op(expr.op, reduce_once(expr.left), expr.right)
    return Op(expr.op, expr.left, reduce_once(expr.right))


def _operand(rng: random.Random, level: ArithmeticLevel, low: int = 0) -> int:
    value = rng.randint(low, level.max_operand)
    if level.negatives and rng.random() < 0.25:
        value = -value
    return value


def _build(rng: random.Random, level: ArithmeticLevel, num_ops: int) -> Expr | None:
    """Random tree with `num_ops` operations, or None when a constraint fails (caller retries)."""
    if num_ops == 0:
        return Num(_operand(rng, level))
    op = rng.choice(level.ops)
    if op == "/":
        divisor_tree = _build(rng, level, num_ops - 1)
        if divisor_tree is None:
            return None
        divisor = evaluate(divisor_tree)
        if divisor == 0 or abs(divisor) > level.max_operand:
            return None
        quotient = _operand(rng, level, low=1)
        return Op("/", Num(int(divisor) * quotient), divisor_tree)
    left_ops = rng.randint(0, num_ops - 1)
    left, right = _build(rng, level, left_ops), _build(rng, level, num_ops - 1 - left_ops)
    if left is None or right is None:
        return None
    return Op(op, left, right)


def _within_bounds(expr: Expr, level: ArithmeticLevel) -> bool:
    """Every number in every step is within max_abs_value (and >= 0 unless negatives are on).

    Each step replaces one operation by its value, so the numbers of all steps are the leaves and
    the values of all operations: one bottom-up pass checks them (linear, not quadratic, in size).
    """
    low = -level.max_abs_value if level.negatives else 0
    return _bounded_value(expr, low, level.max_abs_value) is not None


def _bounded_value(expr: Expr, low: int, high: int) -> Fraction | int | None:
    """Value of `expr`, or None if it or any leaf or operation value inside is outside [low, high]."""
    if isinstance(expr, Num):
        value = expr.value
    else:
        left = _bounded_value(expr.left, low, high)
        right = None if left is None else _bounded_value(expr.right, low, high)
        if right is None:
            return None
        value = _apply(expr.op, left, right)
    return value if low <= value <= high else None


def random_expression(rng: random.Random, level: int) -> Expr:
    """A valid expression for `level` (retries until every constraint holds)."""
    spec = LEVELS[level]
    while True:
        num_ops = rng.randint(spec.min_ops, spec.max_ops)
        expr = _build(rng, spec, num_ops)
        if expr is None or not _within_bounds(expr, spec):
            continue
        if not spec.parens and "(" in render(expr):
            continue
        return expr


def arithmetic_problem(rng: random.Random, level: int) -> tuple[str, str, str]:
    """(question, step-by-step solution ending in \\boxed{answer}, answer) for `level`."""
    expr = random_expression(rng, level)
    question = rng.choice(_QUESTION_TEMPLATES).format(render(expr))
    lines = [render(expr)]
    current = expr
    while isinstance(current, Op):
        current = reduce_once(current)
        lines.append("= " + render(current))
    answer = format_number(evaluate(expr))
    lines.append(f"The answer is \\boxed{{{answer}}}.")
    return question, "\n".join(lines), answer
