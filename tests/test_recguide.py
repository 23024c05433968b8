"""RecGuide: the verify forward pre-drafts the next block for its likely outcomes; a hit skips
the next draft forward, and the output is still exactly AR's."""
import random

import pytest
import torch

from conftest import random_token_prompts, tiny_drafter
from helpers import EOS, MASK, FakeStep, copy_model, exact_pair_law, logits_from, prefilled_engine
from fastspec.config import FastspecError
from fastspec.convention import FASTSPEC, NLD
from fastspec.engine import Engine, Step
from fastspec.methods.base import RunInfo
from fastspec.methods.recguide import (H_COVERED, H_HIT, H_RISKY, H_SLOTS, H_WANTED, RecGuide)
from fastspec.methods.step_clock import StepClock
from fastspec.sampling import SamplerState, SamplingParams







# Draft of a B = 4 round after seed s = 4: aligned index i proposes d(i+1) (fastspec's shift).
DRAFT = torch.stack([logits_from({3: 0.9}),             # d1 = 3 (exact: never a branch point)
                     logits_from({5: 0.45, 6: 0.40}),   # d2 = 5, risky (margin 0.05), alt 6
                     logits_from({7: 0.9}),             # d3 = 7, safe
                     logits_from({1: 0.8})])[None]      # d4 = 1: the guess of the bonus


def target(*tokens):
    return torch.stack([logits_from({t: 0.9}) for t in tokens])[None]


def branch_logits(tokens):
    return torch.stack([logits_from({t: 0.7}) for t in tokens])[None]


def run_round(verify_targets, variant="draft2", carry=None, policy="reference", seed="guess"):
    m = RecGuide(block=4, policy=policy, seed=seed)
    m.eos_ids = (EOS,)
    corr, cont = branch_logits([2, 4, 8, 0]), branch_logits([1, 2, 3, 4])
    overlap = torch.cat([verify_targets, corr, cont], 1)
    outputs = ([] if variant.startswith("hit") else [DRAFT]) + [overlap]
    step = FakeStep(outputs, 4)
    out = m.round(step, torch.tensor([4]), torch.tensor([4]), carry or {}, variant)
    return m, step, out


def test_overlap_layout_matches_hand_written_rows_mask_and_positions():
    # d2 is the one risky draft (c = 1): the reference policy wants [correction at 2, continuation].
    _, step, out = run_round(target(3, 6, 0, 0))
    draft_call, overlap = step.calls
    assert draft_call["ids"].tolist() == [[4, MASK, MASK, MASK]]
    M = MASK
    assert overlap["ids"].tolist() == [[4, 3, 5, 7,  6, M, M, M,  1, M, M, M]]
    assert overlap["rel"].tolist() == [[0, 1, 2, 3,  2, 3, 4, 5,  4, 5, 6, 7]]
    assert overlap["adapter"].int().tolist() == [[0, 0, 0, 0,  0, 1, 1, 1,  0, 1, 1, 1]]
    want = torch.tensor([
        # verify s d1 d2 d3 | correction a2 M M M | continuation d4 M M M
        [1, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0],
        [1, 1, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0],
        [1, 1, 1, 0,  0, 0, 0, 0,  0, 0, 0, 0],
        [1, 1, 1, 1,  0, 0, 0, 0,  0, 0, 0, 0],
        [1, 1, 0, 0,  1, 0, 0, 0,  0, 0, 0, 0],     # a2 sees s d1 and itself (seed: causal)
        [1, 1, 0, 0,  1, 1, 1, 1,  0, 0, 0, 0],     # its masks see s d1 and the whole branch
        [1, 1, 0, 0,  1, 1, 1, 1,  0, 0, 0, 0],
        [1, 1, 0, 0,  1, 1, 1, 1,  0, 0, 0, 0],
        [1, 1, 1, 1,  0, 0, 0, 0,  1, 0, 0, 0],     # the continuation sees the whole verify row
        [1, 1, 1, 1,  0, 0, 0, 0,  1, 1, 1, 1],
        [1, 1, 1, 1,  0, 0, 0, 0,  1, 1, 1, 1],
        [1, 1, 1, 1,  0, 0, 0, 0,  1, 1, 1, 1]])
    assert torch.equal(overlap["mask"][0].int(), want)


def test_correction_hit_carries_the_branch_draft():
    # The verifier accepts d1 = 3, rejects d2 = 5 and emits 6 = alt_2: correction 2 is hit.
    _, _, out = run_round(target(3, 6, 0, 0))
    assert out.n_emitted.tolist() == [2] and out.emitted[0, :2].tolist() == [3, 6]
    h = out.host[0].tolist()
    assert (h[H_RISKY], h[H_WANTED], h[H_COVERED:H_COVERED + 3], h[H_HIT], h[H_SLOTS]) == \
        (1, 2, [1, 0, 0], 1, 2)
    assert out.carry["valid"].tolist() == [1]
    assert out.carry["drafts"].tolist() == [[2, 4, 8, 0]]      # the correction branch's drafts


def test_wrong_alternative_is_no_hit():
    _, _, out = run_round(target(3, 8, 0, 0))                   # emits 8, not alt_2 = 6
    assert out.host[0, H_HIT].item() == 0 and out.carry["valid"].tolist() == [0]
    assert out.host[0, H_COVERED:H_COVERED + 3].tolist() == [0, 0, 0]


def test_full_acceptance_with_the_guessed_bonus_hits_the_continuation():
    _, _, out = run_round(target(3, 5, 7, 1))                   # all accepted, bonus 1 == d4
    assert out.n_emitted.tolist() == [4] and out.emitted[0].tolist() == [3, 5, 7, 1]
    assert out.host[0, H_COVERED:H_COVERED + 3].tolist() == [0, 1, 0]     # slot 1: continuation
    assert out.carry["drafts"].tolist() == [[1, 2, 3, 4]]


