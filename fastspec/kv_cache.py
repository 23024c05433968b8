"""Static KV cache: preallocated buffers, one committed length per slot.

A forward writes its N new tokens' K/V at columns `length .. length+N` of the row's slot; nothing
is committed until `commit` advances the length, so rejected speculative entries are simply
overwritten by the next forward. Slots are recycled by the scheduler.
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

    def commit(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Advance the committed length of `slots` by `accepted` tokens (no host sync)."""
        self.lengths.index_add_(0, slots, accepted.to(self.lengths.dtype))

    def reset(self, slots: torch.Tensor) -> None:
        self.lengths.index_fill_(0, slots, 0)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
