import os
from types import SimpleNamespace

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
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
