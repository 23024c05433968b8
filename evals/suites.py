"""Benchmark names, suites and per-suite generation budgets."""
from __future__ import annotations

from fastspec.config import FastspecError

# Every benchmark we can load, prompt and score, in display order.
BENCHES = ["gsm8k", "math500", "aime25", "aime24", "humaneval", "mbpp", "lcb", "gpqa", "ifeval"]

SUITES: dict[str, list[str]] = {
    "math": ["gsm8k", "math500", "aime25"],
    "code": ["humaneval", "mbpp", "lcb"],
    "qa": ["gpqa", "ifeval"],
}
# "all" = every suite member; aime24 stays opt-in (--bench aime24) as a spare AIME set.
SUITES["all"] = [b for name in ("math", "code", "qa") for b in SUITES[name]]

SUITE_OF = {b: s for s in ("math", "code", "qa") for b in SUITES[s]} | {"aime24": "math"}

# lcb is a LeetCode-contest stand-in for LiveCodeBench; the star says so in tables.
DISPLAY_NAMES = {"lcb": "lcb*"}

# CPU-sized generation budgets; a GPU run may pass its own max_new_tokens.
MAX_NEW_TOKENS = {"math": 256, "code": 256, "qa": 128}

# Spellings people type for the same benchmark.
ALIASES = {"lcb*": "lcb", "leetcode_contest": "lcb", "livecodebench": "lcb",
           "gpqa_diamond": "gpqa", "math-500": "math500", "math_500": "math500",
           "aime2025": "aime25", "aime2024": "aime24"}


class UnknownBenchmark(FastspecError, ValueError):
    """Unknown suite or benchmark name; the message is one line listing valid names."""


def display_name(bench: str) -> str:
    return DISPLAY_NAMES.get(bench, bench)


def max_new_tokens(bench: str) -> int:
    return MAX_NEW_TOKENS[SUITE_OF[canonical_name(bench)]]


def canonical_name(name: str) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in BENCHES:
        raise UnknownBenchmark(f"unknown benchmark {name!r}; valid: {', '.join(BENCHES)}")
    return key


def resolve_benches(suite: str | None = None, bench: str | list[str] | None = None) -> list[str]:
    """Benchmarks to run. `bench` (name, comma list or list) wins over `suite`; default suite 'all'."""
    if bench:
        names = bench.split(",") if isinstance(bench, str) else list(bench)
        out = [canonical_name(n) for n in names if n.strip()]
        return list(dict.fromkeys(out))  # drop repeats, keep order
    key = (suite or "all").strip().lower()
    if key not in SUITES:
        raise UnknownBenchmark(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}")
    return list(SUITES[key])
