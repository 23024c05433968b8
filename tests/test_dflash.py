"""DFlash: a separate drafter drafts a block from the target's hidden states; the public checkpoint
format round-trips, bad checkpoints fail in one line, and the output is exactly AR's."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import random_token_prompts, tiny_loaded
from fastspec.config import FastspecError
from fastspec.engine import Engine
from fastspec.layout import cache_mask, causal_block
from fastspec.methods.dflash import DFlash
from fastspec.model.dflash import (DFlashDrafter, attach_dflash, drafter_config_for, load_dflash,
                                   save_dflash)
from fastspec.sampling import SamplingParams, filtered_logprobs
from fastspec.train.data import Example
from fastspec.train.dflash import DFlashTrainConfig, DFlashTrainer, dflash_loss, make_dflash_batch

MASK = 5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_target(vocab=16, seed=0, **kw):
    """A tiny target; a small vocabulary makes random drafts right often enough to be accepted."""
    return tiny_loaded(seed=seed, vocab_size=vocab, **kw)


def tiny_dflash(t, seed=1, layers=1, target_layers=(0, 1), block=8, bias=False, sliding=None,
                qk_norm=True, attach=True):
    cfg = drafter_config_for(t.cfg, layers, target_layers, block, MASK)
    cfg.layers = cfg.layers.replace(attention_bias=bias)
    cfg.qk_norm = qk_norm
    if sliding is not None:
        cfg.layer_types, cfg.sliding_window = ("sliding_attention",) * layers, sliding
    d = DFlashDrafter(cfg, max_positions=t.model.rope_cos.shape[0]).init_random(seed, std=0.2)
    d = d.eval().requires_grad_(False)
    return attach_dflash(t.model, d) if attach else d


def capture(model, prompts, layers):
    """(captured hidden [B, N, K·H] of right-padded prompts, lengths [B]) from a fresh cache."""
    lens = torch.tensor([len(p) for p in prompts])
    B, N = len(prompts), int(lens.max())
    ids = torch.zeros(B, N, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    c = model.cfg
    k = torch.zeros(c.num_layers, B, c.num_kv_heads, N, c.head_dim)
    pos = torch.arange(N).expand(B, N)
    mask = cache_mask(torch.zeros(B, dtype=torch.long), causal_block(N), N)
    _, hidden = model(ids, pos, k, k.clone(), pos, mask, torch.arange(B), capture=layers)
    return hidden, lens


# --- the public format ----------------------------------------------------------------------------
def reference_block_logits(sd, hf, target, block_ids, start, ctx_hidden):
    """The public format's drafter written out from its tensors: context features
    hidden_norm(fc(h)), per layer q from the normed block, k/v from [features | normed block]
    (q/k per-head RMSNorm, RoPE at the tokens' positions), attention over everything, o_proj,
    MLP, final norm, the target's head. One row, eager loops."""
    eps, hd = hf["rms_norm_eps"], hf["head_dim"]
    nh, nkv = hf["num_attention_heads"], hf["num_key_value_heads"]

    def rms(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):                                    # x [T, heads, hd], HF rotate-half
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(pos.double(), inv)
        cos, sin = torch.cat([ang, ang], -1).cos().float(), torch.cat([ang, ang], -1).sin().float()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    C, n = ctx_hidden.shape[0], block_ids.shape[0]
    feats = rms(ctx_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    ctx_pos, blk_pos = torch.arange(C), start + torch.arange(n)
    x = target.embed[block_ids]
    for i in range(hf["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])

        def proj(t, name):
            y = t @ sd[p + f"self_attn.{name}_proj.weight"].T
            return y + sd[p + f"self_attn.{name}_proj.bias"] if hf["attention_bias"] else y
        q = proj(h, "q").view(n, nh, hd)
        k = proj(torch.cat([feats, h]), "k").view(C + n, nkv, hd)
        v = proj(torch.cat([feats, h]), "v").view(C + n, nkv, hd)
        if p + "self_attn.q_norm.weight" in sd:
            q, k = rms(q, sd[p + "self_attn.q_norm.weight"]), rms(k, sd[p + "self_attn.k_norm.weight"])
        q, k = rope(q, blk_pos), rope(k, torch.cat([ctx_pos, blk_pos]))
        rep = nh // nkv
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / math.sqrt(hd)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(rep, 1))
        x = x + proj(out.reshape(n, nh * hd), "o")
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        g, u = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"]) @ target.head_weight.T


def drafter_block_logits(d, target, block_ids, start, ctx_hidden):
    C, n = ctx_hidden.shape[0], block_ids.shape[0]
    k, v = d.context_kv(ctx_hidden[None], torch.arange(C)[None])
    h = d(target.embed[block_ids][None], (start + torch.arange(n))[None], k, v, torch.arange(C)[None],
          torch.ones(1, n, C, dtype=torch.bool), torch.ones(1, n, n, dtype=torch.bool))
    return (h @ target.head_weight.T)[0]


PUBLIC_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.0.{n}" for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                              "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                              "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
QK_NORMS = {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"}
BIASES = {f"layers.0.self_attn.{n}_proj.bias" for n in "qkvo"}


@pytest.mark.parametrize("bias, qk_norm", [(False, True), (True, False)])
def test_public_format_round_trip_gives_the_same_drafter(tmp_path, bias, qk_norm):
    t = tiny_target(vocab=64)
    d = tiny_dflash(t, bias=bias, qk_norm=qk_norm, attach=False)
    save_dflash(d, tmp_path / "drafter")
    hf = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"] == {"mask_token_id": MASK, "block_size": 8, "target_layer_ids": [0, 1]}
    assert (hf["num_hidden_layers"], hf["num_target_layers"], hf["block_size"]) == (1, 2, 8)
    sd = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert set(sd) == PUBLIC_NAMES | (QK_NORMS if qk_norm else set()) | (BIASES if bias else set())
    assert sd["fc.weight"].shape == (64, 2 * 64)

    t2 = tiny_target(vocab=64)                       # the same target, built again
    loaded = load_dflash(tmp_path / "drafter", t2.model)
    assert t2.model.dflash is loaded and loaded.cfg.qk_norm == qk_norm
    for name, w in d.state_dict_hf().items():
        assert torch.equal(loaded.state_dict_hf()[name], w), name
    # Same outputs, and both are what the format's tensors compute written out by hand.
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(11, 2 * 64, generator=g)
    block = torch.tensor([7, MASK, MASK, MASK])
    got = drafter_block_logits(loaded, t2.model, block, 11, ctx)
    assert torch.allclose(got, drafter_block_logits(d, t.model, block, 11, ctx), atol=1e-5)
    ref = reference_block_logits(sd, hf, t2.model, block, 11, ctx)
    assert (got - ref).abs().max() < 1e-4


def test_newer_config_layout_loads_with_its_sliding_layers(tmp_path):
    """Newer public configs: RoPE in rope_parameters, block size inside dflash_config, no
    num_target_layers, sliding-window layers (context farther than the window is not seen)."""
    t = tiny_target(vocab=64)
    d = tmp_path / "drafter"
    save_dflash(tiny_dflash(t, attach=False), d)
    hf = json.loads((d / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "block_size", "num_target_layers"):
        hf.pop(key)
    hf.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, use_sliding_window=True,
              sliding_window=6, layer_types=["sliding_attention"], dtype="bfloat16")
    (d / "config.json").write_text(json.dumps(hf))
    loaded = load_dflash(d, t.model, attach=False)
    assert (loaded.cfg.block_size, loaded.cfg.num_target_layers, loaded.cfg.window(0)) == (8, None, 6)
    full = tiny_dflash(t, attach=False)
    ctx = torch.randn(20, 2 * 64, generator=torch.Generator().manual_seed(4))
    block = torch.tensor([7, MASK, MASK])
    near = drafter_block_logits(loaded, t.model, block, 20, ctx)
    # Only context positions 20 − 6 + 1 .. 19 are within reach of the block's first token.
    assert not torch.allclose(near, drafter_block_logits(full, t.model, block, 20, ctx), atol=1e-4)
    assert torch.allclose(near, drafter_block_logits(loaded, t.model, block, 20,
                                                     torch.cat([torch.randn(10, 128), ctx[10:]])),
                          atol=1e-5)


def test_auto_finds_a_drafter_only_for_the_methods_that_draft_with_one():
    """A drafter shipped or beside the checkpoint is not loaded into AR and LinearSS runs; a
    folder the user names is."""
    from fastspec.evals.runner import dflash_for
    from fastspec.methods import get_method
    plain = [get_method("ar"), get_method("linear", block=4), get_method("bastion")]
    assert dflash_for(plain, "auto") == "none"
    for spec in ("dflash", "bastion[drafter=dflash]", "libraspec[drafter=dflash]"):
        assert dflash_for(plain + [get_method(spec)], "auto") == "auto"
    assert dflash_for(plain, "/drafters/mine") == "/drafters/mine"
    assert dflash_for(plain + [get_method("dflash")], "none") == "none"


def test_captured_layers_are_the_hf_hidden_states():
    """capture=(i, ...) returns the outputs of those layers (the last one after the final norm),
    and the logits are unchanged."""
    t = tiny_target(vocab=64, layers=3)
    m = t.model
    ids = torch.randint(0, 64, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    mask = cache_mask(torch.zeros(2, dtype=torch.long), causal_block(7), 7)
    k = torch.zeros(3, 2, 2, 7, 16)
    plain = m(ids, pos, k, k.clone(), pos, mask, torch.arange(2))
    logits, hidden = m(ids, pos, k, k.clone(), pos, mask, torch.arange(2), capture=(2, 0))
    assert torch.equal(plain, logits)
    x = m.embed[ids]
    outs = []
    for i, blk in enumerate(m.layers):
        x = blk(x, m.rope_cos[pos], m.rope_sin[pos], k[i], k[i].clone(), pos, mask, torch.arange(2), None)
        outs.append(x)
    assert torch.allclose(hidden, torch.cat([m.norm(outs[2]), outs[0]], -1), atol=1e-5)


# --- loader errors ---------------------------------------------------------------------------------
def _resave(d, edit):
    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"))


def _edit_config(d, **fields):
    hf = json.loads((d / "config.json").read_text())
    hf.update(fields)
    (d / "config.json").write_text(json.dumps(hf))


BREAKERS = {
    "no directory": lambda d: d.rename(d.parent / "elsewhere"),
    "no config": lambda d: (d / "config.json").unlink(),
    "corrupt config": lambda d: (d / "config.json").write_text("{not json"),
    "not a drafter": lambda d: (d / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64})),
    "no mask id": lambda d: _edit_config(d, dflash_config={"target_layer_ids": [0, 1]}),
    "no weights": lambda d: (d / "model.safetensors").unlink(),
    "pickle only": lambda d: ((d / "model.safetensors").unlink(), (d / "pytorch_model.bin").write_bytes(b"x")),
    "truncated": lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:700]),
    "garbage": lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
    "missing tensor": lambda d: _resave(d, lambda sd: sd.pop("layers.0.mlp.up_proj.weight")),
    "wrong shape": lambda d: _resave(d, lambda sd: sd.update({"fc.weight": torch.zeros(64, 64)})),
    "mask outside vocab": lambda d: _edit_config(d, dflash_config={"mask_token_id": 999,
                                                                   "target_layer_ids": [0, 1]}),
}


@pytest.mark.parametrize("breaker", sorted(BREAKERS))
def test_a_bad_checkpoint_is_one_error_line(tmp_path, breaker):
    t = tiny_target(vocab=64)
    d = tmp_path / "drafter"
    save_dflash(tiny_dflash(t, attach=False), d)
    BREAKERS[breaker](d)
    with pytest.raises(FastspecError) as e:
        load_dflash(d, t.model)
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    assert not hasattr(t.model, "dflash")


@pytest.mark.parametrize("target_kw, word", [(dict(hidden_size=32, head_dim=8), "hidden size"),
                                             (dict(vocab=128), "vocabulary"),
                                             (dict(layers=3), "target of 2 layers")])
def test_a_drafter_for_another_target_is_refused(tmp_path, target_kw, word):
    save_dflash(tiny_dflash(tiny_target(vocab=64), attach=False), tmp_path / "d")
    other = tiny_target(**{"vocab": 64, **target_kw})
    with pytest.raises(FastspecError, match=word) as e:
        load_dflash(tmp_path / "d", other.model)
    assert "\n" not in str(e.value)


# --- lossless decoding ---------------------------------------------------------------------------
def dflash_engine(backend="eager", **compile_kw):
    t = tiny_target()
    tiny_dflash(t)
    return Engine(t, backend=backend, **compile_kw)


@pytest.mark.parametrize("concurrency, block, window", [(1, 8, 16), (3, 4, 1024), (8, 16, 32)])
def test_greedy_dflash_equals_ar_token_for_token(concurrency, block, window):
    engine = dflash_engine()
    prompts = random_token_prompts(8, seed=concurrency, vocab=16)
    params = SamplingParams(max_new_tokens=41, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    out = engine.generate(prompts, params, method=DFlash(block=block, window=window,
                                                         drafter=engine.model.dflash),
                          concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    rounds = sum(c.rounds for c in out)
    accepted = sum(len(c.token_ids) - 1 for c in out) - rounds
    assert accepted > 0                     # drafts were accepted: the acceptance path ran
    assert max(max(c.accept_lengths) for c in out) <= block
    # Two forwards per round (drafter + verify) plus the prefill.
    assert engine.last_stats.request_forwards == sum(2 * c.rounds + 1 for c in out)


def test_compiled_dflash_round_equals_ar():
    engine = dflash_engine(backend="compile", compiler="aot_eager")
    prompts = random_token_prompts(3, seed=11, vocab=16)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=2)
    out = engine.generate(prompts, params, method=DFlash(block=8, window=16, drafter=engine.model.dflash),
                          concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0


def test_sampled_dflash_follows_the_target_law():
    """(x1, x2) under top-4 sampling: x2 comes from the first round (d1 accepted with p/q or the
    residual), and the empirical joint law approaches the exact one."""
    engine = dflash_engine()
    m, prompt = engine.model, [5, 9, 11]

    def next_law(ids):
        L = len(ids)
        k = torch.zeros(m.cfg.num_layers, 1, m.cfg.num_kv_heads, L, m.cfg.head_dim)
        out = m(torch.tensor([ids]), torch.arange(L)[None], k, k.clone(), torch.arange(L)[None],
                cache_mask(torch.zeros(1, dtype=torch.long), causal_block(L), L), torch.arange(1))
        return filtered_logprobs(out[:, -1], torch.ones(1), torch.tensor([4]), torch.ones(1))[0].exp()

    p1 = next_law(prompt)
    exact = torch.zeros(16, 16)
    for x1 in p1.nonzero()[:, 0].tolist():
        exact[x1] = p1[x1] * next_law(prompt + [x1])
    meth = DFlash(block=4, window=16, drafter=m.dflash)
    distances = []
    for n, seed in ((200, 3), (3000, 4)):
        out = engine.generate([prompt] * n, SamplingParams(temperature=1.0, top_k=4, max_new_tokens=2,
                                                           seed=seed, ignore_eos=True),
                              method=meth, concurrency=128)
        emp = torch.zeros(16, 16)
        for c in out:
            emp[c.token_ids[0], c.token_ids[1]] += 1 / n
        distances.append(0.5 * (emp - exact).abs().sum().item())
    assert distances[1] < 0.05, distances
    assert distances[1] < distances[0]


# --- the carried context -------------------------------------------------------------------------
def run_with_snapshots(engine, prompts, meth, index=0):
    """Generate, recording after each of request `index`'s rounds its slot's ring, committed
    length and the round's draft probabilities."""
    snaps = []

    def on_commit(i, tokens, n_drafted):
        if i == index:                        # one request in flight: it is in slot 0
            last = engine.last_round
            snaps.append({"length": int(engine.cache.lengths[0]),
                          **{k: v[0].clone() for k, v in engine.carry.items()},
                          "draft_prob": None if last is None or last.draft_prob is None
                          else last.draft_prob[0].clone()})
    out = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True), method=meth,
                          concurrency=1, on_commit=on_commit)
    return out, snaps[1:]                     # the first commit is the prefill's token


def test_carried_context_is_the_committed_tokens_features():
    """After every round the ring holds exactly the last W committed positions (since the prompt,
    or since 0 when the engine has the prefill hook), each with the K/V a full recompute gives."""
    engine = dflash_engine()
    d, W = engine.model.dflash, 16
    prompt = random_token_prompts(1, seed=5, vocab=16)[0]
    meth = DFlash(block=8, window=W, drafter=d)
    out, snaps = run_with_snapshots(engine, [prompt], meth)
    first = 0 if meth.report()["prompt_context"] else len(prompt)
    seq = prompt + out[0].token_ids
    hidden, _ = capture(engine.model, [seq], d.cfg.target_layer_ids)
    ref_k, ref_v = d.context_kv(hidden, torch.arange(len(seq))[None])        # [1, layers, kv, T, hd]
    assert len(snaps) >= 3 and snaps[-1]["length"] - len(prompt) > W      # the ring wrapped
    for s in snaps:
        L = s["length"]
        want = set(range(max(first, L - W), L))
        held = s["ctx_pos"][s["ctx_pos"] >= 0].tolist()
        assert sorted(held) == sorted(want)
        for j, p in enumerate(s["ctx_pos"].tolist()):
            if p >= 0:
                assert j == p % W
                assert torch.allclose(s["ctx_k"][:, :, j], ref_k[0, :, :, p], atol=1e-4)
                assert torch.allclose(s["ctx_v"][:, :, j], ref_v[0, :, :, p], atol=1e-4)


def test_context_is_cleared_between_requests_in_a_reused_slot():
    """A request that reuses a retired request's slot drafts exactly as it does alone."""
    engine = dflash_engine()
    d = engine.model.dflash
    first, second = random_token_prompts(2, seed=8, vocab=16)
    alone, snaps_alone = run_with_snapshots(engine, [second], DFlash(block=8, window=64, drafter=d))
    after, snaps_after = run_with_snapshots(engine, [first, second], DFlash(block=8, window=64, drafter=d),
                                            index=1)
    assert after[1].token_ids == alone[0].token_ids
    assert after[1].accept_lengths == alone[0].accept_lengths
    assert len(snaps_after) == len(snaps_alone)
    for a, b in zip(snaps_alone, snaps_after):
        assert torch.allclose(a["draft_prob"], b["draft_prob"], atol=1e-6)
        assert torch.equal(a["ctx_pos"], b["ctx_pos"])
    assert (engine.carry["ctx_pos"] == -1).all()              # retired slots hold nothing


class PromptContextEngine(Engine):
    """The engine with the prefill hook proposed in the DFlash report, done here by a second
    capture forward (the proposed diff captures in the prefill forward itself)."""
    hook = None

    def _prefill(self, seqs, *args, **kw):
        logits = super()._prefill(seqs, *args, **kw)
        if "ctx_pos" not in self.carry:              # the run's method is not DFlash
            return logits
        hidden, lengths = capture(self.model, [s.prompt_ids for s in seqs], self.hook.prefill_capture)
        self.hook.prefill_context(self.carry, torch.tensor([s.slot for s in seqs]), hidden, lengths)
        return logits


def test_prefill_hook_puts_the_prompt_into_the_context():
    t = tiny_target()
    d = tiny_dflash(t)
    engine = PromptContextEngine(t, backend="eager")
    W = 16
    meth = engine.hook = DFlash(block=8, window=W, drafter=d)
    prompts = [random_token_prompts(1, seed=2, vocab=16)[0][:6], list(range(3, 16)) * 2]  # 6 and 26
    ar = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True), concurrency=2)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True), method=meth,
                          concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert meth.report()["prompt_context"]
    # The hook alone: each ring holds the prompt's last W positions, as a full recompute gives.
    carry = {k: torch.full((3, *s.shape), s.fill, dtype=s.dtype) for k, s in meth.carry_spec(16).items()}
    hidden, lengths = capture(t.model, prompts, d.cfg.target_layer_ids)
    meth.prefill_context(carry, torch.tensor([2, 0]), hidden, lengths)
    assert (carry["ctx_pos"][1] == -1).all()
    for slot, p in ((2, prompts[0]), (0, prompts[1])):
        h, _ = capture(t.model, [p], d.cfg.target_layer_ids)
        ref_k, _ = d.context_kv(h, torch.arange(len(p))[None])
        held = carry["ctx_pos"][slot]
        assert sorted(held[held >= 0].tolist()) == list(range(max(0, len(p) - W), len(p)))
        for j, q in enumerate(held.tolist()):
            if q >= 0:
                assert torch.allclose(carry["ctx_k"][slot, :, :, j], ref_k[0, :, :, q], atol=1e-4)


