"""D²SD: dual diffusion drafts on a prefix tree, verified in one forward.

A round runs three forwards:
  1. draft: the usual draft block (LinearSS's), drafts d1..d(b-1) with their probabilities c_p;
  2. re-anchor: for the K most likely first-rejection points p (by Π_{i<p} c_i · (1 − c_p)) a
     second, batched draft fills a block that keeps `s d1 .. d(p-1)` and replaces d_p by its best
     alternative a_p: the drafter (trained with partially masked blocks) continues after a_p;
  3. verify: main chain and the K branches as one prefix tree (the shared prefix is computed
     once), accepted by the tree verifier; the accepted path's K/V is compacted into place.

Worked example, b = 5, K = 2, boundaries p = 2 and p = 4 (fastspec's d1 is exact: never a
boundary). Re-anchor forward (two draft blocks side by side, each seeing only itself):

    segment p=2:  s  d1 a2 M  M        -> drafts after a2:  e3 e4
    segment p=4:  s  d1 d2 d3 a4       -> nothing after a4 (a4 is the last judged position)

Tree verified in forward 3 (node: token, parent), N = b + K·(b−1) = 13 columns, padding invalid:

    0:s  1:d1(0) 2:d2(1) 3:d3(2) 4:d4(3) | 5:a2(1) 6:e3(5) 7:e4(6) 8:- | 9:a4(3) 10:- 11:- 12:-

Either drafter (`d2sd[drafter=dflash]`, fastspec/methods/drafter.py): with the model's DFlash
drafter both drafts are its forwards over the request's context ring (a re-anchored block holds
the real tokens `s d1 .. a_p` before its masks), the tree verify captures its target layers, and
the seed and the accepted path enter the ring.

Alternatives differ from the draft they replace, so siblings carry distinct tokens, and the tree
verifier's walk (sample or argmax at each node, descend into the child that matches) is exact.
"""
from __future__ import annotations

import torch

from fastspec.config import FastspecError
from fastspec.methods.base import Plan, RoundOutput
from fastspec.methods.drafter import (DrafterChoice, commit_path, draft_positions,
                                     draft_stats_and_alternatives,
                                     make_drafter)
from fastspec.methods.linear import BLOCK_SIZES, LinearSS
from fastspec.tree import tree_mask
from fastspec.verify import accept_tree


