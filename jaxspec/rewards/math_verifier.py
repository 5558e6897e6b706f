"""The exact-rational answer checker (the registered "arithmetic" reward): extract a final answer
from free text and compare it exactly.

Extraction order (`extract_answer`): the contents of the last `\\boxed{...}` (nested braces
handled), else the number (or whole line) after the last `####` (GSM8K style), else the last
number in the text.

Normalisation (`parse_number`): surrounding `$`, spaces, `\\$`, `\\%`/`%`, `\\!`, `\\,`,
`\\left`/`\\right`, `\\text{...}` units, degree signs, enclosing braces, one pair of enclosing
parentheses and a trailing period are dropped; thousands separators (`1,234`, `1{,}234`) are
removed; integers, decimals (`0.75`, `.5`, `2.0`), plain fractions (`3/4`) and LaTeX fractions
(`\\frac{3}{4}`, `\\dfrac`, `\\tfrac`, `\\frac34`, nested) with any sign placement become an exact
`fractions.Fraction`.

Before extraction, Unicode minus signs become "-" and empty boxes are dropped (`normalize_text`).
Numbers split by spaces (`1 2`, `3, 400`, `5\\text{ or }6`) are not numbers.

Equivalence: two answers match when both parse and the fractions are equal. When the reference
answer is not a number (e.g. `\\sqrt{2}`), the answers match when their normalised strings are
equal. A response with no extractable or parsable answer gets reward 0; the verifier never raises
on any string input.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A leading "-" counts as a sign only when not preceded by a digit/letter/")" (so "5-3" -> 5, 3).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|\.\d+)")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"([+-]?)\\frac")
_UNITS = re.compile(r"\\(?:text|mbox)\{[^{}]*\}|\^\{?\\circ\}?")
_SPLIT_DIGITS = re.compile(r"\d(?:\s*,)?\s+\d")  # "1 2", "3, 400": a list, not one number
_EMPTY_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{\s*\}")
_UNICODE_MINUS = ("\u2212", "\ufe63", "\uff0d")  # minus sign, small and fullwidth hyphen-minus
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "\\%", "%", "$", " ")


def normalize_text(text: str) -> str:
    """Unicode minus signs -> "-"; empty `\\boxed{}`s removed (an answer boxed before one counts)."""
    for minus in _UNICODE_MINUS:
        text = text.replace(minus, "-")
    return _EMPTY_BOX.sub("", text)


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_answer(text: str, fallback: str = "last_number") -> str | None:
    """The final answer written in `text`, as a raw string (not yet normalised).

    fallback: what to use when there is neither a `\\boxed{}` nor a `####` marker:
    "last_number" (the last number in the text; for model responses) or "whole" (the stripped
    text itself; for reference answers such as `\\frac{1}{2}`). Returns None when nothing is found.
    """
    if fallback not in ("last_number", "whole"):
        raise ValueError(f"fallback must be 'last_number' or 'whole', got {fallback!r}")
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if not tail:
            return None
        line = tail.splitlines()[0].strip()
        leading = _NUMBER.match(line.lstrip("$ "))
        # "#### 72 dollars" -> "72"; a line that is itself an answer ("\frac{1}{2}") is kept whole
        return leading.group() if parse_number(line) is None and leading else line
    if fallback == "whole":
        return text.strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _clean(text: str) -> str:
    s = text.strip()
    for token in _DROPPED:
        s = s.replace(token, "")
    s = s.replace("{,}", ",").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _group(s: str, start: int) -> tuple[str, int] | None:
    """The LaTeX argument at s[start]: a balanced {...} group or one character; (text, end)."""
    if start >= len(s):
        return None
    if s[start] != "{":
        return s[start], start + 1
    depth = 0
    for i in range(start, len(s)):
        depth += {"{": 1, "}": -1}.get(s[i], 0)
        if depth == 0:
            return s[start + 1 : i], i + 1
    return None


def _split_frac(s: str) -> tuple[str, str, str] | None:
    """(sign, numerator, denominator) when all of `s` is one `\\frac{..}{..}` (or `\\frac34`)."""
    match = _FRAC.match(s)
    if not match:
        return None
    num = _group(s, match.end())
    den = _group(s, num[1]) if num else None
    if den is None or den[1] != len(s):
        return None
    return match.group(1), num[0], den[0]


def parse_number(text: str) -> Fraction | None:
    """Exact value of a numeric answer string, or None when it is not a plain number/fraction."""
    spaced = _UNITS.sub(" ", text)
    if _SPLIT_DIGITS.search(spaced):
        return None
    s = _clean(spaced)
    while s.startswith("{") and _group(s, 0) is not None and _group(s, 0)[1] == len(s):
        s = s[1:-1]
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    if not s:
        return None
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    frac = _split_frac(s)
    if frac is not None:
        sign, num, den = frac
        num_v, den_v = parse_number(num), parse_number(den)
        if num_v is None or den_v is None or den_v == 0:
            return None
        value = num_v / den_v
        return -value if sign == "-" else value
    if s.count("/") == 1:
        num, den = s.split("/")
        if not (_PLAIN_NUMBER.fullmatch(num) and _PLAIN_NUMBER.fullmatch(den)):
            return None
        den_v = Fraction(den)
        return None if den_v == 0 else Fraction(num) / den_v
    if _PLAIN_NUMBER.fullmatch(s):
        return Fraction(s)
    return None


def format_number(value: Fraction) -> str:
    """Canonical answer string: "42", "-7", "3/4", "-3/4"."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def normalize_answer(text: str) -> str:
    """Canonical form of a reference answer: `format_number` of its value, else `_clean(text)`."""
    value = parse_number(text)
    return format_number(value) if value is not None else _clean(text)


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference answer, else 0.0.

    `answer` may itself carry a `\\boxed{}` or `#### x` marker (raw GSM8K/MATH fields); otherwise
    it is taken whole. Never raises for string inputs: an unparsable response scores 0.0.
    """
    try:
        predicted = extract_answer(normalize_text(response), fallback="last_number")
        reference = extract_answer(normalize_text(answer), fallback="whole")
        if predicted is None or reference is None:
            return 0.0
        ref_value = parse_number(reference)
        if ref_value is not None:
            return float(parse_number(predicted) == ref_value)
        ref_text = _clean(reference)
        return float(bool(ref_text) and _clean(predicted) == ref_text)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return 0.0