def test_method_without_a_drafter_says_so():
    t = tiny_target()
    engine = Engine(t, backend="eager")
    with pytest.raises(FastspecError, match="needs a DFlash drafter"):
        engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4), method=DFlash())


# --- training ------------------------------------------------------------------------------------
def random_examples(n=3, seed=0, prompt=5, target=30, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(6, vocab, (prompt + i,), generator=g).tolist(),
                    torch.randint(6, vocab, (target,), generator=g).tolist()) for i in range(n)]


def test_training_reduces_the_loss_and_saves_a_loadable_drafter(tmp_path):
    t = tiny_target(vocab=64)
    cfg = DFlashTrainConfig(draft_layers=1, target_layers=(0, 1), block=4, mask_token_id=MASK,
                            blocks_per_seq=4, seqs_per_step=2, lr=3e-3, warmup_steps=1, max_steps=40)
    trainer = DFlashTrainer(t.model, random_examples(), cfg, out_dir=tmp_path / "dflash")
    batch = make_dflash_batch(trainer.examples[:2], torch.tensor([[5, 9, 14, 20], [6, 7, 18, 25]]))
    before = dflash_loss(t.model, trainer.drafter, batch, 4)[0].item()
    for _ in range(25):
        trainer.train_step(batch)
    after = dflash_loss(t.model, trainer.drafter, batch, 4)[0].item()
    assert after < 0.7 * before, (before, after)
    assert not any(p.requires_grad for p in t.model.parameters())
    trainer.save_drafter()
    hf = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert hf["fastspec"]["steps"] == 25 and hf["dflash_config"]["mask_token_id"] == MASK
    loaded = load_dflash(tmp_path / "dflash", t.model)
    ctx = torch.randn(9, 2 * 64)
    block = torch.tensor([7, MASK, MASK, MASK])
    with torch.no_grad():
        want = drafter_block_logits(trainer.drafter, t.model, block, 9, ctx)
    assert torch.allclose(drafter_block_logits(loaded, t.model, block, 9, ctx), want, atol=1e-5)


