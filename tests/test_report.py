"""Report metrics on a hand-made run, the results file round trip, tables and plots."""
import json
import re

import pytest
from rich.console import Console

from fastspec.config import FastspecError
from fastspec.evals.report import (accuracy_table, figure5_table, load_results, lookup, metrics,
                                   pareto_optimal, per_request_rate, table2, write_plots)


def rec(bench, method, c, n, accept, latency, ttft=0.1, correct=None, identical=True, forwards=True):
    r = {"bench": bench, "problem_id": "0", "method": method, "concurrency": c, "prompt_tokens": 10,
         "new_tokens": n, "rounds": len(accept), "tau": 0.0, "latency_s": latency, "ttft_s": ttft,
         "finish_reason": "length", "correct": correct, "identical": identical, "completion": ""}
    if forwards:            # C=1 records carry forwards and accept lengths; C=2 records do not
        r.update(forwards=len(accept) + 1, accept_lengths=accept)
    return r


def synthetic():
    # Per-request streaming rate = (n - 1) / (latency - ttft): AR 10 tok/s everywhere; linear
    # 20 on gsm8k and 30 on math500.
    rows = [("gsm8k", "ar", 5, [1] * 4, 0.5, True, True), ("gsm8k", "ar", 9, [1] * 8, 0.9, False, True),
            ("math500", "ar", 7, [1] * 6, 0.7, True, True),
            ("gsm8k", "linear", 5, [3, 1], 0.3, True, True), ("gsm8k", "linear", 9, [4, 2, 2], 0.5, False, True),
            ("math500", "linear", 7, [4, 2], 0.3, True, False)]
    records = [rec(b, m, 1, n, a, lat, correct=ok, identical=same) for b, m, n, a, lat, ok, same in rows]
    records += [rec(b, m, 2, n, a, lat, correct=ok, identical=same, forwards=False)
                for b, m, n, a, lat, ok, same in rows]
    runs = [{"method": m, "concurrency": c, "tokens_per_s": tps, "tokens_per_forward": tpf, "warmup_s": 0.0}
            for m, c, tps, tpf in (("ar", 1, 10.0, 1.0), ("linear", 1, 25.0, 2.0),
                                   ("ar", 2, 18.0, 1.0), ("linear", 2, 40.0, 1.9))]
    return records, runs


def test_metrics_match_hand_computed_values():
    m = metrics(*synthetic())
    assert m["methods"] == ["ar", "linear"] and m["benches"] == ["gsm8k", "math500"]
    assert m["concurrency"] == [1, 2]
    lin = lookup(m, "by_method", method="linear", concurrency=1)
    assert lin["tau"] == pytest.approx(18 / 7)                  # (4 + 8 + 6) / (2 + 3 + 2)
    assert lin["tokens_per_forward"] == pytest.approx(21 / 10)  # from records' forwards
    assert lin["accept_hist"] == {1: 1, 2: 3, 3: 1, 4: 2}
    assert lin["speedup"] == pytest.approx(2.5)                  # 25 / 10 aggregate
    assert lin["per_request_tokens_per_s"] == pytest.approx(70 / 3)
    assert lin["accuracy"] == pytest.approx(2 / 3) and lin["identical"] == pytest.approx(2 / 3)
    gsm = lookup(m, "by_bench", bench="gsm8k", method="linear", concurrency=1)
    math = lookup(m, "by_bench", bench="math500", method="linear", concurrency=1)
    assert (gsm["tau"], math["tau"]) == (pytest.approx(2.4), pytest.approx(3.0))
    assert (gsm["speedup"], math["speedup"]) == (pytest.approx(2.0), pytest.approx(3.0))   # per-request
    assert (gsm["tokens_per_forward"], math["tokens_per_forward"]) == (pytest.approx(2.0), pytest.approx(7 / 3))
    avg = lookup(m, "macro", method="linear", concurrency=1)
    assert avg["tau"] == pytest.approx(2.7) and avg["speedup"] == pytest.approx(2.5)
    assert avg["accuracy"] == pytest.approx(0.75) and avg["identical"] == pytest.approx(0.5)
    ar = lookup(m, "by_method", method="ar", concurrency=1)
    assert ar["tau"] == ar["speedup"] == ar["tokens_per_forward"] == 1.0 and ar["accept_hist"] == {1: 18}
    # C=2 records lack forwards and accept_lengths: tokens/forward falls back to the run's.
    lin2 = lookup(m, "by_method", method="linear", concurrency=2)
    assert lin2["tokens_per_forward"] == 1.9 and lin2["accept_hist"] is None
    assert lin2["speedup"] == pytest.approx(40 / 18)
    assert lookup(m, "by_bench", bench="gsm8k", method="linear", concurrency=2)["tokens_per_forward"] is None


