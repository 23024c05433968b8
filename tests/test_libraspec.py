"""LibraSpec: the draft's confidences and the forward's cost choose each request's speculative
length every round; the verify width follows, and the output is still exactly AR's."""
import random
from collections import Counter
import time
from fractions import Fraction

import pytest
import torch

from conftest import random_token_prompts, tiny_drafter, tiny_loaded
from fastspec.convention import FASTSPEC, NLD
from fastspec.draft import AdapterConfig, attach_adapter
from fastspec.engine import Engine
from fastspec.methods.base import Plan, RunInfo
from fastspec.methods.libraspec import (H_CAPPED, H_GAMMA, H_ROWS, LibraSpec, choose_lengths,
                                        stop_length)
from fastspec.sampling import SamplerState, SamplingParams
from helpers import copy_model, look_as_if_perfect, null_quantile, tv

# T(γ) = forward_ms(rows, γ + 1) of the shipped CPU profile of SmolLM2-135M, γ = 0..8.
T_ROWS1 = [19.69, 19.70, 19.71, 19.72, 19.73, 19.73, 19.90, 20.73, 21.56]
T_ROWS8 = [48.37, 48.44, 48.50, 48.56, 48.63, 53.83, 60.44, 67.06, 73.68]
CONF = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.4]


def profile_like(rows: int, tokens: int) -> float:
    """A roofline-shaped T(rows, tokens): a fixed cost, flat while memory-bound, then growing
    with rows × tokens (so the marginal token costs more at larger batches)."""
    return 10.0 + 2.0 * rows + max(0.0, 0.5 * rows * tokens - 4.0)


# --- the stop rule -------------------------------------------------------------------------
def accepted_per_ms(conf, cost, gamma) -> Fraction:
    """E(γ) / T(γ), exactly: E(γ) = Σ_{k≤γ} Π_{i≤k} c_i, every product recomputed from scratch."""
    expected = Fraction(0)
    for k in range(1, gamma + 1):
        p = Fraction(1)
        for i in range(k):
            p *= Fraction(conf[i])
        expected += p
    return expected / Fraction(cost[gamma])


def first_local_max(conf, cost) -> int:
    """Brute force: enumerate γ = 0..n and stop at the first γ whose successor does not raise
    accepted drafts per verify millisecond."""
    n = len(conf)
    for g in range(n):
        if accepted_per_ms(conf, cost, g + 1) <= accepted_per_ms(conf, cost, g):
            return g
    return n


def random_case(rng, n, convex):
    """Confidences (c1 = 1: fastspec's exact d1) and costs T(0..n); continuous draws, so no
    two ratios tie."""
    conf = [1.0] + [rng.uniform(0.05, 1.0) for _ in range(n - 1)]
    if convex:       # increasing marginal costs, some of them zero
        steps = sorted(max(0.0, rng.uniform(-2.0, 8.0)) for _ in range(n))
    else:
        steps = [rng.choice([0.0, rng.uniform(0.0, 10.0)]) for _ in range(n)]
    cost = [rng.uniform(5.0, 20.0)]
    for s in steps:
        cost.append(cost[-1] + s)
    return conf, cost


@pytest.mark.parametrize("convex", [True, False])
def test_stop_rule_equals_brute_force_on_small_cases(convex):
    rng = random.Random(int(convex))
    seen = Counter()
    for _ in range(300):
        n = rng.randrange(1, 7)
        conf, cost = random_case(rng, n, convex)
        want = first_local_max(conf, cost)
        assert stop_length(conf, cost) == want, (conf, cost)
        got = choose_lengths(torch.tensor([conf], dtype=torch.float64), torch.tensor(cost))
        assert got.tolist() == [want], (conf, cost)
        if convex:   # E is concave (c <= 1) and T convex: E/T is unimodal, the rule finds its max
            ratios = [accepted_per_ms(conf, cost, g) for g in range(n + 1)]
            assert want == ratios.index(max(ratios)), (conf, cost)
        seen[want == n] += 1
    assert seen[True] > 20 and seen[False] > 20       # both stopping inside and running to the end


