"""D²SD: a first draft picks the likely rejection points, a second draft re-anchors there, and
the chain plus branches are verified as one prefix tree — lossless like every method."""
from types import SimpleNamespace

import pytest
import torch

from conftest import random_token_prompts, tiny_drafter
from helpers import look_as_if_perfect
from fastspec.convention import FASTSPEC, NLD
from fastspec.engine import Engine
from fastspec.methods.d2sd import D2SD, assemble_tree, covered_boundaries
from fastspec.methods.linear import LinearSS
from fastspec.methods.drafter import exact_first_draft
from fastspec.tree import tree_mask
from fastspec.sampling import SamplerState, SamplingParams, point_mass_logp
from fastspec.verify import accept_chain


def test_boundaries_are_the_most_likely_first_rejections():
    # c = P(draft accepted) per aligned index (d1..d4); block 5 judges d1..d4. fastspec's d1 is
    # exact, so it is never a boundary: P(first rejection at p) = Π_{i<p} c_i (1 − c_p)
    #   p=2: 1.0·0.9·... -> c1=0.9 is ignored (exact) -> 1·(1−0.5) = 0.5
    #   p=3: 0.5·(1−0.8) = 0.10,  p=4: 0.5·0.8·(1−0.6) = 0.16
    prob = torch.tensor([[0.9, 0.5, 0.8, 0.6, 0.1]])
    m = D2SD(block=8, branches=2)
    got = m.boundaries(exact_first_draft(FASTSPEC), prob, torch.tensor([5]))
    assert got.tolist() == [[2, 4]]
    # NLD's d1 is a real guess: P(first rejection at 1) = 0.1 joins the race.
    got = m.boundaries(exact_first_draft(NLD), prob, torch.tensor([5]))
    assert got.tolist() == [[2, 4]]          # 0.9·0.5 = 0.45, 0.9·0.5·0.8·0.4 = 0.144 > 0.1
    got = D2SD(block=8, branches=3).boundaries(exact_first_draft(NLD), prob, torch.tensor([5]))
    assert got.tolist() == [[2, 4, 1]]


def test_bad_options_are_refused():
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError):
        D2SD(block=8, branches=0)
    with pytest.raises(FastspecError):
        D2SD(block=6)
    with pytest.raises(FastspecError):
        D2SD(block=8, gate=2)
    with pytest.raises(FastspecError, match="ar must be 0 or 1"):
        D2SD(block=8, ar=2)
    with pytest.raises(FastspecError, match="prices must be"):
        D2SD(block=8, prices="guess")


@pytest.mark.parametrize("block, branches, concurrency", [(8, 2, 1), (4, 1, 3), (8, 3, 8)])
def test_greedy_d2sd_equals_ar_token_for_token(block, branches, concurrency):
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(6, seed=block + branches)
    params = SamplingParams(max_new_tokens=33)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    d2 = engine.generate(prompts, params, method=D2SD(block, branches, gate=0, ar=0), concurrency=concurrency)
    assert [c.token_ids for c in d2] == [c.token_ids for c in ar]
    # Three forwards a round, counted as run.
    assert all(c.forwards == 1 + 3 * c.rounds for c in d2)


def test_prefix_tree_matches_the_worked_example():
    # b = 5, K = 2, boundaries p = 2 and 4 (the module docstring's example). Tokens: s=10,
    # d1..d4 = 11..14, alternatives a_p = 20 + p, segment k's aligned drafts 30 + 10k + j.
    chain = torch.tensor([[10, 11, 12, 13, 14]])
    alt = torch.tensor([[21, 22, 23, 24, 25]])
    seg = torch.tensor([[[30, 31, 32, 33, 34], [40, 41, 42, 43, 44]]])
    tokens, parents, valid = assemble_tree(chain, alt, seg, torch.tensor([[2, 4]]), torch.tensor([5]))
    #                    s  d1 d2 d3 d4 | a2 e3 e4 -  | a4 -  -  -
    assert tokens.tolist()[0][:8] + tokens.tolist()[0][9:10] == [10, 11, 12, 13, 14, 22, 32, 33, 24]
    assert parents.tolist() == [[-1, 0, 1, 2, 3, 1, 5, 6, 0, 3, 0, 0, 0]]
    assert valid.int().tolist() == [[1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0]]
    mask, depth = tree_mask(parents)
    assert depth[0, :8].tolist() == [0, 1, 2, 3, 4, 2, 3, 4] and depth[0, 9].item() == 4


def test_d2sd_compiled_step_equals_ar():
    engine = Engine(tiny_drafter(), backend="compile", compiler="aot_eager")
    prompts = random_token_prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=20)
    ar = engine.generate(prompts, params, concurrency=3)
    d2 = engine.generate(prompts, params, method=D2SD(4, 1, gate=0, ar=0), concurrency=3)
    assert [c.token_ids for c in d2] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0


