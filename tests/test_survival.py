"""Verification-guided block sizes: survival tables fitted from censored traces, and the chooser."""
import numpy as np
import pytest

from fastspec.survival import (START, Observation, SurvivalTables, choose_block, history_signal,
                               isotonic_increasing, km_survival, stratum)


def geometric_trace(rng, n, p_of_s, blocks=(8, 16, 32), z="8P"):
    """Rounds whose run of accepted drafts is geometric with P(accept) = p_of_s(s); a block of B
    commits min(run, B − 1) + 1, so a whole-accepted block is censored."""
    obs = []
    for _ in range(n):
        s = rng.uniform()
        run = rng.geometric(1 - p_of_s(s)) - 1                   # drafts accepted before a miss
        B = int(rng.choice(blocks))
        obs.append(Observation(s, z, B, min(run, B - 1) + 1))
    return obs


def test_kaplan_meier_counts_censored_runs_as_survivors():
    # Runs 0, 1, 2 seen exactly; two blocks accepted whole at 2 (R >= 2).
    surv, risk = km_survival(np.array([0, 1, 2, 2, 2]), np.array([False, False, False, True, True]), 3)
    # j=0: 5 at risk, 1 event -> 4/5; j=1: 4 at risk, 1 event -> 3/4; j=2: the censored two are
    # not at risk past 2 (unknown), 1 exact event among 1 at risk... the exact run of 2 ends there.
    assert surv[:3].tolist() == pytest.approx([1.0, 0.8, 0.6])
    assert risk[:3].tolist() == [5, 4, 1]


def test_survival_fit_recovers_a_known_law_from_censored_traces():
    rng = np.random.default_rng(0)
    obs = geometric_trace(rng, 6000, lambda s: 0.8)
    t = SurvivalTables.fit(obs, bins=1)
    for B in (8, 16, 32):
        want = 0.8 ** np.arange(B)                               # P(A_B >= k) = p^(k-1)
        got = t.survival(B, 0.5, "8P")
        assert np.abs(got - want).max() < 0.04, (B, got, want)
        assert t.value(B, 0.5, "8P") == pytest.approx(want.sum(), rel=0.05)


def test_tables_are_monotone_in_s_and_k_and_thin_strata_use_the_pool():
    rng = np.random.default_rng(1)
    obs = geometric_trace(rng, 4000, lambda s: 0.4 + 0.5 * s) + \
        geometric_trace(rng, 15, lambda s: 0.1, z="16F")          # a thin, very different stratum
    t = SurvivalTables.fit(obs, bins=4, min_count=50)
    for key, rows in t.tables.items():
        rows = np.array(rows)
        assert (np.diff(rows, axis=0) >= -1e-12).all(), key      # non-decreasing in s
        assert (np.diff(rows, axis=1) <= 1e-12).all(), key       # non-increasing in k
        assert (rows[:, 0] == 1).all()
    # V grows with the history signal; the thin stratum is pulled toward the pooled table.
    v = [t.value(16, s, "8P") for s in (0.05, 0.35, 0.65, 0.95)]
    assert v == sorted(v) and v[-1] > 2 * v[0]
    thin, pooled = t.value(16, 0.9, "16F"), t.value(16, 0.9, "*")
    assert thin > 0.5 * pooled
    assert t.value(16, 0.9, "unseen") == pooled                 # unknown stratum: the pool


def test_isotonic_fit_pools_adjacent_violators():
    assert isotonic_increasing(np.array([1.0, 3.0, 2.0, 4.0]), np.ones(4)).tolist() == [1, 2.5, 2.5, 4]


def test_chooser_picks_the_known_optimum():
    values = {8: 4.0, 16: 5.5, 32: 6.0}
    costs = {8: 40.0, 16: 50.0, 32: 80.0}
    assert choose_block(values, costs) == 16                     # 0.100, 0.110, 0.075 tok/ms
    assert choose_block(values, costs, "penalty", rho=0.0) == 32
    assert choose_block(values, costs, "penalty", rho=0.2) == 8   # 4-8, 5.5-10, 6-16


def test_history_signal_and_strata():
    assert stratum(None, None) == START
    assert stratum(8, 8) == "8F" and stratum(8, 3) == "8P"
    assert history_signal([8, 8, 8, 8], [8, 1, 8, 1]) == pytest.approx((0 + 1 + 0) / 3)


def test_tables_round_trip_through_json(tmp_path):
    rng = np.random.default_rng(2)
    t = SurvivalTables.fit(geometric_trace(rng, 500, lambda s: 0.7), bins=2)
    import json
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_dict()))
    u = SurvivalTables.load(str(path))
    assert u.value(16, 0.3, "8P") == t.value(16, 0.3, "8P")


def test_probe_rounds_measure_every_block_from_the_same_state_and_stay_lossless():
    from helpers import copy_model
    from fastspec.calibrate import SurvivalProbe, collect, fit_tables
    from fastspec.engine import Engine
    from fastspec.sampling import SamplingParams
    t = copy_model()
    engine = Engine(t, backend="eager")
    ps = [[5, 6, 7, 7, 7], [9, 9, 9, 4], [3, 4, 3, 4]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = engine.generate(ps, params)
    probe = SurvivalProbe(8, (4, 8, 16))
    out = engine.generate(ps, params, method=probe)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    by_block = {b: [o.commit for o in probe.observations if o.block == b] for b in (4, 8, 16)}
    # The trajectory's own block: its probe equals what the round committed (before the budget).
    committed = [a for c in out for a in c.accept_lengths[:-1]]
    assert by_block[8] == committed
    assert all(1 <= c <= 16 for c in by_block[16]) and max(by_block[16]) > 8
    obs = collect(engine, ps, blocks=(4, 8, 16), max_new_tokens=24)
    tables = fit_tables(obs, (4, 8, 16), bins=2, min_count=5)
    assert tables.value(16, 0.9, "8F") >= tables.value(4, 0.9, "8F")
