"""Score one completion against one Problem.

`score()` returns {"correct": bool | None, "extracted": str | None, "detail": str | None}.
correct=None means "not scored" (no runnable tests, no checker installed), never a guess.
Generated code only ever runs in a separate, isolated Python process.
"""
from __future__ import annotations

import importlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

from .data import Problem

MATH_LATEX = ("math500", "aime24", "aime25")
CODE = ("humaneval", "mbpp", "lcb")


def _result(correct, extracted=None, detail=None) -> dict:
    return {"correct": correct, "extracted": extracted, "detail": detail}


# ------------------------------------------------------------------ math

def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if absent."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    if not starts:
        return None
    i = starts[-1].end()
    if i >= len(text) or text[i] != "{":  # "\boxed 5" form: up to whitespace or '$'
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unbalanced: the model ran out of tokens mid-answer


_NUM = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"


def _to_number(s: str) -> Fraction | None:
    """Exact value of a plain number, a/b, or \\frac{a}{b} (already normalised); else None."""
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    try:
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
            return Fraction(s)
        m = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or \
            re.fullmatch(r"(-?)(-?[\d.]+)/(-?[\d.]+)", s)
        if m:
            v = Fraction(m.group(2)) / Fraction(m.group(3))
            return -v if m.group(1) else v
    except (ValueError, ZeroDivisionError):
        pass
    return None


def _unwrap(s: str, cmd: str) -> str:
    """Replace \\cmd{X} by X (X may contain balanced braces)."""
    while (k := s.find(cmd + "{")) >= 0:
        depth, j = 0, k + len(cmd)
        for j in range(k + len(cmd), len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                break
        s = s[:k] + s[k + len(cmd) + 1:j] + s[j + 1:]
    return s


def normalize_math(s: str) -> str:
    s = s.strip()
    s = re.sub(r"\\text\{\s+[a-zA-Z ]*\}\s*$", "", s)  # trailing "\text{ cm}" is a unit
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mbox", "\\mathbf"):
        s = _unwrap(s, cmd)
    s = re.sub(r"\\(left|right|displaystyle)\b", "", s)
    s = re.sub(r"\\[!,;:]|\\q?quad", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|\\%|%|\\\$|\$|°", "", s)  # degrees, percent, dollars
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = re.sub(r"^[a-zA-Z]=(?!.*=)", "", s)  # "x=5" -> "5", but keep equations with two '='
    s = s.rstrip(".")
    s = re.sub(r"(\d)\.0+$", r"\1", s) if re.fullmatch(r"-?\d+\.0+", s) else s
    return s


def math_equal(pred: str, ref: str) -> bool:
    a, b = normalize_math(pred), normalize_math(ref)
    if a == b:
        return True
    x, y = _to_number(a), _to_number(b)
    return x is not None and y is not None and abs(float(x - y)) <= 1e-6 * max(1.0, abs(float(y)))


def extract_gsm8k(text: str) -> str | None:
    """Final number: \\boxed{} first, then 'answer is', then '####', then the last number."""
    marked = [last_boxed(text)]
    for pat in (r"answer is[:\s]*(.{0,40})", r"####\s*(.{0,40})"):
        hits = re.findall(pat, text, re.I)
        marked.append(hits[-1] if hits else None)
    for c in filter(None, marked):
        if (v := _to_number(normalize_math(c))) is not None:  # e.g. \frac{1}{2}, 1,000 in \boxed
            return _fmt(v)
        if nums := re.findall(_NUM, c):  # first number after the marker
            return _fmt(_to_number(nums[0].replace(",", "")))
    nums = re.findall(_NUM, text)
    return _fmt(_to_number(nums[-1].replace(",", ""))) if nums else None


def _fmt(v: Fraction | None) -> str | None:
    if v is None:
        return None
    return str(v.numerator) if v.denominator == 1 else str(float(v))


# ------------------------------------------------------------------ code

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str) -> str:
    """Last ```python block (else last fenced block, else the whole text)."""
    blocks = _FENCE.findall(text)
    py = [b for lang, b in blocks if lang.lower() in ("python", "python3", "py")]
    if py or blocks:
        return (py or [b for _, b in blocks])[-1]
    return text


# Runs first in the child: no sockets, bounded memory. Best effort, not a security boundary.
_SANDBOX_PRELUDE = '''\
import socket as _s
def _no_net(*a, **k):
    raise OSError("network disabled during evaluation")
for _m in ("connect", "connect_ex", "bind", "sendto"):
    setattr(_s.socket, _m, _no_net)  # socketpair() etc. still work for asyncio
_s.create_connection = _s.getaddrinfo = _no_net
try:
    import resource as _r
    _r.setrlimit(_r.RLIMIT_AS, (4 << 30, 4 << 30))
except Exception:
    pass
del _s, _no_net, _m
'''

# LeetCode runs solutions with these names already imported / defined.
_LCB_PRELUDE = '''\
from typing import *
from collections import *
from functools import *
from itertools import *
from heapq import *
from bisect import *
import math, string, re, heapq, bisect, collections, itertools, functools
from math import inf, gcd, comb, isqrt, sqrt, log2
class ListNode:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next
class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val, self.left, self.right = val, left, right
'''


def run_program(program: str, timeout: float = 10.0) -> tuple[bool, str]:
    """Run `program` in a fresh `python -I` process inside a temp dir. (passed, detail)."""
    # Exit code 0 alone is not enough: a stray sys.exit(0) / os._exit(0) in the completion
    # would skip the asserts. The tests must also reach this last line.
    nonce = secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="fastspec_eval_") as d:
        path = Path(d) / "prog.py"
        path.write_text(f"{_SANDBOX_PRELUDE}{program}\nprint({nonce!r})\n", encoding="utf-8")
        # Minimal env: no proxies, no PYTHON* variables, HOME/TMP inside the scratch dir.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": d, "TMPDIR": d,
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", str(path)], cwd=d, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Kill the whole session so forked children cannot outlive the check.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.communicate()
            return False, f"timeout after {timeout:g}s"
    if proc.returncode == 0:
        if nonce.encode() in out:
            return True, "passed"
        return False, "exited before the tests finished"
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return False, (lines[-1][:200] if lines else f"exit code {proc.returncode}")


