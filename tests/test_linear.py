"""LinearSS: diffusion-mode drafting, AR verification — lossless for greedy and for sampling."""
import random

import pytest
import torch

from conftest import tiny_loaded
from fastspec.draft import AdapterConfig, adapter_loras, attach_adapter
from fastspec.engine import Engine
from fastspec.layout import cache_mask, causal_block
from fastspec.methods.base import Plan
from fastspec.graphs.keys import GraphKey
from fastspec.convention import FASTSPEC, draft_adapter_flags, draft_block_mask
from fastspec.methods.linear import BLOCK_SIZES, LinearSS
from fastspec.sampling import SamplerState, SamplingParams, filtered_logprobs
from fastspec.verify import accept_chain


def drafting_engine(seed=0, targets=("q", "k", "v", "o")):
    loaded = tiny_loaded(seed)
    attach_adapter(loaded.model, AdapterConfig(rank=4, targets=targets), seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _, _, lora in adapter_loras(loaded.model):
        lora.B.data.copy_(torch.randn(lora.B.shape, generator=g) * 0.1)
    loaded.model.requires_grad_(False)
    return Engine(loaded, backend="eager")


def random_prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_draft_mask_matches_hand_written_matrix():
    # Row 0: block 3 of width 4; row 1: full block of 4.
    got = draft_block_mask(FASTSPEC, torch.tensor([3, 4]), 4).int()
    want = torch.tensor([
        [[1, 0, 0, 0],      # seed: itself only (plus the prefix, added by cache_mask)
         [1, 1, 1, 0],      # masks: the seed and every mask of the block
         [1, 1, 1, 0],
         [0, 0, 0, 1]],     # padding: itself only
        [[1, 0, 0, 0],
         [1, 1, 1, 1],
         [1, 1, 1, 1],
         [1, 1, 1, 1]],
    ])
    assert torch.equal(got, want)
    # Seedless (TiDAR's pre-draft): the seed slot is a MASK too and sees the whole block.
    seedless = draft_block_mask(FASTSPEC, torch.tensor([3]), 4, seedless=True).int()
    assert seedless[0].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    assert draft_adapter_flags(FASTSPEC, 1, 4, seedless=True).all()
    assert draft_adapter_flags(FASTSPEC, 1, 4).tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("block, concurrency", [(4, 1), (8, 3), (16, 4), (32, 2)])
def test_greedy_linear_equals_ar_token_for_token(block, concurrency):
    engine = drafting_engine()
    prompts = random_prompts(6, seed=block)
    params = SamplingParams(max_new_tokens=37)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    lin = engine.generate(prompts, params, method="linear", block=block, concurrency=concurrency)
    assert [c.token_ids for c in lin] == [c.token_ids for c in ar]
    # The seed sees no mask and runs without the adapter: every round commits >= 2 tokens
    # (except a last round cut short by max_new_tokens).
    for c in lin:
        assert min(c.accept_lengths[:-1], default=2) >= 2


def test_mlp_lora_acts_on_draft_tokens_only_and_linear_still_equals_ar():
    """LoRA on the MLP is part of the draft adapter: it changes a token's MLP output only where the
    adapter flag is on, so the verifier is the base model and greedy LinearSS equals AR."""
    engine = drafting_engine(seed=3, targets=("q", "k", "v", "o", "gate", "up", "down"))
    mlp = engine.model.layers[0].mlp
    x = torch.randn(1, 3, mlp.w_down.shape[0])
    flags = torch.tensor([[1.0], [0.0], [1.0]])[None]          # draft, verify, draft
    base = mlp(x)
    out = mlp(x, flags)
    assert torch.equal(out[:, 1], base[:, 1])
    assert not torch.allclose(out[:, 0], base[:, 0]) and not torch.allclose(out[:, 2], base[:, 2])
    equals_ar(engine, "linear", 4, seed=11, max_new_tokens=30, concurrency=2)


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("q", "v", "up", "down"), ("o",)])
def test_fused_lora_drafts_what_the_per_target_loras_draft(targets):
    """fuse_adapter (one A and one block-diagonal B per shared input: q/k/v, gate/up) is the same
    adapter: the draft forward's logits match the per-target LoRAs, the verifier's are untouched,
    and a later set_adapter_state refreshes the fused copy."""
    from fastspec.draft import adapter_state, fuse_adapter, set_adapter_state
    engine = drafting_engine(seed=5, targets=targets)
    model = engine.model
    engine.prepare(1, 64)
    engine.sampler = SamplerState(1)
    engine.cache.lengths.fill_(5)
    ids = torch.tensor([[7] + [engine.mask_token_id] * 7])
    draft_mask = draft_block_mask(FASTSPEC, torch.tensor([8]), 8)
    on = torch.arange(8)[None] > 0

    def forwards():
        draft = engine.forward(ids, draft_mask, adapter_on=on)
        verify = engine.forward(torch.tensor([[7, 1, 2, 3, 4, 5, 6, 8]]), causal_block(8))
        return draft, verify

    draft, verify = forwards()
    fuse_adapter(model)
    calls = {"qkv", "o", "gate_up", "down"} & {n for blk in model.layers[:1]
                                                for part in (blk.attn, blk.mlp) for n in (part.fused or {})}
    assert calls == ({"qkv"} if {"q", "k", "v"} & set(targets) else set()) | \
        ({"o"} if "o" in targets else set()) | ({"gate_up"} if {"gate", "up"} & set(targets) else set()) | \
        ({"down"} if "down" in targets else set())
    fused_draft, fused_verify = forwards()
    # The same sums in another order (one GEMM over concatenated A's): fp32 rounding only, which
    # depends on the CPU's GEMM kernels (AVX2 MKL reached 1.04e-5 on logits of magnitude ~3).
    torch.testing.assert_close(fused_draft, draft, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_verify, verify)
    # Zero every B through set_adapter_state: the fused copy follows, so drafts become the base model's.
    sd = {k: (torch.zeros_like(v) if k.endswith(".B") else v) for k, v in adapter_state(model).items()}
    set_adapter_state(model, sd)
    zero_draft, _ = forwards()
    for blk in model.layers:
        for part in (blk.attn, blk.mlp):
            for fused in (part.fused or {}).values():
                assert fused.B.abs().max() == 0
    assert (zero_draft - fused_draft).abs().max() > 1e-4


