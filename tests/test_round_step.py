"""One round = one step per GraphKey: draft forward, verify forward, acceptance and the length
commit traced as a single function, equal to the eager round on every backend."""
import random

import pytest
import torch

from conftest import random_token_prompts, tiny_drafter, tiny_loaded
from fastspec.draft import AdapterConfig, attach_adapter
from fastspec.engine import Engine
from fastspec.graphs.keys import GraphKey
from fastspec.sampling import SamplerState, SamplingParams, sample_categorical, uniform

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(seed=5)


def prompts(n, seed=0):
    return random_token_prompts(n, seed)


SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=20),
    "filtered": SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=20, seed=3),
}
COMPILED = [pytest.param("compile", "aot_eager", "cpu", id="compile-aot_eager"),
            pytest.param("cuda-graph", None, "cuda", id="cuda-graph",
                         marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))]


@pytest.mark.parametrize("backend, compiler, device", COMPILED)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("n", [3, 5])          # 3 requests in the 4 bucket, 5 in the 8 bucket
def test_compiled_linear_round_equals_eager_round(drafter, backend, compiler, device, sampling, n):
    check_compiled_round(drafter, backend, compiler, device, sampling, n)


def test_inductor_compiled_sampled_round_equals_eager_round(drafter):
    """The one whole-round test on fastspec's real compile backend (skinny GEMM pass + inductor),
    in the mode with the most code: sampling with top-k/top-p, rejection and residual draws."""
    check_compiled_round(drafter, "compile", None, "cpu", "filtered", 3)


def check_compiled_round(drafter, backend, compiler, device, sampling, n):
    drafter.model.to(device)
    try:
        ps, params = prompts(n, seed=n), SAMPLINGS[sampling]
        ref = Engine(drafter, backend="eager").generate(ps, params, method="linear", block=4,
                                                        concurrency=n)
        engine = Engine(drafter, backend=backend, compiler=compiler)
        for call in range(2):
            out = engine.generate(ps, params, method="linear", block=4, concurrency=n)
            assert [c.token_ids for c in out] == [c.token_ids for c in ref]
            assert [c.accept_lengths for c in out] == [c.accept_lengths for c in ref]
            assert engine.last_stats.recompiles == 0      # the warm-up built every step it used
            stats = engine.runner.stats()
            key = GraphKey(4 if n == 3 else 8, 4, "linear", sampling, "linear")
            assert key in stats
            if call == 0:
                first = {k: dict(v) for k, v in stats.items()}
        # The second run replays every key it built: no recompilation.
        for k, v in engine.runner.stats().items():
            assert v["compiles"] == first[k]["compiles"] >= 1, k
            assert v["calls"] > first[k]["calls"]
    finally:
        drafter.model.to("cpu")


def test_a_round_is_one_step_per_key(drafter):
    """LinearSS: one runner call per round (not one per forward), keyed by its layout."""
    engine = Engine(drafter, backend="eager")
    out = engine.generate(prompts(2), SAMPLINGS["greedy"], method="linear", block=8, concurrency=2)
    stats = engine.runner.stats()
    rounds = max(c.rounds for c in out)
    assert list(stats) == [GraphKey(2, 8, "linear", method="linear")]
    # + the warm-up's two rounds (the first builds the step, the second times it)
    assert stats[GraphKey(2, 8, "linear", method="linear")]["calls"] == rounds + 2
    assert engine.last_stats.forwards == 2 * rounds + 1                   # + one prefill
    # Draft statistics of the last round come back with it, one per draft position.
    last = engine.last_round
    assert last.draft_confidence.shape == (2, 8)
    assert ((last.draft_margin >= 0) & (last.draft_margin <= last.draft_confidence)).all()
    assert ((last.draft_prob > 0) & (last.draft_prob <= last.draft_confidence + 1e-6)).all()


def test_sampled_outputs_do_not_depend_on_concurrency(drafter):
    """Each request draws from its own stream: the same seed gives the same tokens at any C."""
    engine = Engine(drafter, backend="eager")
    ps = prompts(5, seed=9)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=11)
    runs = [[c.token_ids for c in engine.generate(ps, params, method=m, concurrency=c)]
            for m, c in (("ar", 1), ("ar", 5), ("linear", 2), ("linear", 5))]
    assert runs[0] == runs[1]
    assert runs[2] == runs[3]            # (LinearSS draws differently from AR: same law, not same tokens)


