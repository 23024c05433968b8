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
