"""Forward profiles: JSON round trip, measured-else-roofline costs, a tiny eager profile run via the CLI."""
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import tiny_loaded
from fastspec.cli.profile import profile as profile_cmd
from fastspec.config import FastspecError
from fastspec.graphs.profile import Profile, _config_dict, default_path, fit_points, slug
from fastspec.graphs.roofline import Roofline, forward_bytes, forward_flops

TRUTH = Roofline(alpha_c=2.0, beta_c=0.003, alpha_m=1.5, beta_m=0.002, peak_flops=100e9, bandwidth=40e9)


def synthetic_profile() -> Profile:
    cfg = tiny_loaded().cfg.replace(hidden_size=576, intermediate_size=1536, num_layers=30,
                                    num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152)
    points = []
    for b in (1, 4):
        for n in (1, 4, 16, 32):
            for lay in ("chain", "draft"):
                t = float(TRUTH.predict(forward_flops(cfg, b, n, 256), forward_bytes(cfg, b, n, 256)))
                points.append({"batch": b, "block": n, "layout": lay, "ctx": 256, "ms": t * 1e3,
                               "compile_s": 1.5, "peak_mem_mb": 900.0})
    fit = fit_points(cfg, points, TRUTH.peak_flops, TRUTH.bandwidth)
    return Profile(device="cpu Test CPU (2 threads)", model="synthetic", dtype="float32", torch="x",
                   backend="compile", config=_config_dict(cfg), points=points, roofline=fit.to_dict(),
                   peak_flops=TRUTH.peak_flops, bandwidth=TRUTH.bandwidth)


def test_round_trip_and_costs(tmp_path):
    prof = synthetic_profile()
    path = prof.save(str(tmp_path / "sub" / "p.json"))
    back = Profile.load(path)
    assert back.to_dict() == json.loads(json.dumps(prof.to_dict()))
    assert back.cfg == prof.cfg
    # A measured point: its measured time, exactly.
    p = back.points[3]
    assert back.cost_ms(p["batch"], p["block"], p["layout"], p["ctx"]) == p["ms"]
    # An unmeasured point (batch 8, block 8, ctx 1024): the roofline's prediction.
    want = float(back.fit().predict(forward_flops(back.cfg, 8, 8, 1024),
                                    forward_bytes(back.cfg, 8, 8, 1024))) * 1e3
    assert back.measured(8, 8, "chain", 1024) is None
    assert back.cost_ms(8, 8, "chain", 1024) == pytest.approx(want)
    # The fit recovered the synthetic truth closely enough to extrapolate.
    truth = float(TRUTH.predict(forward_flops(back.cfg, 8, 8, 1024), forward_bytes(back.cfg, 8, 8, 1024)))
    assert want == pytest.approx(truth * 1e3, rel=0.05)
    assert back.fit_error() < 0.05


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(FastspecError, match="no profile"):
        Profile.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FastspecError, match="cannot read"):
        Profile.load(str(bad))
    bad.write_text(json.dumps({"device": "x"}))
    with pytest.raises(FastspecError, match="not a fastspec profile"):
        Profile.load(str(bad))


def test_no_fit_without_two_shapes():
    prof = synthetic_profile()
    prof.points = prof.points[:2]                       # one shape, two layouts
    prof.roofline = None
    p = prof.points[0]
    assert prof.cost_ms(1, 1, p["layout"], 256) == p["ms"]
    with pytest.raises(FastspecError, match="roofline"):
        prof.cost_ms(4, 4, "chain", 256)


def test_default_path_names_device_and_model():
    assert default_path("cpu AMD EPYC (2 threads)", "smollm2-135m") == os.path.join(
        "profiles", "cpu-amd-epyc-smollm2-135m.json")
    assert slug("NVIDIA H200") == "nvidia-h200"
    # One CPU name covers Zen 3 (AVX2) and Zen 4 (AVX-512); int8 weights change the cost's shape.
    assert default_path("cpu AMD EPYC (2 threads)", "smollm2-135m", "skinny-avx512", "int8") == os.path.join(
        "profiles", "cpu-amd-epyc-smollm2-135m-skinny-avx512-int8.json")