class D2SD(DrafterChoice, LinearSS):
    name = "d2sd"
    layout = "d2sd"
    forwards = 3

    def __init__(self, block: int = 8, branches: int = 2, drafter: str = "self", window: int = 1024):
        """drafter: "self" (the backbone's adapter) or "dflash" (the model's DFlash drafter, with
        a context ring of `window` committed tokens per request: both drafts are its forwards,
        the re-anchored blocks hold real tokens before their masks)."""
        if block not in BLOCK_SIZES:
            raise FastspecError(f"--block must be one of {BLOCK_SIZES}, got {block}")
        if not 1 <= branches <= block - 2:
            raise FastspecError(f"d2sd: branches must be in 1..{block - 2}, got {branches}")
        self.source = make_drafter(drafter, window, block)
        super().__init__(block)
        self.branches = branches
        self.eos_ids: tuple[int, ...] = ()

    def key_name(self) -> str:
        return f"d2sd(k={self.branches},drafter={self.source.key_name()})"

    def begin(self, run) -> None:
        self.bind_drafter(run)
        self.eos_ids = tuple(sorted(run.eos_ids))

    def report(self) -> dict:
        return {"drafter": self.source.name}

    def nodes(self) -> int:
        return self.block + self.branches * (self.block - 1)

    def max_width(self) -> int:
        return max(self.nodes(), self.branches * self.block)

    def plans(self) -> list[Plan]:
        return [Plan(self.block)]

    # --- inside the step --------------------------------------------------------------------
    def boundaries(self, exact_d1: bool, prob: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[S, K] draft positions p (1-based: d_p) where the first rejection is most likely,
        P(first rejection at p) = Π_{i<p} c_i · (1 − c_p) over the judged drafts (exact_d1: d1 is
        the verifier's own token, never a boundary)."""
        S, n = prob.shape
        p = torch.arange(1, n + 1, device=prob.device)[None, :]            # aligned i -> d_(i+1)
        judged = (p >= (2 if exact_d1 else 1)) & (p <= blocks[:, None] - 1)
        c = torch.where(judged, prob, torch.ones_like(prob))
        before = torch.cumprod(torch.cat([torch.ones_like(c[:, :1]), c[:, :-1]], 1), 1)
        first_reject = torch.where(judged, before * (1 - c), torch.full_like(c, -1.0))
        return first_reject.topk(self.branches, dim=-1).indices + 1        # [S, K]

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        n, dev = step.width, pending.device
        K, M = self.branches, self.source.mask_token_id(step)
        i = torch.arange(n, device=dev)
        positions = draft_positions(self.source, step, n, dev)               # [S, n] or None

        # 1. the first draft: d1..d(n-1) at aligned indices 0..n-2.
        logits = self.source.logits(step, pending, blocks, n, carry, positions)
        drafts = logits.argmax(-1)          # tree candidates are deterministic (see verify.accept_tree)
        prob, conf, margin, alt, _ = draft_stats_and_alternatives(logits, drafts, self.eos_ids)
        alt = alt[..., 0]
        bounds = self.boundaries(self.source.exact_first(step), prob, blocks)    # [S, K]

        # 2. re-anchor: segment k keeps s d1..d(p-1), puts a_p at block position p, masks after.
        chain = torch.cat([pending[:, None], drafts[:, : n - 1]], 1)          # s d1 .. d(n-1)
        segs = []
        for k in range(K):
            p = bounds[:, k: k + 1]                                           # [S, 1]
            a_p = alt.gather(1, p - 1)                                        # [S, 1]
            seg = torch.where(i[None, :] < p, chain, torch.full_like(chain, M))
            segs.append(torch.where(i[None, :] == p, a_p, seg))
        seg_logits = self.source.segment_logits(step, torch.cat(segs, 1), blocks, n, carry, positions)
        # e_(j+1) for aligned index j >= p: the drafter's continuation after a_p.
        seg_drafts = seg_logits.argmax(-1)                                    # [S, K, n]

        # 3. the tree, verified in one forward; the accepted path is compacted into place.
        tokens, parents, valid = assemble_tree(chain, alt, seg_drafts, bounds, blocks)
        tmask, depth = tree_mask(parents)
        target_logits, hidden = self.source.verify(step, tokens, tmask, rel_positions=depth)
        emitted, n_emitted, accepted, path = accept_tree(tokens, parents, valid, target_logits,
                                                         step.sampler, tmask, depth, n - 1)
        new = commit_path(self.source, carry, hidden, path, n_emitted, positions)
        return RoundOutput(emitted, n_emitted, accepted, prob, conf, margin, carry=new,
                           commit_cols=path, host=bounds)


def assemble_tree(chain: torch.Tensor, alt: torch.Tensor, seg_drafts: torch.Tensor,
                  bounds: torch.Tensor, blocks: torch.Tensor):
    """(tokens, parents, valid) [S, n + K(n-1)] of the prefix tree: the main chain `s d1 ..
    d(n-1)` at nodes 0..n-1, then branch k at nodes n + k(n-1) ..: a_p (child of node p-1, the
    node that d_p hangs from), then e_(p+1), e_(p+2), ... each the child of the one before;
    a branch node is valid while its draft position is judged (<= b - 1).

    chain [S, n]; alt [S, n] (aligned: alt[:, p-1] replaces d_p); seg_drafts [S, K, n] (aligned
    drafts of re-anchored segment k: index j proposes e_(j+1)); bounds [S, K] (p, 1-based)."""
    S, n = chain.shape
    K = bounds.shape[1]
    dev = chain.device
    i = torch.arange(n, device=dev)
    j = torch.arange(n - 1, device=dev)[None, :]
    tokens, parents, valid = [chain], [(i - 1)[None, :].expand(S, n)], [i[None, :] < blocks[:, None]]
    for k in range(K):
        p = bounds[:, k: k + 1]
        start = n + k * (n - 1)
        src = (p + j - 1).clamp(max=n - 1)          # node j > 0 holds e_(p+j): aligned index p+j-1
        tokens.append(torch.where(j == 0, alt.gather(1, p - 1), seg_drafts[:, k].gather(1, src)))
        parents.append(torch.where(j == 0, p - 1, start + j - 1))
        valid.append(p + j <= blocks[:, None] - 1)
    tokens, parents, valid = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(valid, 1)
    # Padding nodes hang from the root (their own column only matters to themselves).
    parents = torch.where(valid, parents, torch.zeros_like(parents))
    parents[:, 0] = -1
    return tokens, parents, valid