def test_a_warm_start_begins_from_the_saved_drafter_and_refuses_another_shape(tmp_path):
    """--init-adapter DIR with --kind dflash: the new run's drafter starts as the saved one (its
    lineage recorded), a fresh optimizer; a drafter of another shape is one clear error."""
    t = tiny_target(vocab=64)
    cfg = lambda **kw: DFlashTrainConfig(**{**dict(draft_layers=1, target_layers=(0, 1), block=4,
                                                   mask_token_id=MASK, blocks_per_seq=4,
                                                   seqs_per_step=2, lr=3e-3, warmup_steps=1,
                                                   max_steps=40), **kw})
    first = DFlashTrainer(t.model, random_examples(), cfg(), out_dir=tmp_path / "a")
    batch = make_dflash_batch(first.examples[:2], torch.tensor([[5, 9, 14, 20], [6, 7, 18, 25]]))
    for _ in range(10):
        first.train_step(batch)
    first.save_drafter()
    trained = dflash_loss(t.model, first.drafter, batch, 4)[0].item()
    fresh = DFlashTrainer(t.model, random_examples(), cfg(), out_dir=tmp_path / "b")
    warm = DFlashTrainer(t.model, random_examples(), cfg(seed=5), out_dir=tmp_path / "b",
                         init_drafter_dir=tmp_path / "a")
    assert dflash_loss(t.model, warm.drafter, batch, 4)[0].item() == pytest.approx(trained, rel=1e-5)
    assert dflash_loss(t.model, fresh.drafter, batch, 4)[0].item() > trained * 1.1
    assert warm.meta["init_drafter"] == str(tmp_path / "a")
    assert warm.meta["init_drafter_meta"]["steps"] == 10 and warm.step == 0
    with pytest.raises(FastspecError, match="block_size"):
        DFlashTrainer(t.model, random_examples(), cfg(block=6), init_drafter_dir=tmp_path / "a")


