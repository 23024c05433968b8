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


def test_ece_floor_is_the_ece_of_a_calibrated_drafter_on_as_many_positions():
    from fastspec.evals.calibration import ece_floor
    # One bin of 100 positions at p = 0.5: sqrt(2/pi) * sqrt(25) / 100.
    assert ece_floor(np.full(100, 0.5)) == pytest.approx(math.sqrt(2 / math.pi) * 5 / 100)
    assert ece_floor(np.ones(50)) == 0.0                 # certain drafts: no noise
    rng = np.random.default_rng(3)
    for n in (300, 3000):                                # shrinks as 1/sqrt(n)
        p = rng.uniform(0.05, 0.95, size=n)
        simulated = np.mean([ece(p, rng.uniform(size=n) < p)[0] for _ in range(300)])
        assert ece_floor(p) == pytest.approx(simulated, rel=0.12)


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


# --- exact drafts, calibrated metrics -------------------------------------------------------------
def test_exact_leading_drafts_are_not_judged():
    from fastspec.convention import FASTSPEC, NLD
    from fastspec.evals.calibration import exact_positions
    assert exact_positions(FASTSPEC) == 1 and exact_positions(NLD) == 0
    labels = position_labels([2, 0, 3], [4, 4, 4], 4, skip=1)
    assert [l.tolist() for l in labels] == [[-1, 1, 0, -1], [-1, -1, -1, -1], [-1, 1, 1, -1]]
    # fastspec's d1 always accepted at p = 0.3: counted it would dominate the ECE.
    kw = dict(draft_prob=[[0.3, 0.8]] * 10, draft_confidence=[[0.3, 0.8]] * 10,
              draft_margin=[[0.1, 0.5]] * 10, n_drafted=[2] * 8 + [1] * 2, block=[3] * 10)
    assert calibration_metrics(**kw)["ece"] == pytest.approx((10 * 0.7 + 10 * 0.0) / 20)
    m = calibration_metrics(**kw, skip=1)
    assert m["positions"] == 10 and m["exact_positions"] == 1 and m["ece"] == pytest.approx(0.0)
    assert m["by_index"] == [{"index": 1, "count": 10, "accept_rate": 0.8, "mean_draft_prob": 0.8}]


def test_a_round_whose_first_draft_is_a_guess_is_judged_from_index_0():
    """skip per round: a TiDAR warm round's d1 was drafted before its seed was known (and a
    DFlash drafter's d1 is its own guess), so it is judged where a draft forward's is not."""
    labels = position_labels([0, 0, 1], [2, 2, 3], 2, skip=[1, 0, 0])
    assert [l.tolist() for l in labels] == [[-1, -1], [0, -1], [1, 0]]
    kw = dict(draft_prob=[[0.9]] * 4, draft_confidence=[[0.9]] * 4, draft_margin=[[0.5]] * 4,
              n_drafted=[1, 1, 0, 1], block=[2] * 4)
    m = calibration_metrics(**kw, skip=[1, 0, 0, 0])
    assert m["positions"] == 3 and m["accepted"] == 2 and m["exact_rounds"] == 1
    assert m["exact_positions"] == 1
    with pytest.raises(ValueError, match="one per round"):
        position_labels([0, 1], [2, 2], 2, skip=[1])


def test_methods_say_whether_their_first_draft_can_be_exact():
    from fastspec.methods import get_method
    from fastspec.methods.tidar import TiDAR
    assert get_method("linear").exact_drafts("") and get_method("bastion").exact_drafts("")
    assert not get_method("dflash").exact_drafts("")
    assert not get_method("libraspec[drafter=dflash]").exact_drafts("")
    t = TiDAR(block=2)
    assert t.exact_drafts("cold") and not t.exact_drafts("warm")


def test_calibrated_metrics_apply_the_temperature_of_each_index():
    from fastspec.draft import DraftCalibration
    # Index 0 at p = 0.8, index 1 at p = 0.5; rounds of block 3 (both judged when 0 is accepted).
    kw = dict(draft_prob=[[0.8, 0.5]] * 4, draft_confidence=[[0.8, 0.5]] * 4,
              draft_margin=[[0.6, 0.0]] * 4, n_drafted=[2, 1, 0, 0], block=[3] * 4)
    m = calibration_metrics(**kw, calibration=DraftCalibration([2.0, 3.0]))
    # sigmoid(logit(0.8) / 2) = 2 / 3; 0.5 stays 0.5 under any T.
    assert m["mean_calibrated_prob"] == pytest.approx((4 * 2 / 3 + 2 * 0.5) / 6)
    assert m["ece"] == pytest.approx((4 * abs(0.8 - 0.5) + 2 * abs(0.5 - 0.5)) / 6)
    assert m["ece_calibrated"] == pytest.approx((4 * abs(2 / 3 - 0.5) + 0) / 6)
    # A table for block 3 wins over the pooled one.
    m = calibration_metrics(**kw, calibration=DraftCalibration([2.0, 3.0], {3: [1.0, 1.0]}))
    assert m["ece_calibrated"] == pytest.approx(m["ece"])


