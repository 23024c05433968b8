"""BASTION: a best-first token tree from one draft's marginals, verified in one forward; the
accepted path's K/V is compacted into place, and the output is exactly AR's."""
from types import SimpleNamespace

import pytest
import torch

from conftest import random_token_prompts, tiny_drafter
from helpers import look_as_if_perfect
from fastspec.engine import Engine
from fastspec.methods.bastion import BASTION, BUDGETS, H_NODES, H_WANTED
from fastspec.sampling import SamplingParams


class RecordingBASTION(BASTION):
    """Keeps every decoding round's accepted paths (eager runs only: a traced round writes no
    state). The warm-up's dummy rounds come before the first `plan` and are not kept."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rounds, self.live = [], False

    def plan(self, seq):
        self.live = True
        return super().plan(seq)

    def round(self, step, pending, blocks, carry, variant=""):
        out = super().round(step, pending, blocks, carry, variant)
        if self.live and variant != "ar":          # AR rounds build no tree
            self.rounds.append((out.commit_cols.clone(), out.n_drafted.clone()))
        return out


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_drafter(), backend="eager")


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_greedy_bastion_equals_ar_token_for_token(engine, concurrency):
    prompts = random_token_prompts(8, seed=concurrency)
    params = SamplingParams(max_new_tokens=36)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    method = RecordingBASTION(budgets=BUDGETS)         # trees in every round (no AR rounds)
    out = engine.generate(prompts, params, method=method, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    # d1 is the verifier's own token (fastspec's convention): every round commits >= 2 tokens
    # except a last one cut short by the budget or EOS.
    for c in out:
        assert min(c.accept_lengths[:-1], default=2) >= 2
    # The trees really branched: some accepted path left the first-child chain 1, 2, 3, ...
    assert any(cols[r, :a].tolist() != list(range(1, a + 1))
               for cols, acc in method.rounds for r, a in enumerate(acc.tolist()))


def test_greedy_bastion_equals_ar_under_the_nld_convention():
    """An unshifted drafter (no exact d1): the depth-1 candidates come from its marginals too."""
    from fastspec.convention import NLD
    loaded = tiny_drafter(seed=7)
    loaded.model.draft_convention = NLD
    engine = Engine(loaded, backend="eager")
    prompts = random_token_prompts(4, seed=13)
    params = SamplingParams(max_new_tokens=24)
    ar = engine.generate(prompts, params, concurrency=2)
    out = engine.generate(prompts, params, method=BASTION(), concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]


def test_greedy_bastion_compiled_equals_ar():
    engine = Engine(tiny_drafter(seed=6), backend="compile", compiler="aot_eager")
    prompts = random_token_prompts(2, seed=11)
    params = SamplingParams(max_new_tokens=24)
    ar = engine.generate(prompts, params)
    out = engine.generate(prompts, params, method=BASTION(block=8, budgets=(8, 16)))
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0


def test_compaction_leaves_the_cache_exactly_as_ar_would(engine):
    """After a run, the committed columns of every slot hold the K/V of prompt + output: the
    accepted paths (tree nodes written at L+i) were moved to L+1.. exactly."""
    prompts = random_token_prompts(3, seed=22, max_len=12)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    method = RecordingBASTION(budgets=BUDGETS)         # trees in every round (no AR rounds)
    out = engine.generate(prompts, params, method=method, concurrency=3)
    cols = [len(p) + len(c.token_ids) - 1 for p, c in zip(prompts, out)]   # the last is never fed
    tree_kv = [(engine.cache.k[:, s, :, :n].clone(), engine.cache.v[:, s, :, :n].clone())
               for s, n in enumerate(cols)]                                   # request i: slot i
    ar = engine.generate(prompts, params, concurrency=3)
    assert [c.token_ids for c in ar] == [c.token_ids for c in out]
    for s, ((k, v), n) in enumerate(zip(tree_kv, cols)):
        assert torch.allclose(k, engine.cache.k[:, s, :, :n], atol=1e-5)
        assert torch.allclose(v, engine.cache.v[:, s, :, :n], atol=1e-5)
    # Some accepted path left the first-child chain, so K/V really moved.
    moved = [c[r, :a].tolist() for c, acc in method.rounds for r, a in enumerate(acc.tolist())]
    assert any(m != list(range(1, len(m) + 1)) for m in moved)


def test_compact_path_moves_exactly_the_accepted_path():
    """accept_tree's commit_cols through engine.compact_path: with K/V tagged by column, the
    path s -> 2 -> 5 -> 6 of a tree at L = 4 lands at columns 5, 6, 7; nothing else changes."""
    from fastspec.engine import compact_path
    from fastspec.sampling import SamplerState
    from fastspec.verify import accept_tree
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2, 5]])
    tokens = torch.tensor([[9, 0, 1, 4, 2, 3, 4]])
    y = [1, 5, 3, 0, 0, 4, 0]                      # the verifier's argmax at each node
    logits = torch.full((1, 7, 6), -5.0).scatter(2, torch.tensor([[y]]).transpose(1, 2), 5.0)
    _, n_emitted, _, path = accept_tree(tokens, parents, torch.ones(1, 7, dtype=torch.bool), logits,
                                        SamplerState(1), max_depth=4)
    assert n_emitted.tolist() == [4] and path.tolist() == [[2, 5, 6, 0]]
    cols = torch.arange(16, dtype=torch.float)
    k = cols[None, None, None, :, None].repeat(2, 3, 2, 1, 4)       # [layers, slots, heads, ctx, hd]
    v = -k
    before = k.clone()
    compact_path(k, v, torch.tensor([1]), torch.tensor([4]), path)
    assert k[0, 1, 0, :, 0].tolist()[:8] == [0, 1, 2, 3, 4, 6, 9, 10]   # L+1.. <- L+2, L+5, L+6
    assert torch.equal(v, -k)
    assert torch.equal(k[:, [0, 2]], before[:, [0, 2]])              # other slots untouched
    assert torch.equal(k[:, 1, :, :5], before[:, 1, :, :5])          # the prefix and the seed


def test_planner_moves_the_budget_with_the_tree_the_rule_wanted():
    m = BASTION(block=16, budgets=BUDGETS)                 # the rule alone (no AR rounds)
    seq = SimpleNamespace(host=[], block=16, accept_lengths=[], state={})
    assert m.plan(seq).block == 16                       # no round yet: the starting budget
    # wanted = budget + 1: the rule would have gone on past the budget.
    for wanted, budget, nxt in ((5, 16, 8), (8, 8, 8), (9, 8, 16), (12, 16, 16), (17, 16, 32),
                                (33, 32, 32), (9, 32, 16), (1, 8, 4), (5, 4, 8)):
        seq.host, seq.block = [0, 0], budget
        seq.host[H_WANTED], seq.host[H_NODES] = wanted, budget
        assert m.plan(seq).block == nxt, (wanted, budget)
    assert sorted(p.block for p in m.plans()) == [4, 8, 16, 32] and m.max_width() == 32
    assert sorted(p.block for p in BASTION().plans()) == [1, 4, 8, 16, 32]


def test_cost_tables_follow_the_profile_per_row_bucket():
    m = BASTION()
    run = SimpleNamespace(rows=4, forward_ms=lambda rows, n: rows * (10 + n))
    m.begin(run)
    assert m.cost_table(1, 8)[3] == (10 + 8) + (10 + 3)     # draft forward (width 8) + tree of 3
    assert m.cost_table(4, 32)[33] == 4 * 18 + 4 * 43         # one past the budget: the rule's look
    assert (8, 8) not in m.cost_tables                        # no bucket beyond the run's


def test_bastion_sampling_matches_ar_sampling(engine):
    """The law of the first three sampled tokens equals AR's (the second is the tree's root
    sample, the third the verifier's draw at the depth-1 node or the next round's root)."""
    from helpers import first, null_quantile, tv
    big, small = 2000, 500

    def sample(method, n, first_seed):
        params = [SamplingParams(temperature=1.0, top_k=8, max_new_tokens=3, seed=first_seed + i,
                                 ignore_eos=True) for i in range(n)]
        return [tuple(c.token_ids[:3]) for c in
                engine.generate([[5, 9, 11]] * n, params, method=method, concurrency=128)]

    ar = sample("ar", big, 10_000)
    tree = sample(BASTION(block=8, budgets=(8,)), big, 50_000)     # one step width: quicker
    assert len(set(first(tree, 2))) > 10
    for k in (2, 3):
        large = tv(first(ar, k), first(tree, k))
        small_tv = tv(first(ar[:small], k), first(tree[:small], k))
        assert large <= null_quantile(first(ar, k), first(tree, k)), (k, large)
        assert large < small_tv, (k, large, small_tv)


def test_a_step_writes_its_draft_block_then_its_tree():
    """A budget's step writes the draft block, then a tree of `budget` nodes over the same
    columns. A tree of 4 nodes is at most 3 deep, so its draft is 4 wide, not 8: the step's
    width (attention reach, and the price the engine joins budgets at) is the budget."""
    from fastspec.methods.base import Plan
    m = BASTION(block=16, draft_block=8, budgets=(4, 8, 16, 32))
    assert [m.step_width(Plan(b)) for b in (4, 8, 16, 32)] == [4, 8, 16, 32]
    assert [m.draft_width(b) for b in (4, 8, 16, 32)] == [4, 8, 8, 8]
    # Its round is priced as what it runs: the draft forward, then the tree's (not twice the wider).
    T = lambda rows, tokens: 10.0 * rows + tokens  # noqa: E731
    assert m.step_cost(2, Plan(32), T) == T(2, 8) + T(2, 32) == 80.0
    assert m.step_cost(2, Plan(4), T) == 2 * T(2, 4) == 48.0


def test_the_first_b_nodes_of_a_tree_tell_what_a_budget_of_b_would_have_committed():
    """Best first adds a node after its parent, so the accepted path's nodes below index b are
    the path a b-node tree would have accepted; then the verifier's token."""
    from fastspec.methods.bastion import prefix_commits
    path = torch.tensor([[1, 2, 5, 7, 0], [3, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    accepted = torch.tensor([4, 1, 0])
    got = prefix_commits(path, accepted, (4, 8, 16), nodes=8)
    assert got.tolist() == [[3, 5, 0], [2, 2, 0], [1, 1, 0]]       # b = 16 > 8 nodes: not seen


def test_the_planner_cuts_the_rules_budget_where_a_smaller_tree_commits_more_per_ms():
    """The rule wants 8 nodes. Its trees' first 4 nodes would have committed 3 tokens, all 8 of
    them 4. One row (T = 20 + n): price(4) = 48, price(8) = 56 -> 3/48 = .0625 < 4/56 = .071:
    8. Two rows (T = 20 + 6n): price(4) = 88, price(8) = 136 -> .034 > .029: 4. A new run starts
    from the last run's E_b (weighed as COMMIT_ROUNDS rounds) at its own prices."""
    from fastspec.methods.ar_rounds import COMMIT_ROUNDS as PREFIX_ROUNDS
    from fastspec.methods.bastion import H_PREFIX
    one, two = (lambda rows, n: 20.0 + n), (lambda rows, n: 20.0 + 6 * n)
    m = BASTION(block=8, budgets=(4, 8, 16), prices="profile")
    for forward_ms, chosen in ((one, 8), (two, 4)):
        m.commits = None                                    # no earlier run
        m.begin(SimpleNamespace(rows=1, forward_ms=forward_ms))
        seq = SimpleNamespace(host=[], block=8, accept_lengths=[], state={})
        plans = []
        for _ in range(PREFIX_ROUNDS + 1):
            seq.host = [8, 8] + [0] * 3
            seq.host[H_PREFIX:H_PREFIX + 2] = [3, 4]          # b = 4 and 8; 16 not seen
            seq.accept_lengths, seq.block = [4], 8            # every round ran at 8 here
            plans.append(m.plan(seq).block)
        assert plans[:PREFIX_ROUNDS - 1] == [8] * (PREFIX_ROUNDS - 1) and plans[-1] == chosen
        assert m.report()["expected_tokens"] == {4: 3.0, 8: 4.0}
    # The next run (two rows again) knows E_b from the first: its first round is a tree of 4.
    m.begin(SimpleNamespace(rows=1, forward_ms=two))
    assert m.plan(SimpleNamespace(host=[], block=8, accept_lengths=[], state={})).block == 4
    rule = BASTION(block=8, budgets=(4, 8, 16), prices="profile", choose="rule")
    rule.begin(SimpleNamespace(rows=1, forward_ms=two))
    seq = SimpleNamespace(host=[8, 8, 3, 4, 0], block=8, accept_lengths=[4], state={})
    assert {rule.plan(seq).block for _ in range(PREFIX_ROUNDS + 1)} == {8}


def test_greedy_bastion_with_a_four_node_budget_equals_ar(engine):
    """A budget of 4 drafts 4 wide (depth <= 3): still AR's output, at most 4 tokens a round."""
    prompts = random_token_prompts(4, seed=31)
    params = SamplingParams(max_new_tokens=30)
    ar = engine.generate(prompts, params, concurrency=2)
    method = RecordingBASTION(block=4, budgets=(4,))
    out = engine.generate(prompts, params, method=method, concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert max(max(c.accept_lengths) for c in out) <= 4
    assert {cols.shape[1] for cols, _ in method.rounds} == {3}        # paths of depth <= 3
    assert any(max(c.accept_lengths) >= 2 for c in out)


# --- AR rounds: where no tree pays -----------------------------------------------------------
def test_the_planner_takes_ar_rounds_and_looks_again_at_its_last_budget():
    """T(rows, n) = 10 + n: a round of budget 8 costs 36 ms (draft 18 + tree 18), an AR round 11.
    Tree rounds of 2 tokens (.056 a ms, below .9 of AR's .091) turn the request to AR rounds once
    HISTORY of them came in; after EXPLORE AR rounds it looks with HISTORY trees at the budget
    its last tree round chose."""
    from fastspec.methods.ar_rounds import EXPLORE, HISTORY
    m = BASTION(block=16)
    m.begin(SimpleNamespace(rows=1, forward_ms=lambda rows, n: 10.0 + n))    # a perfect tree pays
    assert m.look_pays() and m.cost_table(1, 8)[8] == 36.0
    good = SimpleNamespace(state={})            # another request of the run: 5 tokens a tree
    for _ in range(HISTORY):
        m.switch.record(good, 5, 36.0)
    assert m.look_pays()                        # 5 / 36 > 1 / 11 (2 / 36 would not be)
    seq = SimpleNamespace(host=[5, 8], block=8, accept_lengths=[2], state={})
    plans = []
    for _ in range(EXPLORE + 2 * HISTORY):
        p = m.plan(seq)
        plans.append((p.block, p.variant))
        seq.block = p.block
        seq.host, seq.accept_lengths[-1] = ([0, 0], 1) if p.variant == "ar" else ([5, 8], 2)
    look = HISTORY - 1 + EXPLORE
    assert plans[:HISTORY - 1] == [(8, "")] * (HISTORY - 1)
    assert plans[HISTORY - 1:look] == [(1, "ar")] * EXPLORE
    assert plans[look:look + HISTORY] == [(8, "")] * HISTORY and plans[look + HISTORY] == (1, "ar")
    rep = m.report()
    assert rep["looks"] == 1 and rep["rounds"] == 2 * HISTORY   # tree rounds only in the tree stats


@pytest.mark.parametrize("concurrency", [1, 3])
def test_where_drafting_does_not_pay_bastion_takes_ar_rounds_and_still_equals_ar(engine, concurrency):
    prompts = random_token_prompts(4, seed=40 + concurrency)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    saved = engine._forward_cost
    try:
        engine._forward_cost = lambda rows, tokens: 10.0 * rows * tokens
        m = BASTION(block=8, prices="profile")
        out = engine.generate(prompts, params, method=m, concurrency=concurrency)
        assert [c.token_ids for c in out] == [c.token_ids for c in ar]
        assert not m.look_pays() and m.report()["ar_share"] == 1.0, m.report()
        for c in out:                        # AR rounds only: one forward, one token each
            assert set(c.accept_lengths) == {1} and c.forwards == 1 + len(c.accept_lengths)
    finally:
        engine._forward_cost = saved


def test_a_run_mixes_ar_rounds_and_trees_and_still_equals_ar(engine, monkeypatch):
    """T = 10 + 3·tokens: trees rarely beat AR's 13 ms, a perfect one would; requests switch
    between AR rounds and trees (and the accepted paths' K/V compaction), output AR's. (Looks
    judged as if every draft were accepted: `look_as_if_perfect`.)"""
    look_as_if_perfect(monkeypatch)
    prompts = random_token_prompts(6, seed=60)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=3)
    saved = engine._forward_cost
    try:
        engine._forward_cost = lambda rows, tokens: 10.0 + 3.0 * tokens
        m = BASTION(block=8, budgets=(1, 8), prices="profile")
        out = engine.generate(prompts, params, method=m, concurrency=3)
    finally:
        engine._forward_cost = saved
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rep = m.report()
    assert m.look_pays() and rep["looks"] >= 2 and 0.5 < rep["ar_share"] < 1.0, rep


def test_measured_step_times_overrule_the_profile_in_the_choice_of_ar_rounds():
    """The profile prices a budget-8 tree round at 160 ms against AR's 10 (T = 10 ms a token);
    measured, it takes 24. Trees committing 3 tokens (.125 a ms against AR's .1) go on with
    measured prices and turn to AR rounds with the profile's."""
    from fastspec.methods.ar_rounds import HISTORY
    budgets = []
    for prices in ("measured", "profile"):
        m = BASTION(block=8, budgets=(1, 8), prices=prices)
        m.begin(SimpleNamespace(rows=1, forward_ms=lambda rows, n: 10.0 * n, step_ms={}))
        for _ in range(3):
            m.timed_step(1, 8, "", 24.0)
            m.timed_step(1, 1, "ar", 10.0)
        seq = SimpleNamespace(host=[5, 8], block=8, accept_lengths=[3], state={})
        budgets.append([m.plan(seq).block for _ in range(HISTORY)][-1])
    assert budgets == [8, 1]
