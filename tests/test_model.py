"""The native decoder: explicit layouts, per-token adapter flag, precisions."""
import pytest
import torch
from torch import nn

from conftest import tiny_loaded
from fastspec.layout import bidirectional_block, cache_mask, causal_block
from fastspec.model.llama import LoRA
from fastspec.sampling import filtered_logprobs


def fresh_cache(cfg, batch, ctx, dtype=torch.float32):
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, ctx, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def prefill(m, ids, dtype=torch.float32, adapter_on=None):
    """Logits of a causal forward of `ids` [B, N] into a fresh cache."""
    B, N = ids.shape
    pos = torch.arange(N).expand(B, N)
    k, v = fresh_cache(m.cfg, B, N, dtype)
    mask = cache_mask(torch.zeros(B, dtype=torch.long), causal_block(N), N)
    return m(ids, pos, k, v, pos, mask, torch.arange(B), adapter_on=adapter_on)


def test_cache_mask_matches_hand_written_matrix():
    # Row 0: 2 committed tokens, block of 3 bidirectional; row 1: 0 committed, causal block.
    lengths = torch.tensor([2, 0])
    block = torch.stack([bidirectional_block(3), causal_block(3)])
    got = cache_mask(lengths, block, 6).int()
    want = torch.tensor([
        [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]],
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]],
    ])
    assert torch.equal(got, want)


def test_incremental_decoding_equals_one_full_forward():
    loaded = tiny_loaded()
    m, cfg = loaded.model, loaded.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    k, v = fresh_cache(cfg, 2, 16)
    full = m(ids, pos, k, v, pos, cache_mask(torch.zeros(2, dtype=torch.long), causal_block(12), 16),
             torch.arange(2))
    k, v = fresh_cache(cfg, 2, 16)
    lengths = torch.zeros(2, dtype=torch.long)
    steps = []
    for chunk in (ids[:, :5], ids[:, 5:6], ids[:, 6:12]):
        n = chunk.shape[1]
        cols = lengths[:, None] + torch.arange(n)
        steps.append(m(chunk, cols, k, v, cols, cache_mask(lengths, causal_block(n), 16), torch.arange(2)))
        lengths += n
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-4


def test_adapter_flag_switches_lora_per_token_in_one_forward():
    loaded = tiny_loaded()
    m, cfg = loaded.model, loaded.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    base = prefill(m, ids)
    torch.manual_seed(0)
    for blk in m.layers:
        a = blk.attn
        a.lora = nn.ModuleDict({n: LoRA(cfg.hidden_size if n != "o" else cfg.num_heads * cfg.head_dim,
                                        o, rank=4, alpha=8)
                                for n, o in zip("qkvo", (*a.split, cfg.hidden_size))})
        for lora in a.lora.values():
            nn.init.normal_(lora.B, std=0.5)
    # Adapter on for the last 3 tokens only: the first 5 (which never see them) equal the base.
    flag = torch.tensor([[False] * 5 + [True] * 3])
    mixed = prefill(m, ids, adapter_on=flag)
    assert (mixed[:, :5] - base[:, :5]).abs().max() < 1e-5
    assert (mixed[:, 5:] - base[:, 5:]).abs().max() > 1e-2
    off = prefill(m, ids, adapter_on=torch.zeros_like(flag))
    assert (off - base).abs().max() < 1e-5


def test_bfloat16_forward_tracks_fp32():
    loaded = tiny_loaded(std=0.05)
    m, cfg = loaded.model, loaded.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    ref = prefill(m, ids)
    out = prefill(m.to(torch.bfloat16), ids, torch.bfloat16)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = lambda t, k, p: filtered_logprobs(logits, torch.tensor([t]), torch.tensor([k]), torch.tensor([p])).exp()
    assert torch.allclose(one(1.0, 2, 1.0), torch.tensor([[0.625, 0.375, 0, 0]]), atol=1e-6)
    assert torch.allclose(one(1.0, 0, 0.8), torch.tensor([[0.625, 0.375, 0, 0]]), atol=1e-6)
    assert torch.allclose(one(1.0, 0, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95, atol=1e-6)
    assert torch.equal(one(0.0, 0, 1.0), torch.tensor([[1.0, 0, 0, 0]]))


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
])
def test_native_logits_match_transformers_llama_with_rope_scaling(rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastspec.config import ModelConfig
    from fastspec.model.llama import LlamaModel
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=False, rope_theta=10000.0)
    if rope:
        kw["rope_scaling"] = rope
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert (cfg.rope_scaling or {}).get("rope_type") == (rope or {}).get("rope_type")
    m = LlamaModel(cfg)
    m.load_hf_state_dict(hf.state_dict())
    ids = torch.randint(0, 256, (2, 150))          # past the original context for llama3/yarn
    with torch.no_grad():
        ref = hf(ids).logits
        out = prefill(m, ids)
    assert (out - ref).abs().max() < 1e-4


def test_tree_layout_matches_hand_written_matrix_and_each_path_equals_its_chain():
    from fastspec.layout import tree_block
    mask, depth = tree_block((-1, 0, 0, 1))
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert depth.tolist() == [0, 1, 1, 2]
    with pytest.raises(ValueError):
        tree_block((-1, 2, 0))
    # One forward over the tree [s a b c] after a 5-token prefix: token c's logits equal those of
    # the plain chain [s a c], token b's those of [s b].
    m = tiny_loaded().model
    prefix = torch.tensor([[11, 22, 33, 44, 55]])
    s, a, b, c = 7, 8, 9, 10
    k, v = fresh_cache(m.cfg, 1, 16)
    L = prefix.shape[1]
    pos = torch.arange(L)[None]
    m(prefix, pos, k, v, pos, cache_mask(torch.zeros(1, dtype=torch.long), causal_block(L), 16), torch.arange(1))
    lengths = torch.tensor([L])
    cols = L + torch.arange(4)[None]
    tree = m(torch.tensor([[s, a, b, c]]), L + depth[None], k, v, cols, cache_mask(lengths, mask, 16),
             torch.arange(1))
    chain_c = prefill(m, torch.cat([prefix, torch.tensor([[s, a, c]])], 1))
    chain_b = prefill(m, torch.cat([prefix, torch.tensor([[s, b]])], 1))
    assert (tree[0, 3] - chain_c[0, -1]).abs().max() < 1e-4
    assert (tree[0, 2] - chain_b[0, -1]).abs().max() < 1e-4