# --- fitting a temperature per position -----------------------------------------------------------
def drafted_rounds(temps, rounds, seed=0, exact=1):
    """Rounds of block len(temps) + 1 whose draft at index i is accepted with probability
    sigmoid(logit(p) / temps[i]) until the first rejection (index < exact: always accepted)."""
    rng = np.random.default_rng(seed)
    n = len(temps)
    p = rng.uniform(0.05, 0.97, size=(rounds, n))
    accept_p = 1 / (1 + np.exp(-np.log(p / (1 - p)) / np.asarray(temps)))
    ok = rng.uniform(size=(rounds, n)) < accept_p
    ok[:, :exact] = True
    n_drafted = np.cumprod(ok, axis=1).sum(1)
    return dict(draft_prob=p, n_drafted=n_drafted, block=np.full(rounds, n + 1))


def test_temperature_fit_recovers_a_known_temperature():
    from fastspec.evals.calibration import fit_temperature, scaled
    rng = np.random.default_rng(1)
    p = rng.uniform(0.02, 0.98, size=40_000)
    for t in (0.5, 1.0, 2.5):
        y = rng.uniform(size=p.size) < scaled(p, t)
        assert fit_temperature(p, y) == pytest.approx(t, rel=0.06)


def test_platt_fit_recovers_a_known_temperature_and_bias():
    from fastspec.evals.calibration import fit_platt, scaled
    rng = np.random.default_rng(2)
    p = rng.uniform(0.02, 0.98, size=60_000)
    for t, b in ((1.0, 0.0), (0.8, 0.6), (2.0, -0.5)):
        y = rng.uniform(size=p.size) < scaled(p, t, b)
        got_t, got_b = fit_platt(p, y)
        assert got_t == pytest.approx(t, rel=0.06) and got_b == pytest.approx(b, abs=0.05)


def test_a_bias_calibrates_an_under_confident_drafter_where_a_temperature_cannot():
    """Drafts accepted with sigmoid(logit(p) + 0.7): every p is too low. A temperature only
    stretches the log-odds about 1/2 and leaves most of the gap; T and b close it."""
    from fastspec.evals.calibration import fit_temperatures
    rng = np.random.default_rng(3)
    rounds, n = 30_000, 4
    p = rng.uniform(0.3, 0.9, size=(rounds, n))
    ok = rng.uniform(size=(rounds, n)) < 1 / (1 + np.exp(-(np.log(p / (1 - p)) + 0.7)))
    ok[:, :1] = True
    data = dict(draft_prob=p, n_drafted=np.cumprod(ok, axis=1).sum(1), block=np.full(rounds, n + 1))
    kw = dict(draft_confidence=p, draft_margin=p, n_drafted=data["n_drafted"], block=data["block"], skip=1)
    temp_only = fit_temperatures(**data, skip=1, min_count=500, width=n, intercept=False)
    platt = fit_temperatures(**data, skip=1, min_count=500, width=n)
    assert temp_only.bias == [] and platt.bias[0] == 0.0
    assert platt.bias[1:] == pytest.approx([0.7] * (n - 1), abs=0.1)
    raw = calibration_metrics(p, calibration=None, **kw)["ece"]
    by_t = calibration_metrics(p, calibration=temp_only, **kw)["ece_calibrated"]
    by_tb = calibration_metrics(p, calibration=platt, **kw)["ece_calibrated"]
    assert raw > 0.1 and by_t > raw / 3 and by_tb < 0.02