def test_bf16_training_learns_and_keeps_the_drafter_fp32(tmp_path):
    """--precision bf16 trains the DFlash drafter under bf16 autocast; its weights stay fp32."""
    t = tiny_target(vocab=64)
    cfg = DFlashTrainConfig(draft_layers=1, target_layers=(0, 1), block=4, mask_token_id=MASK,
                            blocks_per_seq=4, seqs_per_step=2, lr=3e-3, warmup_steps=1, max_steps=40,
                            precision="bf16")
    trainer = DFlashTrainer(t.model, random_examples(), cfg, out_dir=tmp_path / "dflash")
    batch = make_dflash_batch(trainer.examples[:2], torch.tensor([[5, 9, 14, 20], [6, 7, 18, 25]]))
    first = trainer.train_step(batch)["loss"]
    for _ in range(24):
        last = trainer.train_step(batch)["loss"]
    assert last < 0.7 * first, (first, last)
    assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())


# --- LibraSpec, D²SD and BASTION on the DFlash drafter -------------------------------------------
def dflash_drafted(name, W=1024, ar=False):
    """LibraSpec / D²SD / BASTION drafting with the model's DFlash drafter (bound at run start);
    ar: with the plain AR round in LibraSpec's widths / BASTION's budgets / D²SD's rounds,
    priced by the profile."""
    from fastspec.methods import get_method
    one = "1/" if ar else ""
    prices = ";prices=profile" if ar else ""          # the test's cost model decides, not timings
    spec = {"libraspec": f"libraspec[drafter=dflash;window={W};blocks={one}4/8/16{prices}]",
            "d2sd": f"d2sd[drafter=dflash;window={W};block=8;branches=2;ar={int(ar)}{prices}]",
            "bastion": f"bastion[drafter=dflash;window={W};block=8;budgets={one}8/16;draft_block=8{prices}]"}[name]
    return get_method(spec)


