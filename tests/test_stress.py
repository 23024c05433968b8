"""Load that is held: many requests, mixed lengths, every method; nothing lost, duplicated or
changed, and the cache never overflows at its exact size."""
import random

import pytest
import torch

from conftest import EOS, random_token_prompts, tiny_drafter, tiny_loaded
from fastspec.draft import AdapterConfig, attach_adapter
from fastspec.engine import CTX_ALIGN, Engine
from fastspec.methods.recguide import RecGuide
from fastspec.sampling import SamplingParams

METHODS = ["ar", "linear", "recguide"]


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(seed=8)


def method(name):
    return RecGuide(block=4, branches=2) if name == "recguide" else name


def workload(n, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 48))] for _ in range(n)]
    greedy = [SamplingParams(max_new_tokens=rng.randrange(1, 17)) for _ in range(n)]
    return prompts, greedy


@pytest.mark.parametrize("name", METHODS)
def test_512_requests_at_c16_none_lost_or_duplicated_and_greedy_equals_solo_ar(drafter, name):
    engine = Engine(drafter, backend="eager")
    prompts, greedy = workload(512, seed=1)
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=p.max_new_tokens, seed=i)
               for i, p in enumerate(greedy)]
    # Half greedy, half sampled, interleaved: one run serves both kinds side by side.
    params = [g if i % 2 == 0 else s for i, (g, s) in enumerate(zip(greedy, sampled))]
    streamed = {i: [] for i in range(len(prompts))}
    out = engine.generate(prompts, params, method=method(name), concurrency=16,
                          on_commit=lambda i, ids, _: streamed[i].extend(ids))
    assert sorted(c.index for c in out) == list(range(512))
    solo = Engine(drafter, backend="eager")
    for c, p, sp in zip(out, prompts, params):
        assert streamed[c.index] == c.token_ids                  # streamed exactly once, in order
        assert 1 <= len(c.token_ids) <= sp.max_new_tokens
        # tau counts committed tokens only: EOS and the budget cut the last round short.
        assert sum(c.accept_lengths) == len(c.token_ids) - 1
        if sp.greedy and c.index % 16 == 0:
            assert c.token_ids == solo.generate([p], sp)[0].token_ids


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("need", [CTX_ALIGN, 1024])       # a multiple of 256; the whole context
def test_a_cache_sized_exactly_to_the_need_never_overflows(drafter, name, need):
    """Prompt + budget == the cache's need (and == the model's context): speculative writes of
    every round, from every slot, stay inside the cache."""
    engine = Engine(drafter, backend="eager")
    rng = random.Random(need)
    prompts = [[rng.randrange(3, 512) for _ in range(need - 12 - i)] for i in range(3)]
    params = [SamplingParams(max_new_tokens=12 + i, ignore_eos=True) for i in range(3)]
    ar = engine.generate(prompts, params, concurrency=2)
    out = engine.generate(prompts, params, method=method(name), concurrency=2)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert all(len(c.token_ids) == p.max_new_tokens for c, p in zip(out, params))


def test_concurrency_means_requests_in_flight(drafter):
    """C=3 decodes 3 requests at a time (the 4-row bucket's spare row stays inactive)."""
    engine = Engine(drafter, backend="eager")
    in_flight = []
    prompts, _ = workload(9, seed=3)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def watch(index, tokens, n_drafted):
        in_flight.append(int((engine.cache.lengths[:-1] > 0).sum()))

    engine.generate(prompts, params, method="linear", block=4, concurrency=3, on_commit=watch)
    assert max(in_flight) == 3
    assert engine.cache.num_slots == 4                     # 3 slots + the trash for padded rows
