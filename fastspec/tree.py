"""Token trees inside a traced step: ancestor masks, best-first construction, the accepted path.

Layout of one row's tree of N nodes (static N, so one compiled step per width):

    node 0 is the seed (the pending token, the root, depth 0); nodes 1..N-1 are drafted tokens;
    parents [S, N] long, parents[:, 0] = -1, parents[:, i] < i for a real node;
    valid [S, N] bool: padding nodes are invalid (never accepted; parent 0 keeps masks sane).

    parents [-1 0 0 1]:     s             mask   s a b c    depth
                           / \\             s    1 0 0 0    0
                          a   b            a    1 1 0 0    1
                          |                b    1 0 1 0    1
                          c                c    1 1 0 1    2

Node i is written at cache column L+i with RoPE position L+depth(i) and attends to itself, its
ancestors and the committed prefix, so every root-to-leaf path reads like a plain causal chain.
Siblings carry distinct tokens (the verifier relies on it: at most one child matches a sample).
Everything here is tensor code with static shapes and no host sync.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch


def tree_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [S, N, N] bool: node i sees node j iff j is i itself or an ancestor, depth [S, N]).

    One step of the parent relation (each node and its parent; the root's -1 and a padding node
    pointing at itself add nothing), closed transitively by repeated squaring: after k squarings
    a node sees ancestors up to 2^k - 1 steps up, so ceil(log2 N) squarings reach the root from
    any depth < N."""
    S, N = parents.shape
    dev = parents.device
    nodes = torch.arange(N, device=dev)
    reach = (nodes[None, :, None] == nodes[None, None, :]) \
        | (parents.clamp(min=0)[:, :, None] == nodes[None, None, :])          # [S, N, N]
    reach = reach.float()
    for _ in range(math.ceil(math.log2(N)) if N > 1 else 0):
        reach = (torch.bmm(reach, reach) > 0).float()
    mask = reach > 0
    return mask, mask.long().sum(-1) - 1


class Tree(NamedTuple):
    tokens: torch.Tensor        # [S, N] node tokens (node 0: the root token, or 0)
    parents: torch.Tensor       # [S, N] long, -1 at the root
    valid: torch.Tensor         # [S, N] bool
    path_prob: torch.Tensor     # [S, N] the node's path probability (root 1, padding 0)
    wanted: torch.Tensor        # [S] nodes (root included) the stopping rule kept; n_nodes + 1
                                # when it would have gone on past the budget


# Frontier columns: a candidate node is (its path probability, its parent's path probability,
# depth, rank among its siblings, parent node). Small integers ride exactly in float32.
_P, _PP, _DEPTH, _RANK, _PARENT = range(5)