def test_uncounted_rounds_leave_tau_out_and_missing_reference_leaves_speedup_out():
    records = [rec("gsm8k", "hf", 1, 5, [1] * 4, 0.5)]
    records[0]["rounds"] = None
    m = metrics(records, [{"method": "hf", "concurrency": 1, "tokens_per_s": 9.0}])
    row = lookup(m, "by_method", method="hf", concurrency=1)
    assert row["tau"] is None and row["speedup"] is None and row["per_request_tokens_per_s"] == 10.0


def test_results_round_trip_and_bad_files(tmp_path):
    records, runs = synthetic()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"environment": {}, "runs": runs, "summary": [], "records": records}))
    res = load_results(str(path))
    assert metrics(res["records"], res["runs"]) == metrics(records, runs)
    bad = tmp_path / "bad.json"
    for text, msg in (("{not json", "not valid JSON"), ("[]", "needs 'runs' and 'records'"),
                      (json.dumps({"runs": runs, "records": [{"bench": "x"}]}), "records\\[0\\] lacks")):
        bad.write_text(text)
        with pytest.raises(FastspecError, match=msg) as e:
            load_results(str(bad))
        assert "\n" not in str(e.value)
    with pytest.raises(FastspecError, match="not found"):
        load_results(str(tmp_path / "missing.json"))