def test_stop_rule_on_hand_made_confidences_and_the_profile():
    # The module docstring's worked example: γ = 6 at rows 1, γ = 4 at rows 8.
    assert stop_length(CONF, T_ROWS1) == 6
    assert stop_length(CONF, T_ROWS8) == 4
    assert choose_lengths(torch.tensor([CONF, CONF]), torch.tensor(T_ROWS1)).tolist() == [6, 6]
    assert choose_lengths(torch.tensor([CONF]), torch.tensor(T_ROWS8)).tolist() == [4]
    # c = [1 .9 .5], T = [10 10 12 16]: .45·12 = 5.4 <= E(2)·4 = 7.6 stops at 2.
    assert stop_length([1, 0.9, 0.5], [10, 10, 12, 16]) == 2
    assert stop_length([1, 1, 1, 1], [10, 10, 10, 10, 10]) == 4      # free tokens, sure drafts
    assert stop_length([1, 0.0, 1, 1], [10, 10, 10, 10, 10]) == 1    # d2 cannot be accepted
    assert stop_length([1, 0.9], [10, 10, 10]) == 2
    assert stop_length([1, 0.05], [10, 11, 12]) == 1                 # .05·11 = .55 <= 1·1
    assert stop_length([1, 0.1], [10, 11, 12]) == 2                  # .1·11 = 1.1 > 1·1


def test_lengths_shrink_as_the_marginal_token_costs_more():
    """Costs whose marginal token grows relative to the forward: chosen lengths never grow,
    and they end strictly shorter."""
    rng = random.Random(7)
    for _ in range(50):
        conf = [1.0] + sorted((rng.uniform(0.3, 1.0) for _ in range(11)), reverse=True)
        lengths = [stop_length(conf, [20.0 + slope * g for g in range(13)])
                   for slope in (0.0, 0.1, 0.5, 2.0, 8.0)]
        assert lengths == sorted(lengths, reverse=True), lengths
        assert lengths[0] == 12 and lengths[-1] < lengths[0]


def test_lengths_shrink_from_rows_1_to_rows_8_under_a_roofline():
    """T grows faster with tokens at larger batches, so the same draft gets a shorter length."""
    rng = random.Random(3)
    shorter = 0
    for _ in range(50):
        conf = [1.0] + sorted((rng.uniform(0.2, 1.0) for _ in range(15)), reverse=True)
        g1 = stop_length(conf, [profile_like(1, g + 1) for g in range(17)])
        g8 = stop_length(conf, [profile_like(8, g + 1) for g in range(17)])
        assert g8 <= g1
        shorter += g8 < g1
    assert shorter > 25


# --- inside a round ------------------------------------------------------------------------
V, MASK = 10, 10


def logits_from(top: int, p: float) -> torch.Tensor:
    """Logits over V whose softmax puts p on `top` and spreads the rest evenly."""
    q = torch.full((V,), (1 - p) / (V - 1))
    q[top] = p
    return q.log()


class FakeStep:
    """Hands out prepared logits per forward (draft, then verify) and records the ids."""

    def __init__(self, outputs, width, convention=FASTSPEC):
        self.outputs, self.width, self.convention = list(outputs), width, convention
        self.sampler = SamplerState(len(outputs[0]))
        self.mask_token_id = MASK
        self.calls = []

    def forward(self, ids, block_mask, adapter_on=None, rel_positions=None):
        self.calls.append(ids)
        return self.outputs.pop(0)


def run_round(conf, rows, convention=FASTSPEC, forward_ms=None, batch_rows=None, cost_rows="batch"):
    """One round of width len(conf) for `rows` identical rows (of a run at batch bucket
    batch_rows): draft d_i = i with top-1 probability conf[i-1]; the verifier agrees with d1, d2
    only."""
    n = len(conf)
    m = LibraSpec(block=8, cost_rows=cost_rows)
    batch_rows = batch_rows or rows
    m.begin(RunInfo(batch_rows, batch_rows, set(), {}, forward_ms or profile_like))
    draft = torch.stack([logits_from(i + 1 if i + 1 < V else 1, c) for i, c in enumerate(conf)])
    verify = torch.stack([logits_from(t, 0.9) for t in [1, 2, 0] + [0] * (n - 3)])
    step = FakeStep([draft.expand(rows, n, V), verify.expand(rows, n, V)], n, convention)
    out = m.round(step, torch.zeros(rows, dtype=torch.long), torch.full((rows,), n), {})
    return m, step, out