def test_full_acceptance_with_another_bonus_is_no_hit():
    _, _, out = run_round(target(3, 5, 7, 2))
    assert out.carry["valid"].tolist() == [0]


def test_a_hit_round_verifies_the_carried_draft_in_one_forward():
    _, _, first = run_round(target(3, 6, 0, 0))
    carry = first.carry
    _, step, out = run_round(target(2, 4, 8, 3), variant="hit2", carry=carry)
    assert len(step.calls) == 1                                 # no draft forward
    assert step.calls[0]["ids"][0, :4].tolist() == [4, 2, 4, 8]  # seed + the carried drafts
    assert out.n_emitted.tolist() == [4]


def test_a_seedless_correction_is_all_masks_and_hit_by_any_correction_at_its_position():
    """seed=mask: the correction branch is [M M M M] at L+2 (adapter on, bidirectional, seeing
    s d1); it is hit when d2 is the first rejection, whatever the verifier emitted there."""
    _, step, out = run_round(target(3, 8, 0, 0), seed="mask")        # emits 8, not alt_2 = 6
    overlap = step.calls[1]
    M = MASK
    assert overlap["ids"].tolist() == [[4, 3, 5, 7,  M, M, M, M,  1, M, M, M]]
    assert overlap["rel"].tolist() == [[0, 1, 2, 3,  2, 3, 4, 5,  4, 5, 6, 7]]
    assert overlap["adapter"].int().tolist() == [[0, 0, 0, 0,  1, 1, 1, 1,  0, 1, 1, 1]]
    assert overlap["mask"][0, 4:8].int().tolist() == [[1, 1, 0, 0,  1, 1, 1, 1,  0, 0, 0, 0]] * 4
    assert out.emitted[0, :2].tolist() == [3, 8]
    assert out.host[0, H_COVERED:H_COVERED + 3].tolist() == [1, 0, 0]
    assert out.carry["valid"].tolist() == [1] and out.carry["drafts"].tolist() == [[2, 4, 8, 0]]
    _, _, out = run_round(target(2, 0, 0, 0), seed="mask")           # d1 rejected: no branch
    assert out.carry["valid"].tolist() == [0]


def ranked_example(m: RecGuide):
    """`m.candidates` on one 4-block with hand-made draft probabilities (d2 the risky one); the
    second-best alternatives have probabilities 0.005, 0.10, 0.01, 0.02."""
    prob = torch.tensor([[0.9, 0.45, 0.9, 0.8]])
    alt_prob = torch.tensor([[[0.01, 0.005], [0.40, 0.10], [0.02, 0.01], [0.05, 0.02]]])
    alt_prob = alt_prob[..., :m.n_alts]
    margin = torch.tensor([[0.8, 0.05, 0.8, 0.7]])
    return m.candidates(FakeStep([], 4), torch.tensor([4]), margin, prob, alt_prob, torch.tensor([1]))


def test_likelihood_policy_ranks_branches_by_the_drafters_probabilities():
    idx, rank, cont, seedless, wanted, c = ranked_example(RecGuide(block=4, policy="likelihood"))
    # correction at d2: 1 · 0.40 = 0.40; continuation: 0.45 · 0.9 · 0.8 = 0.324;
    # correction at d3: 0.45 · 0.02 = 0.009 (d1 is exact in fastspec's convention: never a branch)
    assert cont[0].tolist() == [False, True, False]
    assert idx[0, 0].item() == 1 and idx[0, 2].item() == 2
    assert wanted[0].tolist() == [True, True, True] and not seedless.any() and not rank.any()


def test_likelihood_policy_with_more_slots_takes_the_next_most_likely_candidates():
    """slots=5 on the example above: its three candidates (d2, cont, d3; d1 is exact and the
    last draft has no correction branch), then two unwanted slots, pointing inside the block."""
    idx, _, cont, _, wanted, _ = ranked_example(RecGuide(block=4, policy="likelihood", slots=5,
                                                      branches=5))
    assert cont[0].tolist() == [False, True, False, False, False]
    assert idx[0].tolist()[:3] == [1, 0, 2] and wanted[0].tolist() == [True, True, True, False, False]
    assert all(0 <= i < 4 for i in idx[0].tolist())
    with pytest.raises(FastspecError, match="slots must be"):
        RecGuide(slots=5)                        # the reference policy has its three
    with pytest.raises(FastspecError, match="slots must be"):
        RecGuide(policy="likelihood", slots=7)


def test_mixed_policy_adds_seedless_corrections_for_the_outcomes_the_guess_misses():
    """seed=mix on the example above, 5 slots: guessed d2 0.40; continuation 0.324; seedless d2
    1 · (1 − 0.45 − 0.40) · 0.8 = 0.12; seedless d3 0.45 · (1 − 0.9 − 0.02) · 0.8 = 0.0288;
    guessed d3 0.45 · 0.02 = 0.009 (d4 guesses the bonus: no correction there)."""
    m = RecGuide(block=4, policy="likelihood", seed="mix", slots=5, branches=5)
    idx, rank, cont, seedless, wanted, _ = ranked_example(m)
    assert cont[0].tolist() == [False, True, False, False, False]
    assert idx[0].tolist() == [1, 0, 1, 2, 2]
    assert seedless[0].tolist() == [False, False, True, True, False]
    assert wanted[0].all() and not rank.any()
    with pytest.raises(FastspecError, match="policy=likelihood"):
        RecGuide(seed="mix")