def render(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_tables_show_the_numbers():
    m = metrics(*synthetic())
    t2 = render(table2(m, 1))
    assert "C=1" in t2 and "gsm8k" in t2 and "avg" in t2
    assert "1.00 / 1.00×" in t2 and "2.40 / 2.00×" in t2 and "3.00 / 3.00×" in t2 and "2.70 / 2.50×" in t2
    assert "C=2" in render(table2(m, 2))
    f5 = render(figure5_table(m))
    assert "25.0" in f5 and "23.3" in f5 and "2.50×" in f5 and "2.22×" in f5
    acc = render(accuracy_table(m))
    assert "50% / 100%" in acc and "100% / 0%" in acc and "75% / 50%" in acc
    with pytest.raises(FastspecError, match="concurrency 8"):
        table2(m, 8)


def test_pareto_optimal():
    assert pareto_optimal([(1, 10), (2, 5), (1, 4), (2, 5)]) == [True, True, False, True]


def test_write_plots_makes_pngs(tmp_path):
    records, runs = synthetic()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"runs": runs, "records": records}))
    paths = write_plots(str(path), str(tmp_path / "plots"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["pareto.png", "tau_by_bench.png", "accept_hist.png"]
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024


def test_table1_reads_each_method_at_its_own_block_size():
    """A run at --block 8 beside linear[block=16]: the B=16 rows' accepted fractions are taken of
    their own 15 drafts (a fully accepted 16-block is 'high', not outside every interval)."""
    from fastspec.evals.recguide_report import print_tables, transitions
    records = [rec("gsm8k", "linear[block=16]", 1, 40, [16, 16, 1, 16, 2], 1.0),
               rec("gsm8k", "linear", 1, 20, [8, 1, 8, 3], 1.0)]
    runs = [{"method": m, "concurrency": 1, "tokens_per_s": 1.0, "tokens_per_forward": 1.0}
            for m in ("linear[block=16]", "linear")]
    console = Console(record=True, width=200)
    print_tables(console, runs, records, block=8)
    text = console.export_text()
    assert text.count("Table 1") == 2
    # rounds (last cut): 16 16 1 16 -> high high low high: high->high, high->low, low->high
    assert transitions(records, "linear[block=16]", 16) == [[0, 0, 1], [0, 0, 0], [0.5, 0, 0.5]]


def test_table1_reads_the_block_a_run_recorded_without_a_run_wide_block():
    """bench without --block: TiDAR ran at its own B (here 4) and its run says so; Table 1 reads its
    rounds of 4 (a fully accepted 4-block is 'high'), not the suite's 8."""
    from fastspec.evals.recguide_report import print_tables
    records = [rec("gsm8k", "tidar", 1, 20, [4, 4, 1, 4, 2], 1.0)]
    runs = [{"method": "tidar", "concurrency": 1, "tokens_per_s": 1.0, "tokens_per_forward": 1.0,
             "block": 4}]
    console = Console(record=True, width=200)
    print_tables(console, runs, records, block=None)
    text = console.export_text()
    assert text.count("Table 1") == 1
    rows = {cells[1].split()[0]: [c.strip() for c in cells[2:-1]]
            for line in text.splitlines() if (cells := line.split("│"))[1:2]
            and cells[1].split()[:1] in (["low"], ["mid"], ["high"])}
    # rounds (last cut): 4 4 1 4 -> high high low high: from high, 1/2 to low and 1/2 to high
    assert rows == {"low": ["0.00", "0.00", "1.00"], "mid": ["0.00", "0.00", "0.00"],
                    "high": ["0.50", "0.00", "0.50"]}


def test_the_gate_bound_table_shows_each_slot_count_of_a_recguide_run():
    from fastspec.evals.recguide_report import print_tables
    report = {"rounds": 10, "proposed": 0, "laid_out": 0, "coverage": 0.3, "reuse": 0.0,
              "no_hit": 1.0, "slots_chosen": {0: 10},
              "gate_bound": [{"slots": 0, "hit_rate": 0.0, "measured": 1.0, "profile": 1.0},
                             {"slots": 1, "hit_rate": 0.34, "measured": 0.9544, "profile": 1.0719}]}
    runs = [{"method": "recguide", "concurrency": 1, "tokens_per_s": 1.0, "tokens_per_forward": 1.0,
             "method_report": report}]
    console = Console(record=True, width=200)
    print_tables(console, runs, [], block=8)
    text = console.export_text()
    assert "Gate bound" in text
    # one row per slot count: k, H_k, bound on measured steps, bound on the profile
    assert re.search(r"recguide\W+1\W+1\W+34%\W+0\.95×\W+1\.07×", text)
    assert re.search(r"recguide\W+1\W+0\W+0%\W+1\.00×\W+1\.00×", text)


def test_per_request_rate_streams_after_the_first_token_and_skips_requests_without_a_rate():
    rows = [{"new_tokens": 11, "latency_s": 3.0, "ttft_s": 1.0},     # 10 tokens in 2 s: 5 tok/s
            {"new_tokens": 21, "latency_s": 2.0, "ttft_s": 0.0},     # 20 tokens in 2 s: 10 tok/s
            {"new_tokens": 1, "latency_s": 1.0, "ttft_s": 1.0}]      # only the prefill token: no rate
    assert per_request_rate(rows) == 7.5
    assert per_request_rate(rows[2:]) is None


def test_figure5_points_use_the_tables_per_request_rate():
    from fastspec.evals.recguide_report import throughput_points
    records, runs = synthetic()
    pts = throughput_points(runs, records)
    # linear: two gsm8k requests at 20 tok/s and one math500 request at 30 -> mean 23.33
    assert [(c, agg) for c, agg, _ in pts["linear"]] == [(1, 25.0), (2, 40.0)]
    assert pts["linear"][0][2] == pytest.approx(70 / 3)
    assert pts["ar"][1][2] == pytest.approx(10.0)
    m = metrics(records, runs)
    assert pts["linear"][0][2] == pytest.approx(lookup(m, "by_method", method="linear", concurrency=1)
                                                ["per_request_tokens_per_s"])


def test_paired_speedup_is_the_geometric_mean_of_per_request_ratios_with_an_interval():
    """Each request against AR on the same request: twice as fast on one, half on another ->
    geometric mean 1; a constant ratio has a zero-width interval; fewer than 2 pairs: none."""
    from fastspec.evals.report import paired_speedup

    def rec(pid, rate, method="linear"):
        # (new_tokens - 1) / (latency - ttft) = rate
        return {"bench": "b", "problem_id": pid, "method": method, "new_tokens": 11,
                "latency_s": 1.0 + 10 / rate, "ttft_s": 1.0}
    ar = [rec(str(i), 10.0, "ar") for i in range(4)]
    p = paired_speedup([rec("0", 20.0), rec("1", 5.0), rec("2", 20.0), rec("3", 5.0)], ar)
    assert abs(p["geomean"] - 1.0) < 1e-9 and p["requests"] == 4
    assert p["ci95"][0] < 1.0 < p["ci95"][1]
    q = paired_speedup([rec(str(i), 13.0) for i in range(4)], ar)
    assert abs(q["geomean"] - 1.3) < 1e-9 and abs(q["ci95"][0] - 1.3) < 1e-9 and abs(q["ci95"][1] - 1.3) < 1e-9
    assert paired_speedup([rec("0", 13.0)], ar) is None
    assert paired_speedup([rec("9", 13.0), rec("8", 13.0)], ar) is None      # no request in common


def test_a_method_spec_in_brackets_is_shown_whole():
    """`linear[block=4]` and `linear[block=16]` are different rows: rich must not read the
    brackets as markup and print both as `linear`."""
    from fastspec.evals.report import paired_lines
    records, runs = synthetic()
    spec = "linear[block=4]"
    records = [dict(r, method=spec) if r["method"] == "linear" else r for r in records]
    runs = [dict(r, method=spec) if r["method"] == "linear" else r for r in runs]
    m = metrics(records, runs)
    for table in (table2(m, 1), figure5_table(m), accuracy_table(m)):
        assert spec in render(table)
    console = Console(width=200, record=True)
    for line in paired_lines(m):
        console.print(line, highlight=False)      # markup lines: the spec comes out whole
    assert f"{spec} " in console.export_text()


def test_the_tree_methods_show_their_decisions_and_every_timed_step():
    """D²SD's branches per round and what each would buy, BASTION's tree sizes and AR rounds,
    and the profile-vs-measured table for every timed method, not only RecGuide."""
    from fastspec.evals.recguide_report import print_tables
    check = {"steps": {"1x8:k0": {"measured": 52.9, "profile": 48.0, "error": -0.093, "at_level": 0.0}},
             "mean_abs_error": 0.093, "level": 1.0, "mean_abs_error_at_level": 0.0}
    d2sd = {"rounds": 12, "branch_share": {0: 0.75, 2: 0.25}, "hit_rates": [0.167, 0.067],
            "mean_extra": [2.15, 2.5], "mean_chain_tokens": 3.15, "prices": "measured",
            "profile_check": check, "block_share": {"8": 0.25, "1": 0.5, "4": 0.25},
            "expected_chain": {"4": 2.9, "8": 3.159}}
    bastion = {"rounds": 9, "mean_wanted_nodes": 4.9, "mean_nodes": 8.0, "mean_budget": 8.0,
               "tau": 3.43, "ar_share": 0.095, "looks": 2, "prices": "profile",
               "profile_check": {"steps": {}}, "budget_share": {1: 0.095, 8: 0.905},
               "expected_tokens": {4: 2.901, 8: 3.426}}
    runs = [{"method": m, "concurrency": 1, "tokens_per_s": 1.0, "tokens_per_forward": 1.0,
             "method_report": r} for m, r in (("d2sd", d2sd), ("bastion", bastion))]
    console = Console(record=True, width=200)
    print_tables(console, runs, [], block=8)
    text = console.export_text()
    assert re.search(r"d2sd\W+1\W+12\W+0:75% 2:25%\W+17% 7%\W+2\.15 2\.50\W+3\.15\W+"
                     r"1:50% 4:25% 8:25%\W+4:2\.90 8:3\.16\W+measured", text)
    assert re.search(r"bastion\W+1\W+9\W+4\.9\W+8\.0\W+8\.0\W+3\.43\W+1:10% 8:90%\W+"
                     r"4:2\.90 8:3\.43\W+2\W+profile", text)
    assert re.search(r"d2sd\W+1\W+1x8:k0\W+52\.9\W+48\.0\W+-9%", text)


def test_tidar_shows_the_block_it_chose_and_why():
    """block=auto: the report names the block each run took, the acceptance rate it judged by
    and the tokens per ms its best blocks promised."""
    from fastspec.evals.recguide_report import print_tables
    rep = {"rounds": 40, "tau": 1.59, "block": 2, "seed_hit_share": 0.0,
           "block_choice": {"accept_rate": 0.5918, "rows": 1, "block": 2,
                            "tokens_per_ms": {"2": 0.07105, "3": 0.05697, "4": 0.04313, "8": 0.0159}}}
    runs = [{"method": "tidar", "concurrency": 1, "tokens_per_s": 1.0, "tokens_per_forward": 1.0,
             "method_report": rep}]
    console = Console(record=True, width=200)
    print_tables(console, runs, [], block=None)
    text = console.export_text()
    assert re.search(r"tidar\W+1\W+1\W+0\.59\W+2\W+2:0\.0711 3:0\.0570 4:0\.0431\W+1\.59\W+0%", text)