def test_a_boundary_covers_the_outcome_when_the_verifier_diverges_there_with_its_alternative():
    # The docstring's example: d1..d4 = 11..14, a2 = 22, a4 = 24, boundaries (2, 4).
    drafts = torch.tensor([[11, 12, 13, 14, 0]] * 4)
    alt = torch.tensor([[21, 22, 23, 24, 25]] * 4)
    bounds = torch.tensor([[2, 4]] * 4)
    emitted = torch.tensor([[11, 22, 35, 0, 0],      # diverged at depth 2 with a2
                            [11, 12, 13, 24, 0],     # at depth 4 with a4
                            [11, 23, 0, 0, 0],       # at depth 2, not with a2
                            [11, 12, 13, 14, 24]])   # all accepted: no boundary
    n_emitted = torch.tensor([3, 4, 2, 5])
    got = covered_boundaries(emitted, n_emitted, drafts, alt, bounds)
    assert got.int().tolist() == [[1, 0], [0, 1], [0, 0], [0, 0]]


def gate_after(rounds, times, branches=2):
    """A D²SD planner after `rounds` (tokens committed, covered flags, boundaries, branches laid
    out), pricing steps at `times` {k: ms} as measured."""
    from types import SimpleNamespace
    from fastspec.methods.base import RunInfo
    m = D2SD(block=8, branches=branches, ar=0)
    m.begin(RunInfo(1, 1, set(), {}, lambda rows, tokens: 10.0 + tokens))
    for k, ms in times.items():
        for _ in range(3):
            m.timed_step(1, 8, f"k{k}", ms)
    seq = SimpleNamespace(host=[], accept_lengths=[], state={}, block=8)
    for tokens, covered, bounds, laid in rounds:
        seq.state["branches"] = laid
        seq.host, seq.accept_lengths = list(covered) + list(bounds), [tokens]
        m.observe(seq)
    return m


def test_the_branch_gate_lays_out_branches_only_where_their_tokens_pay_for_their_step():
    """Half the rounds commit 3 tokens along the chain; in the other half branch 0 covers the
    outcome (boundary 2) and adds 3 tokens to the chain's 2. Where a branch's round costs about what a chain round does
    (a GPU), lay it out; where it costs twice as much (a 2-core CPU), run the chain alone."""
    rounds = [(3, (0, 0), (2, 4), 1), (5, (1, 0), (2, 4), 1)] * 20
    cheap = gate_after(rounds, {0: 20.0, 1: 22.0, 2: 24.0})
    assert cheap.hit_rate(0) == pytest.approx((20 + 1.2) / 44)
    assert cheap.mean_extra(0) == pytest.approx(3.0, abs=0.2)    # (prior: 2 rounds of 1.48)
    assert cheap.choose_branches() >= 1
    dear = gate_after(rounds, {0: 20.0, 1: 40.0, 2: 60.0})
    assert dear.choose_branches() == 0
    assert gate_after(rounds, {0: 20.0, 1: 40.0, 2: 60.0}).plan(
        SimpleNamespace(host=[], accept_lengths=[], state={})).variant == "k0"


def test_chain_rounds_still_count_the_branches_they_would_have_hit():
    """A chain round (k0) that diverged at boundary 2 with a2 books the hit (the branch was
    not laid out: no tokens added) and counts the chain's own tokens."""
    m = gate_after([(2, (1, 0), (2, 4), 0)] * 10, {})
    assert m.covered == [10, 0] and m.hits_laid == [0, 0] and m.mean_chain() == pytest.approx(2.0)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_gated_d2sd_equals_ar_and_counts_the_forwards_it_ran(concurrency):
    """With the gate, rounds switch between the chain alone (two forwards) and trees (three);
    outputs equal AR and every forward is counted."""
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(4, seed=20 + concurrency)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    m = D2SD(8, 2, ar=0)
    d2 = engine.generate(prompts, params, method=m, concurrency=concurrency)
    assert [c.token_ids for c in d2] == [c.token_ids for c in ar]
    rep = m.report()
    assert rep["rounds"] > 0 and abs(sum(rep["branch_share"].values()) - 1) < 1e-9, rep
    for c in d2:
        assert 1 + 2 * c.rounds <= c.forwards <= 1 + 3 * c.rounds


def test_a_chain_round_equals_linearss_round_for_round():
    """k0 is LinearSS's round: with the gate held at k0, D²SD commits the same tokens in the
    same rounds with the same forwards, by length (no tree, no compaction)."""
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(3, seed=31)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    linear = engine.generate(prompts, params, method=LinearSS(8), concurrency=2)
    m = D2SD(8, 2, ar=0, narrow=0)
    m.choose_branches = lambda: 0
    d2 = engine.generate(prompts, params, method=m, concurrency=2)
    for a, b in zip(d2, linear):
        assert a.token_ids == b.token_ids
        assert (a.rounds, a.forwards, a.accept_lengths) == (b.rounds, b.forwards, b.accept_lengths)
    assert m.report()["branch_share"] == {0: 1.0}