def test_planners_read_the_profile_of_their_kernel_and_weight_precision(tmp_path, monkeypatch):
    """The profile measured with the run's kernel and weights; else the device's unqualified
    profile if it records the same (or nothing: those were fp32); else, saying so, the device's
    profile of another precision; else the nominal roofline, streaming the run's weight bytes."""
    import fastspec.graphs.profile as gp
    monkeypatch.setattr(gp, "device_name", lambda device="cpu": "cpu Test CPU (2 threads)")
    monkeypatch.chdir(tmp_path)
    dev, cfg = "cpu Test CPU (2 threads)", synthetic_profile().cfg
    cost = lambda kernel, weights: gp.ForwardCost.for_model(cfg, "cpu", "synthetic", kernel, weights)  # noqa: E731
    nominal = cost("skinny-avx2", "bf16")
    assert nominal.path is None and nominal.source == "default" and "no profile" in nominal.describe()
    assert nominal(1, 1) < gp.ForwardCost(cfg)(1, 1)                     # half the weight bytes
    legacy = synthetic_profile()
    legacy.save(default_path(dev, "synthetic"))
    int8 = synthetic_profile()
    int8.meta["environment"] = {"kernel": "skinny-avx2", "weights": "int8", "backend": "compile"}
    int8.save(default_path(dev, "synthetic", "skinny-avx2", "int8"))
    assert cost("skinny-avx2", "int8").path == default_path(dev, "synthetic", "skinny-avx2", "int8")
    exact = cost("skinny-avx2", "fp32")                 # records nothing: an fp32 profile
    assert exact.path == default_path(dev, "synthetic") and exact.note == ""
    assert cost(None, "fp32").path == default_path(dev, "synthetic")
    other = cost("skinny-avx2", "bf16")                  # no bf16 profile: the fp32 one, said
    assert other.path == default_path(dev, "synthetic") and "fp32 weights" in other.describe()
    assert "--weights bf16" in other.describe()
    avx2 = synthetic_profile()                           # the same kernel's fp32 profile comes first
    avx2.meta["environment"] = {"kernel": "skinny-avx2", "weights": "fp32", "backend": "compile"}
    avx2.save(default_path(dev, "synthetic", "skinny-avx2"))
    assert cost("skinny-avx2", "bf16").path == default_path(dev, "synthetic", "skinny-avx2")
    assert "fp32 weights with skinny-avx2" in cost("skinny-avx2", "bf16").describe()
    assert cost("skinny-avx2", "fp32").note == ""
    os.remove(default_path(dev, "synthetic", "skinny-avx2"))
    # An unqualified profile that records another precision is this run's only approximately.
    legacy.meta["environment"] = {"kernel": "skinny-avx512", "weights": "int8", "backend": "compile"}
    legacy.save(default_path(dev, "synthetic"))
    assert cost("skinny-avx512", "fp32").note and "int8 weights" in cost("skinny-avx512", "fp32").describe()
    assert cost("skinny-avx512", "int8").path == default_path(dev, "synthetic")
    assert cost("skinny-avx512", "int8").note == ""
    assert cost("skinny-avx2", "int8").path == default_path(dev, "synthetic", "skinny-avx2", "int8")


def test_a_profile_measured_on_a_cpu_of_another_isa_says_so(tmp_path, monkeypatch):
    """One CPU name covers Zen 3 (AVX2) and Zen 4 (AVX-512): a native AVX2 machine finds the
    skinny-avx2 profile a Zen 4 measured with its kernel forced narrower, and the run says so."""
    import fastspec.graphs.kernels as gk
    import fastspec.graphs.profile as gp
    monkeypatch.setattr(gp, "device_name", lambda device="cpu": "cpu Test CPU (2 threads)")
    monkeypatch.chdir(tmp_path)
    dev, cfg = "cpu Test CPU (2 threads)", synthetic_profile().cfg
    forced = synthetic_profile()
    forced.meta["environment"] = {"kernel": "skinny-avx2", "weights": "fp32", "backend": "compile",
                                  "isa": "avx512"}
    forced.save(default_path(dev, "synthetic", "skinny-avx2"))
    cost = lambda weights: gp.ForwardCost.for_model(cfg, "cpu", "synthetic", "skinny-avx2", weights)  # noqa: E731
    monkeypatch.setattr(gk, "cpu_isas", lambda: ("avx512", "avx2"))      # the Zen 4 that measured it
    assert cost("fp32").note == ""
    monkeypatch.setattr(gk, "cpu_isas", lambda: ("avx2",))               # a native AVX2 CPU
    same = cost("fp32")
    assert same.path == default_path(dev, "synthetic", "skinny-avx2")
    assert "measured on a CPU with avx512, this one has avx2" in same.describe()
    other = cost("bf16")                         # another precision and another CPU: both said
    assert "fp32 weights" in other.note and "this one has avx2" in other.note


