"""Nemotron-Labs-Diffusion checkpoints load natively: a Ministral3 backbone equal to transformers',
the diffusion head, the in-vocabulary MASK token and the linear_spec_lora draft adapter."""
import json

import pytest
import torch

from fastspec.config import FastspecError
from fastspec.draft import AdapterConfig, attach_adapter, has_adapter
from fastspec.engine import Engine
from fastspec.model.llama import LlamaModel
from fastspec.model.loader import load_model, tiny_random_config, write_hf_checkpoint
from fastspec.model.nld import write_nld_checkpoint
from fastspec.sampling import SamplingParams
from test_loader import IDS, hf_logits, native_logits

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


def with_draft_lora(model: LlamaModel) -> LlamaModel:
    attach_adapter(model, AdapterConfig(rank=4, alpha=8.0, mask_token_id=MASK_ID, block_size=8), seed=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for blk in model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.2 * torch.randn(lora.B.shape, generator=g))
        model.mask_embed.copy_(model.embed[MASK_ID])    # NLD: MASK is a vocabulary token
    return model.eval().requires_grad_(False)


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


@pytest.fixture(scope="module")
def nld_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nld")
    write_nld_checkpoint(with_draft_lora(ministral3(seed=2)), d, mask_token_id=MASK_ID, block_size=8)
    return d


def test_nld_checkpoint_loads_backbone_head_and_draft_lora(nld_dir):
    assert json.loads((nld_dir / "config.json").read_text())["architectures"] == ["NemotronLabsDiffusionModel"]
    names = set(__import__("safetensors").safe_open(str(nld_dir / "model.safetensors"), "pt").keys())
    assert "diffusion_head.weight" in names and "encoder.layers.0.self_attn.q_proj.weight" in names
    ref = with_draft_lora(ministral3(seed=2))
    loaded = load_model(str(nld_dir))
    m = loaded.model
    assert loaded.adapter_path.endswith("linear_spec_lora") and has_adapter(m)
    assert m.mask_token_id == MASK_ID and m.adapter_config.block_size == 8
    assert torch.equal(m.mask_embed, m.embed[MASK_ID])
    # Verify mode (adapter off) is the backbone; draft mode (adapter on) is backbone + LoRA.
    assert (native_logits(m, IDS) - native_logits(ref, IDS)).abs().max() < 1e-5
    on = torch.ones_like(IDS, dtype=torch.bool)
    ids = IDS.clone()
    ids[:, 6:] = MASK_ID
    def drafted(model):
        B, N = ids.shape
        c = model.cfg
        k = torch.zeros(c.num_layers, B, c.num_kv_heads, N, c.head_dim)
        pos = torch.arange(N).expand(B, N)
        mask = torch.ones(B, N, N, dtype=torch.bool)
        return model(ids, pos, k, k.clone(), pos, mask, torch.arange(B), on)
    assert (drafted(m) - drafted(ref)).abs().max() < 1e-5
    assert (drafted(m) - native_logits(m, ids)).abs().max() > 1e-2


def test_linear_self_speculation_on_an_nld_checkpoint_equals_ar(nld_dir):
    engine = Engine(load_model(str(nld_dir)), backend="eager")
    prompts = [[5, 17, 300, 42], [1, 2, 3], [99, 98, 97, 96, 95, 94]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = engine.generate(prompts, params, method="ar", concurrency=3)
    lin = engine.generate(prompts, params, method="linear", block=8, concurrency=3)
    assert [c.token_ids for c in lin] == [c.token_ids for c in ar]


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