def test_seed_prediction_is_exactly_the_verifier_next_token():
    engine = drafting_engine()
    engine.prepare(1, 64)
    engine.sampler = SamplerState(1)
    engine.cache.lengths.fill_(5)
    ids = torch.tensor([[7] + [engine.mask_token_id] * 7])
    draft = engine.forward(ids, draft_block_mask(FASTSPEC, torch.tensor([8]), 8),
                           adapter_on=torch.arange(8)[None] > 0)
    verify = engine.forward(torch.tensor([[7, 1, 2, 3, 4, 5, 6, 8]]), causal_block(8))
    assert (draft[:, 0] - verify[:, 0]).abs().max() < 1e-5
    assert (draft[:, 1:] - verify[:, 1:]).abs().max() > 1e-3


def tv(p, q):
    return 0.5 * (p - q).abs().sum().item()


def test_rejection_sampling_preserves_the_target_distribution():
    """accept_chain on synthetic p, q: the first emitted token follows p exactly."""
    torch.manual_seed(0)
    V, n = 6, 4
    target_logits = torch.randn(n, V) * 1.5
    draft_logits = torch.randn(n, V) * 1.5          # a deliberately bad drafter
    p0 = target_logits[0].softmax(-1)
    distances = []
    for samples, seed in ((500, 1), (50_000, 2)):
        sampler = SamplerState(samples, seed=seed, mode="sample")
        sampler.temperature.fill_(1.0)
        q = draft_logits.log_softmax(-1).expand(samples, n, V)
        drafts = torch.multinomial(q[0].exp(), samples, replacement=True,
                                   generator=torch.Generator().manual_seed(seed)).T    # [samples, n]
        emitted, n_emitted, _ = accept_chain(drafts, target_logits.expand(samples, n, V),
                                             torch.full((samples,), n), sampler, q)
        first = torch.bincount(emitted[:, 0], minlength=V).float() / samples
        distances.append(tv(first, p0))
    assert distances[1] < 0.01
    assert distances[1] < distances[0]


