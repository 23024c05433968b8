"""Plain AR rounds for drafting methods: a request drafts while its drafts pay on this device
and load, and takes one-forward AR rounds where they do not (fastspec/methods/ar_rounds.py)."""
from types import SimpleNamespace

import pytest

from fastspec.methods.ar_rounds import (AR_MARGIN, EXPLORE, EXPLORE_MAX, HISTORY, RATE_MEMORY,
                                        ARSwitch, DraftMeans, draft_could_pay,
                                        mixed_round_ms)


def request(block=8):
    return SimpleNamespace(block=block, state={})


def test_a_draft_could_pay_at_low_load_and_not_under_load():
    # The module's examples: the Zen 4 profile at C = 1 and C = 8.
    assert draft_could_pay([(4, 33.0), (8, 48.0)], 16.0)
    assert not draft_could_pay([(4, 139.0), (8, 261.0)], 30.0)
    assert not draft_could_pay([(4, 40.0)], 10.0)         # a tie is not a gain


def test_a_look_pays_only_where_the_runs_best_request_could_beat_ar():
    """C=4 on Zen 4: a B=8 round 116 ms, an AR round 21. A perfect draft (8 tokens) would pay,
    so before any request is judged a look goes ahead; once the best request of the run has
    averaged 4.9 tokens a round, no look can (4.9 / 116 < 1 / 21). A block the best request
    fills anyway counts its own tokens (min(4, 4.9))."""
    assert draft_could_pay([(8, 116.0)], 21.0)
    assert draft_could_pay([(8, 116.0)], 21.0, best=None)
    assert not draft_could_pay([(8, 116.0)], 21.0, best=4.9)
    assert draft_could_pay([(8, 116.0)], 21.0, best=5.6)
    assert draft_could_pay([(4, 70.0), (8, 116.0)], 21.0, best=4.9)          # B=4: 4 / 70 > 1 / 21
    assert not draft_could_pay([(4, 90.0), (8, 116.0)], 21.0, best=4.9)      # 4 / 90 < 1 / 21


def test_the_best_drafting_is_the_highest_current_mean_of_the_requests_judged():
    """Each request's mean tokens per drafting round counts once it has HISTORY rounds; the
    best is the highest of the current means: a request that starts 8, 8, 5 (7.0) and then
    drafts 5, 3, 3, 4, 3 (4.9) counts 4.9, not its early 7.0."""
    means = DraftMeans()
    a, b = {}, {}
    for t in (8, 8)[:HISTORY - 1]:
        means.add(a, t)
    assert means.best is None
    for t in (8, 8, 5, 5, 3, 3, 4, 3)[HISTORY - 1:]:
        means.add(a, t)
    assert means.best == pytest.approx(39 / 8)
    for t in (2, 3, 4):
        means.add(b, t)
    assert means.best == pytest.approx(39 / 8)
    for t in (9, 9, 9, 9):
        means.add(b, t)
    assert means.best == pytest.approx(45 / 7)


def test_the_drafting_rate_is_a_moving_average_judged_after_history_rounds():
    """AR at 10 ms is .1 token a ms; drafting must stay above AR_MARGIN of it (.09). Rounds of 2
    tokens for 25 ms (.08) are judged after HISTORY of them: AR. Then each round of 3 tokens (.12)
    moves the average 1/RATE_MEMORY of the way: .0867, .0922, .0968 -> drafting pays from the
    second."""
    seq, sw = request(), ARSwitch()
    for _ in range(HISTORY - 1):
        sw.record(seq, 2, 25.0)
        assert sw.drafting_pays(seq, 10.0) is None
    sw.record(seq, 2, 25.0)
    assert sw.drafting_pays(seq, 10.0) is False
    assert AR_MARGIN == 0.9
    rate, seen = 0.08, []
    for _ in range(3):
        sw.record(seq, 3, 25.0)
        rate += (0.12 - rate) / RATE_MEMORY
        assert seq.state["rate"] == pytest.approx(rate)
        seen.append(sw.drafting_pays(seq, 10.0))
    assert seen == [False, True, True]