def test_a_round_verifies_its_whole_width_and_reports_the_chosen_length():
    conf = [0.3, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.4]       # c1 counts as 1: d1 is exact
    table = {1: T_ROWS1, 8: T_ROWS8}
    for rows, want in ((1, 6), (8, 4)):
        m, step, out = run_round(conf, rows, forward_ms=lambda r, t: table.get(r, T_ROWS8)[t - 1] if t <= 9 else 99.0)
        draft_ids, verify_ids = step.calls
        assert draft_ids[0].tolist() == [0] + [MASK] * 7
        assert verify_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]        # judges d1..d7
        assert out.n_drafted.tolist() == [2] * rows and out.n_emitted.tolist() == [3] * rows
        assert out.host[:, H_GAMMA].tolist() == [want] * rows
        assert out.host[:, H_CAPPED].tolist() == [0] * rows
        assert out.host[:, H_ROWS].tolist() == [rows] * rows


def test_cost_rows_batch_reads_t_at_the_run_and_step_at_the_step():
    """A step of 1 row in a run of 8: "batch" prices tokens at rows 8 (γ = 4), "step" at its own
    single row (γ = 6)."""
    conf = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.4]
    table = {1: T_ROWS1, 8: T_ROWS8}
    cost = lambda r, t: table.get(r, T_ROWS8)[t - 1] if t <= 9 else 99.0    # noqa: E731
    _, _, out = run_round(conf, 1, forward_ms=cost, batch_rows=8)
    assert out.host[0].tolist() == [4, 0, 8]
    _, _, out = run_round(conf, 1, forward_ms=cost, batch_rows=8, cost_rows="step")
    assert out.host[0].tolist() == [6, 0, 1]


def test_sure_drafts_run_to_the_last_known_draft_and_ask_for_more():
    # Shifted (fastspec): d1..d4 known in a width-4 draft; unshifted (NLD): d1..d3.
    _, _, out = run_round([1.0] * 4, 1, FASTSPEC, lambda r, t: 10.0)
    assert out.host[0, :2].tolist() == [4, 1]
    _, _, out = run_round([1.0] * 4, 1, NLD, lambda r, t: 10.0)
    assert out.host[0, :2].tolist() == [3, 1]
    # The first judged draft is always worth it (E(0) = 0); under NLD it is not exact, and a
    # weak c1 = .2 stops there under a steep cost: .04·20 = 0.8 <= E(1)·10 = 2.
    _, _, out = run_round([0.2] * 4, 1, NLD, lambda r, t: 10.0 * t)
    assert out.host[0, :2].tolist() == [1, 0]


def test_the_next_width_is_the_smallest_block_holding_the_length():
    m = LibraSpec(block=8)
    cases = {(1, 0): 4, (2, 0): 4, (3, 0): 4, (4, 1): 8, (4, 0): 8, (7, 0): 8, (8, 1): 16,
             (8, 0): 16, (15, 0): 16, (16, 1): 32, (31, 0): 32, (32, 1): 32}
    for (gamma, capped), width in cases.items():
        assert m.width_for(gamma, bool(capped)) == width, (gamma, capped)

    class Seq:
        host, block, state, accept_lengths = [], 8, {}, [3]
    assert m.plan(Seq()).block == 8                  # the first round: the start block
    Seq.host = [3, 0, 1]
    assert m.plan(Seq()).block == 4
    Seq.host = [8, 1, 1]
    assert m.plan(Seq()).block == 16
    rep = m.report()
    assert rep["gamma_share"] == {3: 0.5, 8: 0.5} and rep["mean_gamma"] == 5.5
    assert rep["width_share"] == {4: 1 / 3, 8: 1 / 3, 16: 1 / 3}


def test_options_name_the_compiled_steps():
    assert LibraSpec().key_name() != LibraSpec(blocks=(4, 8)).key_name()
    assert LibraSpec(block=4).key_name() != LibraSpec(block=8).key_name()
    assert LibraSpec(cost_rows="step").key_name() != LibraSpec().key_name()
    m = LibraSpec()          # T at the run's rows is baked into its steps: a key per batch
    m.begin(RunInfo(8, 8, set(), {}))
    eight = m.key_name()
    m.begin(RunInfo(1, 1, set(), {}))
    assert m.key_name() != eight
    assert [(p.block, p.variant) for p in LibraSpec().plans()] == \
        [(1, "ar"), (4, ""), (8, ""), (16, ""), (32, "")]
    assert [p.block for p in LibraSpec(blocks=(4, 8, 16, 32)).plans()] == [4, 8, 16, 32]
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError):
        LibraSpec(block=16, blocks=(4, 8))
    with pytest.raises(FastspecError):
        LibraSpec(blocks=(4, 5))
    with pytest.raises(FastspecError):
        LibraSpec(cost_rows="row")


