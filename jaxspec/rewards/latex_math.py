"""Math answer grading with HF's math-verify: the verifier for external math data (GSM8K, MATH,
DAPO-style answers, LaTeX).

math-verify extracts the final answer (the last `\\boxed{}`, else the last LaTeX or plain
expression, including GSM8K's `#### x`), parses LaTeX into sympy and compares symbolically:
`2\\frac{1}{2}` = 5/2, `\\sqrt2` = `\\sqrt{2}`, `10^{3}` = 1000, `x = 5` = 5, `\\text{5}` = 5,
while `3, 400` (a pair), `1 2` and `5\\text{ or }6` are not 3400, 12 or 56. Before parsing, a
Unicode minus (U+2212) becomes "-" and empty `\\boxed{}`s are dropped (a model that ends with an
empty box has still written its answer in the box before it).

The reference answer is extracted like the built-in checker does (`extract_answer(...,
"whole")`: a `\\boxed{}` or `#### x` marker, else the whole field) and read as LaTeX.
`math_reward` is the registered "math" reward's grader; it runs inside that reward's worker process
(`jaxspec.rewards.timed`), so math-verify's own signal-based timeouts apply there, and the worker's
wall-clock limit backs them up from any thread.
"""

from __future__ import annotations

import threading

from jaxspec.rewards.math_verifier import extract_answer, normalize_text

PARSE_TIMEOUT_S = 5  # math-verify's per-expression limits (seconds, signal-based: the worker's main thread)


def math_reward(response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equal to the reference, else 0.0
    (also when either side yields nothing to compare). Never raises."""
    from math_verify import parse, verify

    # signal.alarm works on the main thread only; elsewhere math-verify raises unless its timeouts are off
    limit = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        reference = extract_answer(normalize_text(str(answer)), fallback="whole")
        if not reference:
            return 0.0
        gold = parse(f"${reference.strip('$ ')}$", parsing_timeout=limit)
        if not gold:
            gold = parse(reference, parsing_timeout=limit)
        predicted = parse(normalize_text(response), parsing_timeout=limit)
        if not gold or not predicted:
            return 0.0
        return float(verify(gold, predicted, timeout_seconds=limit))
    except Exception:  # math-verify's parsers and sympy raise many kinds of errors on odd text
        return 0.0


def math_example_reward(response: str, example: dict) -> float:
    """`math_reward` against example["answer"] (the registered "math" reward's body)."""
    return math_reward(response, str(example["answer"]))


def load_math_verify() -> None:
    """Imports math-verify and parses one expression (its grammar's first load): ~0.7 s that a
    reward worker pays when it starts (`TimedCall`'s warm_up) rather than inside a call's limit."""
    from math_verify import parse

    parse("$1$")


math_reward.warm_up = load_math_verify
math_example_reward.warm_up = load_math_verify