def _code_program(p: Problem, code: str) -> str | None:
    if p.bench == "humaneval":
        entry, stub = p.meta["entry_point"], p.meta["prompt"]
        if not re.search(rf"def\s+{re.escape(entry)}\s*\(", code):
            code = stub + code  # body-only completion: continue the given stub
        else:  # full function: keep the stub's imports (typing etc.) the prompt promised
            imports = [l for l in stub.splitlines() if l.startswith(("import ", "from "))]
            code = "\n".join(imports) + "\n" + code
        return f"{code}\n\n{p.reference}\n\ncheck({entry})\n"
    if p.bench == "mbpp":
        if not p.reference:
            return None
        return f"{code}\n\n{p.meta.get('test_setup', '')}\n" + "\n".join(p.reference) + "\n"
    if p.bench == "lcb":
        if "assert" not in (p.reference or ""):
            return None
        return f"{_LCB_PRELUDE}\n{code}\n\n{p.reference}\n"
    raise ValueError(p.bench)


# ------------------------------------------------------------------ gpqa / ifeval

def extract_letter(text: str) -> str | None:
    """A-D from 'answer is (X)' / 'Answer: X', then \\boxed{X}, then the last standalone letter."""
    hits = re.findall(r"(?i:answer)(?:\s+is)?\s*[:\-]?\s*[*(\[]*\s*([A-D])\b", text)
    if hits:
        return hits[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        m = re.fullmatch(r"\s*\(?([A-D])\)?\s*", _unwrap(boxed, "\\text"))
        if m:
            return m.group(1)
    hits = re.findall(r"(?<![\w'])([A-D])(?![\w'])", text)
    return hits[-1] if hits else None


def _ifeval_registry():
    # Only maintained checkers count; without one IFEval stays unscored.
    for mod in ("instruction_following_eval.instructions_registry",
                "lm_eval.tasks.ifeval.instructions_registry"):
        try:
            return importlib.import_module(mod)
        except Exception:
            continue
    return None


def _score_ifeval(p: Problem, completion: str) -> dict:
    reg = _ifeval_registry()
    if reg is None:
        return _result(None, None, "not scored: no IFEval checker installed")
    try:  # strict mode: every instruction must be followed
        ok = bool(completion.strip())
        for iid, kwargs in zip(p.reference["instruction_id_list"], p.reference["kwargs"]):
            inst = reg.INSTRUCTION_DICT[iid](iid)
            inst.build_description(**{k: v for k, v in (kwargs or {}).items() if v is not None})
            if "prompt" in (inst.get_instruction_args() or {}):
                inst.build_description(prompt=p.question)
            ok = ok and bool(inst.check_following(completion))
    except Exception as e:  # e.g. missing nltk data: unscored, not wrong
        return _result(None, None, f"not scored: {type(e).__name__}: {e}"[:200])
    return _result(ok, None, None)


# ------------------------------------------------------------------ entry point

def score(problem: Problem, completion: str, timeout: float = 10.0) -> dict:
    b = problem.bench
    if b == "gsm8k":
        got = extract_gsm8k(completion)
        ref = _to_number(problem.reference.replace(",", ""))
        return _result(got is not None and ref is not None
                       and abs(float(Fraction(got) - ref)) < 1e-6, got)
    if b in MATH_LATEX:
        got = last_boxed(completion)
        return _result(got is not None and math_equal(got, problem.reference), got)
    if b in CODE:
        code = extract_code(completion)
        program = _code_program(problem, code)
        if program is None:
            return _result(None, code, "not scored: no runnable tests")
        passed, detail = run_program(program, timeout)
        return _result(passed, code, detail)
    if b == "gpqa":
        got = extract_letter(completion)
        return _result(got == problem.meta["letter"], got)
    if b == "ifeval":
        return _score_ifeval(problem, completion)
    raise ValueError(f"no scorer for benchmark {b!r}")
