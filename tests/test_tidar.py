"""TiDAR-style self-speculation: one forward per round verifies the draft and pre-drafts the next
block for every accepted prefix; the sub-block of the accepted length becomes the next draft,
right seed or not, and the output is still exactly AR's."""
import math

import pytest
import torch

from conftest import random_token_prompts, tiny_drafter
from fastspec.convention import FASTSPEC, NLD, aligned_draft_logits
from fastspec.engine import Engine, Step
from fastspec.methods.tidar import H_ACCEPTED, H_SEED_HIT, H_VALID, TiDAR
from fastspec.sampling import SamplerState, SamplingParams
from helpers import FakeStep, copy_model, exact_pair_law, logits_from, prefilled_engine

V, MASK, EOS, M = 10, 10, 9, 10
SEED = 4

# Draft of a B = 3 round after seed 4 (fastspec's shift: aligned index i proposes d(i+1)).
DRAFT = torch.stack([logits_from({3: 0.8, 8: 0.15}),    # d1 = 3, alternative 8
                     logits_from({5: 0.45, 6: 0.40}),   # d2 = 5, alternative 6
                     logits_from({1: 0.8})])[None]      # d3 = 1: the guess of the bonus


def target(*tokens):
    return torch.stack([logits_from({t: 0.9}) for t in tokens])[None]


# What the three sub-blocks of the forward predict (their argmax drafts).
SUB_BLOCKS = ([2, 4, 8], [0, 1, 2], [7, 7, 3])


def run_round(verify_targets, variant="cold", carry=None):
    m = TiDAR(block=3, seed="guess")
    m.eos_ids = (EOS,)
    subs = [torch.stack([logits_from({t: 0.7}) for t in toks])[None] for toks in SUB_BLOCKS]
    forward = torch.cat([verify_targets, *subs], 1)
    step = FakeStep(([] if variant == "warm" else [DRAFT]) + [forward], 3)
    out = m.round(step, torch.tensor([SEED]), torch.tensor([3]), carry or {}, variant)
    return step, out


def test_layout_matches_hand_written_tokens_mask_positions_and_adapter_flags():
    step, _ = run_round(target(3, 6, 0))
    draft_call, call = step.calls
    assert draft_call["ids"].tolist() == [[SEED, M, M]]          # cold: the draft forward first
    #                             verify    | j=0: d1 rejected | j=1: d2 rejected | j=2: all in
    assert call["ids"].tolist() == [[SEED, 3, 5,  8, M, M,  6, M, M,  1, M, M]]
    assert call["rel"].tolist() == [[0, 1, 2,  1, 2, 3,  2, 3, 4,  3, 4, 5]]
    assert call["adapter"].int().tolist() == [[0, 0, 0,  0, 1, 1,  0, 1, 1,  0, 1, 1]]
    want = torch.tensor([
        [1, 0, 0,  0, 0, 0,  0, 0, 0,  0, 0, 0],     # verify row: causal
        [1, 1, 0,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 0, 0,  1, 0, 0,  0, 0, 0,  0, 0, 0],     # alt 8 sees s and itself (causal seed)
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],     # its masks see s and the whole sub-block
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 0, 0,  0, 0, 0],     # alt 6 sees s d1
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 0, 0],     # the bonus guess sees s d1 d2
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1]])
    assert torch.equal(call["mask"][0].int(), want)


def test_unshifted_layout_seeds_the_corrections_and_leaves_the_bonus_a_mask():
    """NLD: every sub-block is bidirectional with the adapter on everywhere; the all-accepted
    sub-block has no bonus guess to seed it: [M M M]."""
    step = FakeStep([], 3, convention=NLD)
    ids, mask, adapter, rel = TiDAR(block=3, seed="guess").layout_tokens(
        step, torch.tensor([[SEED, 3, 5]]), torch.tensor([[8, 6, 0]]), torch.tensor([1]))
    assert ids.tolist() == [[SEED, 3, 5,  8, M, M,  6, M, M,  M, M, M]]
    assert rel.tolist() == [[0, 1, 2,  1, 2, 3,  2, 3, 4,  3, 4, 5]]
    assert adapter.int().tolist() == [[0, 0, 0,  1, 1, 1,  1, 1, 1,  1, 1, 1]]
    want = torch.tensor([
        [1, 0, 0,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],     # the seed sees its whole block too
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1]])
    assert torch.equal(mask[0].int(), want)


