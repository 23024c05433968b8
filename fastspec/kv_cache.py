"""Static KV cache: preallocated buffers, one committed length per slot.

A forward writes its N new tokens' K/V at columns `length .. length+N` of the row's slot; nothing
is committed until the engine advances the length (inside the round step, by the tokens the
round emits), so rejected speculative entries are simply overwritten by the next forward. Slots
are recycled by the scheduler; the last slot is the trash that padded rows of a bucket write to.
"""
from __future__ import annotations

import torch

from fastspec.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.num_slots = num_slots
        self.max_len = max_len

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
