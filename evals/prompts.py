"""Chat messages per benchmark (the engine renders them with the chat template: Engine.render_chat)."""
from __future__ import annotations

from .data import Problem

MATH_INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."
CODE_INSTRUCTION = "Write a Python solution in a single fenced ```python block."
GPQA_INSTRUCTION = ("Think step by step, then finish with 'The answer is (X)' "
                    "where X is the letter of the correct option (A, B, C or D).")


def _user_text(p: Problem) -> str:
    if p.bench in ("gsm8k", "math500", "aime24", "aime25"):
        return f"{p.question}\n\n{MATH_INSTRUCTION}"
    if p.bench == "humaneval":
        return ("Complete the following Python function.\n\n"
                f"```python\n{p.meta['prompt']}```\n\n{CODE_INSTRUCTION}")
    if p.bench == "mbpp":
        # One example assert pins the function name and signature, as in the usual MBPP prompt.
        example = f"\n\nYour code should pass this test:\n{p.reference[0]}" if p.reference else ""
        return f"{p.question}{example}\n\n{CODE_INSTRUCTION}"
    if p.bench == "lcb":
        starter = p.meta.get("starter", "")
        code = f"\n\nComplete this starter code:\n```python\n{starter}```" if starter else ""
        return f"{p.question}{code}\n\n{CODE_INSTRUCTION}"
    if p.bench == "gpqa":
        options = "\n".join(f"{l}) {c}" for l, c in zip("ABCD", p.meta["choices"]))
        return f"{p.question}\n\n{options}\n\n{GPQA_INSTRUCTION}"
    if p.bench == "ifeval":
        return p.question  # the instructions to follow are the prompt itself
    raise ValueError(f"no prompt format for benchmark {p.bench!r}")


def build_messages(problem: Problem) -> list[dict]:
    return [{"role": "user", "content": _user_text(problem)}]