def test_more_alternatives_rank_the_next_best_guesses_as_their_own_candidates():
    """alts=2, 4 slots: guessed d2 0.40; continuation 0.324; d2's second alternative 0.10;
    guessed d3 0.009 (d3's second, 0.0045, is fifth); with mix the seedless d2 (1 − 0.45 − 0.50)
    · 0.8 = 0.04 comes before guessed d3."""
    idx, rank, cont, seedless, _, _ = ranked_example(
        RecGuide(block=4, policy="likelihood", alts=2, slots=4, branches=4))
    assert cont[0].tolist() == [False, True, False, False]
    assert idx[0].tolist() == [1, 0, 1, 2] and rank[0].tolist() == [0, 0, 1, 0]
    assert not seedless.any()
    idx, rank, cont, seedless, _, _ = ranked_example(
        RecGuide(block=4, policy="likelihood", alts=2, seed="mix", slots=4, branches=4))
    assert idx[0].tolist() == [1, 0, 1, 1] and rank[0].tolist() == [0, 0, 1, 0]
    assert seedless[0].tolist() == [False, False, False, True]
    with pytest.raises(FastspecError, match="alts"):
        RecGuide(alts=2)                         # the reference policy guesses one alternative


def test_a_second_alternative_hits_when_the_verifier_emits_it():
    """alts=2, 3 slots [guessed d2 (alt 6), continuation, d2's second alternative (4)]."""
    m = RecGuide(block=4, policy="likelihood", alts=2, slots=3, branches=3)
    m.eos_ids = (EOS,)
    draft = DRAFT.clone()
    draft[0, 1] = logits_from({5: 0.45, 6: 0.40, 4: 0.10})
    branches = [branch_logits([2, 4, 8, 0]), branch_logits([1, 2, 3, 4]), branch_logits([7, 7, 7, 7])]
    step = FakeStep([draft, torch.cat([target(3, 4, 0, 0)] + branches, 1)], 4)   # emits 4
    out = m.round(step, torch.tensor([4]), torch.tensor([4]), {}, "draft3")
    assert step.calls[1]["ids"][0, 8:].tolist() == [1, MASK, MASK, MASK, 4, MASK, MASK, MASK]
    assert step.calls[1]["rel"][0, 12:].tolist() == [2, 3, 4, 5]
    assert out.host[0, H_COVERED:H_COVERED + 3].tolist() == [0, 0, 1]
    assert out.carry["drafts"].tolist() == [[7, 7, 7, 7]]
    assert out.carry["alt"].shape == (1, 4, 2)


def run_mixed_round(verify_targets):
    """One mixed round, 3 slots laid out: [guessed d2 (alt 6), continuation, seedless d2]."""
    m = RecGuide(block=4, policy="likelihood", seed="mix", slots=3, branches=3)
    m.eos_ids = (EOS,)
    branches = [branch_logits([2, 4, 8, 0]), branch_logits([1, 2, 3, 4]), branch_logits([9, 9, 9, 9])]
    step = FakeStep([DRAFT, torch.cat([verify_targets] + branches, 1)], 4)
    out = m.round(step, torch.tensor([4]), torch.tensor([4]), {}, "draft3")
    return step, out


def test_a_guessed_correction_wins_over_the_seedless_one_at_its_position():
    step, out = run_mixed_round(target(3, 6, 0, 0))                  # emits 6 = alt_2
    M = MASK
    assert step.calls[1]["ids"].tolist() == [[4, 3, 5, 7,  6, M, M, M,  1, M, M, M,  M, M, M, M]]
    assert step.calls[1]["adapter"].int().tolist() == \
        [[0, 0, 0, 0,  0, 1, 1, 1,  0, 1, 1, 1,  1, 1, 1, 1]]
    assert out.host[0, H_COVERED:H_COVERED + 3].tolist() == [1, 0, 0]
    assert out.carry["drafts"].tolist() == [[2, 4, 8, 0]]           # the guessed branch's


def test_the_seedless_correction_covers_what_the_guess_missed():
    _, out = run_mixed_round(target(3, 8, 0, 0))                     # emits 8, not alt_2
    assert out.host[0, H_COVERED:H_COVERED + 3].tolist() == [0, 0, 1]
    assert out.host[0, H_HIT].item() == 1 and out.carry["drafts"].tolist() == [[9, 9, 9, 9]]


# --- on a model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(seed=5)


def prompts(n, seed=0):
    return random_token_prompts(n, seed)


@pytest.mark.parametrize("convention", [FASTSPEC, NLD], ids=["fastspec", "nld"])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_a_branch_drafts_exactly_what_the_next_rounds_draft_forward_would(drafter, convention, p):
    """Correction branch at p inside the verify forward == the draft forward of the next round
    after the verifier commits `s d1 .. d(p-1)` and emits alt_p (same logits)."""
    model = drafter.model
    model.draft_convention = convention
    try:
        c = prefilled_engine(drafter, [11, 12, 13, 14, 15]).cache
        n = 8
        verify = torch.tensor([[20, 21, 22, 23, 24, 25, 26, 27]])
        alt = torch.tensor([99])
        slot = torch.tensor([0])
        step = Step(model, c.k, c.v, c.lengths[:1].clone(), slot, SamplerState(1), n)
        ids, mask, adapter, rel = RecGuide.overlap_layout(
            step, verify, torch.tensor([n]), [torch.tensor([p])], [alt], [torch.tensor([True])])
        branch = step.forward(ids, mask, adapter_on=adapter, rel_positions=rel)[:, n:]
        # The next round: s d1 .. d(p-1) committed, alt_p is its seed.
        c.lengths[0] = 5 + p
        nxt = Step(model, c.k, c.v, c.lengths[:1].clone(), slot, SamplerState(1), n)
        fresh = RecGuide(block=n).draft(nxt, alt, torch.tensor([n]))[2]
        from fastspec.convention import aligned_draft_logits
        got = aligned_draft_logits(convention, branch, model.mask_token_id)
        assert torch.allclose(got, fresh, atol=1e-4), (got - fresh).abs().max()
    finally:
        model.draft_convention = None


