"""Batched AR decoding: ragged batches and continuous batching equal one-at-a-time decoding."""
import random

import pytest
import torch

from conftest import EOS, tiny_loaded
from fastspec.config import FastspecError
from fastspec.engine import Engine
from fastspec.layout import causal_block
from fastspec.methods.ar import AR
from fastspec.sampling import SamplingParams


def random_prompts(n, seed=0, max_len=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


@pytest.mark.parametrize("concurrency", [2, 3, 8])
def test_ragged_batched_greedy_equals_per_request(tiny, concurrency):
    engine = Engine(tiny, backend="eager")
    prompts = random_prompts(7, seed=concurrency)
    params = SamplingParams(max_new_tokens=12)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    together = engine.generate(prompts, params, concurrency=concurrency)
    assert [c.token_ids for c in together] == alone


def test_continuous_batching_stress_every_request_completes_once(tiny):
    engine = Engine(tiny, backend="eager")
    rng = random.Random(1)
    prompts = random_prompts(64, seed=1)
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 24)) for _ in prompts]
    streamed = {i: [] for i in range(len(prompts))}
    out = engine.generate(prompts, params, concurrency=8,
                          on_commit=lambda i, ids, _: streamed[i].extend(ids))
    assert [c.index for c in out] == list(range(64))
    for c, p, sp in zip(out, prompts, params):
        assert c.prompt_ids == p
        assert streamed[c.index] == c.token_ids           # streamed exactly once, in order
        assert 1 <= len(c.token_ids) <= sp.max_new_tokens
        assert c.finish_reason == ("eos" if c.token_ids[-1] == EOS else "length")
    # Each request alone gives the same tokens (no slot leaked state to the next occupant).
    for i in range(0, 64, 9):
        assert engine.generate([prompts[i]], params[i])[0].token_ids == out[i].token_ids


def test_eos_stops_a_request_and_frees_its_slot():
    loaded = tiny_loaded()
    engine = Engine(loaded, backend="eager")
    prompt = random_prompts(1, seed=5)[0]
    free_run = engine.generate([prompt], SamplingParams(max_new_tokens=10))[0].token_ids
    # Declare the 4th generated token to be EOS: generation must stop right there.
    engine.eos_ids = {free_run[3]}
    stopped = engine.generate([prompt] * 3, SamplingParams(max_new_tokens=10), concurrency=2)
    for c in stopped:
        assert c.token_ids == free_run[: free_run.index(free_run[3]) + 1]
        assert c.finish_reason == "eos"


class GarbageThenAR(AR):
    """AR, but every round first writes K/V for 6 random tokens it never commits."""
    name = "garbage-then-ar"

    def max_width(self):
        return 6                                        # the cache keeps room for the garbage

    def round(self, step, pending, blocks, carry, variant=""):
        garbage = (pending[:, None] * 7 + torch.arange(6)) % 500 + 3
        step.forward(garbage, causal_block(6))          # lands after every slot's prefix
        return super().round(step, pending, blocks, carry, variant)


def test_uncommitted_speculative_kv_leaves_later_outputs_unchanged(tiny):
    """Write K/V for tokens that are never committed; decoding afterwards must not notice."""
    engine = Engine(tiny, backend="eager")
    prompt = random_prompts(1, seed=3)[0]
    params = SamplingParams(max_new_tokens=16)
    reference = engine.generate([prompt], params)[0].token_ids
    out = engine.generate([prompt], params, method=GarbageThenAR())[0]
    assert out.token_ids == reference
    assert out.rounds >= 15


def test_sampling_is_reproducible_for_a_seed_and_varies_across_seeds(tiny):
    engine = Engine(tiny, backend="eager")
    prompt = random_prompts(1, seed=4)[0]
    runs = [engine.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16,
                                                     seed=s))[0].token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_prompt_longer_than_context_is_a_clear_error(tiny):
    engine = Engine(tiny, backend="eager")
    with pytest.raises(FastspecError, match="context"):
        engine.generate([[5] * 1000], SamplingParams(max_new_tokens=100))
    with pytest.raises(FastspecError, match="empty prompt"):
        engine.generate([[]], SamplingParams())


