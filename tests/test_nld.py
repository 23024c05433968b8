"""Nemotron-Labs-Diffusion checkpoints load natively and draft the way they were trained: a
Ministral3 backbone equal to transformers', the diffusion head, the in-vocabulary MASK token, the
o_proj linear_spec_lora (fp32) and NLD's drafting convention, checked against an independent
reference forward written here."""
import json
from types import SimpleNamespace

import pytest
import torch

from fastspec.config import FastspecError
from fastspec.convention import FASTSPEC, NLD, model_convention
from fastspec.draft import AdapterConfig, attach_adapter, has_adapter
from fastspec.engine import Engine
from fastspec.layout import cache_mask, causal_block
from fastspec.model.llama import LlamaModel
from fastspec.model.loader import load_model, tiny_random_config, write_hf_checkpoint
from fastspec.sampling import SamplingParams
from helpers import IDS, hf_logits, native_logits

MASK_ID = 7
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def ministral3(seed=0) -> LlamaModel:
    """A tiny Ministral3: YaRN RoPE and the Llama-4 query temperature, which grows every 4
    positions here so a 12-token test crosses three of its steps."""
    cfg = tiny_random_config(architecture="Ministral3ForCausalLM", rope_theta=1e6, rope_scaling=YARN,
                             attn_temperature_beta=0.1, attn_temperature_length=4,
                             max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaModel(cfg).init_random(seed, std=0.2)


def test_ministral3_backbone_matches_transformers(tmp_path):
    model = ministral3()
    write_hf_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "ministral3"
    loaded = load_model(str(tmp_path))
    assert loaded.cfg.attn_temperature_beta == 0.1
    ref = hf_logits(tmp_path, IDS)
    assert ref.std() > 0.3
    assert (native_logits(loaded.model, IDS) - ref).abs().max() < 1e-4
    # The temperature matters: without it the logits past position 4 differ.
    loaded.model.q_scale = None
    assert (native_logits(loaded.model, IDS)[:, 4:] - ref[:, 4:]).abs().max() > 1e-3


R, ALPHA = 4, 16.0        # LoRA rank and alpha of the test adapter (scale 4, as NLD's 512 / 128)


def write_real_nld(d, model: LlamaModel, lora: dict, mask_id=MASK_ID, paradigm="block_diff"):
    """A checkpoint in NLD's published layout, written here by hand (not by fastspec's writer):
    encoder.* + diffusion_head.weight, and a PEFT linear_spec_lora/ with o_proj-only keys."""
    from safetensors.torch import save_file
    d.mkdir(parents=True, exist_ok=True)
    hf = model.cfg.to_hf()
    hf.update(architectures=["NemotronLabsDiffusionModel"], model_type="nemotron_labs_diffusion",
              mask_token_id=mask_id, block_size=8, dlm_paradigm=paradigm)
    (d / "config.json").write_text(json.dumps(hf))
    sd = {}
    for name, t in model.hf_state_dict().items():
        name = name.replace("model.", "encoder.", 1).replace("lm_head.", "diffusion_head.")
        sd[name] = t.clone().contiguous()
    save_file(sd, str(d / "model.safetensors"))
    (d / "linear_spec_lora").mkdir()
    save_file({f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_{w}.weight": t
               for (i, w), t in lora.items()}, str(d / "linear_spec_lora" / "adapter_model.safetensors"))
    (d / "linear_spec_lora" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.0,
         "target_modules": ["o_proj"], "base_model_name_or_path": "nld"}))
    return d


def random_lora(model, seed=4) -> dict:
    g = torch.Generator().manual_seed(seed)
    c = model.cfg
    out = {}
    for i in range(c.num_layers):
        out[i, "A"] = torch.randn(R, c.num_heads * c.head_dim, generator=g) * 0.3
        out[i, "B"] = torch.randn(c.hidden_size, R, generator=g) * 0.3
    return out