def test_seedless_layout_masks_the_correction_seeds():
    """seed=mask: the correction sub-blocks are [M M M] (adapter on, bidirectional), drafting
    past a correction not emitted yet; the all-accepted one keeps the bonus guess (shifted)."""
    step = FakeStep([], 3)
    ids, mask, adapter, rel = TiDAR(block=3, seed="mask").layout_tokens(
        step, torch.tensor([[SEED, 3, 5]]), torch.tensor([[8, 6, 0]]), torch.tensor([1]))
    assert ids.tolist() == [[SEED, 3, 5,  M, M, M,  M, M, M,  1, M, M]]
    assert rel.tolist() == [[0, 1, 2,  1, 2, 3,  2, 3, 4,  3, 4, 5]]
    assert adapter.int().tolist() == [[0, 0, 0,  1, 1, 1,  1, 1, 1,  0, 1, 1]]
    want = torch.tensor([
        [1, 0, 0,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  0, 0, 0],
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],     # the masked seed sees its whole block
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],
        [1, 0, 0,  1, 1, 1,  0, 0, 0,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 0,  0, 0, 0,  1, 1, 1,  0, 0, 0],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 0, 0],     # the bonus guess: a causal seed
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1],
        [1, 1, 1,  0, 0, 0,  0, 0, 0,  1, 1, 1]])
    assert torch.equal(mask[0].int(), want)
    assert TiDAR(block=3).seedless and not TiDAR(block=3, seed="guess").seedless   # the default


def test_a_seedless_sub_block_is_selected_like_a_seeded_one_and_never_counts_a_seed_hit():
    m = TiDAR(block=3, seed="mask")
    m.eos_ids = (EOS,)
    subs = [torch.stack([logits_from({t: 0.7}) for t in toks])[None] for toks in SUB_BLOCKS]
    step = FakeStep([DRAFT, torch.cat([target(3, 6, 0), *subs], 1)], 3)
    out = m.round(step, torch.tensor([SEED]), torch.tensor([3]), {}, "cold")
    assert out.emitted[0, :out.n_emitted[0]].tolist() == [3, 6]
    assert out.carry["drafts"].tolist() == [SUB_BLOCKS[1]]
    assert out.host[0, H_SEED_HIT].item() == 0          # emitted 6 = alt, but nothing guessed it


@pytest.mark.parametrize("verified, emitted, sub_block, seed_hit", [
    ((3, 6, 0), [3, 6], 1, 1),        # d2 rejected, the verifier emits alt 6: right seed
    ((3, 7, 0), [3, 7], 1, 0),        # d2 rejected, emits 7: wrong seed, same sub-block
    ((3, 5, 1), [3, 5, 1], 2, 1),     # all accepted, bonus 1 == the guess d3
    ((3, 5, 4), [3, 5, 4], 2, 0),     # all accepted, another bonus
    ((2, 0, 0), [2], 0, 0)])          # d1 rejected (emits 2, not alt 8)
def test_the_accepted_length_selects_its_sub_block_right_seed_or_not(verified, emitted,
                                                                     sub_block, seed_hit):
    _, out = run_round(target(*verified))
    assert out.emitted[0, :out.n_emitted[0]].tolist() == emitted
    h = out.host[0].tolist()
    assert (h[H_ACCEPTED], h[H_SEED_HIT], h[H_VALID]) == (sub_block, seed_hit, 1)
    assert out.carry["drafts"].tolist() == [SUB_BLOCKS[sub_block]]
    assert out.carry["valid"].tolist() == [1]