def test_looks_back_off_while_drafting_does_not_pay_and_reset_when_it_does():
    """A request goes AR once HISTORY rounds say so; after the run's wait it looks: HISTORY
    drafting rounds, judged alone. The wait doubles with each look that finds AR again (16, 32,
    64, 128, 128), and it is the run's: a second request waits as long as the first one's last
    wait. A look whose rounds pay sends the wait back to 16."""
    seq, sw = request(), ARSwitch()

    def draft(q, tokens):
        """HISTORY drafting rounds of `tokens` each; True if q then goes AR."""
        for i in range(HISTORY):
            sw.record(q, tokens, 25.0)
            ar = sw.next_is_ar(q, 10.0, look_pays=True)
            if i < HISTORY - 1:
                assert not ar                              # not judged yet: drafting goes on
        return ar

    def wait(q):
        """AR rounds in a row before q looks (q has just gone AR)."""
        q.block, n = 1, 1
        while sw.next_is_ar(q, 10.0, look_pays=True):
            n += 1
        q.block = 8
        return n
    assert draft(seq, 2) and seq.state["rate"] is None      # AR, and the rate is forgotten
    waits = []
    for _ in range(5):                 # each look's rounds commit 2 tokens again
        waits.append(wait(seq))
        assert draft(seq, 2)
    assert waits == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE, EXPLORE_MAX, EXPLORE_MAX] and sw.looks == 5
    other = request()
    assert draft(other, 2) and wait(other) == EXPLORE_MAX  # the run's wait, not its own
    assert not draft(other, 4) and sw.explore == EXPLORE    # a look that pays: drafting again
    # Where not even a perfect draft pays, an AR run never ends.
    seq.block = 1
    assert all(sw.next_is_ar(seq, 10.0, look_pays=False) for _ in range(3 * EXPLORE_MAX))


def test_a_new_request_starts_ar_where_no_draft_pays_or_the_run_mostly_takes_ar():
    first = ARSwitch.first_is_ar
    assert first(look_pays=False, ar_rounds=0, rounds=0)
    assert not first(look_pays=True, ar_rounds=0, rounds=0)
    assert not first(look_pays=True, ar_rounds=EXPLORE - 1, rounds=EXPLORE - 1)   # too few
    assert first(look_pays=True, ar_rounds=EXPLORE, rounds=EXPLORE)
    assert not first(look_pays=True, ar_rounds=10, rounds=20)                    # half


def zen4_c4_price(n, block):
    """ms of a step for n requests at C=4, of the order a 2-core Zen 4 measures (rounded; see
    mixed_round_ms): AR 20 at any rows; a B=8 drafting round 40 (1 row), 70 (2), 120 (3-4
    rows: the 4-row bucket)."""
    if block == 1:
        return 20.0
    return {1: 40.0, 2: 70.0, 3: 120.0, 4: 120.0}[n]


def test_a_lone_drafter_beside_ar_rows_is_judged_at_what_its_step_adds_to_everyones_round():
    """One request drafting B=8 beside three AR requests: the round is 20 + 40 = 60 ms, its
    drafting adds 40 ms to all four, priced T_eff = 20 + 4 · 40 = 180 ms; two drafters share
    what their step adds: 20 + 2 · (20 + 70 - 20) = 160. A round in which all draft, or none,
    is no mixed round (None: the caller's own price)."""
    assert mixed_round_ms([8, 1, 1, 1], zen4_c4_price) == pytest.approx(180.0)
    assert mixed_round_ms([8, 8, 1, 1], zen4_c4_price) == pytest.approx(160.0)
    assert mixed_round_ms([8, 8, 8, 8], zen4_c4_price) is None
    assert mixed_round_ms([1, 1, 1, 1], zen4_c4_price) is None
    assert mixed_round_ms([], zen4_c4_price) is None


def test_the_mixed_price_says_what_the_rounds_own_rate_says():
    """Drafters committing k tokens each beat AR on T_eff (k / T_eff > 1 / T_AR) exactly when
    the mixed round commits more per ms than an AR round for everyone: (n - d + d·k) / T >
    n / T_AR. Random prices and token counts, brute force."""
    import random
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        n = rng.randint(2, 8)
        d = rng.randint(1, n - 1)
        t_ar = {m: rng.uniform(10, 30) for m in range(1, n + 1)}
        t_ar = {m: max(t_ar[j] for j in range(1, m + 1)) for m in t_ar}   # more rows cost more
        t_draft = rng.uniform(20, 200)
        k = rng.uniform(1, 9)
        price = lambda m, b: t_ar[m] if b == 1 else t_draft      # noqa: E731
        t_eff = mixed_round_ms([8] * d + [1] * (n - d), price)
        round_ms = t_ar[n - d] + t_draft
        if t_ar[n - d] + t_draft <= t_ar[n]:
            continue
        assert (k / t_eff > 1 / t_ar[n]) == ((n - d + d * k) / round_ms > n / t_ar[n])
        checked += 1
    assert checked > 1000