def test_temperature_per_position_recovers_each_index_and_pools_thin_ones():
    from fastspec.evals.calibration import fit_temperatures
    data = drafted_rounds([1.0, 2.0, 0.6, 1.5], 30_000)
    cal = fit_temperatures(**data, skip=1, min_count=500, width=6)
    assert cal.temperature[0] == 1.0                     # exact: never fitted
    assert cal.temperature[1:4] == pytest.approx([2.0, 0.6, 1.5], rel=0.1)
    assert cal.meta["fitted_indices"] == [1, 2, 3]
    # Indices without data take the temperature fitted over every judged position.
    assert cal.temperature[4] == cal.temperature[5] == cal.meta["pooled_temperature"]
    assert cal.meta["counts"]["by_index"][0] == 0 and cal.meta["counts"]["by_index"][1] == 30_000
    assert cal.meta["log_loss_after"] < cal.meta["log_loss_before"]
    m_kw = dict(draft_confidence=data["draft_prob"], draft_margin=data["draft_prob"], skip=1)
    m = calibration_metrics(data["draft_prob"], n_drafted=data["n_drafted"], block=data["block"],
                            calibration=cal, **m_kw)
    assert m["ece"] > 0.04 and m["ece_calibrated"] < m["ece"] / 3
    # With too few positions anywhere, every judged index gets the pooled temperature.
    thin = fit_temperatures(**drafted_rounds([1.0, 2.0, 2.0], 300), skip=1, min_count=1000, width=3)
    assert thin.meta["fitted_indices"] == [] and thin.temperature[1] == thin.temperature[2] > 1.3


def test_temperatures_per_block_size_when_the_data_has_several():
    from fastspec.evals.calibration import fit_temperatures
    a, b = drafted_rounds([1.0, 2.0, 2.0], 20_000, seed=1), drafted_rounds([1.0, 0.7, 0.7], 20_000, seed=2)
    # Pad the second to width 3 with block 3: index 2 never judged there.
    b["draft_prob"] = b["draft_prob"][:, :3]
    b["block"] = np.full(20_000, 3)
    b["n_drafted"] = np.minimum(b["n_drafted"], 2)
    cal = fit_temperatures(draft_prob=list(a["draft_prob"]) + list(b["draft_prob"]),
                           n_drafted=np.concatenate([a["n_drafted"], b["n_drafted"]]),
                           block=np.concatenate([a["block"], b["block"]]), skip=1, width=4)
    assert sorted(cal.by_block) == [3, 4]
    assert cal.table(4)[1] == pytest.approx(2.0, rel=0.1) and cal.table(3)[1] == pytest.approx(0.7, rel=0.1)
    assert cal.table(3)[2] == cal.temperature[2]        # not judged in block 3: the pooled table's
    assert cal.table(16) == cal.temperature             # an unseen block: the pooled table


# --- calibration.json beside the adapter ----------------------------------------------------------
def test_calibration_json_round_trip_onto_a_model(tmp_path, capsys):
    from conftest import tiny_drafter, tiny_loaded
    from fastspec.draft import (CALIBRATION_FILE, DraftCalibration, load_adapter, save_adapter,
                                save_calibration)
    d = str(tmp_path / "draft")
    save_adapter(tiny_drafter().model, d)
    fresh = tiny_loaded().model
    load_adapter(fresh, d)
    assert fresh.draft_calibration is None               # no file: nothing fitted
    cal = DraftCalibration([1.0, 1.7, 2.25, 0.8], {8: [1.0, 1.5, 2.0, 0.9]}, {"command": "fastspec x"})
    save_calibration(cal, d)
    load_adapter(fresh, d)
    got = fresh.draft_calibration
    assert got.temperature == cal.temperature and got.by_block == cal.by_block
    assert got.meta["command"] == "fastspec x" and len(got.meta["adapter_sha256"]) == 16
    assert got.temperatures(6, block=8).tolist() == pytest.approx([1.0, 1.5, 2.0, 0.9, 0.9, 0.9])
    p = torch.tensor([[0.5, 0.8, 0.8, 0.8]])
    assert got.apply(p).tolist()[0] == pytest.approx([0.5, 1 / (1 + 4 ** (-1 / 1.7)),
                                                      1 / (1 + 4 ** (-1 / 2.25)), 1 / (1 + 4 ** (-1 / 0.8))])
    # Retrained weights: the old calibration does not describe them and is ignored, in one line.
    other = tiny_drafter(seed=9).model
    save_adapter(other, d)
    capsys.readouterr()
    load_adapter(fresh, d)
    assert fresh.draft_calibration is None
    assert "fitted for other adapter weights" in capsys.readouterr().err
    # A bias table travels with the file and shifts the log-odds: sigmoid(logit(p) / T + b).
    save_adapter(tiny_drafter().model, d)
    save_calibration(DraftCalibration([1.0, 2.0], {}, {}, [0.0, 0.5], {8: [0.0, -1.0]}), d)
    load_adapter(fresh, d)
    got = fresh.draft_calibration
    assert got.bias == [0.0, 0.5] and got.by_block_bias == {8: [0.0, -1.0]}
    z = math.log(4) / 2
    assert got.apply(torch.tensor([[0.5, 0.8, 0.8]])).tolist()[0] == pytest.approx(
        [0.5, 1 / (1 + math.exp(-(z + 0.5))), 1 / (1 + math.exp(-(z + 0.5)))])
    assert got.apply(torch.tensor([[0.5, 0.8]]), block=8).tolist()[0] == pytest.approx(
        [0.5, 1 / (1 + math.exp(-(z - 1.0)))])       # block 8: the pooled T, its own b
    (tmp_path / "draft" / CALIBRATION_FILE).write_text('{"temperature": [1.0], "bias": [1e999]}')
    with pytest.raises(Exception, match="bias"):
        load_adapter(fresh, d)
    (tmp_path / "draft" / CALIBRATION_FILE).write_text('{"temperature": [1.0, -2]}')
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError, match="positive"):
        load_adapter(fresh, d)


