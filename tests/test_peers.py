"""HF peers decode the same tokens as the fastspec AR engine on the same weights and ids."""
import pytest

from conftest import tiny_loaded
from fastspec.config import FastspecError
from fastspec.engine import Engine
from fastspec.evals.peers import peer_model, run_hf_peers
from fastspec.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 250, 3, 100, 3, 250], [42] * 3]


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


@pytest.fixture(scope="module")
def hf(loaded):
    return peer_model(loaded)


def by_name(runs):
    return {r.name: r for r in runs}


def test_hf_greedy_and_prompt_lookup_equal_fastspec_ar(loaded, hf):
    params = SamplingParams(max_new_tokens=8)
    ar = Engine(loaded, backend="eager").generate(PROMPTS, params)
    runs = by_name(run_hf_peers(loaded, PROMPTS, params, hf=hf))
    assert [c.token_ids for c in runs["hf"].completions] == [c.token_ids for c in ar]
    assert [c.token_ids for c in runs["hf-pld"].completions] == [c.token_ids for c in ar]
    for run in runs.values():
        s = run.stats
        assert s.requests == 3 and s.new_tokens == sum(len(c.token_ids) for c in ar)
        assert s.wall_s > 0 and s.tokens_per_s > 0
        for c in run.completions:
            assert 0 < c.ttft_s <= c.latency_s and c.forwards == c.rounds + 1
    # Plain greedy: one forward per token, so τ = 1 and every round commits one token.
    for c in runs["hf"].completions:
        assert c.forwards == len(c.token_ids) and c.tau == 1.0 and c.accept_lengths == [1] * c.rounds


def test_prompt_lookup_accepts_drafts_and_still_matches_greedy():
    # Small weights make the tied-embedding model repeat its last token, then switch (9 x14, 210...):
    # lookup drafts get accepted, and the switch forces a rejection.
    loaded = tiny_loaded(std=0.05)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = Engine(loaded, backend="eager").generate([PROMPTS[0]], params)[0]
    plain, pld = run_hf_peers(loaded, [PROMPTS[0]], params)
    assert pld.completions[0].token_ids == plain.completions[0].token_ids == ar.token_ids
    assert len(set(ar.token_ids)) > 1
    c = pld.completions[0]
    assert c.forwards < plain.completions[0].forwards and max(c.accept_lengths) > 1
    assert sum(c.accept_lengths) <= len(c.token_ids) - 1 and c.tau > 1


def test_eos_stops_like_the_engine(loaded, hf):
    engine = Engine(loaded, backend="eager")
    params = SamplingParams(max_new_tokens=10)
    free = engine.generate([PROMPTS[1]], params)[0].token_ids
    engine.eos_ids = {free[3]}
    want = engine.generate([PROMPTS[1]], params)[0]
    for run in run_hf_peers(loaded, [PROMPTS[1]], params, hf=hf, eos_ids={free[3]}):
        c = run.completions[0]
        assert (c.token_ids, c.finish_reason) == (want.token_ids, "eos"), run.name
    # ignore_eos runs to the length limit through the stop token, like the engine.
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    want = engine.generate([PROMPTS[1]], params)[0].token_ids
    for run in run_hf_peers(loaded, [PROMPTS[1]], params, hf=hf, eos_ids={free[3]}):
        assert run.completions[0].token_ids == want and len(want) == 10, run.name


def test_sampling_is_skipped_with_a_message_and_bad_input_is_one_line(loaded):
    said = []
    assert run_hf_peers(loaded, PROMPTS, SamplingParams(temperature=0.7), log=said.append) == []
    assert "only greedy" in said[0]
    with pytest.raises(FastspecError, match="unknown peer"):
        run_hf_peers(loaded, PROMPTS, SamplingParams(), names=("vllm",))
    with pytest.raises(FastspecError, match="token ids"):
        run_hf_peers(loaded, ["hello"], SamplingParams())


# --- llama.cpp -------------------------------------------------------------------------------------
def test_a_missing_llama_cpp_is_one_line_before_anything_runs(monkeypatch, tmp_path):
    """--peers llama.cpp without llama-cpp-python: exit 1 and one line saying how to install it,
    from bench and speed alike, before the model loads."""
    import importlib.util

    from click.testing import CliRunner

    from fastspec.cli.main import cli
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for argv in (["bench", "--model", "tiny-random", "--prompts", str(prompts), "--peers", "llama.cpp"],
                 ["speed", "--model", "tiny-random", "--no-hf", "--peers", "llama.cpp"]):
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and "needs llama-cpp-python: pip install 'fastspec[llamacpp]'" in lines[0]


def test_a_llama_cpp_that_does_not_import_is_one_line(monkeypatch):
    """Installed but broken (e.g. with --no-deps: no `diskcache`): one line naming the import
    error and how to reinstall, not a traceback from deep in the run."""
    import importlib
    import importlib.util

    from fastspec.config import FastspecError
    from fastspec.evals.peers import check_peers
    real_spec, real_import = importlib.util.find_spec, importlib.import_module
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "llama_cpp" else real_spec(name, *a))

    def broken(name, *a):
        if name == "llama_cpp":
            raise ModuleNotFoundError("No module named 'diskcache'")
        return real_import(name, *a)
    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(FastspecError, match="does not import .ModuleNotFoundError: No module named 'diskcache'.*"
                                            "fastspec\\[llamacpp\\]"):
        check_peers(["llama.cpp"])


def test_llama_cpp_greedy_equals_fastspec_ar_on_the_same_weights(loaded):
    """llama.cpp on a GGUF of the engine's fp32 weights decodes the engine's AR tokens."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = Engine(loaded, backend="eager").generate(PROMPTS, params)
    run, = run_hf_peers(loaded, PROMPTS, params, names=("llama.cpp",))
    assert [c.token_ids for c in run.completions] == [c.token_ids for c in ar]
    assert run.stats.new_tokens == 36 and run.stats.tokens_per_forward == 1.0


def test_a_llama_cpp_crash_is_one_line_and_costs_the_peer_not_the_run(monkeypatch, tmp_path):
    """llama.cpp is probed in a child process: a native crash there (as its AMX kernels do on some
    CPUs) becomes one line naming the signal and the fix, and the other peers still run."""
    import fastspec.evals.peers as peers
    monkeypatch.setattr(peers, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(FastspecError, match="crashed \\(SIGSEGV\\).*AMX") as e:
        peers.probe_llamacpp(tmp_path / "model.gguf", threads=1)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(peers, "_PROBE", "import sys; sys.exit('no such file')")
    with pytest.raises(FastspecError, match="failed on model.gguf: no such file"):
        peers.probe_llamacpp(tmp_path / "model.gguf", threads=1)

    def crashed(*a, **k):
        raise FastspecError("llama.cpp crashed (SIGSEGV)")
    monkeypatch.setattr(peers, "check_peers", lambda names: None)
    monkeypatch.setattr(peers, "_run_llamacpp", crashed)
    logged = []
    loaded = tiny_loaded()
    runs = run_hf_peers(loaded, PROMPTS[:1], SamplingParams(max_new_tokens=4), names=("llama.cpp", "hf"),
                        log=logged.append)
    assert [r.name for r in runs] == ["hf"] and logged == ["llama.cpp crashed (SIGSEGV)"]