# --- compiled prefill ------------------------------------------------------------------------------
def test_prompt_buckets_pad_at_most_an_eighth_from_64_tokens():
    """Under CUDA graphs a prompt is padded to its length bucket: 8-token steps up to 128, then a
    sixteenth of the next power of two, capped by the cache."""
    from fastspec.engine import prompt_bucket
    assert [prompt_bucket(n, 4096) for n in (1, 5, 8, 9, 16, 17, 33, 60, 69, 129, 300, 1000)] == \
        [8, 8, 8, 16, 16, 24, 40, 64, 72, 144, 320, 1024]
    assert prompt_bucket(300, 310) == 310
    for n in range(64, 3000):
        assert n <= prompt_bucket(n, 10 ** 6) < n * 9 / 8


def test_compiled_prefill_runs_every_prompt_length_through_one_compile_and_equals_eager():
    """A prompt runs through the compiled step at its own length (a symbolic size: one compile
    serves 5, 17, 20 and 9 tokens): its last-token logits and its K/V equal the eager prefill's,
    and a whole run gives the eager tokens with the step compiled in warm-up, none while timing."""
    from conftest import tiny_drafter
    from fastspec.model import llama
    t = tiny_drafter()
    eng = Engine(t, backend="compile", compiler="aot_eager")
    eng.prepare(1, 64)
    # Prompts under 16 tokens pad to 16: a symbolic length never meets the attention kernel's
    # cap of 8 queries (traced here as its reference op), which would split it in two.
    assert [eng.prefill_bucket(n) for n in (1, 5, 17, 33)] == [16, 16, 17, 33]
    llama.set_cpu_attention(llama.attend_cache)
    try:
        check_one_prefill_compile(t, eng)
    finally:
        llama.set_cpu_attention(None)


def check_one_prefill_compile(t, eng):
    c = eng.cache
    for ids in ([7, 9, 11, 13, 15], list(range(3, 20))):
        n = len(ids)
        logits = eng._prefill_compiled(ids, 0)
        k, v = c.k[:, 0, :, :n].clone(), c.v[:, 0, :, :n].clone()
        ref_k, ref_v = torch.zeros_like(c.k), torch.zeros_like(c.v)
        pos = torch.arange(n)[None]
        from fastspec.layout import cache_mask
        mask = cache_mask(torch.zeros(1, dtype=torch.long), causal_block(n), n)
        ref = t.model(torch.tensor([ids]), pos, ref_k, ref_v, pos, mask, torch.tensor([0]))[:, -1]
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, ref_k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ref_v[:, 0, :, :n], rtol=1e-5, atol=1e-5)
    (key,) = [k for k in eng.runner.keys() if k.layout == "prefill"]
    assert key.block == 0 and eng.runner.stats()[key]["compiles"] == 1    # 5 and 17: one compile

    prompts = [[5, 6, 7], list(range(3, 23)), [42] * 9]
    params = SamplingParams(max_new_tokens=7)
    want = [x.token_ids for x in Engine(t, backend="eager").generate(prompts, params, concurrency=2)]
    for method in ("ar", "linear"):
        got = eng.generate(prompts, params, method=method, block=8 if method == "linear" else None,
                           concurrency=2)
        assert [x.token_ids for x in got] == want
        assert eng.last_stats.lazy_compiles == 0 and eng.last_stats.recompiles == 0
    # 3, 20 and 9 tokens: one more compile, for the larger cache of concurrency 2, none after.
    assert [k for k in eng.runner.keys() if k.layout == "prefill"] == [key]
    assert eng.runner.stats()[key]["compiles"] == 2


