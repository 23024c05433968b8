"""LinearSS: the backbone drafts a block in diffusion mode, then verifies it autoregressively.

Draft forward, block size b (here b = 4), seed s at position L:

    tokens      s   M   M   M          adapter: off on on on
    attends     s | s M M M | ...      (seed causal; masks see the prefix, the seed and each other)
    predicts    d1  d2  d3  d4         (token shift: position i predicts the token at L+i+1)

The seed never sees the masks and runs without the adapter, so d1 is exactly the verifier's next
token: every round commits at least 2 tokens under greedy decoding.

Verify forward: `s d1 d2 d3`, causal, adapter off (the base model), then `accept_chain`.
Rows with a smaller block than the batch's widest are padded with masks nobody attends to.
"""
from __future__ import annotations

import torch

from fastspec.config import FastspecError
from fastspec.methods.base import Method, RoundOutput
from fastspec.methods.drafter import AdapterDraft, chain_round, draft_logits, sample_drafts

BLOCK_SIZES = (4, 8, 16, 32)
SELF_DRAFT = AdapterDraft()         # the backbone drafts with its adapter (methods/drafter.py)


class LinearSS(Method):
    name = "linear"
    needs_adapter = True
    layout = "linear"               # a draft forward then a chain verify forward, one step
    forwards = 2

    def __init__(self, block: int = 8):      # the best measured B on the CPU (results/README.md)
        if block not in BLOCK_SIZES:
            raise FastspecError(f"--block must be one of {BLOCK_SIZES}, got {block}")
        super().__init__(block)

    def draft(self, step, pending: torch.Tensor, blocks: torch.Tensor):
        """Draft forward: drafts [S, n], the drafter's filtered log-probs [S, n, V] (None under
        greedy: q is never needed) and its logits."""
        logits = draft_logits(step, pending, blocks, step.width)
        return (*sample_drafts(step, logits), logits)

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        return chain_round(SELF_DRAFT, step, pending, blocks, carry)

