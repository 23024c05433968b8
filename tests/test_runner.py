"""StepRunner: padded bucketed steps equal the eager unpadded forward on every backend; keys compile once."""
import pytest
import torch

from conftest import tiny_loaded
from fastspec.config import FastspecError
from fastspec.draft import AdapterConfig, attach_adapter
from fastspec.graphs.keys import GraphKey, batch_bucket
from fastspec.graphs.runner import StepRunner, pad_rows, pad_step, trash_slots
from fastspec.kv_cache import KVCache
from fastspec.layout import cache_mask, causal_block, tree_block, tree_layout_name
from fastspec.convention import FASTSPEC, draft_block_mask

CUDA = torch.cuda.is_available()
N = 4
MAX_LEN = 40
LENGTHS = (5, 9, 3, 12, 1)
TREE = (-1, 0, 0, 1)            # a branch layout: seed, two candidates, one continuation

# (runner backend, torch.compile backend): the inductor compile has its own single test below.
BACKENDS = [
    pytest.param("eager", None, "cpu", id="eager"),
    pytest.param("compile", "aot_eager", "cpu", id="compile-aot_eager"),
    pytest.param("cuda-graph", None, "cuda", id="cuda-graph",
                 marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
]


@pytest.fixture(scope="module")
def drafter():
    """The tiny model with a draft adapter whose LoRA is non-zero (so adapter flags matter)."""
    t = tiny_loaded(seed=3)
    attach_adapter(t.model, AdapterConfig(rank=4, alpha=8.0), seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for blk in t.model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.3 * torch.randn(lora.B.shape, generator=g))
        t.model.mask_embed.add_(0.1 * torch.randn(t.model.mask_embed.shape, generator=g))
    t.model.requires_grad_(False)
    return t


def case(t, n: int, layout: str, device: str, seed: int = 0):
    """Unpadded inputs of one forward of n requests (slots 0..n-1) and a cache with a random prefix."""
    cfg, model = t.cfg, t.model
    g = torch.Generator().manual_seed(seed)
    bucket = batch_bucket(n)
    cache = KVCache(cfg, bucket, MAX_LEN)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    lengths = torch.tensor(LENGTHS[:n])
    ids = torch.randint(0, cfg.vocab_size, (n, N), generator=g)
    cols = lengths[:, None] + torch.arange(N)
    pos = cols
    if layout == "chain":                      # LinearSS verify: causal, adapter off
        block_mask, adapter_on = causal_block(N), None
    elif layout.startswith("tree"):            # tree verify: ancestors only, depth positions
        block_mask, depth = tree_block(TREE)
        pos, adapter_on = lengths[:, None] + depth, None
    else:                                      # LinearSS draft: seed + masks, per-row blocks
        blocks = torch.tensor([N, N - 1, 2, N, 3][:n])
        block_mask = draft_block_mask(FASTSPEC, blocks, N)
        ids[:, 1:] = model.mask_token_id
        adapter_on = (torch.arange(N) > 0)[None, :].expand(n, N).contiguous()
    mask = cache_mask(lengths, block_mask, MAX_LEN)
    slots = torch.arange(n)
    to = (lambda x: None if x is None else x.to(device))
    return (bucket, to(ids), to(pos), to(cols), to(mask), to(slots), to(adapter_on),
            cache.k.to(device), cache.v.to(device))


def reference(model, ids, pos, cols, mask, slots, adapter_on, k, v):
    k, v = k.clone(), v.clone()
    with torch.no_grad():
        logits = model(ids, pos, k, v, cols, mask, slots, adapter_on)
    return logits, k, v


@pytest.mark.parametrize("backend, compiler, device", BACKENDS)
@pytest.mark.parametrize("layout", ["chain", "draft", tree_layout_name(TREE)])
@pytest.mark.parametrize("n", [3, 5])
def test_padded_bucket_matches_eager_unpadded(drafter, backend, compiler, device, layout, n):
    model = drafter.model.to(device)
    bucket, ids, pos, cols, mask, slots, adapter_on, k, v = case(drafter, n, layout, device)
    ref_logits, ref_k, ref_v = reference(model, ids, pos, cols, mask, slots, adapter_on, k, v)

    P = pad_step(bucket, ids, pos, cols, mask, slots, adapter_on, num_slots=k.shape[1])
    assert P[0].shape == (bucket, N) and P[3].shape == (bucket, N, MAX_LEN)

    def step(ids, pos, k, v, cols, mask, slots, adapter_on):
        return (model(ids, pos, k, v, cols, mask, slots, adapter_on),)

    runner = StepRunner(backend, compiler=compiler, model=model)
    key = GraphKey(bucket, N, layout)
    kc, vc = k.clone(), v.clone()          # one cache, as in the engine (CUDA graphs capture its address)
    for call in range(2):
        kc.copy_(k), vc.copy_(v)
        logits, = runner.run(key, step, P[0], P[1], kc, vc, P[2], P[3], P[4], P[5], static=(2, 3))
        assert logits.shape == (bucket, N, drafter.cfg.vocab_size)
        assert torch.isfinite(logits).all(), "padded rows must never produce NaN"
        torch.testing.assert_close(logits[:n], ref_logits, rtol=1e-4, atol=1e-4)
        # The real rows' K/V land where eager puts them; untouched slots stay as they were.
        torch.testing.assert_close(kc[:, :n], ref_k[:, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vc[:, :n], ref_v[:, :n], rtol=1e-5, atol=1e-5)
        if call == 0:
            first = dict(runner.stats()[key])
    second = runner.stats()[key]
    assert second["calls"] == 2
    assert second["compiles"] == first["compiles"], "the second call of a key must not recompile"
    if backend != "eager":
        assert first["compiles"] >= 1
    drafter.model.to("cpu")


def test_inductor_compile_pads_and_does_not_recompile(drafter):
    """The one test on fastspec's real compile backend (skinny GEMM + inductor): 3 rows in the 4 bucket."""
    model = drafter.model
    bucket, ids, pos, cols, mask, slots, adapter_on, k, v = case(drafter, 3, "chain", "cpu", seed=1)
    ref_logits, ref_k, _ = reference(model, ids, pos, cols, mask, slots, adapter_on, k, v)
    P = pad_step(bucket, ids, pos, cols, mask, slots, num_slots=k.shape[1])
    runner = StepRunner("auto", model=model)          # auto = compile on the CPU
    assert runner.resolved == ("cuda-graph" if CUDA else "compile")
    key = GraphKey(bucket, N, "chain")

    def step(*inputs):
        return model(*inputs)                          # a bare tensor comes back as a 1-tuple

    for _ in range(2):
        kc, vc = k.clone(), v.clone()
        out = runner.run(key, step, P[0], P[1], kc, vc, P[2], P[3], P[4], static=(2, 3))
        assert isinstance(out, tuple) and len(out) == 1
        assert torch.isfinite(out[0]).all()
        torch.testing.assert_close(out[0][:3], ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kc[:, :3], ref_k[:, :3], rtol=1e-5, atol=1e-5)
    s = runner.stats()[key]
    assert s["calls"] == 2 and s["compiles"] >= 1 and s["compile_s"] > 0
    assert s["compiles"] == 1                          # one graph (no breaks), compiled once


def test_new_fn_for_a_key_rebuilds_it():
    runner = StepRunner("compile", compiler="aot_eager")
    key = GraphKey(1, 2, "ar")
    x = torch.arange(4.0).view(1, 4)
    assert torch.equal(runner.run(key, lambda t: (t * 2,), x)[0], x * 2)
    assert torch.equal(runner.run(key, lambda t: (t + 1,), x)[0], x + 1)
    assert runner.stats()[key]["compiles"] == 2 and runner.keys() == [key]


def test_pad_rows_and_trash_slots():
    t = torch.arange(6).view(3, 2)
    assert pad_rows(t, 3) is t
    assert pad_rows(t, 4).tolist() == [[0, 1], [2, 3], [4, 5], [0, 0]]
    assert pad_rows(t, 5, fill=7)[3:].tolist() == [[7, 7], [7, 7]]
    assert pad_rows(t, 4, fill=torch.tensor([8, 9]))[3].tolist() == [8, 9]
    with pytest.raises(ValueError):
        pad_rows(t, 2)
    assert trash_slots(torch.tensor([0, 2, 5]), 3, 8).tolist() == [1, 3, 4]


def test_pad_step_rules():
    """Padded rows: zero ids, their own unused slot, length 0, own token visible, adapter off."""
    n, B, ctx = 3, 4, 16
    lengths = torch.tensor([2, 5, 1])
    ids = torch.ones(n, N, dtype=torch.long)
    cols = lengths[:, None] + torch.arange(N)
    mask = cache_mask(lengths, causal_block(N), ctx)
    slots = torch.tensor([3, 0, 1])
    on = torch.ones(n, N, dtype=torch.bool)
    p_ids, p_pos, p_cols, p_mask, p_slots, p_on = pad_step(B, ids, cols, cols, mask, slots, on,
                                                           num_slots=B)
    assert p_ids[n:].eq(0).all() and p_slots.tolist() == [3, 0, 1, 2]
    assert p_cols[n:].tolist() == [list(range(N))] and not p_on[n:].any()
    own = p_mask[n:, torch.arange(N), p_cols[n]]
    assert own.all() and p_mask[n:].any(-1).all()
    assert torch.equal(p_mask[:n], mask) and torch.equal(p_ids[:n], ids)
    with pytest.raises(ValueError):
        pad_step(8, ids, cols, cols, mask, slots, num_slots=4)


def test_backend_choice():
    with pytest.raises(FastspecError):
        StepRunner("tensorrt")
    assert StepRunner("eager").resolved == "eager"
    if not CUDA:
        assert StepRunner("auto").resolved == "compile"
        with pytest.raises(FastspecError, match="CUDA"):
            StepRunner("cuda-graph")


def test_in_place_ops_inside_a_step_survive_the_compile_pass():
    """fastspec's backend must keep an in-place op whose result is unused (a DCE pass dropped it)."""
    runner = StepRunner("compile")                     # fastspec's own pass + inductor

    def step(x, idx, val):
        out = x.clone()
        out.scatter_(1, idx, val)                      # result unused: `out` is read instead
        return out * 2

    x = torch.zeros(3, 4)
    idx = torch.tensor([[1], [0], [3]])
    val = torch.tensor([[5.0], [6.0], [7.0]])
    got, = runner.run(GraphKey(3, 4, "scatter"), step, x, idx, val)
    assert got.tolist() == [[0, 10, 0, 0], [12, 0, 0, 0], [0, 0, 0, 14]]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("compiler", ["aot_eager", "none"])
def test_moved_cache_recaptures_without_recompiling(drafter, compiler):
    """A KV cache at a new address captures the key again (graphs read fixed addresses) but keeps
    its compiled step; the graph pool, freed with its last graph, is made anew (no allocator
    assert); every replay still equals eager."""
    model = drafter.model.to("cuda")
    bucket, ids, pos, cols, mask, slots, adapter_on, k, v = case(drafter, 3, "chain", "cuda")
    ref_logits, ref_k, _ = reference(model, ids, pos, cols, mask, slots, adapter_on, k, v)
    P = pad_step(bucket, ids, pos, cols, mask, slots, adapter_on, num_slots=k.shape[1])

    def step(ids, pos, k, v, cols, mask, slots, adapter_on):
        return (model(ids, pos, k, v, cols, mask, slots, adapter_on),)

    runner = StepRunner("cuda-graph", compiler=compiler, model=model)
    key = GraphKey(bucket, N, "chain")
    for _ in range(3):                                   # three caches, three addresses
        kc, vc = k.clone(), v.clone()
        logits, = runner.run(key, step, P[0], P[1], kc, vc, P[2], P[3], P[4], P[5], static=(2, 3))
        torch.testing.assert_close(logits[:3], ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kc[:, :3], ref_k[:, :3], rtol=1e-5, atol=1e-5)
    st = runner.stats()[key]
    assert st.get("captures") == 3 and st["compiles"] == (0 if compiler == "none" else 1)
    drafter.model.to("cpu")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_no_garbage_collection_runs_during_a_cuda_graph_capture(drafter):
    """Graphs of a runner that died in a reference cycle are freed by the GC; were that to happen
    mid-capture, their reset would invalidate the capture (an H200 profile after a check's
    engines were deleted). The runner collects first and holds the GC off while it captures:
    inside the capture the GC is off and an earlier dead cycle is already gone."""
    import gc
    import weakref
    model = drafter.model.to("cuda")
    bucket, ids, pos, cols, mask, slots, adapter_on, k, v = case(drafter, 3, "chain", "cuda")
    ref_logits, _, _ = reference(model, ids, pos, cols, mask, slots, adapter_on, k, v)
    P = pad_step(bucket, ids, pos, cols, mask, slots, adapter_on, num_slots=k.shape[1])
    seen = []

    def step(ids, pos, k, v, cols, mask, slots, adapter_on):
        if torch.cuda.is_current_stream_capturing():
            seen.append((gc.isenabled(), dead_ref() is None))
        return (model(ids, pos, k, v, cols, mask, slots, adapter_on),)

    class Cycle:
        pass
    dead = Cycle()
    dead.self = dead
    dead_ref = weakref.ref(dead)
    del dead                                      # unreachable; freed only by a GC pass
    runner = StepRunner("cuda-graph", compiler="none", model=model)
    logits, = runner.run(GraphKey(bucket, N, "chain"), step, P[0], P[1], k.clone(), v.clone(),
                         P[2], P[3], P[4], P[5], static=(2, 3))
    torch.testing.assert_close(logits[:3], ref_logits, rtol=1e-4, atol=1e-4)
    assert seen == [(False, True)] and gc.isenabled()
    drafter.model.to("cpu")


def test_a_compiled_step_comes_back_from_the_disk_caches(tmp_path, monkeypatch):
    """fastspec's backend hands inductor graphs that AOTAutograd can key (the skinny GEMM's node
    carries the linear's metadata): compiled again after dynamo forgot it, in a cache under
    $FASTSPEC_CACHE, the step comes from the disk caches without tracing it again (what makes
    a second run's warm-up short)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from fastspec.engine import Engine
    from fastspec.sampling import SamplingParams
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    t = tiny_loaded()
    aot = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        Engine(t, backend="compile").generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))
        aot.append(dict(counters["aot_autograd"]))
    assert (tmp_path / "inductor").is_dir() and any((tmp_path / "inductor").iterdir())
    assert not any("bypass" in k for run in aot for k in run), aot
    assert aot[0].get("autograd_cache_saved", 0) >= 1 and aot[1].get("autograd_cache_hit", 0) >= 1, aot


def test_the_counter_hash_compiles_to_small_loop_bodies(monkeypatch, tmp_path):
    """fastspec's inductor patches realize long pointwise chains: the counter-based uniform (15
    hash stages, each reading its input twice) lowers to loop bodies of a few hundred nodes, not
    the ~2^15 that inlining every use makes (a sampled round's cold compile took >10 minutes)."""
    import torch._inductor.loop_body as lb
    from fastspec.graphs.compile import INDUCTOR_PATCHES
    from fastspec.sampling import uniform
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    sizes, init = [], lb.LoopBody.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sizes.append(sum(len(b.graph.nodes) for b in [self.root_block, *self.subblocks.values()]))
        assert sizes[-1] < 1000, f"a loop body of {sizes[-1]} nodes"     # fail fast, not in minutes

    monkeypatch.setattr(lb.LoopBody, "__init__", recording)
    seed, counter = torch.arange(4) * 77 + 5, torch.arange(4)
    with torch._inductor.config.patch({"fx_graph_cache": False, **INDUCTOR_PATCHES}):
        got = torch.compile(lambda s, c: uniform(s, c, 2, (4,)), backend="inductor")(seed, counter)
    assert torch.equal(got, uniform(seed, counter, 2, (4,)))
    assert sizes and max(sizes) < 1000, sizes          # 309 with the patches, 22783 without


def test_the_graphs_a_warm_up_built_are_never_evicted(monkeypatch):
    """CUDA graphs are kept LRU up to max_graphs, but not the pinned keys a warm-up builds: a run
    takes those round after round, so evicting one would capture it again mid-run. (The capture
    is faked so that the bookkeeping runs on a CPU.)"""
    class FakeGraph:
        def replay(self):
            pass

        def reset(self):
            pass

    def capture(self, key, entry, inputs, static, sig):
        entry.graph, entry.signature = FakeGraph(), sig
        entry.static_in, entry.static_out = list(inputs), _as_tuple(entry.fn(*inputs))
    from fastspec.graphs.runner import _as_tuple
    monkeypatch.setattr(StepRunner, "_capture", capture)
    monkeypatch.setattr(StepRunner, "_kind_for", lambda self, inputs: "cuda-graph")
    runner = StepRunner("eager", max_graphs=2)
    step = lambda x: x + 1
    x = torch.zeros(2)
    keys = [GraphKey(1, n, "chain") for n in range(1, 7)]
    with runner.pinning():
        for key in keys[:3]:                    # the warm-up: three steps, more than max_graphs
            runner.run(key, step, x)
    assert runner.keys() == keys[:3]
    for key in keys[3:]:                        # built mid-run: LRU among themselves
        runner.run(key, step, x)
    assert runner.keys() == keys[:3] + keys[4:]
    runner.run(keys[0], step, x)                # still there: replayed, not captured again
    assert runner.stats()[keys[0]].get("captures") == 1
    with runner.pinning():                      # the next run's warm-up: its pins replace these
        runner.run(keys[5], step, x)
    new = GraphKey(1, 7, "chain")
    runner.run(new, step, x)                    # a capture: the unpinned keep their 2 newest
    assert runner.keys() == [keys[0], keys[5], new]


def test_the_warm_up_pins_every_step_a_run_takes(drafter):
    from fastspec.engine import Engine
    from fastspec.methods import get_method
    from fastspec.sampling import SamplingParams
    engine = Engine(drafter, backend="eager")
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=12),
                    method=get_method("linear", block=4), concurrency=2)
    assert engine.runner.keys() and set(engine.runner.keys()) == engine.runner._pinned