@pytest.fixture(scope="module")
def nld_parts(tmp_path_factory):
    model = ministral3(seed=2)
    lora = random_lora(model)
    return write_real_nld(tmp_path_factory.mktemp("nld"), model, lora), model, lora


@pytest.fixture(scope="module")
def nld_dir(nld_parts):
    return nld_parts[0]


def reference_block_logits(model: LlamaModel, lora: dict, prefix: list[int], seed: int, B: int):
    """NLD's drafting convention, written from its description: one full-sequence forward of
    prefix + [seed, MASK x (B-1)]; causal over the prefix, the whole block bidirectional (seed
    included); o_proj LoRA (fp32, scale alpha / r) on every block token; no token shift, so the
    logit at block position i is the draft of the token at L + i. Returns [B, V]."""
    from fastspec.model.rope import rope_tables
    c = model.cfg
    ids = torch.tensor(prefix + [seed] + [MASK_ID] * (B - 1))
    T, L = len(ids), len(prefix)
    sd = model.hf_state_dict()
    w = lambda n: sd["model." + n].float()
    rms = lambda x, g: g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
    cos, sin = rope_tables(c, T)
    pos = torch.arange(T, dtype=torch.float32)
    temp = 1 + c.attn_temperature_beta * torch.log1p(torch.floor(pos / c.attn_temperature_length))

    def rope(x):                                    # [H, T, D], rotate-half
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

    allowed = torch.ones(T, T).tril().bool()
    allowed[L:, L:] = True                          # the block sees itself whole
    in_block = (torch.arange(T) >= L).float()[:, None]
    x = w("embed_tokens.weight")[ids]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        h = rms(x, w(p + "input_layernorm.weight"))
        q = (h @ w(p + "self_attn.q_proj.weight").T).view(T, c.num_heads, c.head_dim).transpose(0, 1)
        k = (h @ w(p + "self_attn.k_proj.weight").T).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = (h @ w(p + "self_attn.v_proj.weight").T).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
        q, k = rope(q) * temp[None, :, None], rope(k)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = (q @ k.transpose(1, 2)) / c.head_dim ** 0.5
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(T, -1)
        delta = (o @ lora[i, "A"].T @ lora[i, "B"].T) * (ALPHA / R)
        x = x + o @ w(p + "self_attn.o_proj.weight").T + in_block * delta
        h = rms(x, w(p + "post_attention_layernorm.weight"))
        gate, up = h @ w(p + "mlp.gate_proj.weight").T, h @ w(p + "mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ w(p + "mlp.down_proj.weight").T
    logits = rms(x, w("norm.weight")) @ sd["lm_head.weight"].float().T
    return logits[L:]


class DraftStep(SimpleNamespace):
    """The slice of the engine's Step a LinearSS draft uses: rows whose prefixes are in a cache."""

    def forward(self, ids, block_mask, adapter_on=None, rel_positions=None):
        S, n = ids.shape
        cols = self.lengths[:, None] + torch.arange(n)
        mask = cache_mask(self.lengths, block_mask, int(self.lengths.max()) + n)
        with torch.no_grad():
            return self.model(ids, cols, self.k, self.v, cols, mask, torch.arange(S), adapter_on)


def draft_with_linear_method(model, prefixes: list[list[int]], seeds: list[int], B: int):
    """LinearSS.draft (the method itself) after prefilling each prefix: drafts [S, B], logits."""
    from fastspec.methods.linear import LinearSS
    c, S = model.cfg, len(prefixes)
    k = torch.zeros(c.num_layers, S, c.num_kv_heads, 64, c.head_dim)
    v = torch.zeros_like(k)
    for r, pre in enumerate(prefixes):
        n = len(pre)
        cols = torch.arange(n)[None]
        slot = torch.tensor([r])
        with torch.no_grad():
            model(torch.tensor([pre]), cols, k, v, cols, cache_mask(torch.zeros(1, dtype=torch.long),
                  causal_block(n), n), slot)
    step = DraftStep(model=model, k=k, v=v, lengths=torch.tensor([len(p) for p in prefixes]),
                     width=B, mask_token_id=model.mask_token_id,
                     convention=model_convention(model), sampler=SimpleNamespace(any_sampled=False))
    drafts, _, logits = LinearSS(B).draft(step, torch.tensor(seeds), torch.full((S,), B))
    return drafts, logits


def test_nld_checkpoint_loads_backbone_head_and_draft_lora(nld_parts):
    nld_dir, ref, lora = nld_parts
    names = set(__import__("safetensors").safe_open(str(nld_dir / "model.safetensors"), "pt").keys())
    assert "diffusion_head.weight" in names and "encoder.layers.0.self_attn.q_proj.weight" in names
    loaded = load_model(str(nld_dir))
    m = loaded.model
    assert loaded.adapter_path.endswith("linear_spec_lora") and has_adapter(m)
    assert m.mask_token_id == MASK_ID and m.adapter_config.block_size == 8
    assert torch.equal(m.mask_embed, m.embed[MASK_ID])          # MASK is an ordinary vocab row
    assert list(m.layers[0].attn.lora) == ["o"] and m.layers[0].attn.lora["o"].scale == 4.0
    # The checkpoint drafts NLD's way, and says so.
    assert model_convention(m) == NLD and m.adapter_config.convention == NLD.to_dict()
    assert m.adapter_config.meta["dlm_paradigm"] == "block_diff"
    assert loaded.cfg.extra["nld"]["dlm_paradigm"] == "block_diff"
    # Verify mode (adapter off) is the backbone.
    assert (native_logits(m, IDS) - native_logits(ref, IDS)).abs().max() < 1e-5


@pytest.mark.parametrize("B", [4, 8])
def test_draft_logits_follow_the_nld_convention(nld_parts, B):
    nld_dir, backbone, lora = nld_parts
    m = load_model(str(nld_dir)).model
    prefixes, seeds = [[5, 17, 300, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]], [77, 250]
    drafts, logits = draft_with_linear_method(m, prefixes, seeds, B)
    for r, (pre, seed) in enumerate(zip(prefixes, seeds)):
        ref = reference_block_logits(backbone, lora, pre, seed, B)      # [B, V], unshifted
        ref[:, MASK_ID] = float("-inf")                                 # MASK is never a draft
        # Index i of the method's logits proposes d(i+1): the reference's block position i+1.
        got = logits[r, : B - 1]
        assert torch.equal(got.isinf(), ref[1:].isinf())
        fin = ~ref[1:].isinf()
        assert (got[fin] - ref[1:][fin]).abs().max() < 1e-4
        assert torch.equal(drafts[r, : B - 1], ref[1:].argmax(-1))
        assert ref[1:][fin].std() > 0.3
    # The convention matters: fastspec's (shifted, seed causal without adapter) drafts differently.
    m.draft_convention = FASTSPEC
    _, other = draft_with_linear_method(m, prefixes, seeds, B)
    assert (other[:, : B - 1] - logits[:, : B - 1]).nan_to_num(0, 0, 0).abs().max() > 1e-2


def test_linear_self_speculation_on_an_nld_checkpoint_equals_ar(nld_dir):
    engine = Engine(load_model(str(nld_dir)), backend="eager")
    assert model_convention(engine.model) == NLD
    prompts = [[5, 17, 300, 42], [1, 2, 3], [99, 98, 97, 96, 95, 94]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(prompts, params, method="ar", concurrency=3)
    lin = engine.generate(prompts, params, method="linear", block=8, concurrency=3)
    assert [c.token_ids for c in lin] == [c.token_ids for c in ar]
    assert sum(c.rounds for c in lin) < sum(c.rounds for c in ar)      # drafts were accepted


def test_bf16_load_keeps_the_lora_in_fp32_and_rope_to_max_context(nld_parts):
    nld_dir, _, lora = nld_parts
    m = load_model(str(nld_dir), dtype="bfloat16", max_context=48).model
    o = m.layers[0].attn.lora["o"]
    assert m.embed.dtype == torch.bfloat16 and o.A.dtype == o.B.dtype == torch.float32
    assert torch.equal(o.A, lora[0, "A"]) and m.rope_cos.shape[0] == 48
    x = torch.randn(2, 3, o.A.shape[1]).to(torch.bfloat16)
    gate = torch.ones(2, 3, 1, dtype=torch.bfloat16)
    want = ((x.float() @ lora[0, "A"].T @ lora[0, "B"].T) * 4.0).to(torch.bfloat16)
    assert torch.equal(o(x, gate), want)
    assert o(x, gate).dtype == torch.bfloat16
    # Without max_context the tables stop at the config's context, and at DEFAULT_MAX_CONTEXT.
    from fastspec.model.loader import DEFAULT_MAX_CONTEXT
    assert load_model(str(nld_dir), adapter=None).model.rope_cos.shape[0] == 64
    assert DEFAULT_MAX_CONTEXT <= 32768


def test_meta_device_build_reads_straight_into_the_target_dtype(nld_parts, tmp_path, monkeypatch):
    """A bf16 checkpoint loads as bf16 without any full-size fp32 weight ever being allocated
    (the old path built the model in fp32 first)."""
    _, model, lora = nld_parts
    import copy
    d = write_real_nld(tmp_path / "bf16", copy.deepcopy(model).to(torch.bfloat16), lora)
    big = []
    real_empty = torch.empty

    def spy(*shape, **kw):
        t = real_empty(*shape, **kw)
        if t.dtype == torch.float32 and t.device.type != "meta" and t.numel() >= 64 * 64:
            big.append(tuple(t.shape))
        return t
    monkeypatch.setattr(torch, "empty", spy)
    m = load_model(str(d), dtype="bfloat16").model
    monkeypatch.undo()
    assert m.embed.dtype == m.layers[1].mlp.w_down.dtype == torch.bfloat16 and not big
    ref = load_model(str(d), dtype="float32").model          # same bf16 values, upcast
    assert torch.equal(m.layers[1].attn.wqkv.float(), ref.layers[1].attn.wqkv)


def test_adapters_record_their_convention(tmp_path):
    """A fastspec adapter keeps fastspec's convention; a config without the field is fastspec's;
    an nld-trained one loads as nld."""
    from fastspec.draft import load_adapter, save_adapter
    m = LlamaModel(tiny_random_config()).init_random(0)
    attach_adapter(m, AdapterConfig(rank=4, alpha=8.0))
    save_adapter(m, str(tmp_path / "a"))
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["convention"] is None
    fresh = LlamaModel(tiny_random_config()).init_random(0)
    load_adapter(fresh, str(tmp_path / "a"))
    assert model_convention(fresh) == FASTSPEC
    attach_adapter(m, AdapterConfig(rank=4, alpha=8.0, convention=NLD.to_dict()))
    save_adapter(m, str(tmp_path / "b"))
    load_adapter(fresh, str(tmp_path / "b"))
    assert model_convention(fresh) == NLD and fresh.layers[0].attn.lora["q"].fp32
    cfg = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    cfg["convention"] = {"name": "x", "seed_attention": "sideways"}
    (tmp_path / "b" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(FastspecError, match="seed_attention"):
        load_adapter(fresh, str(tmp_path / "b"))


def test_bad_nld_checkpoints_are_one_line_errors(nld_dir, tmp_path):
    import shutil
    d = tmp_path / "nomask"
    shutil.copytree(nld_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FastspecError, match="mask_token_id"):
        load_model(str(d))
    d2 = tmp_path / "badrank"
    shutil.copytree(nld_dir, d2)
    pc = json.loads((d2 / "linear_spec_lora" / "adapter_config.json").read_text())
    pc["r"] = 8
    (d2 / "linear_spec_lora" / "adapter_config.json").write_text(json.dumps(pc))
    with pytest.raises(FastspecError, match="rank 8"):
        load_model(str(d2))
    (d2 / "linear_spec_lora" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(FastspecError, match="cannot read the NLD draft adapter"):
        load_model(str(d2))
