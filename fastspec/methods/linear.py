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
from fastspec.convention import aligned_draft_logits, draft_adapter_flags, draft_block_mask
from fastspec.layout import causal_block
from fastspec.methods.base import Method, RoundOutput
from fastspec.sampling import STREAM_DRAFT, filtered_logprobs, sample_from_logprobs
from fastspec.verify import accept_chain

BLOCK_SIZES = (4, 8, 16, 32)


def draft_stats(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per position: the drafter's probability of its draft, top-1 probability, top-1 − top-2."""
    logits = logits.float()
    lse = logits.logsumexp(-1)
    top2 = logits.topk(2, dim=-1).values
    p1, p2 = (top2[..., 0] - lse).exp(), (top2[..., 1] - lse).exp()
    p_draft = (logits.gather(-1, drafts[..., None])[..., 0] - lse).exp()
    return p_draft, p1, p1 - p2


def draft_logits(step, pending: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The draft forward `[seed, MASK×(n−1)]` in the adapter's convention: aligned logits
    [S, n, V] whose index i proposes d(i+1), MASK excluded (row s drafts its first blocks[s])."""
    S, conv = pending.shape[0], step.convention
    ids = torch.full((S, n), step.mask_token_id, dtype=torch.long, device=pending.device)
    ids[:, 0] = pending
    logits = step.forward(ids, draft_block_mask(conv, blocks, n),
                          adapter_on=draft_adapter_flags(conv, S, n, pending.device))
    return aligned_draft_logits(conv, logits, step.mask_token_id)


class LinearSS(Method):
    name = "linear"
    needs_adapter = True
    layout = "linear"               # a draft forward then a chain verify forward, one step
    forwards = 2

    def __init__(self, block: int = 8):      # the best measured B on the CPU (README)
        if block not in BLOCK_SIZES:
            raise FastspecError(f"--block must be one of {BLOCK_SIZES}, got {block}")
        super().__init__(block)

    def draft(self, step, pending: torch.Tensor, blocks: torch.Tensor):
        """Draft forward: drafts [S, n], the drafter's filtered log-probs [S, n, V] (None under
        greedy: q is never needed) and its logits."""
        S, n = pending.shape[0], step.width
        logits = draft_logits(step, pending, blocks, n)
        s = step.sampler
        if not s.any_sampled:
            return logits.argmax(-1), None, logits
        logp = filtered_logprobs(logits, s.temperature[:S], s.top_k[:S], s.top_p[:S], s.any_filtered)
        return sample_from_logprobs(logp, s.uniform(STREAM_DRAFT, (n,), rows=S)), logp, logits

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        n = step.width
        drafts, draft_logp, draft_logits = self.draft(step, pending, blocks)
        verify_ids = torch.cat([pending[:, None], drafts[:, : n - 1]], dim=1)
        target_logits = step.forward(verify_ids, causal_block(n, pending.device))
        emitted, n_emitted, accepted = accept_chain(drafts, target_logits, blocks, step.sampler,
                                                    draft_logp)
        return RoundOutput(emitted, n_emitted, accepted, *draft_stats(draft_logits, drafts))