# --- in a bench run -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A tiny-random draft adapter whose drafts differ from AR (so some are rejected)."""
    from fastspec.draft import AdapterConfig, attach_adapter, save_adapter
    from fastspec.model.loader import load_model
    model = load_model("tiny-random", adapter=None).model
    attach_adapter(model, AdapterConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for blk in model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.1 * torch.randn(lora.B.shape, generator=g))
    d = tmp_path_factory.mktemp("adapter")
    save_adapter(model, str(d))
    return str(d)


def cli(*args):
    from click.testing import CliRunner
    from fastspec.cli.main import cli as fastspec
    result = CliRunner().invoke(fastspec, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def test_bench_json_carries_calibration_for_a_drafting_method_and_not_for_ar(tmp_path, adapter_dir):
    import json
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(3)))
    out = tmp_path / "r.json"
    text = cli("bench", "--model", "tiny-random", "--adapter", adapter_dir, "--backend", "eager",
               "--max-new-tokens", "12", "--prompts", str(prompts), "--method", "ar,linear",
               "--block", "4", "--concurrency", "1,2", "--json", str(out))
    data = json.loads(out.read_text())
    runs = {(r["method"], r["concurrency"]): r for r in data["runs"]}
    assert "calibration" not in runs[("ar", 1)] and "calibration" not in runs[("ar", 2)]
    for c in (1, 2):
        cal = runs[("linear", c)]["calibration"]
        recs = [r for r in data["records"] if r["method"] == "linear" and r["concurrency"] == c]
        # One row per request per round; d1 is exact under fastspec's convention: not judged.
        assert cal["all"]["rounds"] == sum(r["rounds"] for r in recs)
        assert cal["exact_positions"] == 1 and cal["calibrated"] is False
        assert set(cal["by_bench"]) == {"prompts"}
        m = cal["all"]
        assert 0 < m["positions"] <= 2 * m["rounds"] and 0 <= m["ece"] <= 1
        assert m["first_rejections"] + m["accepted"] == m["positions"]
        assert sum(r["count"] for r in m["reliability"]) == m["positions"]
        assert m["by_index"][0]["index"] == 1 and {i["index"] for i in m["by_index"]} <= {1, 2}
        assert cal["collect_s"] >= 0
    # Greedy: the same drafts at every concurrency (the float sums may differ in the last bits:
    # C=2 collects the same rows in another order).
    def rounded(x):
        if isinstance(x, float):
            return float(f"{x:.9g}")
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        return [rounded(v) for v in x] if isinstance(x, list) else x
    assert rounded(runs[("linear", 1)]["calibration"]["all"]) == rounded(runs[("linear", 2)]["calibration"]["all"])
    assert "Draft calibration — C=1" in text and "AUC risk" in text
    # TiDAR's warm rounds verify pre-drafts made before their seed was known: at B=2 their one
    # draft is judged; its cold rounds' d1 is exact and is not.
    out_t = tmp_path / "t.json"
    cli("bench", "--model", "tiny-random", "--adapter", adapter_dir, "--backend", "eager",
        "--max-new-tokens", "12", "--prompts", str(prompts), "--method", "tidar[block=2;ar=0]",
        "--concurrency", "1", "--json", str(out_t))
    run = next(r for r in json.loads(out_t.read_text())["runs"] if r["method"].startswith("tidar"))
    m, rep = run["calibration"]["all"], run["method_report"]
    assert m["exact_rounds"] == rep["cold_rounds"] == 3 and m["rounds"] == rep["rounds"]
    assert m["positions"] == rep["warm_rounds"] > 0 and m["by_index"][0]["index"] == 0
    # --plot draws the reliability diagram beside the other plots.
    plotted = cli("bench", "--plot", str(out))
    assert (tmp_path / "r_plots" / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reliability.png" in plotted


def test_calibrate_drafter_writes_calibration_json_beside_the_adapter(tmp_path, adapter_dir):
    import json
    import shutil
    from fastspec.model.loader import load_model
    d = tmp_path / "draft"
    shutil.copytree(adapter_dir, d)
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"request number {i}"}) for i in range(6)))
    # The adapter's record says it was trained on 2 of these 6 prompts (seed 4): they are held out.
    config = json.loads((d / "adapter_config.json").read_text())
    config["meta"] = {"data": [{"path": str(train), "weight": 1.0, "prompts": 2, "rows": 6}],
                      "command": "fastspec train-drafter --seed 4"}
    (d / "adapter_config.json").write_text(json.dumps(config))
    text = cli("calibrate", "--drafter", "--model", "tiny-random", "--adapter", str(d),
               "--backend", "eager", "--train-data", str(train), "--prompts", "3",
               "--max-new-tokens", "16", "--blocks", "4")
    saved = json.loads((d / "calibration.json").read_text())
    assert "-> " + str(d / "calibration.json") in text.replace("\n", "")
    # The command spells out every setting, the resolved defaults included.
    words = saved["command"].split()
    assert words[:2] == ["fastspec", "calibrate"] and "--drafter" in words
    for flag, value in (("--model", "tiny-random"), ("--adapter", str(d)), ("--backend", "eager"),
                        ("--train-data", str(train)), ("--prompts", "3"), ("--blocks", "4"),
                        ("--max-new-tokens", "16"), ("--concurrency", "1")):
        assert words[words.index(flag) + 1] == value
    assert saved["data"] == [{"path": str(train), "weight": 1.0, "prompts": 3, "rows": 6, "excluded": 2}]
    assert saved["prompts"] == 3 and saved["blocks"] == [4] and saved["max_new_tokens"] == 16
    assert len(saved["temperature"]) == 32 and saved["temperature"][0] == 1.0
    assert saved["counts"]["positions"] > 0 and saved["counts"]["by_index"][0] == 0
    assert 0 <= saved["ece_after"] <= 1 and 0 <= saved["ece_before"] <= 1
    loaded = load_model("tiny-random", adapter=str(d))
    assert loaded.model.draft_calibration.temperature == saved["temperature"]
    # A bench on this adapter now reports the calibrated ECE beside the raw one.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "question"}))
    out = tmp_path / "r.json"
    cli("bench", "--model", "tiny-random", "--adapter", str(d), "--backend", "eager", "--no-baseline",
        "--max-new-tokens", "12", "--prompts", str(prompts), "--method", "linear", "--block", "4",
        "--json", str(out))
    cal = json.loads(out.read_text())["runs"][0]["calibration"]
    assert cal["calibrated"] is True and cal["temperature"] == saved["temperature"]
    assert cal["all"]["ece_calibrated"] is not None
    # Trained on every prompt of a file: nothing is left to calibrate on, and it says so.
    seen = tmp_path / "seen.jsonl"
    seen.write_text("\n".join(json.dumps({"prompt": f"request number {i}"}) for i in range(2)))
    config["meta"]["data"].append({"path": str(seen), "weight": 1.0, "prompts": 2, "rows": 2})
    (d / "adapter_config.json").write_text(json.dumps(config))
    from click.testing import CliRunner
    from fastspec.cli.main import cli as main_cli
    res = CliRunner().invoke(main_cli, ["calibrate", "--drafter", "--model", "tiny-random",
                                        "--adapter", str(d), "--backend", "eager",
                                        "--train-data", str(seen), "--prompts", "2"])
    assert res.exit_code != 0 and "every prompt in --train-data is one this drafter was trained on" \
        in res.output and "Traceback" not in res.output


def test_calibrate_fits_survival_tables_and_names_the_adapter_they_were_fit_with(tmp_path, adapter_dir):
    """RecGuide's tables hold for the drafter that produced the traces: the file says which
    adapter that was, beside the command that reruns it."""
    import json
    import os
    from fastspec.survival import SurvivalTables
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"request number {i}"}) for i in range(4)))
    out = tmp_path / "tables.json"
    text = cli("calibrate", "--model", "tiny-random", "--adapter", adapter_dir, "--backend", "eager",
               "--train-data", str(train), "--prompts", "2", "--max-new-tokens", "12",
               "--blocks", "4,8", "--out", str(out))
    assert "observations from 2 prompts" in text
    saved = json.loads(out.read_text())
    assert saved["meta"]["adapter"] == os.path.relpath(adapter_dir)
    assert saved["meta"]["command"].split()[:2] == ["fastspec", "calibrate"]
    tables = SurvivalTables.load(str(out))
    assert tables.blocks == (4, 8) and 0 < tables.value(8, 0.5, "*") <= 8
