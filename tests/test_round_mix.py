"""graphs/round_mix.py: a planner's rounds by kind."""
from fastspec.graphs.round_mix import round_kind


def test_a_round_is_ar_only_drafting_only_or_mixed_by_its_steps_variants():
    assert round_kind(["ar"]) == "ar_only"
    assert round_kind(["draft"]) == "drafting_only"
    assert round_kind(["k0", "k1"]) == "drafting_only"
    assert round_kind(["ar", "k0"]) == "mixed"
    assert round_kind(["draft0", "ar"]) == "mixed"


def test_a_plain_recguide_arm_is_the_one_bench_runs():
    """round_mix's `recguide` is fastspec bench's (blocks 1/4/8/16/32, survival tables), not
    the library's fixed B=8; explicit brackets and other methods pass through."""
    from fastspec.graphs.round_mix import arm_specs
    arms = arm_specs("ar,recguide@look_by_best=0,recguide[blocks=8],d2sd", "smollm2-135m")
    assert [a[0] for a in arms] == ["ar", "recguide@look_by_best=0", "recguide[blocks=8]", "d2sd"]
    label, spec, attrs = arms[1]
    assert spec.startswith("recguide[blocks=1/4/8/16/32") and attrs == {"look_by_best": 0}
    assert arms[2][1] == "recguide[blocks=8]" and arms[0][1:] == ("ar", {})