# --- on a model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(seed=5)


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_greedy_libraspec_equals_ar_token_for_token(drafter, concurrency):
    engine = Engine(drafter, backend="eager")
    ps = random_token_prompts(max(concurrency, 4) + 1, seed=concurrency)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
    out = engine.generate(ps, params, method=LibraSpec(block=8), concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]


@pytest.mark.parametrize("cost_rows", ["batch", "step"])
def test_greedy_libraspec_on_a_predictable_model_moves_widths_and_equals_ar(cost_rows):
    """Drafts that are often right: lengths vary, so requests switch widths (each width its own
    step over its own rows), and the output is still AR's."""
    t = copy_model()
    engine = Engine(t, backend="eager")
    rng = random.Random(1)
    ps = [[rng.randrange(3, 32) for _ in range(rng.randrange(2, 9))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=5)
    m = LibraSpec(block=4, cost_rows=cost_rows)
    out = engine.generate(ps, params, method=m, concurrency=5)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    widths = {k.block for k in engine.runner.stats() if k.method.startswith("libraspec")}
    assert len(m.report()["width_share"]) >= 2 and len(widths) >= 2
    for c in out:                  # a round commits at most its width (seed + accepted drafts)
        assert max(c.accept_lengths) <= 32


def test_compiled_libraspec_equals_eager_without_recompiles():
    t = copy_model()
    ps = [[5, 6, 7, 7, 7], [9, 9, 9], [3, 4, 3, 4]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = Engine(t, backend="eager").generate(ps, params, method="ar", concurrency=3)
    engine = Engine(t, backend="compile", compiler="aot_eager")
    out = engine.generate(ps, params, method=LibraSpec(block=4, blocks=(4, 8)), concurrency=3)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0


def test_chosen_lengths_shrink_as_concurrency_grows():
    """Per C in the report: with a roofline-shaped T, mean γ at C = 8 is below mean γ at C = 1
    (7.55 -> 4.89 here), and so are the verify widths."""
    t = copy_model(scale=1.0)                       # confident, not certain: confidences decay
    engine = Engine(t, backend="eager")
    engine._forward_cost = profile_like             # the planner's T(rows, tokens)
    rng = random.Random(2)
    ps = [[rng.randrange(3, 32) for _ in range(rng.randrange(2, 9))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    reports = {}
    for c in (1, 8):
        m = LibraSpec(block=8, blocks=(4, 8, 16, 32))          # the stop rule alone (no AR rounds)
        engine.generate(ps, params, method=m, concurrency=c)
        reports[c] = m.report()
    assert reports[1]["concurrency"] == 1 and reports[8]["rows"] == 8
    assert reports[8]["mean_gamma"] < reports[1]["mean_gamma"] - 1.5, reports
    assert reports[8]["mean_width"] < reports[1]["mean_width"], reports


# --- sampling ------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(drafter):
    engine = Engine(drafter, backend="eager")
    ps = random_token_prompts(4, seed=3)
    m = LibraSpec(block=4, blocks=(4, 8))
    params = SamplingParams(temperature=0.9, top_k=40, max_new_tokens=20, seed=11, ignore_eos=True)
    runs = [engine.generate(ps, params, method=m, concurrency=3) for _ in range(2)]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    other = engine.generate(ps, SamplingParams(temperature=0.9, top_k=40, max_new_tokens=20, seed=12,
                                               ignore_eos=True), method=m, concurrency=3)
    assert [c.token_ids for c in other] != [c.token_ids for c in runs[0]]


@pytest.fixture(scope="module")
def law_engine():
    # As in test_sampling_law: a few likely tokens per step and a drafter that is often wrong.
    loaded = tiny_loaded(seed=1, std=0.5)
    attach_adapter(loaded.model, AdapterConfig(rank=4), seed=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for blk in loaded.model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.3 * torch.randn(lora.B.shape, generator=g))
    return Engine(loaded, backend="eager")


@pytest.mark.parametrize("cost", ["widths", "ar_rounds"])
def test_sampled_libraspec_follows_ar_sampling_law(law_engine, cost):
    """Tokens past the first round (whose width the first round's length chose): the law of
    (x1, x2, x3) and the marginals of x4..x6 match AR sampling's within the permutation bound
    (test_sampling_law shows the same check rejects a sampler that skips rejection sampling).
    widths: cheap tokens, the widths move; ar_rounds: dear ones, three drafting rounds (6 tokens
    or more) then AR rounds, so the marginals of x4..x12 are checked."""
    n, prompt = 1500, [5, 9, 11]
    tokens = 6 if cost == "widths" else 12
    law_engine._forward_cost = {"widths": lambda rows, tokens: 10.0 + 0.05 * tokens,
                                "ar_rounds": lambda rows, tokens: 10.0 + 3.0 * tokens}[cost]

    def sample(method, first_seed):
        params = [SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=first_seed + i,
                                 ignore_eos=True) for i in range(n)]
        out = law_engine.generate([prompt] * n, params, method=method, concurrency=128)
        return [tuple(c.token_ids) for c in out]
    m = LibraSpec(block=4, blocks=(4, 8) if cost == "widths" else (1, 4, 8), prices="profile")
    lib = sample(m, 50_000)
    ar = sample("ar", 10_000)
    if cost == "widths":
        assert len(m.report()["width_share"]) == 2               # widths moved between rounds
    else:
        assert 0.3 < m.report()["ar_share"] < 1.0, m.report()  # drafting, then AR rounds
    assert len(set(s[:3] for s in lib)) > 50                     # a real law, not a point mass
    pairs = [([s[:3] for s in ar], [s[:3] for s in lib])] + \
        [([s[k] for s in ar], [s[k] for s in lib]) for k in range(3, tokens)]
    for a, b in pairs:
        assert tv(a, b) <= null_quantile(a, b), (tv(a, b), null_quantile(a, b))


def test_a_step_writes_and_is_priced_at_its_own_width():
    """A width's step writes (and attends past the prefix) only its own width; the engine prices
    joining widths with it: two forwards of that width."""
    from fastspec.methods.base import Plan
    m = LibraSpec(block=4)
    assert [m.step_width(Plan(b)) for b in (2, 4, 8, 16)] == [2, 4, 8, 16]
    assert m.step_cost(4, Plan(8), lambda rows, tokens: rows * 100 + tokens) == 2 * 408


# --- AR rounds: where no width pays --------------------------------------------------------
class PlanSeq:
    """What LibraSpec's planner reads of a request."""

    def __init__(self, block):
        self.host, self.block, self.state, self.accept_lengths = [], block, {}, []


def test_the_planner_takes_ar_rounds_and_looks_again_every_explore_rounds():
    """T(rows, tokens) = 10 + tokens: a width-4 round costs 28 ms, an AR round 11 (.091 tokens a
    ms). Drafting rounds of 2 tokens (.071 a ms, below .9 of AR's) turn the request to AR rounds
    once HISTORY of them came in (γ = 0 in the report); after EXPLORE AR rounds it looks: HISTORY
    drafting rounds
    at the width its last drafting round chose; they find AR again, and the next wait is twice
    as long. (Another request of the run drafts 4 tokens a round: a look can pay, 4 / 28 > 1 / 11.
    Were 2 tokens a round the run's best, none could, 2 / 24 < 1 / 11: no look, below.)"""
    from fastspec.methods.ar_rounds import EXPLORE, HISTORY
    m = LibraSpec(block=8)
    m.begin(RunInfo(1, 1, set(), {}, lambda r, t: 10.0 + t))        # a perfect draft pays
    assert m.look_pays() and m.round_ms(4, 1) == 28.0
    good = PlanSeq(4)
    for _ in range(HISTORY):
        m.switch.record(good, 4, 28.0)
    assert m.switch.best == 4 and m.look_pays()
    seq = PlanSeq(4)
    seq.host, seq.accept_lengths = [3, 0, 1], [2]
    plans = []
    for _ in range(HISTORY + 3 * EXPLORE + 2 * HISTORY):
        p = m.plan(seq)
        plans.append((p.block, p.variant))
        # An AR round's host values are zeros and it commits 1 token; drafting rounds commit 2.
        seq.block = p.block
        seq.host, seq.accept_lengths[-1] = ([0, 0, 0], 1) if p.variant == "ar" else ([3, 0, 1], 2)
    drafting = [i for i, p in enumerate(plans) if p != (1, "ar")]
    first = HISTORY - 1 + EXPLORE                           # 16 AR rounds after the first rounds
    second = first + HISTORY + 2 * EXPLORE                  # then 32 after the first look
    assert drafting == list(range(HISTORY - 1)) + list(range(first, first + HISTORY)) + \
        list(range(second, second + HISTORY)), drafting
    assert plans[first] == (4, "")                          # at the last drafting width
    rep = m.report()
    assert rep["looks"] == 2 and rep["gamma_share"][0] > 0.8 and rep["ar_share"] > 0.8, rep

    alone = LibraSpec(block=8)                              # the same request, alone in its run
    alone.begin(RunInfo(1, 1, set(), {}, lambda r, t: 10.0 + t))
    seq = PlanSeq(4)
    seq.host, seq.accept_lengths = [3, 0, 1], [2]
    plans = []
    for _ in range(HISTORY + 3 * EXPLORE):
        p = alone.plan(seq)
        plans.append(p.variant)
        seq.block = p.block
        seq.host, seq.accept_lengths[-1] = ([0, 0, 0], 1) if p.variant == "ar" else ([3, 0, 1], 2)
    assert alone.switch.best == 2 and not alone.look_pays()
    assert plans == [""] * (HISTORY - 1) + ["ar"] * (3 * EXPLORE + 1)

    dear = LibraSpec(block=8)
    dear.begin(RunInfo(8, 8, set(), {}, lambda r, t: 10.0 * r * t))   # never, even perfect
    assert not dear.look_pays()
    seq = PlanSeq(8)
    assert dear.plan(seq) == Plan(1, "ar")                 # not even its first round drafts
    for _ in range(3 * EXPLORE):
        seq.block, seq.host, seq.accept_lengths = 1, [0, 0, 0], [1]
        assert dear.plan(seq) == Plan(1, "ar")


@pytest.mark.parametrize("concurrency", [1, 3])
def test_where_drafting_does_not_pay_libraspec_takes_ar_rounds_and_still_equals_ar(drafter, concurrency):
    """Dear tokens (T = 10 ms a token and row, priced by that profile, not by the tiny model's
    step times): every round is an AR round, one forward each, and the output is AR's. Cheap
    tokens and drafts that are right (a predictable model): no AR round at all."""
    engine = Engine(drafter, backend="eager")
    ps = random_token_prompts(4, seed=30 + concurrency)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
    engine._forward_cost = lambda rows, tokens: 10.0 * rows * tokens
    m = LibraSpec(block=8, prices="profile")
    out = engine.generate(ps, params, method=m, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rep = m.report()
    # Not even a perfect draft pays at these costs: every round is an AR round, the first too.
    assert not m.look_pays() and rep["ar_share"] == 1.0 and rep["looks"] == 0, rep
    for c in out:                        # every AR round is one forward and one token
        assert set(c.accept_lengths) == {1} and c.forwards == 1 + len(c.accept_lengths)
    engine = Engine(copy_model(), backend="eager")
    ps = [p[:6] for p in random_token_prompts(4, seed=30 + concurrency, vocab=32)]
    ar = engine.generate(ps, params, method="ar", concurrency=concurrency)
    engine._forward_cost = lambda rows, tokens: 10.0
    m = LibraSpec(block=8, prices="profile")
    out = engine.generate(ps, params, method=m, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert m.report()["ar_share"] == 0.0 and m.report()["mean_gamma"] > 2, m.report()


def test_a_run_mixes_ar_and_drafting_rounds_and_still_equals_ar(drafter, monkeypatch):
    """T = 10 + 3·tokens: a random drafter's rounds rarely beat AR's 13 ms, a perfect one would
    (4 tokens for 44 ms): requests switch between AR rounds and looks at their drafts, requests
    admitted later start with AR rounds as the run mostly does, and the output is AR's. (Looks
    are judged as if no request had drafted yet, every draft accepted: this drafter's best, 2
    tokens a round, could never pay, and without that the run stops looking, as it should.)"""
    engine = Engine(drafter, backend="eager")
    ps = random_token_prompts(8, seed=50)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=3)
    engine._forward_cost = lambda rows, tokens: 10.0 + 3.0 * tokens
    with monkeypatch.context() as patch:
        look_as_if_perfect(patch)
        m = LibraSpec(block=4, blocks=(1, 4, 8), prices="profile")
        out = engine.generate(ps, params, method=m, concurrency=3)
        assert [c.token_ids for c in out] == [c.token_ids for c in ar]
        rep = m.report()
        assert m.look_pays() and rep["looks"] >= 3 and 0.5 < rep["ar_share"] < 1.0, rep
    # The first requests drafted in their first round (>= 2 tokens: d1 is exact), later ones
    # started with an AR round (1 token).
    assert all(c.accept_lengths[0] >= 2 for c in out[:3])
    assert any(c.accept_lengths[0] == 1 for c in out[3:])
    m = LibraSpec(block=4, blocks=(1, 4, 8), prices="profile")
    out = engine.generate(ps, params, method=m, concurrency=3)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert m.switch.best == 2 and not m.look_pays() and m.report()["looks"] == 0


def test_a_new_run_starts_with_ar_rounds_where_the_last_runs_best_request_could_not_pay():
    """T(rows, tokens) = 10 + tokens: a width-w round 2 · (10 + w) ms, AR 11. The first run's
    best request drafted 2 tokens a round, which no width turns into more than AR's 1 / 11 a ms.
    The next run (fresh counts) starts its requests with AR rounds, where the first run started
    drafting on a perfect draft's bound; its looks keep that bound until one of its own
    requests is judged, so it looks after EXPLORE AR rounds all the same."""
    from fastspec.methods.ar_rounds import EXPLORE, HISTORY
    m = LibraSpec(block=8)
    firsts = []
    for run in range(2):
        m.begin(RunInfo(1, 1, set(), {}, lambda r, t: 10.0 + t))
        seq = PlanSeq(4)
        plans = []
        for _ in range(HISTORY + EXPLORE + 1):
            p = m.plan(seq)
            plans.append(p.variant)
            seq.block = p.block
            seq.host, seq.accept_lengths = ([0, 0, 0], [1]) if p.variant == "ar" else ([1, 0, 1], [2])
        firsts.append(plans[0])
        if run == 0:
            assert m.switch.best == 2 and m.switch.prior is None
        else:
            assert m.switch.prior == 2
            assert plans[:EXPLORE] == ["ar"] * EXPLORE and plans[EXPLORE] == ""    # a look
    assert firsts == ["", "ar"]


def test_a_request_that_started_with_ar_rounds_looks_at_the_start_width():
    """A request admitted into a run of AR rounds starts with them (first_is_ar); its first look
    drafts at the method's start width, as no drafting round has chosen one for it yet."""
    from fastspec.methods.ar_rounds import EXPLORE
    m = LibraSpec(block=8)
    m.begin(RunInfo(1, 1, set(), {}, lambda r, t: 10.0 + t))        # a perfect draft pays
    m.widths[1] = 2 * EXPLORE                                      # the run: AR rounds so far
    seq = PlanSeq(None)
    plans = []
    for _ in range(EXPLORE + 1):
        p = m.plan(seq)
        plans.append(p.block)
        seq.block, seq.host, seq.accept_lengths = p.block, [0, 0, 0], [1]
    assert plans == [1] * EXPLORE + [8], plans
    assert m.report()["looks"] == 1


def test_measured_step_times_overrule_the_profile_in_the_choice_of_ar_rounds():
    """The profile says tokens are dear (T = 10 ms a token: a width-4 round 80 ms, AR 10); the
    steps as run say a width-4 round takes 20 ms. Rounds of 3 tokens (.15 a ms against AR's .1)
    keep drafting on measured prices and turn to AR rounds on the profile's (.0375 a ms)."""
    from fastspec.methods.ar_rounds import HISTORY
    blocks = []
    for prices in ("measured", "profile"):
        m = LibraSpec(block=4, blocks=(1, 4), prices=prices)
        m.begin(RunInfo(1, 1, set(), {}, lambda r, t: 10.0 * t))
        for _ in range(3):
            m.timed_step(1, 4, "", 20.0)
            m.timed_step(1, 1, "ar", 10.0)
        assert m.look_pays() == (prices == "measured")
        seq = PlanSeq(4)
        seq.host, seq.accept_lengths = [3, 1, 1], [3]
        blocks.append([m.plan(seq).block for _ in range(HISTORY)][-1])
        assert m.report()["prices"] == prices
    assert blocks == [4, 1]
    assert m.price(1, 4) == 80.0                # prices=profile: the clock never took a time


def test_a_timed_run_prices_the_steps_it_ran(drafter):
    """The engine times every step of a LibraSpec run (compiles excluded); the report compares
    them with the profile."""
    engine = Engine(drafter, backend="eager")
    ps = random_token_prompts(2, seed=8)
    m = LibraSpec(block=4)
    engine.generate(ps, SamplingParams(max_new_tokens=16, ignore_eos=True), method=m, concurrency=2)
    steps = m.report()["profile_check"]["steps"]
    assert steps and all(s["measured"] > 0 for s in steps.values()), steps
    assert set(m.clock.measured) == set(engine.step_ms[m.timing_name()])


def test_a_timed_run_learns_the_host_time_each_round_adds_to_its_step(drafter, monkeypatch):
    """The engine hands a timed method each round's time outside its steps; the clock prices
    a round as its step plus that. A planner made 5 ms slower adds about 5 ms a round."""
    ps = random_token_prompts(2, seed=8)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    overheads = []
    for delay in (0.0, 0.005):
        engine = Engine(drafter, backend="eager")
        m = LibraSpec(block=4)
        plan_round = m.plan_round

        def slow_plan(seqs, plan_round=plan_round, delay=delay):
            time.sleep(delay)
            return plan_round(seqs)
        monkeypatch.setattr(m, "plan_round", slow_plan)
        engine.generate(ps, params, method=m, concurrency=2)
        assert m.clock.overhead_n > 0 and m.clock.overhead > 0
        assert m.clock.time(2, 4, "") > m.clock.overhead
        overheads.append(m.clock.overhead)
    # Every slowed round sleeps 5 ms on the host (a floor, whatever the machine's load); the
    # difference itself is left to the load (a busy 2-core CI runner adds ms to either run).
    assert overheads[1] >= 5.0 and overheads[1] > overheads[0], overheads
    untimed = LibraSpec(block=4, prices="profile")
    Engine(drafter, backend="eager").generate(ps, params, method=untimed, concurrency=2)
    assert untimed.clock.overhead_n == 0               # prices=profile: plans stay deterministic


def test_a_request_drafting_beside_ar_requests_is_judged_at_what_its_step_adds():
    """C=4, T(rows, tokens) = 10 + rows·tokens/2: an AR round 12 ms at 4 rows, a width-4 round
    36 at 4 rows and 24 at 1. One request drafts 3 tokens a round beside three AR requests:
    priced as a round in which all four draft, 3 / 36 beats .9 / 12 and it goes on drafting;
    at what its step adds to the round (12 + 4 · 24 = 108 ms, mixed_round_ms) it turns AR."""
    from fastspec.methods.ar_rounds import HISTORY
    last = {}
    for mixed in (True, False):
        m = LibraSpec(block=4, blocks=(1, 4), prices="profile")
        m.price_mixed_rounds = mixed
        m.begin(RunInfo(4, 4, set(), {}, lambda r, t: 10.0 + r * t / 2))
        assert (m.price(4, 1), m.price(4, 4), m.price(1, 4)) == (12.0, 36.0, 24.0)
        drafter = PlanSeq(4)
        drafter.host, drafter.accept_lengths = [3, 0, 4], [3]
        others = [PlanSeq(1) for _ in range(3)]
        for q in others:
            q.host, q.accept_lengths = [0, 0, 0], [1]
        for _ in range(HISTORY):
            for q, p in zip([drafter] + others, m.plan_round([drafter] + others)):
                q.block = p.block
        last[mixed] = drafter.block
        assert all(q.block == 1 for q in others)
    assert last == {True: 1, False: 4}


def test_a_request_drafting_beside_ar_rows_is_priced_at_the_batchs_rows():
    """C=4, the others in AR rounds: this request's last drafting round ran alone in a 1-row step.
    At 1 row its 3 tokens for 30 ms beat AR's 1 for 15 ms; at the batch's 4 rows (90 ms against
    AR's 20) they do not, and that is what its drafting costs the round. It goes AR."""
    from fastspec.methods.ar_rounds import HISTORY
    m = LibraSpec(block=4, blocks=(1, 4), prices="profile")
    # one forward: 15 ms at 1 row, 20 (1 token) or 45 (more) at 4 rows; a round is two of them
    m.begin(RunInfo(4, 4, set(), {}, lambda r, t: 15.0 if r == 1 else 20.0 if t == 1 else 45.0))
    assert m.price(1, 4) == 30.0 and m.price(4, 4) == 90.0 and m.price(4, 1) == 20.0
    seq = PlanSeq(4)
    seq.host, seq.accept_lengths = [3, 1, 1], [3]             # γ 3, uncapped, ran at 1 row
    plans = [m.plan(seq).block for _ in range(HISTORY)]
    assert plans[-1] == 1, plans