def test_a_warm_round_is_one_forward_over_the_carried_draft():
    _, first = run_round(target(3, 7, 0))                # carries sub-block 1: [0 1 2]
    step, out = run_round(target(0, 1, 5), variant="warm", carry=first.carry)
    (call,) = step.calls                                  # no draft forward
    alt = first.carry["alt"][0].tolist()
    assert call["ids"][0].tolist() == [SEED, 0, 1,  alt[0], M, M,  alt[1], M, M,  2, M, M]
    assert out.n_emitted.tolist() == [3] and out.host[0, H_ACCEPTED].item() == 2


# --- on a model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(seed=5)


@pytest.mark.parametrize("convention", [FASTSPEC, NLD], ids=["fastspec", "nld"])
def test_every_sub_block_drafts_what_the_next_rounds_draft_forward_would(drafter, convention):
    """Sub-block j inside the round's forward == the draft forward the next round runs after the
    verifier commits `s d1 .. dj` and emits the sub-block's seed (same logits); an unshifted
    drafter's all-accepted sub-block is that draft forward with a MASK for the unknown bonus."""
    model = drafter.model
    model.draft_convention = convention
    try:
        c = prefilled_engine(drafter, [11, 12, 13, 14, 15]).cache
        n = 4
        slot = torch.tensor([0])
        verify = torch.tensor([[20, 21, 22, 23]])
        alt, bonus = torch.tensor([[30, 31, 32, 33]]), torch.tensor([40])
        m = TiDAR(block=n, seed="guess")
        for j in range(n):
            # The round's forward (again each time: the fresh draft below overwrites its columns).
            c.lengths[0] = 5
            step = Step(model, c.k, c.v, c.lengths[:1].clone(), slot, SamplerState(1), n)
            ids, mask, adapter, rel = m.layout_tokens(step, verify, alt, bonus)
            logits = step.forward(ids, mask, adapter_on=adapter, rel_positions=rel)
            assert logits.shape[1] == n + n * n
            seed = ids[:, n + j * n]
            want_seed = (alt[0, j].item() if j < n - 1 else bonus.item() if convention.shift
                         else model.mask_token_id)
            assert seed.item() == want_seed
            c.lengths[0] = 5 + j + 1                       # s d1 .. dj committed
            nxt = Step(model, c.k, c.v, c.lengths[:1].clone(), slot, SamplerState(1), n)
            fresh = m.draft(nxt, seed, torch.tensor([n]))[2]
            sub = logits[:, n + j * n: n + (j + 1) * n]
            got = aligned_draft_logits(convention, sub, model.mask_token_id)
            assert torch.allclose(got, fresh, atol=1e-4), (j, (got - fresh).abs().max())
    finally:
        model.draft_convention = None


@pytest.mark.parametrize("convention", [FASTSPEC, NLD], ids=["fastspec", "nld"])
def test_a_seedless_sub_block_is_the_training_layouts_seedless_block(drafter, convention):
    """What `train-drafter --seedless` trains is what the round's forward runs: sub-block j < B-1
    (seed=mask) has the logits of the training pass's seedless block starting at L+j+1 over the
    committed `prefix s d1 .. dj`."""
    from fastspec.train.data import Example
    from fastspec.train.trainer import draft_logits, make_batch
    model = drafter.model
    model.draft_convention = convention
    try:
        prefix = [11, 12, 13, 14, 15]
        c = prefilled_engine(drafter, prefix).cache
        n = 4
        verify = torch.tensor([[20, 21, 22, 23]])
        step = Step(model, c.k, c.v, c.lengths[:1].clone(), torch.tensor([0]), SamplerState(1), n)
        ids, mask, adapter, rel = TiDAR(block=n, seed="mask").layout_tokens(
            step, verify, torch.tensor([[30, 31, 32, 33]]), torch.tensor([40]))
        with torch.no_grad():
            logits = step.forward(ids, mask, adapter_on=adapter, rel_positions=rel)
        ex = Example(prefix, verify[0].tolist() + [24, 25, 26, 27, 28])
        for j in range(n - 1):
            b = make_batch([ex], torch.tensor([[5 + j + 1]]), torch.zeros(1, 1, n, dtype=torch.bool),
                           n, model.mask_token_id, conv=convention, seedless=torch.tensor([[True]]))
            assert b.block_ids[0].tolist() == [model.mask_token_id] * n
            with torch.no_grad():
                trained = draft_logits(model, b)[0]
            sub = logits[0, n + j * n: n + (j + 1) * n]
            assert torch.allclose(trained, sub, atol=1e-4), (j, (trained - sub).abs().max())
    finally:
        model.draft_convention = None


