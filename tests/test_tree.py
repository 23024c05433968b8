"""Token trees: the ancestor mask and depths, BASTION's best-first construction with its
budget-aware stop, and lossless tree verification (greedy path and the exact sampling law)."""
import pytest
import torch

from fastspec.layout import tree_block
from fastspec.sampling import SamplerState
from fastspec.tree import best_first_tree, path_nodes, tree_mask
from fastspec.verify import accept_tree

#          s               node  0  1  2  3  4  5  6 (padding, invalid)
#        /   \             parent -1 0  0  1  3  2  0
#       1     2
#       |     |
#       3     5
#       |
#       4
PARENTS = [-1, 0, 0, 1, 3, 2, 0]


def test_tree_mask_and_depth_match_hand_written_matrix():
    mask, depth = tree_mask(torch.tensor([PARENTS]))
    want = torch.tensor([
        # s  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],    # s: itself (and the committed prefix, added by cache_mask)
        [1, 1, 0, 0, 0, 0, 0],    # 1: s
        [1, 0, 1, 0, 0, 0, 0],    # 2: s, never its sibling 1
        [1, 1, 0, 1, 0, 0, 0],    # 3: s 1
        [1, 1, 0, 1, 1, 0, 0],    # 4: s 1 3  (three steps up: needs the transitive closure)
        [1, 0, 1, 0, 0, 1, 0],    # 5: s 2
        [1, 0, 0, 0, 0, 0, 1],    # 6: padding under the root
    ])
    assert torch.equal(mask[0].int(), want)
    assert depth[0].tolist() == [0, 1, 1, 2, 3, 2, 1]
    # The same as the host-side layout helper, and per row for a batch of different trees.
    ref_mask, ref_depth = tree_block(tuple(PARENTS))
    assert torch.equal(mask[0], ref_mask) and torch.equal(depth[0], ref_depth)
    chain = torch.tensor([[-1, 0, 1, 2, 3, 4, 5], PARENTS])
    m2, d2 = tree_mask(chain)
    assert torch.equal(m2[0], torch.ones(7, 7, dtype=torch.bool).tril())
    assert d2[0].tolist() == list(range(7)) and torch.equal(m2[1], mask[0])


def test_path_nodes_walks_from_the_root_to_the_leaf():
    mask, depth = tree_mask(torch.tensor([PARENTS, PARENTS]))
    assert path_nodes(mask, depth, torch.tensor([4, 5]), 4).tolist() == [[1, 3, 4, 0], [2, 5, 0, 0]]


# Hand-made marginals, D = 3 depths, K = 2 candidates each (sorted, distinct tokens).
TOP_TOKENS = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
TOP_PROBS = torch.tensor([[[0.7, 0.2], [0.6, 0.3], [0.9, 0.05]]])
# Round cost by node count: flat up to 5 nodes, then +0.5 ms per node.
COST = [10.0] * 6 + [10.0 + 0.5 * (n - 5) for n in range(6, 12)]


def test_best_first_tree_on_hand_made_marginals():
    """Best first by path probability; the rule stops before the 8th node:
    t=5: p .2   · T(5) = 2.000 >  E 2.708 · 0.5 = 1.354  -> add 11
    t=6: p .189 · T(6) = 1.985 >  E 2.908 · 0.5 = 1.454  -> add 30 (under 21)
    t=7: p .12  · T(7) = 1.320 <= E 3.097 · 0.5 = 1.549  -> stop."""
    tree = best_first_tree(TOP_TOKENS, TOP_PROBS, 10, COST, root=torch.tensor([7]))
    #                      s   10   20   30    21   11   30    (padding)
    assert tree.tokens[0].tolist() == [7, 10, 20, 30, 21, 11, 30, 0, 0, 0]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 1, 0, 4, 0, 0, 0]
    assert tree.valid[0].tolist() == [True] * 7 + [False] * 3
    want_p = [1, 0.7, 0.42, 0.378, 0.21, 0.2, 0.189, 0, 0, 0]
    assert torch.allclose(tree.path_prob[0], torch.tensor(want_p))
    assert tree.wanted.tolist() == [7]