@pytest.mark.parametrize("branches", [0, 1, 3, "gate"])
@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_greedy_recguide_equals_ar(drafter, branches, concurrency):
    engine = Engine(drafter, backend="eager")
    ps = prompts(8, seed=concurrency)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
    for policy in ("reference", "likelihood"):
        out = engine.generate(ps, params, method=RecGuide(block=8, branches=branches, policy=policy),
                              concurrency=concurrency)
        assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    # Six likelihood-ranked slots (forced, or as many as the gate takes).
    wide = RecGuide(block=8, branches=6 if branches == 3 else branches, policy="likelihood", slots=6)
    out = engine.generate(ps, params, method=wide, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]


@pytest.mark.parametrize("convention", [FASTSPEC, NLD], ids=["fastspec", "nld"])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_greedy_seedless_recguide_equals_ar(drafter, convention, concurrency):
    drafter.model.draft_convention = convention
    try:
        engine = Engine(drafter, backend="eager")
        ps = prompts(6, seed=20 + concurrency)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
        for policy, seed, alts in (("reference", "mask", 1), ("likelihood", "mask", 1),
                                   ("likelihood", "mix", 2)):
            m = RecGuide(block=8, branches=3, policy=policy, seed=seed, alts=alts)
            out = engine.generate(ps, params, method=m, concurrency=concurrency)
            assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    finally:
        drafter.model.draft_convention = None


class MixedBlocks(RecGuide):
    """Requests in blocks of 4, 8 and 16, bucketed by size, with branches."""

    def __init__(self):
        super().__init__(block=16, branches=2)

    def block_for(self, seq):
        return (4, 8, 16)[seq.index % 3]

    def choose_block(self, seq):
        return seq.block

    def join_or_split(self, seqs, blocks):
        return blocks

    def plans(self):
        return [type(p)(b, p.variant) for p in super().plans() for b in (4, 8, 16)]


def test_greedy_recguide_with_mixed_block_sizes_and_bucketing_equals_ar(drafter):
    engine = Engine(drafter, backend="eager")
    ps = prompts(9, seed=4)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=6)
    out = engine.generate(ps, params, method=MixedBlocks(), concurrency=6)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    widths = {k.block for k in engine.runner.stats() if k.method.startswith("recguide")}
    assert widths == {4, 8, 16}


# --- the cost gate and what the warm-up builds -------------------------------------------


def gated(forward_ms, step_ms=None):
    m = RecGuide(block=8)
    m.begin(RunInfo(1, 1, set(), {} if step_ms is None else step_ms, forward_ms))
    return m


def test_the_warm_up_builds_the_branch_layouts_the_gate_reaches_on_this_device():
    """A CPU-like profile (each token ~2 ms: a branch of 8 costs more than the prior hit rate
    times the draft forward it saves) warms the plain round only; a GPU-like one (tokens almost
    free) warms every draft and hit layout."""
    cpu = gated(lambda rows, tokens: 10 + 2.0 * rows * tokens)
    # slot 1: saved T(8) = 26 ms, extra T(16) - T(8) = 16 ms; 0.3 * 26 = 7.8 <= 16: no branch.
    assert [p.variant for p in cpu.plans()] == ["draft0"]
    gpu = gated(lambda rows, tokens: 10 + 0.01 * rows * tokens)
    assert sorted(p.variant for p in gpu.plans()) == sorted(
        f"{v}{k}" for v in ("draft", "hit") for k in range(4))


def test_the_gate_reads_measured_steps_and_scales_the_profile_for_the_others():
    m = gated(lambda rows, tokens: 10 + 1.0 * rows * tokens)
    # Profile: T(8) = 18, T(16) = 26, T(24) = 34; draft0 = 36, draft1 = 44, hit1 = 26.
    assert m.gate(1, 8, hit=False) == 0           # 0.3 * 18 = 5.4 <= 8
    m.timed_step(1, 8, "draft0", 72.0)             # this machine runs at half the profile's speed
    assert m.step_time_ms(1, 8, "draft1") == pytest.approx(88.0)
    assert m.step_time_ms(1, 8, "draft0") == pytest.approx(72.0)
    assert m.gate(1, 8, hit=False) == 0
    # Slot 0 hit 96 times in 100: 0.935 * 36 > 16 admits it; slot 1 keeps the prior 0.3.
    m.slot_covered[0], m.slot_trials[0] = 96, 100
    assert m.gate(1, 8, hit=False) == 1
    for _ in range(5):
        m.timed_step(1, 8, "draft1", 200.0)        # measured: that branch is slow here after all
        m.timed_step(1, 8, "draft0", 72.0)
    assert m.gate(1, 8, hit=False) == 0


def test_step_times_follow_the_machines_load_not_when_each_step_was_last_timed():
    """B=4 and B=8 rounds alternate; the machine then slows to half speed and only B=8 runs.
    Read as profile × shape × level, B=4 keeps about its relative cost (0.9× the B=8 round, as
    measured together), although its last measurement was taken before the slowdown."""
    m = gated(lambda rows, tokens: 30 + 1.0 * tokens)         # draft0: B=4 68 ms, B=8 76 ms
    for _ in range(10):
        m.timed_step(1, 4, "draft0", 68.0)
        m.timed_step(1, 8, "draft0", 76.0)
    for _ in range(10):
        m.timed_step(1, 8, "draft0", 152.0)                    # half speed: only B=8 ran since
    assert m.clock.level > 1.6                                 # most of it read as the machine
    assert m.clock.ms(1, 8, "draft0") == pytest.approx(152.0, rel=0.02)
    # B=4 priced at today's level: ~0.8-0.9x the B=8 round, not the stale 68 / 152 = 0.45x.
    assert 0.75 < m.clock.ms(1, 4, "draft0") / m.clock.ms(1, 8, "draft0") < 0.95