@pytest.mark.parametrize("convention", [FASTSPEC, NLD], ids=["fastspec", "nld"])
def test_greedy_tidar_with_guessed_seeds_equals_ar(drafter, convention):
    drafter.model.draft_convention = convention
    try:
        engine = Engine(drafter, backend="eager")
        ps = prompts(5, seed=10)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        ar = engine.generate(ps, params, method="ar", concurrency=3)
        m = TiDAR(block=4, seed="guess", ar=0)
        out = engine.generate(ps, params, method=m, concurrency=3)
        assert [c.token_ids for c in out] == [c.token_ids for c in ar]
        assert m.report()["warm_rounds"] > 0
    finally:
        drafter.model.draft_convention = None


def prompts(n, seed=0):
    return random_token_prompts(n, seed)


@pytest.mark.parametrize("concurrency, block", [(1, 4), (3, 3), (8, 4)])
def test_greedy_tidar_equals_ar(drafter, concurrency, block):
    engine = Engine(drafter, backend="eager")
    ps = prompts(8, seed=concurrency)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
    out = engine.generate(ps, params, method=TiDAR(block=block), concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]


def test_greedy_tidar_with_an_unshifted_drafter_equals_ar(drafter):
    drafter.model.draft_convention = NLD
    try:
        engine = Engine(drafter, backend="eager")
        # (prompts(5, seed=9) meet a float near-tie, a 2e-6 logit gap, where even LinearSS's
        # verify forward and AR's one-token forward pick different tokens)
        ps = prompts(5, seed=10)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        ar = engine.generate(ps, params, method="ar", concurrency=3)
        out = engine.generate(ps, params, method=TiDAR(block=4), concurrency=3)
        assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    finally:
        drafter.model.draft_convention = None


