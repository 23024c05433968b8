import os
from types import SimpleNamespace

import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", min(2, os.cpu_count() or 1))))
# The kernel's software prefetch changes no result, only speed: tests keep the built-in rule
# instead of timing this machine (the tuner's own tests set FASTSPEC_PREFETCH=auto).
os.environ.setdefault("FASTSPEC_PREFETCH", "rule")
from fastspec.config import ModelConfig  # noqa: E402
from fastspec.model.llama import LlamaModel  # noqa: E402

EOS = 2


def tiny_loaded(seed: int = 0, layers: int = 2, std: float = 0.2, **cfg_overrides):
    """A tiny random Llama as a LoadedModel-like object (no tokenizer): fast, deterministic, fp32."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=layers,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                  eos_token_ids=(EOS,))
    cfg = ModelConfig(**{**fields, **cfg_overrides})
    model = LlamaModel(cfg).init_random(seed, std=std).eval().requires_grad_(False)
    return SimpleNamespace(model=model, cfg=cfg, tokenizer=None, name="tiny", path=None, chat_template=None)


@pytest.fixture
def tiny():
    return tiny_loaded()


def tiny_drafter(seed: int = 5):
    """A tiny random model with a random (non-identity) draft adapter: drafts are mostly wrong,
    which exercises every rejection path."""
    from fastspec.draft import AdapterConfig, attach_adapter
    t = tiny_loaded(seed=seed)
    attach_adapter(t.model, AdapterConfig(rank=4), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in t.model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.1 * torch.randn(lora.B.shape, generator=g))
    t.model.requires_grad_(False)
    return t


def random_token_prompts(n: int, seed: int = 0, max_len: int = 30, vocab: int = 512):
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
