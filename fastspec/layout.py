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


def block_placement(lengths: torch.Tensor, n: int, block_mask: torch.Tensor, ctx: int):
    """(write columns = positions [B, n], mask over cache columns [B, n, ctx], slots [B]) for n new
    tokens per row written right after each row's committed length.

    lengths = [5, 2], n = 3 -> columns [[5 6 7] [2 3 4]]; each row sees its committed prefix
    plus block_mask among the new tokens."""
    cols = lengths[:, None] + torch.arange(n, device=lengths.device)
    return cols, cache_mask(lengths, block_mask, ctx), torch.arange(lengths.shape[0], device=lengths.device)


def tree_block(parents: tuple[int, ...], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree laid out flat: ([n, n] mask, [n] depth). parents[i] is the index of token i's
    parent within the block (-1: a root, attached to the committed prefix); parents come first.

    parents = (-1, 0, 0, 1):     s                 mask   s a b c     depth
                                / \\               s    1 0 0 0     0
                               a   b              a    1 1 0 0     1
                               |                  b    1 0 1 0     1
                               c                  c    1 1 0 1     2

    Each token sees itself and its ancestors; siblings never see each other. Positions are the
    committed length plus the depth, so every path reads like a plain causal chain.
    """
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must come before its child (or be -1)")
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask.to(device), torch.tensor(depth, device=device)


def tree_layout_name(parents: tuple[int, ...]) -> str:
    """The GraphKey layout of a tree: `tree(-1,0,0,1)`."""
    return "tree(" + ",".join(str(p) for p in parents) + ")"
