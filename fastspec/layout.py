"""Attention layouts: which cache columns each new token may attend to.

Every method expresses its forward as a flat row of N new tokens per request plus a mask among
those new tokens (`block_mask [B, N, N]`). The committed prefix (cache columns < length) is always
visible. `cache_mask` turns that into the explicit mask over cache columns the model consumes:

    row with length L=3, N=3 new tokens written at columns 3,4,5; block_mask = causal
    cols:       0 1 2 | 3 4 5 | 6 ...
    token 0:    1 1 1 | 1 0 0 | 0
    token 1:    1 1 1 | 1 1 0 | 0
    token 2:    1 1 1 | 1 1 1 | 0
"""
from __future__ import annotations

import torch


def causal_block(n: int, device=None) -> torch.Tensor:
    """[n, n] lower-triangular: plain AR attention among the new tokens."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def bidirectional_block(n: int, device=None) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device)


def cache_mask(lengths: torch.Tensor, block_mask: torch.Tensor, ctx: int) -> torch.Tensor:
    """Mask over cache columns [B, N, ctx] for new tokens written at `lengths[b] + i`.

    lengths [B] committed lengths; block_mask [N, N] or [B, N, N] among the new tokens.
    All tensor ops: no host sync, static shapes.
    """
    B = lengths.shape[0]
    N = block_mask.shape[-1]
    if block_mask.dim() == 2:
        block_mask = block_mask.expand(B, N, N)
    cols = torch.arange(ctx, device=lengths.device)
    rel = cols[None, :] - lengths[:, None]                     # [B, ctx] column relative to the block
    in_block = (rel >= 0) & (rel < N)
    gathered = torch.gather(block_mask, 2, rel.clamp(0, N - 1)[:, None, :].expand(B, N, ctx))
    return (rel < 0)[:, None, :] | (in_block[:, None, :] & gathered)