def test_round_attends_over_the_live_prefix_and_compiles_once_for_every_context():
    """A round attends over the rows' longest committed length plus its widest write, rounded
    up to CTX_STEP columns, not the whole cache (whose slot gather copies every column per
    layer): as requests grow past several steps of 64 columns the compiled round never
    recompiles, and its tokens equal the eager whole-cache run's."""
    from conftest import tiny_drafter
    from fastspec.engine import CTX_STEP
    t = tiny_drafter()
    prompts = [[5, 6, 7], list(range(3, 23)), [42] * 9]
    params = SamplingParams(max_new_tokens=150, ignore_eos=True)
    want = [x.token_ids for x in Engine(t, backend="eager").generate(prompts, params, concurrency=2)]
    eng = Engine(t, backend="compile")          # fastspec's backend: skinny GEMMs + inductor
    seen = []
    run_group = eng.run_group

    def spy(meth, plan, slots, blocks, concurrency, longest=None):
        if longest is not None:
            seen.append(eng.attention_ctx(meth, longest))
        return run_group(meth, plan, slots, blocks, concurrency, longest)

    eng.run_group = spy
    for method in ("ar", "linear"):
        seen.clear()
        got = eng.generate(prompts, params, method=method, block=8 if method == "linear" else None,
                           concurrency=2)
        assert [x.token_ids for x in got] == want
        assert eng.last_stats.lazy_compiles == 0 and eng.last_stats.recompiles == 0
        assert all(c % CTX_STEP == 0 for c in seen)
        assert min(seen) < eng.cache.max_len and len(set(seen)) >= 3      # it grew with the rows
    m = eng.method("ar")
    assert eng.attention_ctx(m, 1) == CTX_STEP
    assert eng.attention_ctx(m, 10_000) == eng.cache.max_len - 1          # capped below the cache
    # Requests that run to the end of their cache reach the cap: still no recompile.
    for method in ("ar", "linear"):
        meth = eng.method(method, 8 if method == "linear" else None)
        budget = 256 - 20 - meth.max_width() - 2            # need_len + width + 1 = 256 columns
        seen.clear()
        params = SamplingParams(max_new_tokens=budget, ignore_eos=True)
        eng.generate(prompts, params, method=meth, concurrency=2)
        assert eng.cache.max_len == 256 and max(seen) == 255
        assert eng.last_stats.lazy_compiles == 0 and eng.last_stats.recompiles == 0


def test_a_run_in_parts_builds_each_step_once_on_the_cache_reserved_for_it():
    """`bench --interleave` runs a method over groups of prompts in turn. A later group with a
    longer prompt (or fewer requests) than the first would need a bigger (or smaller) cache,
    and new K/V shapes rebuild every compiled step mid-run; reserving the run's largest need
    first keeps one cache, so every step builds once and no part recompiles."""
    from conftest import tiny_drafter
    t = tiny_drafter()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    parts = [[[5, 6, 7], [9, 8]], [list(range(3, 253)), [42] * 9], [[11, 12, 13]]]
    eager = Engine(t, backend="eager")
    want = [[x.token_ids for x in eager.generate(p, params, method="linear", block=4, concurrency=2)]
            for p in parts]

    unreserved = Engine(t, backend="compile", compiler="aot_eager")
    unreserved.generate(parts[0], params, method="linear", block=4, concurrency=2)
    first = unreserved.cache
    unreserved.generate(parts[1], params, method="linear", block=4, concurrency=2)
    assert unreserved.cache is not first                 # the longer prompt needed a new cache,
    assert max(v["compiles"] for v in unreserved.runner.stats().values()) == 2   # and built again

    eng = Engine(t, backend="compile", compiler="aot_eager")
    meth = eng.method("linear", 4)
    eng.reserve(2, 250 + 12, [meth, eng.method("ar")])
    cache = eng.cache
    for j, part in enumerate(parts):
        got = eng.generate(part, params, method=meth, concurrency=2, keep_counts=j > 0)
        assert [x.token_ids for x in got] == want[j]
        assert eng.last_stats.recompiles == 0
    assert eng.cache is cache
    assert max(v["compiles"] for v in eng.runner.stats().values()) == 1


