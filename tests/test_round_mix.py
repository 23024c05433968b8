"""graphs/round_mix.py: a planner's rounds by kind."""
from fastspec.graphs.round_mix import round_kind


def test_a_round_is_ar_only_drafting_only_or_mixed_by_its_steps_variants():
    assert round_kind(["ar"]) == "ar_only"
    assert round_kind(["draft"]) == "drafting_only"
    assert round_kind(["k0", "k1"]) == "drafting_only"
    assert round_kind(["ar", "k0"]) == "mixed"
    assert round_kind(["draft0", "ar"]) == "mixed"