# --- a model whose drafts are often right: hits happen -------------------------------------


def test_hits_happen_on_a_predictable_model_and_output_stays_ar():
    t = copy_model()
    engine = Engine(t, backend="eager")
    ps = [[5, 6, 7, 7, 7], [9, 9, 9], [3, 4, 3, 4]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar")
    m = RecGuide(block=8, branches=3)
    out = engine.generate(ps, params, method=m)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rep = m.report()
    assert rep["reused"] > 0
    # A hit round is one forward: forwards per request < 2 per round.
    assert sum(c.forwards for c in out) < sum(2 * c.rounds + 1 for c in out)




class TakesEveryHit(RecGuide):
    """Verifies every carried draft, whatever a step of their own costs (many hit rounds)."""

    def keep_hits(self, block, n_draft, n_hit):
        return True


@pytest.mark.parametrize("seed", ["guess", "mask"])
def test_sampled_recguide_preserves_the_target_distribution(seed):
    """The joint law of the 4th and 5th sampled tokens (past the first round, where carried
    branch drafts are verified; seedless ones too, drafted before the correction was drawn):
    RecGuide's empirical law approaches AR's exact law, the TV distance shrinking with the
    sample count."""
    V = 4
    t = copy_model(vocab=V, scale=0.5)
    engine = Engine(t, backend="eager")
    prompt = [0, 1, 0, 1, 0]
    exact = exact_pair_law(engine, prompt, 3, 4, 5)
    m = TakesEveryHit(block=4, branches=3, policy="likelihood", seed=seed)
    counts, tv, reused, first = torch.zeros(V, V), [], 0, 0
    for n in (400, 3200):
        params = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=s, ignore_eos=True)
                  for s in range(first, first + n)]
        first += n
        for c in engine.generate([prompt] * n, params, method=m, concurrency=16):
            counts[c.token_ids[3], c.token_ids[4]] += 1
        reused += m.report()["reused"]
        tv.append(0.5 * (counts / counts.sum() - exact).abs().sum().item())
    assert reused > 300                                 # carried drafts were verified
    assert tv[1] < tv[0] and tv[1] < 0.045, tv


def test_carried_state_survives_rounds_and_is_cleared_on_admit_and_retire():
    t = copy_model()
    engine = Engine(t, backend="eager")
    seen_valid = []
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ps = [[5, 6, 7, 7, 7], [9, 9, 9], [3, 4, 3, 4], [8, 8]]

    def watch(index, tokens, n_drafted):
        seen_valid.append(engine.carry["valid"][:2].clone())

    m = RecGuide(block=8, branches=3)
    engine.generate(ps, params, method=m, concurrency=2, on_commit=watch)
    assert any(v.any() for v in seen_valid)            # a pre-draft was carried between rounds
    # Every request retired: no slot keeps a pre-draft or a committed length.
    assert not engine.carry["valid"].any() and not engine.cache.lengths.any()
    # A newly admitted request never inherits its slot's old pre-draft.
    engine.carry["valid"][0] = 1
    engine.carry["drafts"][0] = 7
    engine.clear_slot(0)
    assert engine.carry["valid"][0] == 0 and not engine.carry["drafts"][0].any()


class MeasuredClock(StepClock):
    """Every step as if measured at exactly its given time."""

    def ms(self, rows, width, variant):
        return self.estimate(rows, width, variant)


class FixedTimes(RecGuide):
    """Round times from a fixed cost model (`costs`) instead of the (noisy) measured ones."""

    def begin(self, run):
        super().begin(run)
        self.clock = MeasuredClock(self.costs)


class FixedCosts(FixedTimes):
    def costs(self, rows, block, variant):
        return 10.0 + 0.2 * block + (0.0 if variant.startswith("hit") else 8.0)


@pytest.mark.parametrize("concurrency", [1, 2, 5, 8])
def test_adaptive_block_sizes_follow_the_verifier_and_stay_lossless(concurrency):
    """Blocks chosen per request per round from {4, 8, 16}: a model whose drafts are accepted
    grows its blocks; outputs equal AR at every concurrency, bucketed by block size."""
    rng = random.Random(concurrency)
    ps = [[rng.randrange(3, 32) for _ in range(rng.randrange(2, 9))] for _ in range(8)]
    share = block_share_equal_to_ar(Engine(copy_model(), backend="eager"), ps, 48, concurrency,
                                    FixedCosts(block=4, blocks=(4, 8, 16), branches=0))
    assert share.get(16, 0) > 0.3, share                   # long blocks once drafting goes well


