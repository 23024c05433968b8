"""The verifier: one place where drafted tokens are accepted or rejected.

Chain verification for a row with block size b, seed s and drafts d1..d(b-1) fed to the verify
forward as `[s d1 .. d(b-1)]`; target position i (the verifier's distribution p_i after
`s d1..di`) judges draft d(i+1):

    greedy:   accept the longest prefix with d(i+1) == argmax p_i, then emit argmax p_k (bonus)
    sampling: accept d(i+1) with probability min(1, p_i(d)/q_i(d)); at the first rejection k emit
              a sample of norm(max(p_k - q_k, 0)); if all b-1 are accepted emit a sample of p_(b-1)

Either way a row emits `accepted + 1` tokens and its cache commits the same number (the seed and
the accepted drafts, whose K/V the verify forward wrote). All tensor ops: no host sync.
"""
from __future__ import annotations

import torch

from fastspec.sampling import (STREAM_ACCEPT, STREAM_RESIDUAL, SamplerState, filtered_logprobs,
                               sample_categorical)


def accept_chain(drafts: torch.Tensor, target_logits: torch.Tensor, block: torch.Tensor,
                 sampler: SamplerState, draft_logp: torch.Tensor | None = None):
    """Accept drafted chains.

    drafts [S, n]: drafts[:, i] is the draft for the token after verify input i (d(i+1)).
    target_logits [S, n, V]: verifier logits at inputs `[s d1 .. d(n-1)]`.
    block [S]: each row's block size b <= n (only drafts d1..d(b-1) are judged).
    draft_logp [S, n, V]: the drafter's filtered log-probs q (needed only when sampling).
    Returns (emitted [S, n], n_emitted [S], accepted [S]); emitted[:, :n_emitted] are new tokens.
    """
    S, n, _ = target_logits.shape
    idx = torch.arange(n, device=drafts.device)
    judged = idx[None, :] < (block[:, None] - 1)                  # [S, n]: d(i+1) was a verify input
    if not sampler.any_sampled:
        target = target_logits.argmax(-1)                          # [S, n]
        ok = (drafts == target) & judged
        accepted = ok.long().cumprod(-1).sum(-1)                   # leading run of matches
        # Accepted drafts equal the targets, so the emitted run is target[:, :accepted+1].
        return target, accepted + 1, accepted

    temp, top_k, top_p = sampler.temperature[:S], sampler.top_k[:S], sampler.top_p[:S]
    logp = filtered_logprobs(target_logits, temp, top_k, top_p, sampler.any_filtered)   # [S, n, V]
    p = logp.exp()
    q = draft_logp.exp()
    p_d = p.gather(-1, drafts[..., None])[..., 0]
    q_d = q.gather(-1, drafts[..., None])[..., 0].clamp_min(1e-20)
    u = sampler.uniform(STREAM_ACCEPT, (n,), rows=S)
    ok = (u < (p_d / q_d).clamp(max=1.0)) & judged
    accepted = ok.long().cumprod(-1).sum(-1)                       # [S]
    # At the stop position k: residual max(p - q, 0) after a rejection, plain p after a full run.
    rows = torch.arange(S, device=drafts.device)
    p_k, q_k = p[rows, accepted], q[rows, accepted]
    full_run = (accepted >= block - 1)[:, None]
    residual = torch.where(full_run, p_k, (p_k - q_k).clamp_min(0))
    # An all-zero residual (p == q) cannot be sampled from; p itself is the right law then.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_k)
    last = sample_categorical(residual, sampler.uniform(STREAM_RESIDUAL, rows=S))   # [S]
    emitted = drafts.scatter(1, accepted[:, None], last[:, None])
    return emitted, accepted + 1, accepted