def best_first_tree(top_tokens: torch.Tensor, top_probs: torch.Tensor, n_nodes: int,
                    forward_ms_table: Sequence[float], root: torch.Tensor | None = None,
                    fill: bool = False) -> Tree:
    """BASTION's tree from one draft's position-wise marginals, best first by path probability.

    top_tokens, top_probs [S, D, K]: the K best candidates for the token at depth d+1 (from the
    marginal of aligned draft index d), sorted by probability (rank 0 first; distinct tokens).
    A candidate at depth d, rank r under parent u has path probability P(u) · top_probs[d-1, r].

    Start with the root (probability 1) and a frontier holding its best child. Each step pops the
    frontier's best candidate (ties: the lowest frontier slot), adds it as the next node and
    pushes its best child (rank 0 at the next depth) and its next sibling (same parent, rank
    r+1). Since a child and a next sibling are never likelier than the node that pushed them,
    nodes come out in non-increasing path probability: the tree is the n most likely prefixes.

    Stopping rule (budget-aware): with n nodes in the tree, a candidate of path probability p is
    not added once  p · T(n) <= E · (T(n+1) − T(n)),  i.e. once adding it would not raise the
    expected tokens per millisecond (E + p) / T(n+1) above E / T(n). Here E = 1 + Σ path
    probabilities of the nodes added so far: the root counts 1 because a round always emits the
    verifier's own token after the accepted path, so E is the expected number of tokens the round
    emits (the accepted depth is the number of accepted non-root nodes). T = forward_ms_table:
    T[n] is the ms of a round whose tree has n nodes (index 0 unused; n_nodes + 2 entries, as the
    rule also judges the best candidate left after the budget), a constant baked into the step.
    A row that stops stays stopped (later nodes invalid), and rows stop independently. A
    candidate of probability 0 is never added.

    wanted: the rule's tree size, root included; n_nodes + 1 when the rule would still add the
    best candidate left after the budget (a planner's cue for a bigger budget).

    fill: keep adding the best candidates after the rule stops (up to n_nodes, probability > 0)
    — a step of width N computes N nodes anyway — while `wanted` still reports the rule's size.

    The loop is unrolled n_nodes − 1 times (plus the rule's look past the budget) over a
    frontier of n_nodes fixed slots: a pop frees its slot for the node's child, and the sibling
    takes slot t, still empty at step t. Padding nodes: token 0, parent 0, invalid.

    Example (D = 3, K = 2; depth 1: [10 .7, 11 .2], depth 2: [20 .6, 21 .3], depth 3: [30 .9 ..]):
    nodes 10 (.7), 20 (.42, under 10), 30 (.378, under 20), 21 (.21, under 10), 11 (.2, root) ...
    """
    S, D, K = top_tokens.shape
    dev = top_tokens.device
    T = [float(x) for x in forward_ms_table]
    if len(T) < n_nodes + 2:
        raise ValueError(f"forward_ms_table needs {n_nodes + 2} entries (index = node count), got {len(T)}")
    probs = top_probs.float().reshape(S, D * K)
    toks = top_tokens.reshape(S, D * K)
    F = max(n_nodes, 1)
    slot = torch.arange(F, device=dev)
    frontier = torch.zeros(S, F, 5, device=dev)
    frontier[:, :, _P] = -1.0                                   # empty slot
    frontier[:, 0, _P] = probs[:, 0]                            # the root's best child
    frontier[:, 0, _PP] = 1.0
    frontier[:, 0, _DEPTH] = 1.0

    zero = torch.zeros(S, dtype=torch.long, device=dev)
    tokens = [root if root is not None else zero]
    parents = [torch.full_like(zero, -1)]
    valid = [torch.ones(S, dtype=torch.bool, device=dev)]
    path_prob = [torch.ones(S, device=dev)]
    expected = torch.ones(S, device=dev)
    stopped = torch.zeros(S, dtype=torch.bool, device=dev)
    wanted = torch.ones_like(zero)
    for t in range(1, n_nodes + 1):
        j = frontier[:, :, _P].argmax(-1)                                   # [S]
        best = frontier.gather(1, j[:, None, None].expand(S, 1, 5))[:, 0]   # [S, 5]
        p, pp = best[:, _P], best[:, _PP]
        worth = (p > 0) & (p * T[t] > expected * (T[t + 1] - T[t]))
        stopped = stopped | ~worth
        keep = ~stopped
        wanted = wanted + keep.long()
        if t == n_nodes:              # past the budget: only the rule's verdict is wanted
            break
        d, r, u = best[:, _DEPTH].long(), best[:, _RANK].long(), best[:, _PARENT].long()
        expected = expected + torch.where(keep, p, torch.zeros_like(p))
        add = (p > 0) & (keep | fill)
        at = ((d - 1) * K + r).clamp(0, D * K - 1)
        tokens.append(torch.where(add, toks.gather(1, at[:, None])[:, 0], zero))
        parents.append(torch.where(add, u, zero))
        valid.append(add)
        path_prob.append(torch.where(add, p, torch.zeros_like(p)))

        # The popped slot takes the new node's best child (rank 0 at depth d+1), if any.
        child_p = p * probs.gather(1, (d.clamp(max=D - 1) * K)[:, None])[:, 0]
        child_p = torch.where(d < D, child_p, torch.full_like(p, -1.0))
        child = torch.stack([child_p, p, (d + 1).float(), torch.zeros_like(p),
                             torch.full_like(p, float(t))], 1)
        popped = (slot[None, :] == j[:, None]) & add[:, None]
        frontier = torch.where(popped[:, :, None], child[:, None, :], frontier)
        # Slot t (still empty) takes its next sibling (same parent, rank r+1), if any.
        sib_p = pp * probs.gather(1, ((d - 1) * K + r + 1).clamp(0, D * K - 1)[:, None])[:, 0]
        has_sib = add & (r + 1 < K)
        sib = torch.stack([sib_p, pp, d.float(), (r + 1).float(), u.float()], 1)
        frontier = torch.where((slot == t)[None, :, None] & has_sib[:, None, None],
                               sib[:, None, :], frontier)
    return Tree(torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(valid, 1),
                torch.stack(path_prob, 1), wanted)


def path_nodes(mask: torch.Tensor, depth: torch.Tensor, leaf: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[S, max_depth] the node at depth 1..max_depth on the root-to-`leaf` path (0 past the leaf).

    leaf c of parents [-1 0 0 1] (s -> a -> c), max_depth 3:  [1 3 0]
    """
    S, N, _ = mask.shape
    dev = mask.device
    on_path = mask.gather(1, leaf[:, None, None].expand(S, 1, N))[:, 0]        # [S, N]
    want = torch.arange(1, max_depth + 1, device=dev)
    at = on_path[:, None, :] & (depth[:, None, :] == want[None, :, None])       # [S, Dmax, N]
    return (at.long() * torch.arange(N, device=dev)).sum(-1)                   # one node or none