def test_best_first_tree_fills_the_budget_past_the_stop_and_rows_stop_independently():
    # Row 0 as above; row 1 has a flat cost (never stops) and only one depth worth a node.
    tokens = torch.cat([TOP_TOKENS, TOP_TOKENS + 100])
    probs = torch.cat([TOP_PROBS, torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])])
    tree = best_first_tree(tokens, probs, 10, COST, fill=True)
    # Row 0: the next most likely nodes after the stop: 20 under 11 (.12), 30 under it (.108),
    # 21 under 11 (.06).
    assert tree.tokens[0].tolist() == [0, 10, 20, 30, 21, 11, 30, 20, 30, 21]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 1, 0, 4, 5, 7, 5]
    assert tree.valid[0].all() and tree.wanted[0] == 7
    # Row 1: one node of probability 1, then nothing with probability > 0 is ever added.
    assert tree.tokens[1, :2].tolist() == [0, 110]
    assert tree.valid[1].tolist() == [True, True] + [False] * 8
    assert tree.wanted[1] == 2
    # Without fill, the rule's stop ends row 0 at 7 nodes as before; row 1 is unchanged.
    plain = best_first_tree(tokens, probs, 10, COST)
    assert plain.valid[0].tolist() == [True] * 7 + [False] * 3
    assert torch.equal(plain.valid[1], tree.valid[1])


def test_the_rule_looks_one_node_past_the_budget():
    # Flat cost: the rule never stops; with 4 nodes it still wants the 5th -> wanted = 5.
    tree = best_first_tree(TOP_TOKENS, TOP_PROBS, 4, [10.0] * 6)
    assert tree.valid.all() and tree.wanted.tolist() == [5]
    with pytest.raises(ValueError):            # the table must reach n_nodes + 1
        best_first_tree(TOP_TOKENS, TOP_PROBS, 4, [10.0] * 5)


def test_a_costlier_node_stops_the_tree_earlier():
    # A 2 ms step from 3 to 4 nodes: p .378 · 10 = 3.78 <= E 2.12 · 2 = 4.24 -> stop at 3 nodes.
    cost = [10.0] * 4 + [12.0] * 8
    tree = best_first_tree(TOP_TOKENS, TOP_PROBS, 8, cost)
    assert tree.valid[0].tolist() == [True] * 3 + [False] * 5 and tree.wanted.tolist() == [3]


V = 6


def one_hot_logits(tokens):
    """[1, N, V] target logits whose argmax at node i is tokens[i]."""
    x = torch.full((1, len(tokens), V), -5.0)
    for i, t in enumerate(tokens):
        x[0, i, t] = 5.0
    return x


def test_accept_tree_greedy_takes_the_longest_matching_path():
    #   node      0  1  2  3  4  5  6
    #   token     s  0  1  4  2  3  4 (invalid)
    # verifier's argmax at each node: y = [1, 5, 3, 0, 0, 4, 0]
    # root's y = 1 -> node 2 (node 1 carries 0); node 2's y = 3 -> node 5; node 5's y = 4, and
    # its only child 6 carries 4 but is padding: never accepted. Path s -> 2 -> 5, bonus 4.
    parents = torch.tensor([PARENTS])
    tokens = torch.tensor([[9, 0, 1, 4, 2, 3, 4]])
    valid = torch.tensor([[True] * 6 + [False]])
    parents[0, 6] = 5
    logits = one_hot_logits([1, 5, 3, 0, 0, 4, 0])
    emitted, n_emitted, accepted, cols = accept_tree(tokens, parents, valid, logits, SamplerState(1),
                                                     max_depth=3)
    assert n_emitted.tolist() == [3] and accepted.tolist() == [2]
    assert emitted[0, :3].tolist() == [1, 3, 4]
    assert cols.tolist() == [[2, 5, 0]]         # K/V of node 2 -> L+1, node 5 -> L+2
    # The same tree with node 6 valid: the path goes one deeper and the bonus is node 6's y.
    emitted, n_emitted, accepted, cols = accept_tree(tokens, parents, torch.ones_like(valid), logits,
                                                     SamplerState(1), max_depth=3)
    assert emitted[0, :4].tolist() == [1, 3, 4, 0] and cols.tolist() == [[2, 5, 6]]
    # Nothing matches: the verifier's own token only.
    emitted, n_emitted, accepted, cols = accept_tree(tokens, parents, valid, one_hot_logits([5] * 7),
                                                     SamplerState(1))
    assert n_emitted.tolist() == [1] and emitted[0, 0] == 5 and emitted.shape == (1, 7)