def block_share_equal_to_ar(engine, ps, max_new_tokens, concurrency, *methods) -> dict[int, float]:
    """Greedy runs of each RecGuide method equal AR's token for token; the last one's share of
    rounds per block size (Table 4)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
    for m in methods:
        out = engine.generate(ps, params, method=m, concurrency=concurrency)
        assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    return methods[-1].report()["block_share"]


@pytest.mark.parametrize("sampling", ["greedy", "filtered"])
def test_compiled_recguide_rounds_equal_eager_rounds(drafter, sampling):
    """Every RecGuide step (draft / hit variants, each branch layout) traced and compiled
    (aot_eager: the same graphs inductor or a CUDA graph would get) equals eager, no recompiles."""
    params = (SamplingParams(max_new_tokens=20, ignore_eos=True) if sampling == "greedy" else
              SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=20, seed=3,
                             ignore_eos=True))
    ps = prompts(3, seed=11)
    t = copy_model()
    for model in (drafter, t):
        ref = Engine(model, backend="eager").generate(ps, params, method=RecGuide(block=4, branches=2),
                                                      concurrency=3)
        engine = Engine(model, backend="compile", compiler="aot_eager")
        out = engine.generate(ps, params, method=RecGuide(block=4, branches=2), concurrency=3)
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        assert [c.accept_lengths for c in out] == [c.accept_lengths for c in ref]
        assert engine.last_stats.recompiles == 0


def test_round_time_estimate_from_the_profile():
    """A round's time from the profile: overlap forward of (1 + k)·B tokens, plus the draft
    forward unless the drafts were carried; compared with the measured step in the report."""
    from fastspec.methods.base import RunInfo
    m = RecGuide(block=8)
    m.begin(RunInfo(1, 1, {2}, {(1, 8, "draft1"): 30.0, (1, 8, "hit1"): 16.0},
                    lambda rows, tokens: 1.0 * tokens))
    assert m.estimate_ms(1, 8, "draft1") == 16 + 8
    assert m.estimate_ms(1, 8, "hit1") == 16
    assert m.estimate_ms(1, 8, "draft0") == 8 + 8
    check = m.profile_check()
    assert check["steps"]["1x8:draft1"] == {"measured": 30.0, "profile": 24.0, "error": -0.2,
                                            "at_level": 0.0}
    assert check["steps"]["1x8:hit1"]["error"] == 0.0
    assert check["mean_abs_error"] == 0.1
    # The machine's level, seeded from these steps (their median measured/profile, 1.25).
    assert check["level"] == 1.25 and check["mean_abs_error_at_level"] == 0.125


def test_the_gate_bound_is_the_best_k_slots_could_give_at_the_observed_hit_rates():
    """bound_k = T(draft0) / (H_k·T(hit k) + (1 − H_k)·T(draft k)), H_k the share of rounds one
    of the first k candidates covered. Profile: a forward of n tokens costs 27 + 7n/8 ms (34, 41,
    48, 55 ms at 8, 16, 24, 32 tokens); measured: the one-branch run in results/README.md (72.1,
    46.7, 90.4 ms)."""
    m = RecGuide(block=8)                                  # reference policy: 3 slots
    m.begin(RunInfo(1, 1, {2}, {(1, 8, "draft0"): 72.1, (1, 8, "hit1"): 46.7, (1, 8, "draft1"): 90.4},
                    lambda rows, tokens: 27 + 7 * tokens / 8))
    assert [b["hit_rate"] for b in m.gate_bound(1)] == [0.0, 0.3, 0.6, 0.9]   # no round yet: priors
    m.table3["rounds"] = 100
    m.prefix_covered = [0, 34, 45, 51]                     # the first 1, 2, 3 candidates covered
    bound = m.gate_bound(1)
    assert [b["slots"] for b in bound] == [0, 1, 2, 3]
    assert [b["hit_rate"] for b in bound] == [0.0, 0.34, 0.45, 0.51]
    assert bound[0]["profile"] == bound[0]["measured"] == 1.0
    # 68 / (.34·41 + .66·75), 68 / (.45·48 + .55·82), 68 / (.51·55 + .49·89)
    assert [b["profile"] for b in bound[1:]] == pytest.approx([1.0719, 1.0195, 0.9489], abs=1e-4)
    # measured: 72.1 / (.34·46.7 + .66·90.4): the branch costs more in the run than in the profile
    assert bound[1]["measured"] == pytest.approx(0.9544, abs=1e-4)
    # two slots never ran: the profile's 48 and 82 ms at this run's level (1.139) and the mean
    # shape of its measured steps: 72.1 / (.45·51.67 + .55·88.26)
    assert bound[2]["measured"] == pytest.approx(0.9525, abs=1e-4)
    assert m.report()["gate_bound"] == m.gate_bound(m.rows)


def test_prefix_coverage_counts_a_round_once_for_every_k_past_its_first_covering_candidate():
    """H_k of the gate bound: the share of rounds one of the first k wanted candidates covered.
    Round 1 wants 3 and its 2nd covers; round 2 wants 1 and its 1st covers; round 3 wants 2 and
    only its 3rd (unwanted) candidate would have covered."""
    from fastspec.engine import Sequence
    m = RecGuide(block=8)
    for wanted, covered in ((3, (0, 1, 0)), (1, (1, 0, 0)), (2, (0, 0, 1))):
        seq = Sequence(0, [1], SamplingParams(), block=8)
        seq.host, seq.accept_lengths = [0] * (H_COVERED + 3), [2]     # the round just run
        seq.host[H_WANTED] = wanted
        for j, c in enumerate(covered):
            seq.host[H_COVERED + j] = c
        m.observe(seq)
    assert m.prefix_covered == [0, 1, 2, 2]
    assert m.table3["rounds"] == 3 and m.table3["covered"] == 2
    assert [b["hit_rate"] for b in m.gate_bound(1)] == [0.0, 0.3333, 0.6667, 0.6667]


def test_a_new_request_joins_the_block_the_run_mostly_takes():
    """With per-request block sizes, a request with no history yet starts at the block most of
    the run's rounds took (it joins their bucket instead of splitting the batch); once it has
    history, the chooser decides. Without bucketing there is no bucket to join."""
    from fastspec.engine import Sequence
    m = RecGuide(block=8, blocks=(4, 8, 16))
    m.block_choices = {4: 30, 8: 2}
    assert m.choose_block(Sequence(0, [1], SamplingParams())) == 4
    m.block_choices = {}
    seq = Sequence(1, [1], SamplingParams())
    assert m.choose_block(seq) == 8            # nothing measured yet: its starting block
    unbucketed = RecGuide(block=8, blocks=(4, 8, 16), bucketing=False)
    unbucketed.block_choices = {4: 30}
    assert unbucketed.choose_block(Sequence(2, [1], SamplingParams())) == 8


# --- planning a batch: one request's plan changes its batch's steps ------------------------


class RowCosts(FixedTimes):
    """Step times T(rows, B) = 10 + per_token · rows · B per forward (a draft round runs two)."""

    def __init__(self, per_token, **kw):
        self.per_token = per_token
        super().__init__(**kw)

    def costs(self, rows, block, variant):
        f = 10.0 + self.per_token * rows * block
        return f if variant.startswith("hit") else 2 * f


def with_history(index, block, commits):
    from fastspec.engine import Sequence
    seq = Sequence(index, [1], SamplingParams())
    seq.block = block
    seq.state["blocks"] = [block] * len(commits)
    seq.state["commits"] = list(commits)
    seq.accept_lengths = list(commits)
    return seq


def test_per_request_blocks_split_the_batch_only_when_that_commits_more_per_ms():
    """a drafts well (wants B=16), b badly (wants B=4). Geometric values: V_a = 11.2 / 6.73 /
    3.71 at B = 16 / 8 / 4, V_b = 1.05 at every B. CPU-like costs (each token 1 ms a row): two
    1-row steps, 52 + 28 ms -> 12.25 / 80 = 0.153 a ms, beat one 2-row step at B=8 (7.78 / 52 =
    0.150): keep the split. GPU-like (tokens almost free): one step at B=16, 12.25 / 20.6, beats
    two steps, 12.25 / 40.4."""
    kw = dict(block=8, blocks=(4, 8, 16), branches=0)
    for per_token, expected in ((1.0, [16, 4]), (0.01, [16, 16])):
        m = RowCosts(per_token, **kw)
        m.begin(RunInfo(2, 2, set(), {}, lambda rows, tokens: 1.0))
        a, b = with_history(0, 16, [16, 16, 16]), with_history(1, 4, [1, 1, 1])
        assert [m.choose_block(a), m.choose_block(b)] == [16, 4]
        assert [p.block for p in m.plan_round([a, b])] == expected


def test_a_lone_hit_beside_drafting_rows_is_dropped_when_its_own_step_costs_more():
    """B=8, CPU-like costs. 3 drafting rows + 1 hit: draft(4 rows) 84 + hit(1 row) 18 ms >
    draft(4 rows) 84 ms: the hit is dropped (it drafts afresh with the others). 2 + 2: draft(2)
    52 + hit(2) 26 = 78 < 84: the hits run as their own one-forward step. All rows hit: kept."""
    m = RowCosts(1.0, block=8, branches=0)
    m.begin(RunInfo(4, 4, set(), {}, lambda rows, tokens: 1.0))
    assert not m.keep_hits(8, 3, 1)
    assert m.keep_hits(8, 2, 2)
    assert m.keep_hits(8, 0, 4)
    hit, drafting = [0, 0, 1, 0], [0, 0, 0, 0]     # H_RISKY, H_WANTED, H_HIT, H_SLOTS
    seqs = [with_history(i, 8, [3]) for i in range(4)]
    for q, h in zip(seqs, (hit, drafting, drafting, drafting)):
        q.host = h
    assert [p.variant for p in m.plan_round(seqs)] == ["draft0"] * 4
    assert m.report()["dropped"] == 1 and m.report()["reused"] == 0
    for q, h in zip(seqs, (hit, hit, drafting, drafting)):
        q.host = h
    assert [p.variant for p in m.plan_round(seqs)] == ["hit0", "hit0", "draft0", "draft0"]
    assert m.report()["reused"] == 2


def test_the_gate_charges_a_batch_for_every_row_having_to_hit():
    """Branch tokens almost free (a GPU at low load): the prior hit rate 0.3 opens every slot
    for one request, but a step of 8 saves its draft forward only if all 8 rows hit (0.3^8)."""
    m = gated(lambda rows, tokens: 10 + 0.01 * rows * tokens)
    assert m.gate(1, 8, hit=False) == 3
    assert m.gate(8, 8, hit=False, together=8) == 0


def test_a_step_attends_only_as_far_as_its_own_branches_reach():
    """A plain B=4 round writes 4 columns past the committed length, two branches 12: the
    attention context follows the step, not the widest layout the method could lay out
    (B=32 with 3 slots: 128 columns)."""
    from fastspec.engine import CTX_STEP
    from fastspec.methods.base import Plan
    engine = Engine(copy_model(), backend="eager")
    m = RecGuide(block=4, blocks=(4, 32))
    engine.prepare(1, 400, m)
    assert m.step_width(Plan(4, "draft0")) == 4 and m.step_width(Plan(4, "hit2")) == 12
    assert engine.attention_ctx(m, CTX_STEP - 5, Plan(4, "draft0")) == CTX_STEP
    assert engine.attention_ctx(m, CTX_STEP - 5, Plan(4, "draft2")) == 2 * CTX_STEP
    assert engine.attention_ctx(m, CTX_STEP - 5) == 3 * CTX_STEP     # no plan: the widest, 128


def test_one_pass_statistics_equal_the_separate_ones():
    """draft_stats_and_alternatives == draft_stats + the alternatives by brute force (a masked
    arg-top-k over the whole vocabulary), for greedy drafts and for sampled ones far down the
    ranking, with EOS among the top tokens."""
    from fastspec.methods.drafter import draft_stats, draft_stats_and_alternatives

    def alternatives(logits, drafts, eos_ids, k):
        vocab = torch.arange(logits.shape[-1])
        banned = vocab == drafts[..., None]
        for e in eos_ids:
            banned = banned | (vocab == e)
        alt = logits.masked_fill(banned, float("-inf")).topk(k, dim=-1).indices
        return alt, (logits.gather(-1, alt) - logits.logsumexp(-1, keepdim=True)).exp()

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g)
    logits[0, 0, 7] = 9.0                  # EOS (7) the top token, 2nd after the draft
    logits[1, 1, 7] = 8.0
    logits[1, 1, 3] = 9.0
    for drafts in (logits.argmax(-1), torch.randint(0, 50, (3, 5), generator=g)):
        for k in (1, 3):
            fused = draft_stats_and_alternatives(logits, drafts, (7,), k=k)
            sep = (*draft_stats(logits, drafts), *alternatives(logits, drafts, (7,), k=k))
            assert torch.equal(fused[3], sep[3])
            for a, b in zip(fused, sep):
                torch.testing.assert_close(a, b)
    # The margin p1 − p2 is topk's, a tied maximum included (margin 0).
    logits[2, 2, 4] = logits[2, 2, 5] = 12.0
    _, p1, margin = draft_stats(logits, logits.argmax(-1))
    top2 = (logits.topk(2, dim=-1).values - logits.logsumexp(-1, keepdim=True)).exp()
    torch.testing.assert_close(p1, top2[..., 0])
    torch.testing.assert_close(margin, top2[..., 0] - top2[..., 1])
    assert margin[2, 2] == 0


# --- block 1: the AR round, where drafting does not pay -------------------------------------


class DraftingDoesNotPay(FixedTimes):
    """An AR round 10 ms, a drafting round 10 ms a forward plus 8 ms a drafted token: even a
    perfect B=4 round (4 tokens in 2 · 10 + 32 = 52 ms) commits less per ms than AR (1 in 10)."""

    def costs(self, rows, block, variant):
        return 10.0 if variant == "ar" else 2 * 10.0 + 8.0 * block


class DraftingRarelyPays(FixedTimes):
    """AR 10 ms, a drafting round 9.5 ms a token plus 0.5: a perfect round beats AR (B=4: 4 in
    38.5 ms), a round with 95% of drafts accepted does not (3.71 in 38.5 ms)."""

    def costs(self, rows, block, variant):
        return 10.0 if variant == "ar" else 9.5 * block + 0.5


@pytest.mark.parametrize("concurrency", [1, 3])
def test_where_drafting_does_not_pay_recguide_takes_ar_rounds_and_still_equals_ar(drafter, concurrency):
    """`blocks=1/4/8`: block 1 is a plain AR round (one forward, no draft). Where drafting rarely
    pays, requests run AR rounds and draft once after every EXPLORE of them in a row; where even
    a perfect draft would lose, they never draft. The output is AR's token for token."""
    from fastspec.methods.recguide import EXPLORE
    engine = Engine(drafter, backend="eager")
    ps = prompts(4, seed=concurrency)
    rarely = DraftingRarelyPays(block=4, blocks=(1, 4, 8), branches=0)
    never = DraftingDoesNotPay(block=4, blocks=(1, 4, 8), branches=0)
    assert block_share_equal_to_ar(engine, ps, 60, concurrency, rarely, never) == {1: 1.0}
    share = rarely.report()["block_share"]
    assert share[1] > 0.8, share
    assert 0 < share.get(4, 0) + share.get(8, 0) <= 1 / EXPLORE + 0.1, share