def test_a_chain_round_under_sampling_keeps_the_target_law():
    """The chain's drafts are the argmax (q a point mass on each): accept d with p(d), else
    draw from p without d, so the first token follows p exactly."""
    V, n = 6, 4
    target_logits = torch.randn(n, V, generator=torch.Generator().manual_seed(0)) * 1.5
    p0 = target_logits[0].softmax(-1)
    distances = []
    for samples, seed in ((500, 1), (50_000, 2)):
        sampler = SamplerState(samples, seed=seed, mode="sample")
        sampler.temperature.fill_(1.0)
        drafts = torch.tensor([2, 0, 5, 1]).expand(samples, n)
        logits = target_logits.expand(samples, n, V)
        emitted, _, accepted = accept_chain(drafts, logits, torch.full((samples,), n), sampler,
                                            point_mass_logp(drafts, logits))
        first = torch.bincount(emitted[:, 0], minlength=V).float() / samples
        distances.append(0.5 * (first - p0).abs().sum().item())
    assert accepted.float().mean() > 0 and distances[1] < 0.01 and distances[1] < distances[0]


def test_a_narrow_chain_runs_where_it_commits_more_per_ms():
    """Chains of 8 commit 3 or 5 tokens: a chain of 4 would have committed 3 or 4 (E_4 = 3.5,
    E_8 = 4). Priced like one row (T(4) = 40, T(8) = 45 ms: 3.5/40 = .0875 < 4/45 = .089) the
    round stays at 8; like two rows (T(4) = 50, T(8) = 86: .07 > .047) it narrows to 4. A
    narrow round books E_4 alone (E_8 cannot be read from it)."""
    from fastspec.config import FastspecError
    from fastspec.methods.ar_rounds import COMMIT_ROUNDS as NARROW_ROUNDS
    rounds = [(3, (0, 0), (2, 4), 0), (5, (0, 0), (2, 4), 0)] * (NARROW_ROUNDS // 2)
    for t4, t8, want in ((40.0, 45.0, 8), (50.0, 86.0, 4)):
        m = gate_after(rounds, {0: t8, 1: 3 * t8, 2: 5 * t8})
        for _ in range(3):
            m.timed_step(1, 4, "k0", t4)
        assert m.commits.mean(4) == 3.5 and m.commits.mean(8) == 4.0
        plan = m.plan(SimpleNamespace(host=[], accept_lengths=[], state={}, block=8))
        assert (plan.block, plan.variant) == (want, "k0")
    m.observe(SimpleNamespace(host=[0, 0, 2, 3], accept_lengths=[2], state={"branches": 0}, block=4))
    assert m.commits.sums == {4: (30.0, 9), 8: (32.0, 8)} and m.rounds == NARROW_ROUNDS
    assert gate_after(rounds[:-1], {0: 86.0}).choose_block(0) == 8       # E_8 not known yet
    with pytest.raises(FastspecError):
        D2SD(block=8, branches=4, narrow=4)
    assert D2SD(block=8, branches=4).narrow == 0 and D2SD(block=4, branches=1).narrow == 0


def test_a_narrow_chain_round_is_linearss_round_at_that_block():
    """Held at the narrow block, D²SD commits what LinearSS(4) commits, round for round."""
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(3, seed=32)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    linear = engine.generate(prompts, params, method=LinearSS(4), concurrency=2)
    m = D2SD(8, 2, ar=0)
    m.choose_block = lambda k: 4
    d2 = engine.generate(prompts, params, method=m, concurrency=2)
    for a, b in zip(d2, linear):
        assert a.token_ids == b.token_ids
        assert (a.rounds, a.forwards, a.accept_lengths) == (b.rounds, b.forwards, b.accept_lengths)
    rep = m.report()
    assert rep["block_share"] == {4: 1.0} and rep["expected_chain"][4] > 1
    assert rep["rounds"] == rep["narrow_rounds"] == sum(c.rounds for c in d2) - len(d2)


@pytest.mark.parametrize("concurrency", [1, 3])
def test_where_drafting_does_not_pay_d2sd_takes_ar_rounds_and_still_equals_ar(concurrency):
    """T = 10 ms a token: a perfect chain round (8 tokens, ~170 ms) loses to AR's 10 ms, so every
    round is an AR round (one forward, one token), as with LibraSpec and BASTION."""
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(4, seed=50 + concurrency)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    engine._forward_cost = lambda rows, tokens: 10.0 * rows * tokens
    m = D2SD(8, 2, prices="profile")
    out = engine.generate(prompts, params, method=m, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert not m.look_pays() and m.report()["ar_share"] == 1.0, m.report()
    for c in out:
        assert set(c.accept_lengths) == {1} and c.forwards == 1 + len(c.accept_lengths)


def test_a_d2sd_run_mixes_ar_and_chain_rounds_and_still_equals_ar(monkeypatch):
    """T = 10 + 3·tokens: a chain round (~60 ms) rarely beats AR's 13 ms, a perfect one would;
    requests switch between AR rounds and drafting rounds and the output is AR's. (Looks judged
    as if every draft were accepted: `look_as_if_perfect`.)"""
    look_as_if_perfect(monkeypatch)
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(6, seed=61)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=3)
    engine._forward_cost = lambda rows, tokens: 10.0 + 3.0 * tokens
    m = D2SD(8, 2, prices="profile")
    out = engine.generate(prompts, params, method=m, concurrency=3)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rep = m.report()
    assert m.look_pays() and rep["looks"] >= 1 and 0.5 < rep["ar_share"] < 1.0, rep
