from fractions import Fraction

import pytest

from jaxspec.rewards import arithmetic_reward, extract_answer, normalize_answer, parse_number


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"so the result is \boxed{\frac{6}{8}}", "3/4"),  # equivalent fractions
        (r"\boxed{0.75}", r"\frac{3}{4}"),  # decimal vs fraction
        (r"\boxed{\dfrac{3}{4}}", "0.75"),
        (r"\boxed{-\frac{3}{4}}", "-3/4"),
        (r"\boxed{\frac{-3}{4}}", "-0.75"),
        (r"\boxed{\frac34}", "3/4"),  # LaTeX shorthand
        (r"\boxed{1,234}", "1234"),  # thousands separators
        (r"\boxed{1{,}234{,}567}", "1234567"),
        ("The total is 12,345 dollars.", "12345"),  # no box: last number
        (r"\boxed{12.0}", "12"),  # trailing .0
        (r"$\boxed{-7}$", "-7"),
        (r"\boxed{$-7$}", "-7.00"),
        (r"\boxed{+5}", "5"),
        ("#### 42", "42"),  # GSM8K marker
        ("first 3 then 5\n#### 1,000", "1000"),
        ("#### 72 dollars", "72"),
        (r"#### \frac{1}{2}", "0.5"),
        (r"\boxed{1} ... corrected: \boxed{2}", "2"),  # several boxes: the last
        (r"\boxed{\frac{\frac{1}{2}}{2}}", "1/4"),  # nested braces
        (r"\boxed{{5}}", "5"),
        (r"\boxed{10\%}", "10"),
        (r"\boxed{5\text{ apples}}", "5"),
        (r"\boxed{(-3)}", "-3"),
        ("x = 10 - 3 = 7.", "7"),  # trailing period, last number
        ("the difference 5-3 is 2", "2"),
        (r"\boxed{\sqrt{2}}", r"\sqrt{2}"),  # non-numeric answers: exact string match
        (r"\boxed{x^2 + 1}", r"x^2+1"),
        ("12 apples", "#### 12"),  # reference given in raw GSM8K form
    ],
)
def test_equivalent_answers_score_one(response, answer):
    assert arithmetic_reward(response, answer) == 1.0


@pytest.mark.parametrize(
    "response, answer",
    [
        (r"\boxed{2} but first \boxed{1}", "2"),  # the last box counts, not the first
        (r"\boxed{3/5}", "3/4"),
        (r"\boxed{-3/4}", "3/4"),  # sign matters
        (r"\boxed{0.7499}", "3/4"),
        ("garbage", "3"),  # nothing extractable
        ("", "3"),
        (r"\boxed{", "3"),  # unbalanced box, no number
        (r"\boxed{}", "0"),
        (r"\boxed{1/0}", "1"),  # division by zero is unparsable
        (r"\boxed{abc}", "1"),
        ("The answer is 1,2", "12"),  # not a thousands separator
        (r"\boxed{\sqrt{3}}", r"\sqrt{2}"),
        ("3", ""),  # empty reference
        ("12 then 13", "12"),  # last number is 13
    ],
)
def test_wrong_or_garbage_scores_zero(response, answer):
    assert arithmetic_reward(response, answer) == 0.0


def test_never_raises_on_odd_text():
    odd = [
        "}" * 50 + r"\boxed{" * 50,
        "\x00\xff",
        "1" * 5000 + "/" + "0",
        r"\frac{1}{0}",
        "#### ",
        "####",
        r"\boxed{\frac{}{}}",
        "-",
        ".",
        "$$",
        r"\boxed{1e400}",
        "9" * 400 + ".5",
    ]
    for text in odd:
        for answer in ("1", r"\frac{1}{2}", "x"):
            assert arithmetic_reward(text, answer) in (0.0, 1.0)


def test_extract_answer_order_and_fallbacks():
    assert extract_answer(r"a \boxed{1} b #### 2 c 3") == "1"
    assert extract_answer("a #### 2 c\nmore 3") == "2"
    assert extract_answer("a 2 c 3.5") == "3.5"
    assert extract_answer("no digits") is None
    assert extract_answer(r"\frac{1}{2}", fallback="whole") == r"\frac{1}{2}"
    assert extract_answer(r"\frac{1}{2}") == "2"
    with pytest.raises(ValueError, match="fallback"):
        extract_answer("1", fallback="first")


def test_parse_and_normalize():
    assert parse_number(r"\dfrac{10}{4}") == Fraction(5, 2)
    assert parse_number("-.5") == Fraction(-1, 2)
    assert parse_number("1,234.50") == Fraction(246900, 200)
    assert parse_number("1,23") is None
    assert parse_number("two") is None
    assert normalize_answer(r"\frac{6}{8}") == "3/4"
    assert normalize_answer("1,234") == "1234"
    assert normalize_answer("-4.0") == "-4"
    assert normalize_answer(r"\sqrt{2}") == r"\sqrt{2}"


@pytest.mark.parametrize(
    "response, answer, grade",
    [
        ("The answer is \u22125", "5", 0.0),  # Unicode minus: a sign, not a dash to skip
        ("The answer is \u22125", "-5", 1.0),
        ("\\boxed{\u22125}", "5", 0.0),
        (r"\boxed{3, 400}", "3400", 0.0),  # a pair, not a thousands separator
        (r"\boxed{1 2}", "12", 0.0),
        (r"\boxed{5\text{ or }6}", "56", 0.0),
        (r"\boxed{5}\boxed{}", "5", 1.0),  # an empty last box
    ],
)
def test_issue_strings_exact_checker(response, answer, grade):
    assert arithmetic_reward(response, answer) == grade
