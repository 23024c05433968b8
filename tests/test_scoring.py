import time

import pytest

from fastspec.evals.data import Problem
from fastspec.evals.scoring import extract_code, last_boxed, math_equal, score


def gsm(ref):
    return Problem("gsm8k", "g", "q", ref, {})


def math(ref, bench="math500"):
    return Problem(bench, "m", "q", ref, {})


@pytest.mark.parametrize("completion, ok, got", [
    ("So she makes 9 * 2 = 18 dollars.\n#### 18", True, "18"),
    ("The answer is \\boxed{18}.", True, "18"),
    ("She has $1,000 left... wait, answer is 17", False, "17"),  # 'answer is' beats last number
    ("Total: 3 + 4 = 7 eggs and 12 hours later 18.0", True, "18"),  # falls back to last number
    ("\\boxed{\\$18.00}", True, "18"),
    ("no digits here", False, None),
])
def test_gsm8k(completion, ok, got):
    r = score(gsm("18"), completion)
    assert (r["correct"], r["extracted"]) == (ok, got)


def test_gsm8k_commas():
    assert score(gsm("1234"), "It costs \\boxed{1,234} dollars")["correct"] is True
    assert score(gsm("1234"), "#### 1,235")["correct"] is False


def test_last_boxed_nested_braces():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{a^{2}}{b}} end") == "\\frac{a^{2}}{b}"
    assert last_boxed("\\boxed 7$") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # cut off mid-answer
    assert last_boxed("nothing") is None


@pytest.mark.parametrize("pred, ref", [
    ("\\frac{1}{2}", "0.5"), ("\\dfrac12", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"),
    ("x = 5", "5"), ("90^\\circ", "90"), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("\\text{(C)}", "(C)"), ("10\\text{ cm}", "10"), ("070", "70"), ("5.", "5"),
])
def test_math_equivalent(pred, ref):
    assert math_equal(pred, ref)


def test_math_scoring():
    assert score(math("\\frac{1}{2}"), "so \\boxed{\\dfrac{1}{2}}.")["correct"] is True
    assert score(math("\\frac{1}{2}"), "so \\boxed{\\frac{1}{3}}")["correct"] is False
    r = score(math("\\frac{\\sqrt{3}}{2}"), "We get \\boxed{\\frac{\\sqrt{3}}{2}}")
    assert r == {"correct": True, "extracted": "\\frac{\\sqrt{3}}{2}", "detail": None}
    assert score(math("204", "aime24"), "The answer is 204")["correct"] is False  # needs \boxed
    assert score(math("70", "aime25"), "\\boxed{070}")["correct"] is True


HE_STUB = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n'
HE_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def he():
    return Problem("humaneval", "HumanEval/x", HE_STUB, HE_TEST, {"entry_point": "add", "prompt": HE_STUB})


def mbpp():
    return Problem("mbpp", "mbpp/1", "Add.", ["assert add(2, 3) == 5", "assert add(0, 0) == 0"], {})


def test_code_passes():
    r = score(he(), "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.")
    assert r["correct"] is True and "return a + b" in r["extracted"]
    assert score(he(), "    return a + b\n")["correct"] is True  # body-only continuation
    assert score(mbpp(), "```py\ndef add(a, b):\n    return a + b\n```")["correct"] is True


def test_code_fails_assert():
    r = score(mbpp(), "```python\ndef add(a, b):\n    return a - b\n```")
    assert r["correct"] is False and "AssertionError" in r["detail"]


def test_code_syntax_error():
    r = score(he(), "```python\ndef add(a, b)\n    return a + b\n```")
    assert r["correct"] is False and "SyntaxError" in r["detail"]


def test_code_timeout_is_quick():
    t = time.monotonic()
    r = score(mbpp(), "```python\ndef add(a, b):\n    while True: pass\n```", timeout=2)
    assert r["correct"] is False and "timeout" in r["detail"]
    assert time.monotonic() - t < 6


def test_code_runs_out_of_process():
    # A completion that kills its interpreter must not take the test runner with it,
    # and exiting 0 before the asserts ran is not a pass.
    r = score(mbpp(), "```python\nimport os\nos._exit(0)\n```")
    assert r["correct"] is False and "before the tests" in r["detail"]
    assert score(mbpp(), "```python\nimport sys\nsys.exit(1)\n```")["correct"] is False


def test_lcb_without_tests_is_not_scored():
    p = Problem("lcb", "lc/1", "desc", "", {"starter": "class Solution: ..."})
    assert score(p, "```python\nclass Solution: pass\n```")["correct"] is None


def test_lcb_with_tests():
    test = "\nmy_solution = Solution()\nassert my_solution.f(**{'xs': [3, 1]}) == [1, 3]\n"
    p = Problem("lcb", "lc/2", "sort", test, {"starter": ""})
    good = "```python\nclass Solution:\n    def f(self, xs: List[int]) -> List[int]:\n        return sorted(xs)\n```"
    assert score(p, good)["correct"] is True  # List comes from the LeetCode-style prelude
    assert score(p, good.replace("sorted(xs)", "xs"))["correct"] is False


def test_extract_code_prefers_last_python_block():
    text = "```python\nx = 1\n```\n```text\nnot code\n```\n```python\nx = 2\n```"
    assert extract_code(text).strip() == "x = 2"
    assert extract_code("```python\ny = 3\n").strip() == "y = 3"  # unterminated fence
    assert extract_code("plain = 1") == "plain = 1"


@pytest.mark.parametrize("completion, got", [
    ("Reasoning... The answer is (C).", "C"),
    ("Answer: **B**", "B"),
    ("First I thought the answer is (A). Rechecking, the answer is (D).", "D"),
    ("so \\boxed{D}", "D"),
    ("I pick option A, no wait, D", "D"),
    ("no letter here", None),
])
def test_gpqa_letters(completion, got):
    p = Problem("gpqa", "gpqa-0", "q", "D", {"choices": list("abcd"), "letter": "D"})
    r = score(p, completion)
    assert r["extracted"] == got and r["correct"] is (got == "D")


def test_ifeval_never_fakes_a_score():
    p = Problem("ifeval", "ifeval/1", "Write without commas.",
                {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}, {})
    r = score(p, "Hello world")
    from fastspec.evals.scoring import _ifeval_registry
    if _ifeval_registry() is None:
        assert r["correct"] is None and "not scored" in r["detail"]
    else:
        assert r["correct"] in (True, None)