def test_a_step_compiled_mid_run_counts_as_warm_up_not_as_request_time(tiny, monkeypatch):
    """A step built on first use (a new bucket as requests drain) is warm-up: it leaves the
    run's decode time AND every request's latency, so per-request tok/s stays a decode rate."""
    import time
    engine = Engine(tiny, backend="eager")
    compiled = [0.0]
    monkeypatch.setattr(engine.runner, "total_compile_s", lambda: compiled[0])
    run_group, calls = engine.run_group, [0]

    def slow_first_use(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:                   # "compiles" for 0.4 s, as a lazy build would
            time.sleep(0.4)
            compiled[0] += 0.4
        return run_group(*args, **kwargs)

    monkeypatch.setattr(engine, "run_group", slow_first_use)
    out = engine.generate(random_prompts(3, seed=4), SamplingParams(max_new_tokens=8, ignore_eos=True),
                          concurrency=3)
    assert all(0 < c.latency_s < 0.3 for c in out), [c.latency_s for c in out]
    assert engine.last_stats.decode_s < 0.3 and engine.last_stats.warmup_s >= 0.4


def test_a_prefill_compiled_mid_run_leaves_prefill_time_and_decode_time_alone(tiny, monkeypatch):
    """A prompt length the warm-up did not build compiles while prefilling: warm-up again, taken
    from the prefill time it was spent in, and never from decode (which stays positive)."""
    import time
    engine = Engine(tiny, backend="eager")
    compiled = [0.0]
    monkeypatch.setattr(engine.runner, "total_compile_s", lambda: compiled[0])
    prefill = engine._prefill

    def slow_first_prefill(*args, **kwargs):
        if compiled[0] == 0:
            time.sleep(0.4)
            compiled[0] += 0.4
        return prefill(*args, **kwargs)

    monkeypatch.setattr(engine, "_prefill", slow_first_prefill)
    engine.generate(random_prompts(3, seed=4), SamplingParams(max_new_tokens=8, ignore_eos=True),
                    concurrency=3)
    st = engine.last_stats
    assert 0 <= st.prefill_s < 0.3 and 0 < st.decode_s < st.wall_s < 0.3 and st.warmup_s >= 0.4


# --- joining groups of plans into steps ------------------------------------------------------
def weights_bound(rows: int, plan) -> float:
    """A CPU-like step: the weights' read dominates, each token adds a little."""
    return 30.0 + 0.2 * rows * plan.block


def tokens_bound(rows: int, plan) -> float:
    """A step whose time is its tokens (large batch x width)."""
    return 1.0 * rows * plan.block


def test_groups_join_a_wider_step_only_when_one_step_costs_less_than_two():
    from fastspec.engine import join_groups
    from fastspec.methods.base import Plan
    groups = {Plan(4): ["a"], Plan(8): ["b", "c", "d"], Plan(2): ["e"], Plan(8, "hit"): ["f"],
              Plan(4, "hit"): ["g"]}
    # Weights-bound: every variant runs as one step at its widest plan, its rows in plan order.
    assert join_groups(groups, weights_bound) == {Plan(8): ["b", "c", "d", "a", "e"],
                                                  Plan(8, "hit"): ["f", "g"]}
    # Token-bound: T(4, 8) = 32 > T(3, 8) + T(1, 4) = 28: nothing joins.
    assert join_groups(groups, tokens_bound) == groups
    # Mixed: the row of 4 joins the 4 rows of 8 (T(5, 8) = 38 < 36.4 + 30.8); the row of 2 then
    # stays apart (T(6, 8) = 80 > T(5, 8) + T(1, 2) = 68.4).
    costs = {(5, 8): 38.0, (4, 8): 36.4, (1, 4): 30.8, (6, 8): 80.0, (1, 2): 30.4}
    table = lambda rows, plan: costs[(rows, plan.block)]  # noqa: E731
    assert join_groups({Plan(8): list("abcd"), Plan(4): ["e"], Plan(2): ["f"]}, table) == \
        {Plan(8): list("abcde"), Plan(2): ["f"]}


@pytest.mark.parametrize("cost, one_step", [(weights_bound, True), (tokens_bound, False)])
def test_libraspec_widths_join_one_step_on_weights_bound_costs_and_stay_lossless(cost, one_step):
    """LibraSpec's requests choose different widths: on a CPU-like profile they still run as
    one step per round (two forwards a round), on a token-bound one each width apart."""
    from fastspec.methods.libraspec import LibraSpec
    from helpers import copy_model
    t = copy_model()
    engine = Engine(t, backend="eager")
    engine._forward_cost = lambda rows, tokens: cost(rows, type("P", (), {"block": tokens}))
    rng = random.Random(1)
    ps = [[rng.randrange(3, 32) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar = engine.generate(ps, params, method="ar", concurrency=4)
    # The stop rule's widths alone: on token-bound costs the AR round (block 1) would take over.
    m = LibraSpec(block=4, blocks=(4, 8, 16, 32))
    out = engine.generate(ps, params, method=m, concurrency=4)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert len(m.report()["width_share"]) >= 2            # the requests did choose apart
    st = engine.last_stats
    assert (st.steps == st.rounds) == one_step


@pytest.mark.parametrize("widen", [True, False])
def test_rows_of_a_joined_step_use_its_whole_width_when_the_method_says_so(widen, monkeypatch):
    """LibraSpec widens: in a joined step every row verifies the step's width (free there); a
    method that does not keeps each row's own block (ragged blocks in one step)."""
    import fastspec.engine as engine_module
    from fastspec.methods.libraspec import LibraSpec
    from helpers import copy_model
    joins = []
    join_groups = engine_module.join_groups
    monkeypatch.setattr(engine_module, "join_groups", lambda groups, cost: (
        joins.append(len(groups) - len(out := join_groups(groups, cost))), out)[1])
    t = copy_model()
    engine = Engine(t, backend="eager")
    # Tokens cost enough that rows choose different widths in one round, not enough to keep the
    # widths apart: T(4, 8) = 94 < T(2, 8) + T(2, 4) = 108.
    engine._forward_cost = lambda rows, tokens: 30.0 + 2.0 * rows * tokens
    calls = []
    run_group = engine.run_group
    engine.run_group = lambda meth, plan, slots, blocks, *a: (calls.append((plan.block, list(blocks))),
                                                             run_group(meth, plan, slots, blocks, *a))[1]
    rng = random.Random(1)
    ps = [[rng.randrange(3, 32) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar = Engine(t, backend="eager").generate(ps, params, method="ar", concurrency=4)
    m = LibraSpec(block=4, blocks=(4, 8, 16, 32))     # widths alone (AR rounds follow the clock)
    m.widen_joined = widen
    out = engine.generate(ps, params, method=m, concurrency=4)
    assert [c.token_ids for c in out] == [c.token_ids for c in ar]
    assert sum(joins) > 0                                  # rows of different widths did join
    ragged = [blocks for width, blocks in calls if any(b != width for b in blocks)]
    assert (not ragged) == widen


def test_method_instances_that_differ_only_on_the_host_get_their_own_steps():
    """recguide variants that differ only in host-side options (here the hit prior; in an A/B,
    the survival tables) share a key_name but trace separate step functions: each gets its own
    GraphKeys, so alternating them (bench --interleave) never recompiles the other's steps."""
    from conftest import tiny_drafter
    eng = Engine(tiny_drafter(), backend="compile", compiler="aot_eager")
    a, b = "recguide[prior_hits=0.3]", "recguide[prior_hits=0.6]"
    ma, mb = eng.method(a), eng.method(b)
    assert ma.key_name() == mb.key_name() and ma.step_name() != mb.step_name()
    assert eng.method(a) is ma and ma.step_name() == ma.key_name()
    ps, params = random_prompts(2, seed=1), SamplingParams(max_new_tokens=10)
    for m in (a, b, a, b):
        eng.generate(ps, params, method=m, concurrency=1)
        assert eng.last_stats.recompiles == 0, m
    names = {k.method for k in eng.runner.keys() if k.layout not in ("prefill", "chain")}
    assert names == {ma.step_name(), mb.step_name()}


@pytest.mark.parametrize("timed, rounds", [(True, 3), (False, 2)])
def test_the_warm_up_builds_every_plan_before_it_times_any(tiny, monkeypatch, timed, rounds):
    """Warm-up builds each plan's step once, then the plans take turns: a planner that reads
    measured step times (RecGuide) never starts from a step timed right after its own build."""
    from fastspec.methods.base import Plan

    class TwoPlans:
        bucketing = False

        def __init__(self):
            self.timed = timed

        def plans(self):
            return [Plan(4), Plan(8)]
    engine = Engine(tiny, backend="eager")
    engine.reserve(1, 32, [AR()])
    calls = []
    monkeypatch.setattr(engine, "run_group", lambda meth, plan, *a: calls.append(plan.block))
    engine.warm_up(TwoPlans(), 1)
    assert calls == [4, 8] * rounds


@pytest.mark.parametrize("bucketing, concurrency, groups", [
    (True, 4, [1, 2, 4]), (True, 5, [1, 2, 4, 5]), (True, 1, [1]), (False, 4, [4])])
def test_the_warm_up_builds_every_batch_bucket_a_bucketing_method_can_run(tiny, monkeypatch, bucketing,
                                                                          concurrency, groups):
    """A bucketing method runs each plan's requests as their own group, of any size up to C, in
    its batch bucket: every bucket is built before timing (C=4: 1, 2 and 4 rows; C=5: up to 8),
    so no step compiles mid-run. Without bucketing every round runs the whole batch's bucket."""
    from fastspec.methods.base import Plan

    class Bucketing:
        timed = False

        def plans(self):
            return [Plan(4), Plan(8)]
    meth = Bucketing()
    meth.bucketing = bucketing
    engine = Engine(tiny, backend="eager")
    engine.reserve(concurrency, 32, [AR()])
    calls = []
    monkeypatch.setattr(engine, "run_group", lambda m, plan, rows, *a: calls.append((len(rows), plan.block)))
    engine.warm_up(meth, concurrency)
    assert calls == [(n, b) for n in groups for b in (4, 8)] * 2
