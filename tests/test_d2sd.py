"""D²SD: a first draft picks the likely rejection points, a second draft re-anchors there, and
the chain plus branches are verified as one prefix tree — lossless like every method."""
import pytest
import torch

from conftest import random_token_prompts, tiny_drafter
from fastspec.convention import FASTSPEC, NLD
from fastspec.engine import Engine
from fastspec.methods.d2sd import D2SD, assemble_tree
from fastspec.methods.drafter import exact_first_draft
from fastspec.tree import tree_mask
from fastspec.sampling import SamplingParams


def test_boundaries_are_the_most_likely_first_rejections():
    # c = P(draft accepted) per aligned index (d1..d4); block 5 judges d1..d4. fastspec's d1 is
    # exact, so it is never a boundary: P(first rejection at p) = Π_{i<p} c_i (1 − c_p)
    #   p=2: 1.0·0.9·... -> c1=0.9 is ignored (exact) -> 1·(1−0.5) = 0.5
    #   p=3: 0.5·(1−0.8) = 0.10,  p=4: 0.5·0.8·(1−0.6) = 0.16
    prob = torch.tensor([[0.9, 0.5, 0.8, 0.6, 0.1]])
    m = D2SD(block=8, branches=2)
    got = m.boundaries(exact_first_draft(FASTSPEC), prob, torch.tensor([5]))
    assert got.tolist() == [[2, 4]]
    # NLD's d1 is a real guess: P(first rejection at 1) = 0.1 joins the race.
    got = m.boundaries(exact_first_draft(NLD), prob, torch.tensor([5]))
    assert got.tolist() == [[2, 4]]          # 0.9·0.5 = 0.45, 0.9·0.5·0.8·0.4 = 0.144 > 0.1
    got = D2SD(block=8, branches=3).boundaries(exact_first_draft(NLD), prob, torch.tensor([5]))
    assert got.tolist() == [[2, 4, 1]]


def test_bad_options_are_refused():
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError):
        D2SD(block=8, branches=0)
    with pytest.raises(FastspecError):
        D2SD(block=6)


@pytest.mark.parametrize("block, branches, concurrency", [(8, 2, 1), (4, 1, 3), (8, 3, 8)])
def test_greedy_d2sd_equals_ar_token_for_token(block, branches, concurrency):
    engine = Engine(tiny_drafter(), backend="eager")
    prompts = random_token_prompts(6, seed=block + branches)
    params = SamplingParams(max_new_tokens=33)
    ar = engine.generate(prompts, params, concurrency=concurrency)
    d2 = engine.generate(prompts, params, method=D2SD(block, branches), concurrency=concurrency)
    assert [c.token_ids for c in d2] == [c.token_ids for c in ar]
    # Three forwards a round, counted as run.
    assert all(c.forwards == 1 + 3 * c.rounds for c in d2)


def test_prefix_tree_matches_the_worked_example():
    # b = 5, K = 2, boundaries p = 2 and 4 (the module docstring's example). Tokens: s=10,
    # d1..d4 = 11..14, alternatives a_p = 20 + p, segment k's aligned drafts 30 + 10k + j.
    chain = torch.tensor([[10, 11, 12, 13, 14]])
    alt = torch.tensor([[21, 22, 23, 24, 25]])
    seg = torch.tensor([[[30, 31, 32, 33, 34], [40, 41, 42, 43, 44]]])
    tokens, parents, valid = assemble_tree(chain, alt, seg, torch.tensor([[2, 4]]), torch.tensor([5]))
    #                    s  d1 d2 d3 d4 | a2 e3 e4 -  | a4 -  -  -
    assert tokens.tolist()[0][:8] + tokens.tolist()[0][9:10] == [10, 11, 12, 13, 14, 22, 32, 33, 24]
    assert parents.tolist() == [[-1, 0, 1, 2, 3, 1, 5, 6, 0, 3, 0, 0, 0]]
    assert valid.int().tolist() == [[1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0]]
    mask, depth = tree_mask(parents)
    assert depth[0, :8].tolist() == [0, 1, 2, 3, 4, 2, 3, 4] and depth[0, 9].item() == 4


def test_d2sd_compiled_step_equals_ar():
    engine = Engine(tiny_drafter(), backend="compile", compiler="aot_eager")
    prompts = random_token_prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=20)
    ar = engine.generate(prompts, params, concurrency=3)
    d2 = engine.generate(prompts, params, method=D2SD(4, 1), concurrency=3)
    assert [c.token_ids for c in d2] == [c.token_ids for c in ar]
    assert engine.last_stats.recompiles == 0