def test_an_ar_round_stays_out_of_the_verifiers_history_and_drops_carried_drafts():
    """History (the signal s and the stratum) counts drafting rounds only: an AR round says
    nothing about the drafts. After EXPLORE AR rounds in a row the chooser leaves AR out once,
    where a perfect draft would beat AR."""
    from fastspec.methods.recguide import EXPLORE
    for cls, explored in ((DraftingRarelyPays, 4), (DraftingDoesNotPay, 1)):
        m = cls(block=4, blocks=(1, 4, 8), branches=0)
        m.begin(RunInfo(1, 1, set(), {}, lambda rows, tokens: 1.0))
        seq = with_history(0, 4, [4, 4, 4])         # its last round: B=4, all 4 committed
        seq.host = [0] * (H_COVERED + m.n_cand)

        def plan():
            p = m.plan(seq)
            seq.block = p.block                     # as the engine does
            return p
        # s = 1 (geometric p = 0.95): V_4 = 3.71, V_8 = 6.63 tokens; both lose to AR's 1 in 10 ms.
        assert (plan().block, seq.state["commits"]) == (1, [4] * 4)
        for _ in range(EXPLORE - 1):
            seq.accept_lengths.append(1)
            p = plan()
            assert (p.block, p.variant) == (1, "ar")
        assert seq.state["blocks"] == [4] * 4 and seq.state["commits"] == [4] * 4
        seq.accept_lengths.append(1)
        assert plan().block == explored             # the EXPLORE-th AR round in a row
    # The AR round's step: one token, no drafts, carried drafts invalidated.
    step = FakeStep([target(9)], 1)
    carry = {"valid": torch.ones(1, dtype=torch.long), "drafts": torch.full((1, 8), 5)}
    out = m.round(step, torch.tensor([4]), torch.tensor([1]), carry, "ar")
    assert out.emitted.tolist() == [[9]] and out.n_emitted.tolist() == [1] and out.n_drafted.tolist() == [0]
    assert out.carry["valid"].tolist() == [0] and out.carry["drafts"].shape == (1, 8)
    assert out.host.shape == (1, H_COVERED + m.n_cand)
