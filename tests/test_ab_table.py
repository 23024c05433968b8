"""The paired A/B table over concurrency: ratios to the best other arm and to a reference arm."""
import json

import pytest

from fastspec.config import FastspecError
from fastspec.graphs.ab_table import merge, summarize, table


def arm(name, c, tok_s, per_req, same=True):
    return {"arm": name, "concurrency": c, "mean_tok_s": tok_s, "mean_per_request_tok_s": per_req,
            "identical_to_ar": same}


def write(tmp_path, name, arms):
    p = tmp_path / name
    p.write_text(json.dumps({"environment": {"device": "cpu"}, "arms": arms}))
    return str(p)


def test_candidate_is_compared_with_the_best_other_arm_at_each_c_and_with_the_reference(tmp_path):
    c1 = write(tmp_path, "c1.json", [arm("B4", 1, 30.0, 31.0), arm("B16", 1, 20.0, 21.0),
                                     arm("rec", 1, 33.0, 31.0)])
    c8 = write(tmp_path, "c8.json", [arm("B4", 8, 80.0, 10.0), arm("B16", 8, 40.0, 5.0),
                                     arm("rec", 8, 76.0, 12.0, same=False)])
    rows, envs = merge([c1, c8])
    s = summarize(rows, "rec", "B16")
    assert [r["best_other"] for r in s["per_c"]] == ["B4", "B4"]
    assert [r["vs_best"] for r in s["per_c"]] == pytest.approx([1.1, 0.95])
    assert [r["per_request_vs_best"] for r in s["per_c"]] == pytest.approx([1.0, 1.2])
    assert s["mean_vs_reference"] == pytest.approx((33 / 20 + 76 / 40) / 2)
    assert s["min_vs_best"] == pytest.approx(0.95)
    assert [r["identical_to_ar"] for r in s["per_c"]] == [True, False]
    assert len(envs) == 2 and table(s).row_count == 3 + 3


def test_bad_inputs_are_one_clear_error(tmp_path):
    c1 = write(tmp_path, "c1.json", [arm("B4", 1, 30.0, 31.0), arm("rec", 1, 33.0, 31.0)])
    with pytest.raises(FastspecError, match="appears twice"):
        merge([c1, c1])
    with pytest.raises(FastspecError, match="no arm named"):
        summarize(merge([c1])[0], "recguide", None)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(FastspecError, match="not a method_ab results file"):
        merge([str(bad)])


def test_arm_specs_with_brackets_are_printed_as_written(tmp_path):
    from rich.console import Console
    c1 = write(tmp_path, "c1.json", [arm("linear[block=4]", 1, 30.0, 31.0), arm("recguide", 1, 33.0, 31.0)])
    console = Console(record=True, width=120)
    console.print(table(summarize(merge([c1])[0], "recguide", "linear[block=4]")))
    text = console.export_text()
    assert "linear[block=4]" in text and "÷ linear[block=4]" in text


def test_figure5_png_is_written(tmp_path):
    from fastspec.graphs.ab_table import plot
    c1 = write(tmp_path, "c1.json", [arm("B4", 1, 30.0, 31.0), arm("rec", 1, 33.0, 31.0)])
    c2 = write(tmp_path, "c2.json", [arm("B4", 2, 50.0, 25.0), arm("rec", 2, 52.0, 26.0)])
    png = tmp_path / "f5.png"
    plot(summarize(merge([c1, c2])[0], "rec", None), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
