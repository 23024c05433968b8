"""The verifier: one place where drafted tokens are accepted or rejected.

Chain verification for a row with block size b, seed s and drafts d1..d(b-1) fed to the verify
forward as `[s d1 .. d(b-1)]`; target position i (the verifier's distribution p_i after
`s d1..di`) judges draft d(i+1):

    greedy:   accept the longest prefix with d(i+1) == argmax p_i, then emit argmax p_k (bonus)
    sampling: accept d(i+1) with probability min(1, p_i(d)/q_i(d)); at the first rejection k emit
              a sample of norm(max(p_k - q_k, 0)); if all b-1 are accepted emit a sample of p_(b-1)

Either way a row emits `accepted + 1` tokens and its cache commits the same number (the seed and
the accepted drafts, whose K/V the verify forward wrote). All tensor ops: no host sync.

Tree verification (`accept_tree`, trees laid out as in fastspec/tree.py): draw the verifier's
token y at every node and walk down from the seed while a child carries its parent's y; emit the
path and the last y. The path's K/V then move into place (engine.compact_path).
"""
from __future__ import annotations

import torch

from fastspec.sampling import (STREAM_ACCEPT, STREAM_RESIDUAL, SamplerState, filtered_logprobs,
                               sample_categorical, sample_from_logprobs)
from fastspec.tree import path_nodes, tree_mask


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


def accept_tree(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor,
                target_logits: torch.Tensor, sampler: SamplerState, mask: torch.Tensor | None = None,
                depth: torch.Tensor | None = None, max_depth: int | None = None):
    """Accept the longest root-to-leaf path of a token tree (layout: fastspec/tree.py).

    tokens, parents, valid [S, N]: the tree (node 0 = the seed); target_logits [S, N, V]: the
    verifier's logits at every node (the tree forward, adapter off); mask, depth: tree_mask's
    (computed here when not given); max_depth: the deepest path one can accept (default N-1).

    One rule for greedy and sampling, with deterministic candidates (the tree's tokens are a
    function of the prefix, drawn with no randomness): at every node i draw y_i from the
    verifier's distribution there (greedy: its argmax; sampling: a draw from the filtered target
    law with one uniform of the row's own stream per node). Node i > 0 is OK iff it is valid and
    tokens[i] == y[parent[i]]; a node is accepted iff it and all its ancestors are OK. The path
    ends at the deepest accepted node x (siblings carry distinct tokens, so at most one child of a
    node matches its sample and the accepted nodes form one path); the round emits the path's
    tokens after the seed, then y[x].

    Why this is exactly the target law: read it as a walk from the root. At node u the walk holds
    y_u ~ p(· | prefix, path to u), independent of everything drawn above u. If a child of u
    carries y_u, the walk emits y_u and moves to that child (whose K/V are those of the prefix
    plus y_u); otherwise it emits y_u and stops. Either way the emitted token is y_u, a draw from
    the target's next-token law given what was emitted before, so the emitted sequence is a prefix
    of an exact sample of the target; where it stops depends only on the draws so far, and the
    next round continues from there with fresh uniforms (the stream's counter moves on). Greedy
    is the same walk with point masses. (This equals the multi-candidate rule — try the children
    in order, accept with p/q, resample from the residual — when q puts all mass on a child.)

    Returns (emitted [S, max_depth + 1], n_emitted [S], accepted [S], commit_cols [S, max_depth]):
    emitted[:, :accepted] are the path's tokens, emitted[:, accepted] the verifier's token after
    it; n_emitted = accepted + 1; commit_cols = the path's node indices at depths 1..max_depth
    (0 past its end), the columns whose K/V move to L+1.. (engine.compact_path). A row's result
    depends only on its own logits and stream. All tensor ops: no host sync.
    """
    S, N, _ = target_logits.shape
    dev = tokens.device
    if mask is None or depth is None:
        mask, depth = tree_mask(parents)
    max_depth = N - 1 if max_depth is None else max_depth
    if not sampler.any_sampled:
        y = target_logits.argmax(-1)                                              # [S, N]
    else:
        logp = filtered_logprobs(target_logits, sampler.temperature[:S], sampler.top_k[:S],
                                 sampler.top_p[:S], sampler.any_filtered)
        y = sample_from_logprobs(logp, sampler.uniform(STREAM_ACCEPT, (N,), rows=S))
    nodes = torch.arange(N, device=dev)
    ok = valid & (tokens == y.gather(1, parents.clamp(min=0))) & (nodes[None, :] > 0)
    ok = ok | (nodes[None, :] == 0)                                               # the seed
    accepted_node = ~(mask & ~ok[:, None, :]).any(-1)                            # [S, N]
    leaf = torch.where(accepted_node, depth, torch.full_like(depth, -1)).argmax(-1)   # deepest
    accepted = depth.gather(1, leaf[:, None])[:, 0]
    path = path_nodes(mask, depth, leaf, max_depth)                              # [S, max_depth]
    bonus = y.gather(1, leaf[:, None])
    emitted = torch.cat([tokens.gather(1, path), torch.zeros_like(bonus)], 1)
    emitted = emitted.scatter(1, accepted[:, None], bonus)
    return emitted, accepted + 1, accepted, path