def test_tiny_profile_run_writes_json_and_png(tmp_path):
    out, trace = tmp_path / "tiny.json", tmp_path / "trace.json"
    result = CliRunner().invoke(profile_cmd, [
        "--model", "tiny-random", "--backend", "eager", "--batch", "1,2", "--block", "1,4",
        "--context", "32", "--reps", "2", "--bandwidth-mib", "8", "--out", str(out),
        "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "N=4" in result.output and "roofline" in result.output
    prof = Profile.load(str(out))
    assert prof.model == "tiny-random" and prof.backend == "eager" and prof.torch
    env = prof.meta["environment"]                     # what ran, as in bench's JSON
    assert env["backend"] == "eager" and env["dtype"] == "float32" and env["kernel"] and env["isa"]
    assert len(prof.points) == 2 * 2 * 2               # batch × block × layout (chain, draft)
    assert {(p["batch"], p["block"]) for p in prof.points} == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert all(p["ms"] > 0 and p["compile_s"] >= 0 and p["peak_mem_mb"] > 0 for p in prof.points)
    assert prof.roofline is not None and prof.peak_flops > 0 and prof.bandwidth > 0
    assert np.isfinite(prof.cost_ms(8, 16, "draft", 128))
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("B2xN4 draft ctx32" in e.get("name", "") for e in events)


def test_profile_builds_every_shape_first_then_times_them_in_turns(tmp_path, monkeypatch):
    """No point is timed right after its own compilation: each shape is built with one call,
    then all take turns for `passes` rounds; a point's ms is the median of all its calls, and
    the checkpoint after each round holds the points timed so far."""
    import fastspec.graphs.profile as profile
    built, turns, saved = [], [], []
    real = profile.measure_point

    def measure(fwd, model, batch, block, layout, ctx, reps):
        built.append((batch, block, layout, reps, len(turns)))
        point = real(fwd, model, batch, block, layout, ctx, reps)
        del turns[built[-1][4]:]                           # its own warm-up timing, not a turn
        return point

    def samples(fwd, inputs, device, reps):
        turns.append((inputs[0].shape[0], inputs[0].shape[1]))
        return [100.0 * inputs[0].shape[0] + inputs[0].shape[1] + len(turns)] * reps

    def save(self, path):
        saved.append([(p["ms"], p["samples"]) for p in self.points])
        return path
    monkeypatch.setattr(profile, "measure_point", measure)
    monkeypatch.setattr(profile, "forward_samples", samples)
    monkeypatch.setattr(Profile, "save", save)
    prof = profile.run_profile(tiny_loaded(), batches=[1, 2], blocks=[1, 4], layouts=["chain"],
                               contexts=[8], backend="eager", reps=2, passes=3, bandwidth_mib=8,
                               gemm_n=64, checkpoint=str(tmp_path / "ckpt.json"))
    assert [b[:4] for b in built] == [(1, 1, "chain", 1), (1, 4, "chain", 1), (2, 1, "chain", 1),
                                      (2, 4, "chain", 1)]
    assert all(b[4] == 0 for b in built)                   # every shape built before any turn
    shapes = [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert turns == shapes * 3                             # three rounds, every shape in each
    # each shape's calls in round k were tagged with the turn number: median of three rounds
    for i, ((b, n), p) in enumerate(zip(shapes, prof.points)):
        tags = [100.0 * b + n + i + 1 + 4 * k for k in range(3)]
        assert (p["ms"], p["ms_min"], p["samples"]) == (tags[1], tags[0], 6)
    assert [ck[0][1] for ck in saved] == [1, 1, 1, 1, 2, 4, 6]   # 4 built, then 3 rounds
    assert prof.meta["passes"] == 3 and prof.meta["reps"] == 2


@pytest.mark.parametrize("args, needle", [
    (["--passes", "0"], "--passes"),
    (["--layout", "tree"], "--layout"),
    (["--batch", "0"], "--batch"),
    (["--block", "a,b"], "--block"),
    (["--context", "100000"], "exceeds"),
])
def test_bad_options_are_one_line_errors(args, needle):
    result = CliRunner().invoke(profile_cmd, ["--model", "tiny-random", "--backend", "eager",
                                              "--bandwidth-mib", "8", *args])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and needle in result.output, result.output