@pytest.mark.parametrize("name", ["libraspec", "d2sd", "bastion"])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_greedy_libraspec_d2sd_and_bastion_on_the_dflash_drafter_equal_ar(name, concurrency):
    engine = dflash_engine()
    prompts = random_token_prompts(6, seed=20 + concurrency, vocab=16)
    params = SamplingParams(max_new_tokens=33, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    meth = dflash_drafted(name)
    out = engine.generate(prompts, params, method=meth, concurrency=concurrency)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert sum(len(c.token_ids) - 1 - c.rounds for c in out) > 0     # drafts were accepted
    assert meth.report()["drafter"] == "dflash" and not meth.needs_adapter


@pytest.mark.parametrize("name", ["libraspec", "d2sd", "bastion"])
def test_compiled_rounds_on_the_dflash_drafter_equal_ar(name):
    engine = dflash_engine(backend="compile", compiler="aot_eager")
    prompts = random_token_prompts(3, seed=13, vocab=16)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = engine.generate(prompts, params, concurrency=2)
    out = engine.generate(prompts, params, method=dflash_drafted(name), concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0


@pytest.mark.parametrize("name, ar", [("libraspec", False), ("d2sd", False), ("bastion", False),
                                      ("libraspec", True), ("d2sd", True),
                                      ("bastion", True)])
def test_a_tree_or_variable_chain_fills_the_ring_with_the_committed_tokens(name, ar):
    """The ring after every round of BASTION (the accepted path of a tree, gathered from the tree
    verify's captured layers) and LibraSpec (chains of varying width) holds what a full recompute
    of the committed sequence gives, as DFlash's own chain does; so it does after AR rounds
    (ar: a cost model where tokens are dear, so every round after the first is one)."""
    engine = dflash_engine()
    if ar:
        engine._forward_cost = lambda rows, tokens: 10.0 * tokens
    d, W = engine.model.dflash, 16
    prompt = random_token_prompts(1, seed=5, vocab=16)[0]
    meth = dflash_drafted(name, W, ar)
    out, snaps = run_with_snapshots(engine, [prompt], meth)
    if ar:
        assert meth.report()["ar_share"] > 0.9, meth.report()
    ar_out = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert out[0].token_ids == ar_out[0].token_ids
    first = 0 if meth.source.prefilled else len(prompt)     # the engine's prefill hook ran
    seq = prompt + out[0].token_ids
    hidden, _ = capture(engine.model, [seq], d.cfg.target_layer_ids)
    ref_k, ref_v = d.context_kv(hidden, torch.arange(len(seq))[None])
    assert len(snaps) >= 3 and snaps[-1]["length"] - len(prompt) > W
    for s in snaps:
        L = s["length"]
        held = s["ctx_pos"][s["ctx_pos"] >= 0].tolist()
        assert sorted(held) == list(range(max(first, L - W), L))
        for j, p in enumerate(s["ctx_pos"].tolist()):
            if p >= 0:
                assert torch.allclose(s["ctx_k"][:, :, j], ref_k[0, :, :, p], atol=1e-4)
                assert torch.allclose(s["ctx_v"][:, :, j], ref_v[0, :, :, p], atol=1e-4)


def test_a_dflash_window_narrower_than_a_round_is_one_line():
    from fastspec.methods import get_method
    with pytest.raises(FastspecError, match="narrower than a round"):
        get_method("libraspec[drafter=dflash;window=8;blocks=4/8/16]")
    with pytest.raises(FastspecError, match="drafter must be one of"):
        get_method("bastion[drafter=eagle]")