def test_on_a_predictable_model_seeds_are_hit_and_every_later_round_is_one_forward():
    t = copy_model()
    engine = Engine(t, backend="eager")
    ps = [[5, 6, 7, 7, 7], [9, 9, 9], [3, 4, 3, 4], [8, 8, 5]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=2)
    m = TiDAR(block=4, seed="guess", ar=0)
    out = engine.generate(ps, params, method=m, concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    # Prefill + a two-forward cold round + one forward per later round.
    assert [c.forwards for c in out] == [c.rounds + 2 for c in out]
    rep = m.report()
    assert rep["warm_rounds"] == sum(c.rounds for c in out) - len(out) == rep["seed_trials"]
    assert 0 < rep["seed_hit_share"]
    assert rep["tau"] > 1.5
    assert rep["tokens_per_forward"] == pytest.approx(engine.last_stats.tokens_per_forward)


def test_carried_state_survives_rounds_and_is_cleared_on_admit_and_retire():
    t = copy_model()
    engine = Engine(t, backend="eager")
    seen = []

    def watch(index, tokens, n_drafted):
        seen.append(engine.carry["valid"][:2].clone())

    ps = [[5, 6, 7, 7, 7], [9, 9, 9], [3, 4, 3, 4], [8, 8]]
    engine.generate(ps, SamplingParams(max_new_tokens=30, ignore_eos=True), method=TiDAR(block=4, ar=0),
                    concurrency=2, on_commit=watch)
    assert any(v.all() for v in seen)                   # both slots carried a pre-draft
    assert not engine.carry["valid"].any() and not engine.carry["drafts"].any()
    assert not engine.cache.lengths.any()
    engine.carry["valid"][0] = 1
    engine.carry["drafts"][0] = 7
    engine.carry["alt"][0] = 3
    engine.clear_slot(0)                                # what admission does
    assert engine.carry["valid"][0] == 0
    assert not engine.carry["drafts"][0].any() and not engine.carry["alt"][0].any()


def test_compiled_tidar_rounds_equal_ar_without_recompiles(drafter):
    """Both round steps (cold, warm) traced and compiled (aot_eager: the graphs inductor or a
    CUDA graph would get) give AR's tokens; no step compiles twice."""
    ps = prompts(3, seed=11)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = Engine(drafter, backend="eager").generate(ps, params, method="ar", concurrency=3)
    engine = Engine(drafter, backend="compile", compiler="aot_eager")
    out = engine.generate(ps, params, method=TiDAR(block=3, ar=0), concurrency=3)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0
    layouts = {k.layout for k in engine.runner.stats() if k.method == "tidar(B=3,seed=mask,ar=0)"}
    assert layouts == {"tidar:cold", "tidar:warm"}


@pytest.fixture(scope="module")
def pair_law():
    """A tiny predictable model (sampling still has room to disagree) and AR's exact joint law
    of its 4th and 5th sampled tokens after the prompt."""
    t = copy_model(vocab=4, scale=0.5)
    engine = Engine(t, backend="eager")
    prompt = [0, 1, 0, 1, 0]
    return engine, prompt, exact_pair_law(engine, prompt, 3, 4, 5)


def sampled_pair_tv(engine, prompt, exact, method):
    """TV distance between the method's empirical law of tokens 4 and 5 and the exact law, after
    300 and after 2700 requests; and the verified pre-drafts (trials, wrong seeds among them)."""
    counts, tv, trials, misses, seed = torch.zeros(4, 4), [], 0, 0, 0
    for n in (300, 2400):
        params = [SamplingParams(temperature=1.0, max_new_tokens=5, seed=s, ignore_eos=True)
                  for s in range(seed, seed + n)]
        seed += n
        for c in engine.generate([prompt] * n, params, method=method, concurrency=64):
            counts[c.token_ids[3], c.token_ids[4]] += 1
        rep = method.report()
        trials += rep["seed_trials"]
        misses += rep["seed_trials"] - rep["seed_hits"]
        tv.append(0.5 * (counts / counts.sum() - exact).abs().sum().item())
    return tv, trials, misses


@pytest.mark.parametrize("seed", ["guess", "mask"])
def test_sampled_tidar_preserves_the_target_distribution(pair_law, seed):
    """Tokens 4 and 5 are (mostly) verified by warm rounds from carried sub-blocks, seeded right
    or wrong (or seedless): TiDAR's empirical law approaches AR's exact law, the distance
    shrinking."""
    tv, trials, misses = sampled_pair_tv(*pair_law, TiDAR(block=3, seed=seed, ar=0))
    assert trials > 1500 and misses > 300     # carried drafts were verified, wrong seeds among them
    assert tv[1] < tv[0] and tv[1] < 0.045, tv


class UniformClaim(TiDAR):
    """A broken TiDAR: it carries the selected sub-block's drafts but claims they were drawn
    from a uniform q, so the next round's rejection rule uses the wrong ratio."""

    def round(self, step, pending, blocks, carry, variant=""):
        out = super().round(step, pending, blocks, carry, variant)
        if "logp" in out.carry:
            V = out.carry["logp"].shape[-1]
            out.carry["logp"] = torch.full_like(out.carry["logp"], -math.log(V))
        return out


def test_the_law_check_sees_wrong_draft_probabilities(pair_law):
    tv, _, _ = sampled_pair_tv(*pair_law, UniformClaim(block=3, ar=0))
    assert tv[1] > 0.08, tv


# --- the block size is the device's choice ------------------------------------------------------
def test_expected_commit_is_the_geometric_sum_of_the_accepted_run():
    # V(B) = 1 + a + ... + a^(B-1): B = 3, a = 0.5 -> 1.75; a perfect draft commits the block
    assert TiDAR.expected_commit(3, 0.5) == pytest.approx(1.75)
    assert TiDAR.expected_commit(4, 0.0) == 1.0 and TiDAR.expected_commit(4, 1.0) == 4.0


def test_the_acceptance_rate_is_learned_from_warm_rounds_only():
    """a = (accepted + 1) / (accepted + rejections + 2) over the rounds that verified a
    pre-draft: the cold round's ordinary draft is left out."""
    from types import SimpleNamespace
    m = TiDAR(block=3, ar=0)
    assert m.accept_rate() == 0.5                               # Laplace: no data yet
    seq = SimpleNamespace(host=None, state={})
    hosts = [None,                  # first round: cold
             [0, 2, 1],             # the cold round accepted 2: not counted; next is warm
             [0, 2, 1],             # warm, whole block accepted: 2 drafts, no rejection
             [1, 0, 1]]             # warm, first draft rejected: 0 drafts, 1 rejection
    variants = []
    for h in hosts:
        seq.host = h
        variants.append(m.plan(seq).variant)
    assert variants == ["cold", "warm", "warm", "warm"]
    assert (m.accepted_drafts, m.rejections) == (2, 1)
    assert m.accept_rate() == pytest.approx(3 / 5)


def test_the_profile_picks_the_block_and_a_small_gain_does_not_change_it():
    m = TiDAR()
    m.accepted_drafts, m.rejections = 8, 2                      # a = 0.75

    def flat_then_steep(rows, tokens):  # a GPU-like device: flat to 12 tokens a row
        return 10.0 if tokens <= 12 else 10.0 * tokens
    assert m.choose_block(1, flat_then_steep) == 3              # 6 and 12 tokens cost the same
    assert m.report()["block_choice"]["block"] == 3
    # A CPU-like device, every token paid: 6 tokens beat 12 by far
    assert m.choose_block(1, lambda rows, tokens: float(tokens) ** 2) == 2
    m.block = 2
    # B = 3 only 2% faster than the current B = 2: keep 2 (its steps are built)
    v2, v3 = TiDAR.expected_commit(2, 0.75), TiDAR.expected_commit(3, 0.75)
    t3 = 100.0 * v3 / v2 / 1.02

    def near(rows, tokens):
        return {6: 100.0, 12: t3}.get(tokens, 1e9)
    assert m.choose_block(1, near) == 2
    assert m.choose_block(1, lambda r, t: {6: 100.0, 12: t3 / 1.1}.get(t, 1e9)) == 3


def test_auto_tidar_runs_the_chosen_block_and_equals_ar(drafter):
    """block=auto: each run takes the block its device's costs and the acceptance so far
    choose, builds that block's steps, and stays AR's tokens, the block changing between runs."""
    engine = Engine(drafter, backend="eager")
    ps = prompts(5, seed=12)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=2)
    m = TiDAR(ar=0)
    engine._forward_cost = lambda rows, tokens: 10.0 if tokens <= 12 else 10.0 * tokens
    out = engine.generate(ps, params, method=m, concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert m.block == 3 and m.report()["block"] == 3
    assert m.accepted_drafts + m.rejections > 0                 # a learned from this run
    assert m.rejections <= m.report()["warm_rounds"]
    engine._forward_cost = lambda rows, tokens: float(tokens) ** 2
    out = engine.generate(ps, params, method=m, concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert m.block == 2
    ran = {k.method for k in engine.runner.stats()}
    assert {"tidar(B=3,seed=mask,ar=0)", "tidar(B=2,seed=mask,ar=0)"} <= ran


def test_a_block_outside_the_range_is_one_clear_error():
    from fastspec.config import FastspecError
    for bad in (1, 17, "big", 2.5):
        with pytest.raises(FastspecError, match="auto or an integer"):
            TiDAR(block=bad)


def test_warm_rounds_that_lose_to_ar_switch_to_ar_and_a_look_starts_cold():
    """AR rounds (methods/ar_rounds.py), judged on warm rounds only: the cold round's draft
    forward is a look's entry fee, not its rate. T(rows, tokens) = 10 + tokens: AR 11 ms, a warm
    B=3 round (12 tokens) 22 ms; 1 token a warm round (.045 a ms) loses to .9 / 11 (.082)."""
    from types import SimpleNamespace
    from fastspec.methods.ar_rounds import EXPLORE
    from fastspec.methods.base import RunInfo
    m = TiDAR(block=3, prices="profile")
    m.look_by_best = False                      # a look is judged at a perfect draft (3 / 22)
    m.begin(RunInfo(1, 1, set(), {}, forward_ms=lambda rows, tokens: 10.0 + tokens))
    seq = SimpleNamespace(host=None, state={}, block=0, accept_lengths=[])

    def next_round(host, committed):
        seq.host = host
        if committed:
            seq.accept_lengths.append(committed)
        plan = m.plan_round([seq])[0]
        seq.block = plan.block                  # (what the engine does with a plan)
        return plan.variant

    assert next_round(None, 0) == "cold"                        # a perfect draft would pay
    assert next_round([0, 0, 1], 1) == "warm"                   # cold: not judged
    assert [next_round([0, 0, 1], 1) for _ in range(3)] == ["warm", "warm", "ar"]
    ar_rounds = 1
    while next_round([0, 0, 0], 1) == "ar":
        ar_rounds += 1
        assert ar_rounds < 100
    assert ar_rounds == EXPLORE                                 # then a look, cold: no pre-draft
    assert next_round([0, 0, 1], 1) == "warm"
    rep = m.report()
    assert (rep["cold_rounds"], rep["ar_rounds"], rep["looks"]) == (2, EXPLORE, 1)
    assert (m.accepted_drafts, m.rejections) == (0, 3)          # a's data: the warm rounds only


def test_tidar_where_drafting_cannot_pay_takes_ar_rounds_and_equals_ar(drafter):
    """A device on which every token costs its full price (T = 10 · rows · tokens): not even
    a perfect warm round (2 tokens for 6) beats AR, so every round is one AR forward and no
    pre-draft is ever carried."""
    engine = Engine(drafter, backend="eager")
    ps = prompts(4, seed=13)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=2)
    engine._forward_cost = lambda rows, tokens: 10.0 * rows * tokens
    m = TiDAR(block=2, prices="profile")
    seen = []
    out = engine.generate(ps, params, method=m, concurrency=2,
                          on_commit=lambda i, toks, n: seen.append(engine.carry["valid"].any()))
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rep = m.report()
    assert rep["ar_share"] == 1.0 and rep["warm_rounds"] == rep["cold_rounds"] == 0, rep
    assert not any(seen)
    assert [c.forwards for c in out] == [c.rounds + 1 for c in out]     # prefill + one a round


def test_tidar_mixing_ar_and_drafting_rounds_equals_ar(drafter):
    """Where a perfect draft would pay and the drafter's do not, requests switch to AR, look
    again (cold: the AR round dropped the pre-draft) and stay AR's tokens."""
    engine = Engine(drafter, backend="eager")
    ps = prompts(4, seed=14)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=2)
    engine._forward_cost = lambda rows, tokens: 10.0 + 1.0 * tokens
    m = TiDAR(block=3, prices="profile")
    m.look_by_best = False
    out = engine.generate(ps, params, method=m, concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rep = m.report()
    assert 0 < rep["ar_share"] < 1 and rep["looks"] >= 1, rep
    # The first two requests start cold, the two admitted later with AR rounds (the run's
    # rounds are mostly AR: ARSwitch.first_is_ar), and every look starts cold.
    assert rep["cold_rounds"] == 2 + rep["looks"], rep
    assert rep["warm_rounds"] == rep["seed_trials"] > 0, rep


def test_tidar_refuses_bad_ar_and_prices_options():
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError, match="ar must be 0 or 1"):
        TiDAR(ar=2)
    with pytest.raises(FastspecError, match="prices must be measured or profile"):
        TiDAR(prices="guess")
