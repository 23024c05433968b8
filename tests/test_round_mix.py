"""graphs/round_mix.py: a planner's rounds by kind."""
from fastspec.graphs.round_mix import round_kind


def test_a_round_is_ar_only_drafting_only_or_mixed_by_its_steps_variants():
    assert round_kind(["ar"]) == "ar_only"
    assert round_kind(["draft"]) == "drafting_only"
    assert round_kind(["k0", "k1"]) == "drafting_only"
    assert round_kind(["ar", "k0"]) == "mixed"
    assert round_kind(["draft0", "ar"]) == "mixed"


def test_a_plain_recguide_arm_is_the_one_bench_runs():
    """round_mix's and method_ab's `recguide` is fastspec bench's (blocks 1/4/8/16/32, survival
    tables), not the library's fixed B=8; a spec's own options win; other methods pass through;
    --as-written keeps the specs as they are."""
    from fastspec.evals.runner import split_methods
    from fastspec.graphs.method_ab import arm_specs
    arms = arm_specs(split_methods("ar,recguide@look_by_best=0,recguide[blocks=8],d2sd"), "smollm2-135m")
    assert [a[0] for a in arms] == ["ar", "recguide@look_by_best=0", "recguide[blocks=8]", "d2sd"]
    tables = "profiles/smollm2-135m-survival.json"
    assert arms[1][1:] == (f"recguide[blocks=1/4/8/16/32;tables={tables}]", {"look_by_best": 0})
    assert arms[2][1] == f"recguide[blocks=8;tables={tables}]"
    assert arms[0][1:] == ("ar", {}) and arms[3][1:] == ("d2sd", {})
    assert arm_specs(["recguide"], "smollm2-135m", as_written=True) == [("recguide", "recguide", {})]
