"""Calibration metrics of draft confidences on synthetic rounds with known answers."""
import math

import numpy as np
import pytest
import torch

from fastspec.evals.calibration import (auc, calibration_metrics, ece, position_labels,
                                        reliability_diagram)


def test_position_labels_accepted_run_then_first_rejection():
    labels = position_labels([2, 0, 3, 1], [4, 4, 4, 2], 4)
    assert [l.tolist() for l in labels] == [
        [1, 1, 0, -1],       # 2 accepted, the third rejected, the last never judged alone
        [0, -1, -1, -1],     # the first draft rejected
        [1, 1, 1, -1],       # all b-1 = 3 judged drafts accepted: no rejection
        [1, -1, -1, -1],     # block 2 in a width-4 batch: one judged draft, accepted
    ]


def one_position_rounds(probs, accepted):
    """Rounds of block 2: exactly one judged draft each, so rounds are independent positions."""
    R = len(probs)
    p = torch.tensor(probs, dtype=torch.float)[:, None]
    return dict(draft_prob=p, draft_confidence=p, draft_margin=torch.zeros(R, 1),
                n_drafted=torch.tensor(accepted), block=torch.full((R,), 2))


def test_ece_known_answer():
    # Bin [0.8, 0.9): 10 drafts at p = 0.85, 6 accepted; bin [0.2, 0.3): 10 at p = 0.25, 5 accepted.
    m = calibration_metrics(**one_position_rounds([0.85] * 10 + [0.25] * 10,
                                                  [1] * 6 + [0] * 4 + [1] * 5 + [0] * 5))
    assert m["ece"] == pytest.approx((10 * 0.25 + 10 * 0.25) / 20)
    assert m["positions"] == 20 and m["accepted"] == 11 and m["first_rejections"] == 9
    full = [r for r in m["reliability"] if r["count"]]
    assert [(r["lo"], r["count"], r["accept_rate"]) for r in full] == [(0.2, 10, 0.5), (0.8, 10, 0.6)]
    assert m["brier"] == pytest.approx((6 * 0.15 ** 2 + 4 * 0.85 ** 2 + 5 * 0.25 ** 2 + 5 * 0.75 ** 2) / 20)
    # Perfect calibration: every bin's accept rate equals its confidence.
    m = calibration_metrics(**one_position_rounds([0.75] * 4 + [1.0] * 3, [1, 1, 1, 0, 1, 1, 1]))
    assert m["ece"] == pytest.approx(0.0)


def test_ece_of_a_calibrated_drafter_is_small_and_of_an_overconfident_one_large():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=20_000)
    y = rng.uniform(size=p.size) < p
    assert ece(p, y)[0] < 0.02
    assert ece(np.clip(p + 0.3, 0, 1), y)[0] > 0.2


def test_auc_known_answers():
    assert auc([0.9, 0.8, 0.1, 0.2], [1, 1, 0, 0]) == 1.0
    assert auc([0.1, 0.2, 0.9, 0.8], [1, 1, 0, 0]) == 0.0
    assert auc([0.5] * 4, [1, 0, 1, 0]) == 0.5
    assert auc([0.8, 0.5, 0.5, 0.2], [1, 1, 0, 0]) == 0.875      # one tied pair counts half
    assert math.isnan(auc([0.1, 0.2], [0, 0]))


def test_risk_auc_for_the_first_rejection_through_the_metrics():
    # Width 3, block 4: round 0 accepts 1 then rejects; round 1 rejects at once; round 2 accepts all.
    margin = torch.tensor([[0.9, 0.2, 0.5], [0.3, 0.0, 0.0], [0.8, 0.7, 0.6]])
    kw = dict(draft_prob=torch.full((3, 3), 0.5), draft_confidence=torch.full((3, 3), 0.6),
              draft_margin=margin, n_drafted=torch.tensor([1, 0, 3]), block=torch.tensor([4, 4, 4]))
    m = calibration_metrics(**kw)
    # Counted: accepted margins 0.9, 0.8, 0.7, 0.6 (risk .1 .2 .3 .4); rejections 0.2, 0.3 (.8 .7).
    assert m["positions"] == 6 and m["first_rejections"] == 2
    assert m["auc_first_rejection"] == 1.0
    margin[0, 1] = 0.85                          # a confident rejection now ranks below 3 of 4
    m = calibration_metrics(**{**kw, "draft_margin": margin})
    assert m["auc_first_rejection"] == pytest.approx((1 + 4) / 8)
    assert m["ece_confidence"] == pytest.approx(abs(0.6 - 4 / 6))


def test_ragged_rounds_and_plain_lists():
    m = calibration_metrics(draft_prob=[[0.9, 0.8, 0.1], [0.7]], draft_confidence=[[0.9, 0.8, 0.1], [0.7]],
                            draft_margin=[[0.5, 0.5, 0.5], [0.5]], n_drafted=[1, 0], block=[4, 2])
    assert m["rounds"] == 2 and m["positions"] == 3 and m["accepted"] == 1


def test_reliability_diagram_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    m = calibration_metrics(**one_position_rounds([0.85] * 10 + [0.25] * 10, [1] * 11 + [0] * 9))
    out = reliability_diagram(m, tmp_path / "rel.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    monkeypatch.delitem(sys.modules, "matplotlib.backends.backend_agg", raising=False)
    assert reliability_diagram(m, tmp_path / "none.png") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed" in err