def test_speculative_sampling_on_the_model_matches_exact_two_token_law():
    """End to end: LinearSS sampling gives (x1, x2) with the model's exact joint law."""
    engine = drafting_engine(seed=1)
    prompt = [5, 9, 11]
    # Exact law of the first two tokens under top-4 sampling.
    m = engine.model
    def next_law(ids):
        ids = torch.tensor([ids])
        L = ids.shape[1]
        k = torch.zeros(m.cfg.num_layers, 1, m.cfg.num_kv_heads, L, m.cfg.head_dim)
        logits = m(ids, torch.arange(L)[None], k, k.clone(), torch.arange(L)[None],
                   cache_mask(torch.zeros(1, dtype=torch.long), causal_block(L), L), torch.arange(1))
        return filtered_logprobs(logits[:, -1], torch.ones(1), torch.tensor([4]), torch.ones(1))[0].exp()
    p1 = next_law(prompt)
    exact = torch.zeros(512, 512)
    for x1 in p1.nonzero()[:, 0].tolist():
        exact[x1] = p1[x1] * next_law(prompt + [x1])
    distances = []
    for n, seed in ((200, 3), (3000, 4)):
        out = engine.generate([prompt] * n, SamplingParams(temperature=1.0, top_k=4, max_new_tokens=2,
                                                           seed=seed), method="linear", block=4,
                              concurrency=128)
        emp = torch.zeros(512, 512)
        for c in out:
            emp[c.token_ids[0], c.token_ids[1]] += 1 / n
        distances.append(tv(emp, exact))
    assert distances[1] < 0.06, distances
    assert distances[1] < distances[0]


class PerRequestBlocks(LinearSS):
    """Each request its own block size from {4, 8, 16, 32}, all in one batch."""

    def __init__(self, bucketing=False):
        super().__init__(block=32)
        self.bucketing = bucketing

    def block_for(self, seq) -> int:
        return BLOCK_SIZES[seq.index % len(BLOCK_SIZES)]


def equals_ar(engine, method, n, seed, max_new_tokens, concurrency):
    """Decode n random prompts with `method` and with AR; assert the tokens are equal."""
    prompts = random_prompts(n, seed=seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ar = engine.generate(prompts, params, method="ar", concurrency=concurrency)
    out = engine.generate(prompts, params, method=method, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    return out


def test_requests_with_different_block_sizes_share_one_batch_and_equal_ar():
    engine = drafting_engine(seed=2)
    out = equals_ar(engine, PerRequestBlocks(), 8, seed=7, max_new_tokens=40, concurrency=8)
    for c in out:        # a round commits at most the request's own block (seed + drafts)
        assert max(c.accept_lengths) <= BLOCK_SIZES[c.index % len(BLOCK_SIZES)]
    assert engine.runner.stats()[GraphKey(8, 32, "linear", method="linear")]["calls"] >= 2


def test_bucketed_block_sizes_run_in_their_own_steps_and_equal_ar():
    """With bucketing, requests run in one step per block size over their own slots (nobody is
    padded to the widest block), and the output is still AR's. (Unless joining the steps is
    cheaper, which the engine weighs by default: tests/test_engine.py; off here.)"""
    engine = drafting_engine(seed=2)
    m = PerRequestBlocks(bucketing=True)
    m.join_steps = False
    equals_ar(engine, m, 8, seed=7, max_new_tokens=40, concurrency=8)
    keys = {(k.batch, k.block) for k in engine.runner.stats() if k.method == "linear"}
    assert {(2, 4), (2, 8), (2, 16), (2, 32)} <= keys      # two requests of each size per step


def test_without_bucketing_a_round_is_padded_to_its_own_widest_block():
    """Requests of 4 and 8 in one step run at width 8, not at the method's largest block (32):
    without bucketing every request pays for the round's widest block, no more."""
    class FourAndEight(PerRequestBlocks):
        def block_for(self, seq) -> int:
            return (4, 8)[seq.index % 2]

        def plans(self):
            return [Plan(4), Plan(8)]

    engine = drafting_engine(seed=2)
    equals_ar(engine, FourAndEight(), 4, seed=3, max_new_tokens=24, concurrency=4)
    widths = {k.block for k in engine.runner.stats() if k.method == "linear" and k.batch == 4}
    assert 8 in widths and 32 not in widths