def test_counter_based_uniforms_are_uniform_and_independent():
    seed = torch.tensor([1, 1, 2])
    a = uniform(seed, torch.tensor([0, 1, 0]), 0, (50_000,))
    assert a.min() > 0 and a.max() < 1
    assert abs(a.mean().item() - 0.5) < 0.01 and abs(a.var().item() - 1 / 12) < 0.005
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])      # counter, seed
    assert not torch.equal(a[0], uniform(seed, torch.zeros(3, dtype=torch.long), 1, (50_000,))[0])
    assert torch.equal(a, uniform(seed, torch.tensor([0, 1, 0]), 0, (50_000,)))   # a pure function
    # Neighbouring draws are uncorrelated.
    corr = torch.corrcoef(torch.stack([a[0, :-1], a[0, 1:]]))[0, 1]
    assert abs(corr.item()) < 0.02
    # Histogram of 10 bins: each within 5% of 5000.
    counts = torch.histc(a[0], bins=10, min=0, max=1)
    assert (counts - 5000).abs().max() < 250


def test_inverse_cdf_sampling_follows_the_weights_and_never_draws_zero_weight():
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0])
    st = SamplerState(20_000, seed=4)
    x = sample_categorical(w.expand(20_000, 5), st.uniform(0))
    freq = torch.bincount(x, minlength=5).float() / 20_000
    assert freq[[0, 2, 4]].sum() == 0
    assert abs(freq[1].item() - 0.75) < 0.015
    # u right at the top end still lands on the last positive weight.
    assert sample_categorical(w[None], torch.tensor([1.0 - 2 ** -24])).item() == 3


def test_gpu_check_script_dry_run_on_cpu(tmp_path):
    """The GPU check's code path on a tiny model on the CPU: every method's whole round step,
    compiled (torch.compile, aot_eager) per GraphKey, against eager; then the profile JSON."""
    from fastspec.graphs.gpu_check import main
    from fastspec.graphs.profile import Profile
    out = tmp_path / "p.json"
    # Greedy, AR and LinearSS only, to keep it quick (the GPU run checks every method and both
    # sampling modes by default; compiled sampled rounds are checked against eager above).
    assert main(["--device", "cpu", "--tiny", "--methods", "ar,linear", "--blocks", "4", "--concurrency",
                 "3", "--context", "12", "--new-tokens", "10", "--sampling", "greedy", "--reps", "1",
                 "--compiler", "aot_eager", "--out", str(out)]) == 0
    prof = Profile.load(str(out))
    assert {(p["batch"], p["block"], p["layout"]) for p in prof.points} == {(3, 4, "chain"), (3, 4, "draft")}
    assert prof.backend == "compile"
    rounds = prof.meta["check"]["rounds"]
    assert {r["method"] for r in rounds} == {"ar", "linear"}
    for r in rounds:      # compiled steps were built (not eager vs eager) and matched eager
        assert r["ok"] and r["identical"] == 1.0 and r["steps"] >= 1 and r["kv_err"] < 1e-5, r
        assert r["keys"], r


def test_gpu_check_catches_a_wrong_step():
    """A compiled step that swaps rows between slots must show up as a mismatch."""
    from fastspec.graphs.gpu_check import TINY, check_rounds, random_model, random_prompts
    from types import SimpleNamespace

    def swap_rows(gm, example_inputs):
        def run(*args):
            outs = gm(*args)
            return type(outs)(o.roll(1, 0) if isinstance(o, torch.Tensor) and o.dtype == torch.long
                              and o.dim() == 1 else o for o in outs)
        return run

    model = random_model(TINY, "cpu", torch.float32)
    loaded = SimpleNamespace(model=model, cfg=model.cfg, name="tiny", tokenizer=None, path=None)
    prompts = random_prompts(3, 12, model.cfg.vocab_size)
    r = check_rounds(loaded, "ar", None, prompts, SamplingParams(max_new_tokens=8), "compile", swap_rows)
    assert r["steps"] >= 1 and r["identical"] < 1.0


def test_gpu_check_runs_dflash_and_reports_a_broken_method(tmp_path):
    """The random model carries a DFlash drafter, so the dflash method's step is checked too; a
    method that raises is one failed check in the JSON (exit 1), not the end of the run."""
    import json
    from fastspec.graphs.gpu_check import main
    out = tmp_path / "c.json"
    assert main(["--device", "cpu", "--tiny", "--methods", "dflash", "--blocks", "8", "--concurrency", "2",
                 "--context", "12", "--new-tokens", "10", "--sampling", "greedy", "--compiler", "aot_eager",
                 "--no-profile", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ok"]
    assert main(["--device", "cpu", "--tiny", "--methods", "no-such-method,ar", "--concurrency", "1",
                 "--context", "12", "--new-tokens", "4", "--sampling", "greedy", "--compiler", "aot_eager",
                 "--no-profile", "--out", str(out)]) == 1
    checks = json.loads(out.read_text())["checks"]
    assert [c["ok"] for c in checks] == [False, True] and "no-such-method" in checks[0]["error"]
