"""End to end, LinearSS sampling has AR sampling's law: the joint law of the first sampled tokens,
over many seeds, matches within a TV distance that shrinks with the sample count.

Null calibration by permutation: under "same law", pooling both samples and splitting them at
random gives TV distances distributed as the observed one, so the observed TV must sit below a
high quantile of those (the bound shrinks like 1/sqrt(n)). The first token comes from the prefill
in both methods and the second is the round's first draft d1, which the seed predicts exactly
(p = q, always accepted); the third is d2, judged against the verifier (p != q) with rejection
sampling, so the law of the first three tokens is checked as well.
"""
import pytest
import torch

from conftest import tiny_loaded
from helpers import first, null_quantile, tv
from fastspec.draft import AdapterConfig, attach_adapter
from fastspec.engine import Engine
from fastspec.sampling import SamplingParams

PROMPT = [5, 9, 11]
N_SMALL, N_LARGE = 1000, 4000
FILTERS = {"plain": {}, "top-k": {"top_k": 8}, "top-p": {"top_p": 0.8}}


@pytest.fixture(scope="module")
def engine():
    # std 0.5: a few likely tokens per step (perplexity ~8), so 4000 samples pin a 3-token law.
    loaded = tiny_loaded(seed=1, std=0.5)
    attach_adapter(loaded.model, AdapterConfig(rank=4), seed=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():        # a drafter that is wrong often: rejections and residual draws
        for blk in loaded.model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.3 * torch.randn(lora.B.shape, generator=g))
    return Engine(loaded, backend="eager")


def sample(engine, method, n, first_seed, temperature=1.0, **filters) -> list[tuple[int, ...]]:
    """The first 3 tokens of n requests, request i sampled with seed first_seed + i."""
    params = [SamplingParams(temperature=temperature, max_new_tokens=3, seed=first_seed + i,
                             ignore_eos=True, **filters) for i in range(n)]
    out = engine.generate([PROMPT] * n, params, method=method, block=4, concurrency=128)
    return [tuple(c.token_ids[:3]) for c in out]








@pytest.mark.parametrize("name", list(FILTERS))
def test_linear_sampling_matches_ar_sampling(engine, name):
    kw = FILTERS[name]
    ar = sample(engine, "ar", N_LARGE, 10_000, **kw)
    lin = sample(engine, "linear", N_LARGE, 50_000, **kw)
    assert len(set(first(lin, 2))) > 10                 # a real law, not a near-point mass
    for k in (2, 3):
        small = tv(first(ar[:N_SMALL], k), first(lin[:N_SMALL], k))
        large = tv(first(ar, k), first(lin, k))
        bound_small = null_quantile(first(ar[:N_SMALL], k), first(lin[:N_SMALL], k))
        bound = null_quantile(first(ar, k), first(lin, k))
        assert large <= bound, (name, k, large, bound)
        assert small <= bound_small, (name, k, small, bound_small)
        assert large < small and bound < bound_small, (name, k, large, small)


def test_the_check_sees_a_wrong_law(engine, monkeypatch):
    """Power: accepting every draft (no rejection sampling) changes the law of the third token
    and the same test rejects it; a hotter AR is rejected too."""
    import fastspec.methods.drafter as drafter
    ar = sample(engine, "ar", N_LARGE, 10_000)
    hot = sample(engine, "ar", N_LARGE, 20_000, temperature=1.3)
    assert tv(first(ar, 2), first(hot, 2)) > null_quantile(first(ar, 2), first(hot, 2))

    def accept_everything(drafts, target_logits, block, sampler, draft_logp=None):
        return drafts, block, block - 1
    monkeypatch.setattr(drafter, "accept_chain", accept_everything)   # the chain round's verifier
    broken = sample(engine, "linear", N_LARGE, 50_000)
    assert tv(first(ar, 3), first(broken, 3)) > null_quantile(first(ar, 3), first(broken, 3))