# Sampling law: a bigram target over V tokens (the law after a node depends on its token only;
# the root's on the prefix), and a tree whose children cover the likely tokens.
P0 = torch.tensor([0.35, 0.3, 0.15, 0.1, 0.05, 0.05])
BIGRAM = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 1.5, -1)
#           s    a0   a1   b2   b0   c3   d1   (d1 is a padding node: invalid)
T_TOKENS = [9,   0,   1,   2,   0,   3,   1]
T_PARENTS = [-1, 0,   0,   1,   1,   2,   3]
T_VALID = [True] * 6 + [False]


class SharedUniform(SamplerState):
    """A broken stream: one uniform per row reused at every node (draws become correlated)."""

    def uniform(self, stream, shape=(), rows=None, slots=None):
        u = super().uniform(stream, shape, rows, slots)
        return u[:, :1].expand_as(u) if u.dim() > 1 else u


def sample_tree_rounds(n: int, seed: int, sampler_cls=SamplerState):
    """(x1, x2) of n independent requests: one round of accept_tree, the second token completed
    from the exact law when the round emitted only one."""
    rows = torch.arange(n)
    tokens = torch.tensor(T_TOKENS).expand(n, -1)
    parents = torch.tensor(T_PARENTS).expand(n, -1)
    valid = torch.tensor(T_VALID).expand(n, -1)
    law = torch.stack([P0] + [BIGRAM[t] for t in T_TOKENS[1:]])       # [N, V] at each node
    sampler = sampler_cls(n, seed=seed, mode="sample")
    sampler.temperature.fill_(1.0)
    emitted, n_emitted, _, _ = accept_tree(tokens, parents, valid, law.log().expand(n, -1, -1), sampler)
    x1 = emitted[:, 0]
    nxt = torch.multinomial(BIGRAM[x1], 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    x2 = torch.where(n_emitted >= 2, emitted[rows, 1], nxt)
    return x1, x2, n_emitted


def tv_from_exact(x1, x2):
    exact = P0[:, None] * BIGRAM                                       # [V, V]
    emp = torch.bincount(x1 * V + x2, minlength=V * V).float().view(V, V) / len(x1)
    return 0.5 * (emp - exact).abs().sum().item()


def test_tree_sampling_follows_the_target_law():
    distances = []
    for n, seed in ((500, 1), (200_000, 2)):
        x1, x2, n_emitted = sample_tree_rounds(n, seed)
        distances.append(tv_from_exact(x1, x2))
    # The tree was really walked: most rounds emitted two tokens or more, some three.
    assert (n_emitted >= 2).float().mean() > 0.4 and (n_emitted >= 3).any()
    assert distances[1] < 0.01, distances
    assert distances[1] < distances[0]


def test_tree_sampling_check_sees_a_wrong_law():
    """Power: the same check rejects a verifier that reuses one uniform at every node."""
    x1, x2, _ = sample_tree_rounds(60_000, 2, SharedUniform)
    assert tv_from_exact(x1, x2) > 0.05


def test_tree_sampling_of_a_row_does_not_depend_on_other_rows():
    n = 16
    tokens = torch.tensor(T_TOKENS).expand(n, -1)
    parents = torch.tensor(T_PARENTS).expand(n, -1)
    valid = torch.tensor(T_VALID).expand(n, -1)
    logits = torch.randn(n, len(T_TOKENS), V, generator=torch.Generator().manual_seed(0))
    sampler = SamplerState(n, seed=4, mode="sample")
    sampler.temperature.fill_(1.0)
    sampler.counter.fill_(7)
    full = accept_tree(tokens, parents, valid, logits, sampler)
    for r in (0, 5, 15):
        one = SamplerState.view(tuple(t[r:r + 1] for t in sampler.tensors()), "sample")
        alone = accept_tree(tokens[r:r + 1], parents[r:r + 1], valid[r:r + 1], logits[r:r + 1], one)
        assert all(torch.equal(a[0], b[r]) for a, b in zip(alone, full))