def test_a_request_drafting_beside_ar_requests_turns_to_ar_at_its_mixed_price():
    """6 tokens a round at B=8, C=4: priced as a round in which all four draft (120 ms, .05 a
    ms against .9 / 20 = .045) the request goes on drafting; beside three AR requests (180 ms,
    .033 a ms) it turns to AR rounds once judged."""
    verdicts = []
    for round_ms in (None, mixed_round_ms([8, 1, 1, 1], zen4_c4_price)):
        seq, sw = request(8), ARSwitch()
        seq.accept_lengths, seq.host = [6], [1]
        sw.round_ms = round_ms
        blocks = []
        for _ in range(HISTORY):
            block = sw.next_block(seq, 8, 8, lambda b: zen4_c4_price(4, b), False, {})
            blocks.append(block)
            seq.block = block
        verdicts.append(blocks[-1])
    assert verdicts == [8, 1]


def test_a_first_round_is_judged_by_first_pays_where_given_and_looks_by_look_pays():
    """A new request (no host values yet) takes its first round by `first_pays` (the last run's
    best, ARSwitch.first_bound) where the method gives one; its looks after AR rounds go by
    `look_pays` (this run's own bound)."""
    for first_pays, expected in ((None, 8), (True, 8), (False, 1)):
        seq = request(8)
        seq.host = []
        assert ARSwitch().next_block(seq, 8, None, lambda b: 20.0, True, {}, first_pays) == expected
    sw = ARSwitch(prior=2.0)
    assert sw.prior == 2.0 and sw.best is None and sw.first_bound == 2.0
    means = sw.drafts
    state = {}
    for t in (5, 5, 5):
        means.add(state, t)
    assert sw.first_bound == 5.0            # the run's own best, once it has one


def test_block_commits_believe_a_mean_after_enough_rounds_and_carry_it_to_the_next_run():
    """E_b is None until COMMIT_ROUNDS rounds saw it; a new run starts from the last run's
    mean, weighed as COMMIT_ROUNDS rounds at most (40 rounds of 2.9 -> 8 rounds of 2.9)."""
    from fastspec.methods.ar_rounds import COMMIT_ROUNDS, BlockCommits
    last = BlockCommits((4, 8))
    for i in range(40):
        last.add(4, 2.9)
        if i < COMMIT_ROUNDS - 1:
            last.add(8, 3.5)
    assert last.mean(8) is None and last.mean(4) == pytest.approx(2.9)
    new = BlockCommits((4, 8, 16), last)
    assert new.sums[4] == (pytest.approx(2.9 * COMMIT_ROUNDS), COMMIT_ROUNDS)
    assert new.sums[8] == (pytest.approx(3.5 * (COMMIT_ROUNDS - 1)), COMMIT_ROUNDS - 1)
    assert new.sums[16] == (0.0, 0) and new.mean(16) is None
    assert new.report() == {4: 2.9, 8: 3.5}


def test_an_ar_round_commits_the_seeds_token_and_drops_a_carried_pre_draft():
    """One forward of the seed; the carry comes back whole, but a carried pre-draft (`valid`,
    RecGuide's and TiDAR's) no longer lines up with the sequence and is cleared."""
    import torch
    from helpers import FakeStep, logits_from
    from fastspec.methods.ar_rounds import ar_round
    from fastspec.methods.linear import SELF_DRAFT
    step = FakeStep([logits_from({5: 0.9})[None, None]], width=1)
    carry = {"valid": torch.ones(1, dtype=torch.long), "drafts": torch.tensor([[7, 8]])}
    out = ar_round(SELF_DRAFT, step, torch.tensor([3]), carry, host_columns=4)
    assert out.emitted.tolist() == [[5]] and out.n_emitted.tolist() == [1] and out.n_drafted.tolist() == [0]
    assert step.calls[0]["ids"].tolist() == [[3]]
    assert out.carry["valid"].tolist() == [0] and out.carry["drafts"].tolist() == [[7, 8]]
    assert out.host.tolist() == [[0, 0, 0, 0]]
