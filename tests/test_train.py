"""Draft-adapter training: layout, loss, checkpoints, data cache (tiny random model, token ids)."""
import json

import pytest
import torch
from conftest import tiny_loaded

from fastspec.draft import adapter_parameters, load_adapter
from fastspec.layout import cache_mask, causal_block
from fastspec.train.data import Example, build_targets, read_target_cache, training_prompts
from fastspec.config import FastspecError
from fastspec.convention import FASTSPEC, NLD, draft_adapter_flags, draft_block_mask
from fastspec.train.trainer import (DraftTrainer, TrainConfig, draft_logits, draft_loss, make_batch,
                                    training_mask)

B = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and a busy machine makes it much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cfg(**kw):
    base = dict(block_sizes=(B,), block_weights=(1.0,), blocks_per_seq=3, seqs_per_step=2, rank=4, alpha=8.0, lr=1e-2,
                warmup_steps=1, minutes=10.0, partial_prob=0.3, log_every=1)
    return TrainConfig(**{**base, **kw})


def random_examples(n=4, seed=0, prompt=6, target=24):
    g = torch.Generator().manual_seed(seed)
    return [Example(torch.randint(3, 500, (prompt + i,), generator=g).tolist(),
                    torch.randint(3, 500, (target,), generator=g).tolist()) for i in range(n)]


def perturb_adapter(model, seed=1):
    """Non-zero LoRA B and a random MASK embedding, so the adapter visibly changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """Greedy continuations of the tiny model itself (the self-distilled targets)."""
    loaded = tiny_loaded()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (5 + i,), generator=g).tolist() for i in range(6)]
    path = tmp_path_factory.mktemp("targets") / "t.jsonl"
    return build_targets(loaded, prompts, 20, path, concurrency=4, progress=False), path, prompts


def batch_of(starts, sizes, block=3, conv=FASTSPEC, length=12):
    ex = Example([5], list(range(10, 10 + length)))
    R = 1
    K = len(starts)
    return make_batch([ex], torch.tensor([starts]), torch.zeros(R, K, block, dtype=torch.bool), block,
                      mask_id=512, sizes=torch.tensor([sizes]), conv=conv)


def test_training_mask_matches_hand_written():
    # Two blocks of 3 after the clean columns; starts 1 and 3 (only columns < 4 can be seen).
    b = batch_of([1, 3], [3, 3])
    assert b.clean_len == 6
    got = training_mask(b)[0]
    want = torch.tensor([
        # clean 0..5          | block 0  | block 1
        [1, 0, 0, 0, 0, 0,    1, 0, 0,   0, 0, 0],   # seed of block 0 (s=1): prefix < 1 and itself
        [1, 0, 0, 0, 0, 0,    1, 1, 1,   0, 0, 0],   # masks: prefix + the whole block
        [1, 0, 0, 0, 0, 0,    1, 1, 1,   0, 0, 0],
        [1, 1, 1, 0, 0, 0,    0, 0, 0,   1, 0, 0],   # seed of block 1 (s=3)
        [1, 1, 1, 0, 0, 0,    0, 0, 0,   1, 1, 1],
        [1, 1, 1, 0, 0, 0,    0, 0, 0,   1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(got, want)
    # Block 1 cut to size 2: packed right after block 0, no padding inside the row.
    b = batch_of([1, 3], [3, 2])
    assert b.tok_block.tolist() == [[0, 0, 0, 1, 1]] and b.tok_pos.tolist() == [[0, 1, 2, 0, 1]]
    got = training_mask(b)[0]
    assert got.shape == (5, 5 + 5)
    keep = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]      # clean_len is now 5: drop column 5 and the last row
    assert torch.equal(got, want[:5][:, keep])
    # Rows of different total size: the shorter one is padded with tokens that see only themselves.
    ex = Example([5], list(range(10, 22)))
    b = make_batch([ex, ex], torch.tensor([[1, 3], [2, 4]]), torch.zeros(2, 2, 3, dtype=torch.bool), 3,
                   512, sizes=torch.tensor([[3, 3], [2, 2]]))
    assert b.tok_block[1].tolist() == [0, 0, 1, 1, -1, -1] and b.weights[1, 4:].tolist() == [0, 0]
    m = training_mask(b)[1, :, b.clean_len:]
    assert m[4].tolist() == [0, 0, 0, 0, 1, 0] and not m[:4, 4:].any()


def test_training_mask_nld_convention():
    """nld: the seed sees its whole block, the adapter is on at the seed, targets are unshifted."""
    b = batch_of([1, 3], [3, 2], conv=NLD)
    inner = training_mask(b)[0, :, b.clean_len:]
    assert inner.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0],
                                    [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    from fastspec.train.trainer import training_adapter_flags
    assert training_adapter_flags(b).all()
    assert not training_adapter_flags(batch_of([1, 3], [3, 2]))[0, [0, 3]].any()
    # ids: prompt [5] then 10, 11, ... -> the token at sequence position p is 9 + p.
    assert b.targets.tolist() == [[-100, 11, 12, -100, 13]]              # x_{s+i}
    fs = batch_of([1, 3], [3, 2])
    assert fs.targets.tolist() == [[-100, 12, 13, -100, 14]]             # x_{s+i+1}


def test_make_batch_targets_and_partial_masking():
    ex = Example(list(range(10, 15)), list(range(100, 110)))     # ids 10..14, 100..109 (len 15)
    starts = torch.tensor([[5, 12]])
    keep = torch.zeros(1, 2, B, dtype=torch.bool)
    keep[0, 0, 2] = True                                          # block 0 keeps position 2
    b = make_batch([ex], starts, keep, B, mask_id=512, pos_decay=0.5)
    M = 512
    assert b.block_ids.tolist() == [[100, M, 102, M, 107, M, M, M]]
    assert b.positions.tolist() == [[5, 6, 7, 8, 12, 13, 14, 15]]
    # Block 0: position 1's target (102) is visible as input 2 -> not counted.
    # Block 1: s=12, targets 109 (i=1), then past the end.
    assert b.targets.tolist() == [[-100, -100, 103, 104, -100, 109, -100, -100]]
    assert b.weights.tolist() == [[0, 0, 0.5, 0.25, 0, 1, 0, 0]]
    assert b.all_masked.tolist() == [[False, True]]
    assert b.clean_len == 15
    # A block of size 3 inside B = 4: its last position (i = 2) is now the block's end.
    b = make_batch([ex], torch.tensor([[5]]), torch.zeros(1, 1, B, dtype=torch.bool), B, 512,
                   sizes=torch.tensor([[3]]))
    assert b.targets.tolist() == [[-100, 102, 103]]
    assert b.weights.tolist() == [[0, 1, 1]]
    # nld (unshifted): position i's target is the token at s + i, counted where the input is MASK.
    b = make_batch([ex], starts, keep, B, mask_id=512, pos_decay=0.5, conv=NLD)
    assert b.targets.tolist() == [[-100, 101, -100, 103, -100, 108, 109, -100]]
    assert b.weights.tolist() == [[0, 1, 0, 0.25, 0, 1, 0.5, 0]]


@pytest.mark.parametrize("conv", [FASTSPEC, NLD], ids=["fastspec", "nld"])
def test_a_seedless_block_masks_its_seed_and_trains_position_zero(conv):
    """TiDAR's seedless pre-draft: the seed slot is a MASK too, the whole block sees itself, the
    adapter is on everywhere, and position 0 is trained (shifted: x_{s+1}; unshifted: x_s)."""
    from fastspec.train.trainer import training_adapter_flags
    ex = Example([5], list(range(10, 22)))               # the token at position p is 9 + p
    keep = torch.ones(1, 2, 3, dtype=torch.bool)          # ignored in a seedless block
    b = make_batch([ex], torch.tensor([[1, 3]]), torch.zeros(1, 2, 3, dtype=torch.bool) | keep, 3,
                   mask_id=512, conv=conv, seedless=torch.tensor([[True, False]]))
    assert b.block_ids.tolist() == [[512, 512, 512, 12, 13, 14]]
    first = [11, 12, 13] if conv.shift else [10, 11, 12]
    assert b.targets[0, :3].tolist() == first
    assert b.weights[0, 0].item() == 1.0
    assert b.all_masked.tolist() == [[False, False]] and b.seedless.tolist() == [[True, False]]
    inner = training_mask(b)[0, :, b.clean_len:]
    assert inner[:3, :3].all() and not inner[:3, 3:].any()
    assert training_adapter_flags(b)[0, :3].all()
    assert training_adapter_flags(b)[0, 3].item() == conv.seed_adapter


def test_a_seedless_run_marks_its_adapter_and_logs_its_tau():
    cfg = small_cfg(seedless_prob=0.5)
    assert cfg.adapter_config().convention["seedless"] is True
    assert small_cfg().adapter_config().convention["seedless"] is False
    loaded = tiny_loaded()
    tr = DraftTrainer(loaded.model, random_examples(2), cfg)
    assert loaded.model.draft_convention.seedless
    b = tr.sample_batch()
    assert b.seedless.any() and not b.seedless.all()
    _, metrics = draft_loss(loaded.model, b)
    assert 1.0 <= metrics["tau_seedless"].item() <= B


def inference_draft_logits(model, ids, s, size, conv, mask_id):
    """The engine's draft forward for a round whose committed prefix is ids[:s]: prefill, then
    the block [x_s, MASK x (size-1)] laid out by the convention."""
    cfg = model.cfg
    k = torch.zeros(cfg.num_layers, 1, cfg.num_kv_heads, 128, cfg.head_dim)
    v = torch.zeros_like(k)
    slot = torch.zeros(1, dtype=torch.long)
    cols = torch.arange(s)[None]
    with torch.no_grad():
        model(torch.tensor([ids[:s]]), cols, k, v, cols, cache_mask(slot, causal_block(s), s), slot)
        block = torch.tensor([[ids[s]] + [mask_id] * (size - 1)])
        cols = torch.arange(s, s + size)[None]
        mask = cache_mask(torch.tensor([s]), draft_block_mask(conv, torch.tensor([size]), size), s + size)
        return model(block, cols, k, v, cols, mask, slot,
                     adapter_on=draft_adapter_flags(conv, 1, size))[0]


@pytest.mark.parametrize("conv", [FASTSPEC, NLD], ids=["fastspec", "nld"])
@pytest.mark.parametrize("starts,sizes", [([9], [4]), ([6, 13, 9], [4, 2, 3])])
def test_training_block_forward_equals_inference_layout(starts, sizes, conv):
    """Each packed training block reproduces the engine's draft forward (the convention's mask and
    adapter flags)."""
    loaded = tiny_loaded()
    model = loaded.model
    tr = DraftTrainer(model, random_examples(1), small_cfg(convention=conv.name))
    assert model.draft_convention == conv
    perturb_adapter(model)
    ex = tr.examples[0]
    K = len(starts)
    b = make_batch([ex], torch.tensor([starts]), torch.zeros(1, K, B, dtype=torch.bool), B,
                   tr.mask_id, sizes=torch.tensor([sizes]), conv=conv)
    with torch.no_grad():
        train_logits = draft_logits(model, b)[0]
    for j, (s, size, o) in enumerate(zip(starts, sizes, b.offsets[0].tolist())):
        ref = inference_draft_logits(model, ex.ids, s, size, conv, tr.mask_id)
        assert (train_logits[o: o + size] - ref).abs().max() < 1e-5
        if conv.shift:
            # The seed's output is the base model's own next-token distribution.
            k = torch.zeros(model.cfg.num_layers, 1, model.cfg.num_kv_heads, 64, model.cfg.head_dim)
            slot = torch.zeros(1, dtype=torch.long)
            with torch.no_grad():
                c = torch.arange(s + 1)[None]
                base = model(torch.tensor([ex.ids[: s + 1]]), c, k, k.clone(), c,
                             cache_mask(slot, causal_block(s + 1), s + 1), slot)[0, -1]
            assert (train_logits[o] - base).abs().max() < 1e-5


def test_block_size_mixture_is_sampled_by_weight():
    examples = random_examples(4, target=80)
    cfg = small_cfg(block_sizes=(4, 8, 16, 32), block_weights=(0.1, 0.2, 0.3, 0.4), blocks_per_seq=50)
    tr = DraftTrainer(tiny_loaded().model, examples, cfg)
    sizes = torch.cat([tr.sample_batch().sizes.view(-1) for _ in range(10)])   # 2000 blocks
    share = [(sizes == b).float().mean().item() for b in (4, 8, 16, 32)]
    assert all(abs(s - w) < 0.04 for s, w in zip(share, (0.1, 0.2, 0.3, 0.4))), share
    assert tr.adapter_cfg.block_size == 32
    b = tr.sample_batch()
    assert b.block_ids.shape[1] == int(b.sizes.sum(1).max())              # packed, no wide padding
    assert int((b.starts + b.sizes).max()) <= tr.max_position
    _, m = draft_loss(tr.model, b)
    assert {"tau_b4", "tau_b32"} <= set(m)


def test_gradient_reaches_lora_through_cached_kv():
    """Drafts see each other only through K/V written into the cache: k/v LoRA gets gradient."""
    loaded = tiny_loaded()
    tr = DraftTrainer(loaded.model, random_examples(2), small_cfg(targets=("k", "v")))
    perturb_adapter(loaded.model)
    loss, _ = draft_loss(loaded.model, tr.sample_batch())
    loss.backward()
    for blk in loaded.model.layers:
        for t in ("k", "v"):
            assert blk.attn.lora[t].B.grad.abs().sum() > 0
    assert loaded.model.mask_embed.grad.abs().sum() > 0
    assert all(p.grad is None for p in (loaded.model.embed, loaded.model.layers[0].attn.wqkv))


def test_training_reduces_loss_on_fixed_batch(distilled):
    examples, _, _ = distilled
    loaded = tiny_loaded()
    tr = DraftTrainer(loaded.model, examples, small_cfg(seqs_per_step=4, lr=2e-2))
    batch = tr.sample_batch()
    first = tr.train_step(batch)
    for _ in range(11):
        last = tr.train_step(batch)
    assert last["loss"] < 0.6 * first["loss"]
    assert last["acc"] > first["acc"]
    assert tr.step == 12


def test_checkpoint_resume_round_trip(tmp_path):
    examples = random_examples(5)
    a = DraftTrainer(tiny_loaded().model, examples, small_cfg(), ckpt_dir=tmp_path)
    for _ in range(3):
        a.train_step()
    a.elapsed_s = 12.5
    a.save_checkpoint()
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.bin"))

    b = DraftTrainer(tiny_loaded().model, examples, small_cfg(), ckpt_dir=tmp_path)
    assert b.load_checkpoint()
    assert (b.step, b.target_tokens, b.elapsed_s, b.cursor) == (a.step, a.target_tokens, 12.5, a.cursor)
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert float(sa[i]["step"]) == float(sb[i]["step"])
        assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"])
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)
    # Same RNG and data order: the continued runs are identical.
    for _ in range(2):
        ma, mb = a.train_step(), b.train_step()
        assert ma["loss"] == mb["loss"]
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)

    # A different adapter shape refuses to resume (one line, FastspecError).
    from fastspec.config import FastspecError
    c = DraftTrainer(tiny_loaded().model, examples, small_cfg(rank=8), ckpt_dir=tmp_path)
    with pytest.raises(FastspecError, match="rank"):
        c.load_checkpoint()


def test_saved_adapter_reproduces_draft_logits(tmp_path):
    examples = random_examples(3)
    tr = DraftTrainer(tiny_loaded().model, examples, small_cfg(), out_dir=tmp_path / "draft",
                      meta={"model": "tiny"})
    for _ in range(2):
        tr.train_step()
    tr.save_adapter()
    batch = tr.sample_batch()
    with torch.no_grad():
        for p in adapter_parameters(tr.model):      # the adapter ships in fp16
            p.copy_(p.half().float())
        want = draft_logits(tr.model, batch)
    fresh = tiny_loaded().model
    cfg = load_adapter(fresh, str(tmp_path / "draft"))
    assert cfg.block_size == B and cfg.meta["steps"] == 2 and cfg.meta["model"] == "tiny"
    with torch.no_grad():
        got = draft_logits(fresh, batch)
    # Same weights, same forward; fp32 rounding only (on an AVX2 CPU MKL's GEMM order can differ
    # between two equal models' tensors, where AVX-512 gave equal bits).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_train_loop_logs_and_resumes(tmp_path):
    examples = random_examples(4)
    log = tmp_path / "log.jsonl"
    t = DraftTrainer(tiny_loaded().model, examples, small_cfg(max_steps=3), out_dir=tmp_path / "d",
                     ckpt_dir=tmp_path / "ck", log_path=log)
    s = t.train(progress=False)
    assert s["steps"] == 3 and not s["resumed"]
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert rows[0]["event"] == "start" and rows[0]["step"] == 0
    assert rows[0]["convention"] == FASTSPEC.to_dict() and rows[0]["recipe"]["block_sizes"] == [B]
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["target_tokens"] == t.target_tokens and all("loss" in r for r in rows)
    assert (tmp_path / "d" / "adapter.safetensors").is_file()
    t2 = DraftTrainer(tiny_loaded().model, examples, small_cfg(max_steps=5), out_dir=tmp_path / "d",
                      ckpt_dir=tmp_path / "ck", log_path=log)
    s2 = t2.train(progress=False)
    assert s2["resumed"] and s2["steps"] == 5 and s2["run_steps"] == 2
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert [(r["step"], r.get("event")) for r in rows] == [
        (0, "start"), (1, None), (2, None), (3, None), (3, "resume"), (4, None), (5, None)]


def test_targets_are_greedy_and_cached(distilled, monkeypatch):
    examples, path, prompts = distilled
    assert [e.prompt_ids for e in examples] == prompts
    assert len(read_target_cache(path)) == len(prompts)
    # The target is the model's own greedy continuation.
    from fastspec.engine import Engine
    from fastspec.sampling import SamplingParams
    ref = Engine(tiny_loaded(), backend="eager").generate(prompts[:1], SamplingParams(max_new_tokens=20))
    assert examples[0].target_ids == ref[0].token_ids
    # A rerun generates nothing.
    monkeypatch.setattr(Engine, "generate", lambda *a, **k: pytest.fail("regenerated cached targets"))
    again = build_targets(tiny_loaded(), prompts, 20, path, concurrency=4, progress=False)
    assert [e.target_ids for e in again] == [e.target_ids for e in examples]


def test_target_cache_survives_a_torn_last_line(tmp_path):
    """A run killed mid-write leaves half a line; the next run's lines still parse."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"key": "abc", "target_ids": [1, 2')
    ex = build_targets(tiny_loaded(), [[5, 6, 7], [8, 9]], 6, path, concurrency=2, progress=False,
                       backend="eager")
    assert len(read_target_cache(path)) == 2 and [len(e.target_ids) for e in ex] == [6, 6]


def test_training_prompts_mix(tmp_path):
    from fastspec.train.data import GENERAL_PROMPTS
    n_gen = len(GENERAL_PROMPTS)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(200)))
    ps = training_prompts(data, n_gen + 30, seed=1)
    math = [p for p in ps if p not in GENERAL_PROMPTS]
    assert len(ps) == n_gen + 30 and len(math) == 30 and len(set(ps)) == len(ps)
    assert all(p.startswith("What is") and p.endswith("\\boxed{}.") for p in math)
    assert set(GENERAL_PROMPTS) <= set(ps)
    assert any(p in GENERAL_PROMPTS for p in ps[:5])          # interleaved, not appended
    assert training_prompts(data, 10) == list(GENERAL_PROMPTS[:10])


def test_general_prompts_are_not_benchmark_items():
    from pathlib import Path

    from fastspec.train.data import GENERAL_PROMPTS
    bench = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "benchmarks"
    if not bench.is_dir():
        pytest.skip("no benchmark data here")
    text = "\n".join(f.read_text(errors="ignore") for f in bench.glob("*.jsonl"))
    assert not [p for p in GENERAL_PROMPTS if p[:60] in text]


def write_jsonl(path, field, texts):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def test_mixture_sampling_respects_weights(tmp_path):
    from fastspec.train.data import mixture_prompts, parse_mixture
    a = write_jsonl(tmp_path / "a.jsonl", "question", [f"What is {i} + {i}?" for i in range(500)])
    b = write_jsonl(tmp_path / "b.jsonl", "prompt", [f"Write code number {i}." for i in range(500)])
    c = write_jsonl(tmp_path / "c.jsonl", "prompt", [f"Tell me fact {i}." for i in range(40)])
    srcs = parse_mixture(f"{a}:0.5,{b}:0.3,{c}:0.2")
    assert [s.weight for s in srcs] == [0.5, 0.3, 0.2] and parse_mixture(str(a))[0].weight == 1.0
    ps, rec = mixture_prompts(srcs, 100, seed=0)
    assert [r["prompts"] for r in rec] == [50, 30, 20] and len(set(ps)) == 100
    # Questions get the math instruction; prompts come as written.
    assert sum(p.startswith("What is") and p.endswith("\\boxed{}.") for p in ps) == 50
    assert sum(p.startswith("Write code") for p in ps) == 30
    # Every prefix keeps the mixture (an interrupted generation has all three kinds).
    head = ps[:10]
    assert [sum(p.startswith(k) for p in head) for k in ("What", "Write", "Tell")] == [5, 3, 2]
    # A source smaller than its share gives what it has; the rest goes to the others by weight.
    ps, rec = mixture_prompts(srcs, 400, seed=0)
    assert [r["prompts"] for r in rec] == [225, 135, 40] and len(ps) == 400
    assert mixture_prompts(srcs, 100, seed=1)[0] != mixture_prompts(srcs, 100, seed=0)[0]


def test_calibration_prompts_hold_out_every_prompt_the_drafter_lineage_was_trained_on(tmp_path):
    """A drafter is accepted more often on its own training prompts: calibration draws none of
    them, rebuilt from the adapter's record and the records of the adapters it started from."""
    from fastspec.train.data import (lineage_training_prompts, mixture_prompts, parse_mixture,
                                     training_prompts)
    a = write_jsonl(tmp_path / "a.jsonl", "question", [f"What is {i} + {i}?" for i in range(60)])
    b = write_jsonl(tmp_path / "b.jsonl", "prompt", [f"Write code number {i}." for i in range(60)])
    srcs = parse_mixture(f"{a}:0.5,{b}:0.5")
    first, rec1 = mixture_prompts(srcs, 30, seed=2)
    then, rec2 = mixture_prompts(parse_mixture(f"{a}:0.2,{b}:0.8"), 40, seed=3)
    run1 = {"data": rec1, "command": "fastspec train-drafter --max-prompts 30 --seed 2"}
    run2 = {"data": rec2, "command": "fastspec train-drafter --seed 3 --lr 0.0003",
            "init_adapter_meta": run1}
    seen = lineage_training_prompts(run2, srcs)
    assert seen == set(first) | set(then) and len(seen) < 70          # the runs overlap a little
    held, rec = mixture_prompts(srcs, 40, seed=0, exclude=seen)
    assert len(held) == 40 and not set(held) & seen
    assert [r["excluded"] for r in rec] == [sum(p.startswith(k) for p in seen) for k in ("What", "Write")]
    # Fewer rows left than asked: every unseen prompt, none seen.
    everything, _ = mixture_prompts(srcs, 120, seed=0, exclude=seen)
    assert len(everything) == 120 - len(seen) and not set(everything) & seen
    # A run recorded on another machine: its files are found by name among the sources.
    moved = {**run1, "data": [{**r, "path": f"/elsewhere/{r['path'].split('/')[-1]}"} for r in rec1]}
    assert lineage_training_prompts(moved, srcs) == set(first)
    # A file that changed since the run (other row count): its permutation is unknown, skipped.
    write_jsonl(tmp_path / "a.jsonl", "question", [f"What is {i} + {i}?" for i in range(61)])
    assert lineage_training_prompts(run1, srcs) == {p for p in first if p.startswith("Write")}
    assert lineage_training_prompts(None) == set()
    # A run without --train-data trained on the built-in prompts and a seeded draw of questions.
    builtin = {"data": [{"path": str(b), "builtin_general_prompts": True, "prompts": 80}],
               "command": "fastspec train-drafter --seed 1"}
    got = lineage_training_prompts(builtin, srcs)
    assert got == set(training_prompts(str(b), 80, seed=1)) and sum(p.startswith("Write") for p in got) > 0


def test_benchmark_data_is_refused(tmp_path, monkeypatch):
    from fastspec.config import FastspecError
    from fastspec.train.data import benchmark_dirs, load_questions, mixture_prompts, parse_mixture
    bench = tmp_path / "bench"
    bench.mkdir()
    f = write_jsonl(bench / "gsm8k.jsonl", "question", ["What is 1 + 1?"])
    monkeypatch.setenv("FASTSPEC_DATA", str(bench))
    with pytest.raises(FastspecError, match="refusing to train on .*benchmark"):
        load_questions(f)
    with pytest.raises(FastspecError, match="refusing"):           # also via a relative path
        monkeypatch.chdir(tmp_path)
        mixture_prompts(parse_mixture("bench/../bench/gsm8k.jsonl:1"), 5)
    # The shared benchmark folder is refused even when FASTSPEC_DATA points elsewhere.
    from pathlib import Path
    shared = (Path(__file__).resolve().parents[1] / "../shared/data/benchmarks").resolve()
    assert shared in benchmark_dirs()
    if (shared / "gsm8k.jsonl").is_file():
        with pytest.raises(FastspecError, match="refusing"):
            load_questions(shared / "gsm8k.jsonl")
    ok = write_jsonl(tmp_path / "train.jsonl", "prompt", ["Say hi."])
    assert load_questions(ok) == ["Say hi."]


def test_warm_start_from_a_saved_adapter(tmp_path):
    from fastspec.draft import read_adapter
    examples = random_examples(3)
    a = DraftTrainer(tiny_loaded().model, examples, small_cfg(), out_dir=tmp_path / "a")
    a.train_step()
    a.save_adapter()
    b = DraftTrainer(tiny_loaded().model, examples, small_cfg(seed=5), init_adapter=tmp_path / "a")
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa.half().float(), pb)                  # fp16 on disk
    assert b.meta["init_adapter"] == str(tmp_path / "a")
    assert b.meta["init_adapter_meta"] == read_adapter(str(tmp_path / "a"))[0].meta   # lineage kept
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError, match="rank"):
        DraftTrainer(tiny_loaded().model, examples, small_cfg(rank=8), init_adapter=tmp_path / "a")


def test_a_warm_start_can_add_mlp_lora_to_an_attention_adapter(tmp_path):
    """The parent's attention LoRA comes over exactly; the new MLP LoRA starts as the identity
    (B = 0), so the warm-started drafter drafts what its parent drafted, then trains the MLP too."""
    from fastspec.draft import adapter_loras
    examples = random_examples(3)
    a = DraftTrainer(tiny_loaded().model, examples, small_cfg(), out_dir=tmp_path / "a")
    a.train_step()
    a.save_adapter()
    b = DraftTrainer(tiny_loaded().model, examples, small_cfg(targets=("q", "k", "v", "o", "gate", "up", "down")),
                     init_adapter=tmp_path / "a")
    parent = {(i, t): lora for i, t, lora in adapter_loras(a.model)}
    mine = {(i, t): lora for i, t, lora in adapter_loras(b.model)}
    assert {t for _, t in mine} == {"q", "k", "v", "o", "gate", "up", "down"}
    for key, lora in mine.items():
        if key[1] in ("gate", "up", "down"):
            assert not lora.B.any()
        else:
            assert torch.equal(parent[key].B.half().float(), lora.B)
    b.train_step()
    assert all(lora.B.any() for (_, t), lora in mine.items() if t in ("gate", "up", "down"))
    from fastspec.config import FastspecError
    with pytest.raises(FastspecError, match="targets"):     # dropping a parent's target is refused
        DraftTrainer(tiny_loaded().model, examples, small_cfg(targets=("q", "v")), init_adapter=tmp_path / "a")


def test_train_drafter_command_end_to_end(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fastspec.cli.train import train_drafter
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    q = write_jsonl(tmp_path / "q.jsonl", "question", ["What is 2 + 3?", "What is 4 * 4?"])
    g = write_jsonl(tmp_path / "g.jsonl", "prompt", ["Say hello.", "Name a color.", "Count to 3."])
    out = tmp_path / "draft"
    args = ["--model", "tiny-random", "--out", str(out), "--train-data", f"{q}:0.4,{g}:0.6",
            "--max-prompts", "4", "--target-tokens", "12", "--blocks", "4:1,8:1",
            "--blocks-per-seq", "2", "--seqs-per-step", "2", "--rank", "4", "--threads", "1",
            "--max-steps", "2", "--gen-concurrency", "2", "--gen-backend", "eager", "--device", "cpu"]
    r = CliRunner().invoke(train_drafter, args)
    assert r.exit_code == 0, r.output
    assert "fastspec train-drafter --model tiny-random" in r.output
    assert (out / "adapter.safetensors").is_file() and (out / "train_log.jsonl").is_file()
    assert len(list((tmp_path / "cache" / "train_targets").glob("*.jsonl"))) == 1
    assert len(list((tmp_path / "cache" / "train").glob("*/checkpoint.safetensors"))) == 1
    # The written config reproduces the run: its command parses back to the same settings.
    conf = json.loads((out / "adapter_config.json").read_text())
    meta = conf["meta"]
    assert conf["convention"] == FASTSPEC.to_dict() and conf["block_size"] == 8
    assert meta["steps"] == 2 and meta["target_tokens"] > 0 and meta["prompts"] == 4
    assert [(d["path"], d["weight"], d["prompts"]) for d in meta["data"]] == [(str(q), 0.4, 2), (str(g), 0.6, 2)]
    import shlex

    from fastspec.cli.train import train_config
    argv = shlex.split(meta["command"])
    assert argv[:2] == ["fastspec", "train-drafter"]
    params = train_drafter.make_context("train-drafter", argv[2:]).params
    from dataclasses import asdict
    again = {k: v for k, v in asdict(train_config(params)).items() if k not in ("log_every", "ckpt_every_s")}
    assert json.loads(json.dumps(again)) == meta["recipe"]
    assert meta["recipe"]["block_sizes"] == [4, 8] and meta["recipe"]["max_steps"] == 2
    assert params["train_data"] == f"{q}:0.4,{g}:0.6" and params["max_prompts"] == 4
    start = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
    assert start["command"] == meta["command"] and start["data"] == meta["data"]
    assert start["convention"] == conf["convention"]
    # Resume to a larger step count; bad options are one-line errors.
    r = CliRunner().invoke(train_drafter, args[:-8] + ["--max-steps", "3", "--gen-backend", "eager"])
    assert r.exit_code == 0 and "resumed" in r.output, r.output
    assert json.loads((out / "adapter_config.json").read_text())["meta"]["steps"] == 3
    r = CliRunner().invoke(train_drafter, args + ["--targets", "q,x"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "error:" in r.output
    r = CliRunner().invoke(train_drafter, args[:-8] + ["--max-steps", "4", "--gen-backend", "eager", "--convention", "nld"])
    assert r.exit_code == 1 and "convention" in r.output, r.output      # not the checkpoint's


@pytest.mark.parametrize("seedless", ["0", "0.5"])
def test_train_drafter_nld_convention_writes_its_convention(tmp_path, monkeypatch, seedless):
    """The adapter records the convention it was trained for, seedless (TiDAR) blocks included."""
    from dataclasses import replace

    from click.testing import CliRunner

    from fastspec.cli.train import train_drafter
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    g = write_jsonl(tmp_path / "g.jsonl", "prompt", ["Say hello.", "Name a color."])
    out = tmp_path / "draft"
    r = CliRunner().invoke(train_drafter, [
        "--model", "tiny-random", "--out", str(out), "--train-data", str(g), "--max-prompts", "2",
        "--target-tokens", "10", "--blocks", "4", "--blocks-per-seq", "2", "--seqs-per-step", "2",
        "--rank", "4", "--max-steps", "1", "--gen-concurrency", "2", "--device", "cpu",
        "--gen-backend", "eager", "--convention", "nld", "--seedless", seedless])
    assert r.exit_code == 0, r.output
    want = replace(NLD, seedless=seedless != "0")
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["convention"] == want.to_dict()
    assert ("--seedless 0.5" in conf["meta"]["command"]) == want.seedless
    m = tiny_loaded().model
    load_adapter(m, str(out))
    assert m.draft_convention == want


def test_bf16_autocast_training_tracks_fp32_and_keeps_fp32_weights(distilled):
    """--precision bf16 computes under bf16 autocast: the first step's loss agrees with fp32 to
    bf16 rounding, the trained parameters, gradients and optimizer state stay fp32, and a fixed
    batch is still learned."""
    examples, _, _ = distilled
    runs = {}
    for precision in ("fp32", "bf16"):
        loaded = tiny_loaded()
        tr = DraftTrainer(loaded.model, examples, small_cfg(seqs_per_step=4, lr=2e-2, precision=precision))
        batch = tr.sample_batch()
        rows = [tr.train_step(batch) for _ in range(12)]
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in tr.params)
        assert all(s["exp_avg"].dtype == torch.float32 for s in tr.opt.state.values())
        runs[precision] = rows
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=0.03)
    assert bf16[0]["loss"] != fp32[0]["loss"]                       # it did run in bf16
    assert bf16[-1]["loss"] < 0.6 * bf16[0]["loss"]
    with pytest.raises(FastspecError, match="--precision must be one of fp32, bf16"):
        small_cfg(precision="fp16")


@pytest.mark.parametrize("kind", ["lora", "dflash"])
def test_the_written_command_keeps_the_precision(kind):
    """A bf16 run's recorded command says --precision bf16 (and its warm start) and parses back
    to the same config."""
    import shlex

    from fastspec.cli.train import dflash_command, dflash_config, full_command, train_config, train_drafter
    build, spell = (train_config, full_command) if kind == "lora" else (dflash_config, dflash_command)
    argv = ["--kind", kind, "--out", "x", "--precision", "bf16", "--max-steps", "3",
            "--init-adapter", "prev"]
    params = train_drafter.make_context("train-drafter", argv).params
    cfg = build(params)
    assert cfg.precision == "bf16"
    command = spell(params, cfg)
    assert "--precision bf16" in command and command.count("--init-adapter prev") == 1
    again = build(train_drafter.make_context("train-drafter", shlex.split(command)[2:]).params)
    assert again == cfg


@pytest.mark.parametrize("kind, flag", [("lora", "--draft-block"), ("lora", "--target-layers"),
                                        ("dflash", "--rank"), ("dflash", "--blocks")])
def test_an_option_of_the_other_kind_of_drafter_is_refused(kind, flag, tmp_path):
    """--draft-block trains nothing under --kind lora (nor --rank under dflash): one line, no run."""
    from click.testing import CliRunner
    from fastspec.cli.main import cli
    value = {"--draft-block": "8", "--target-layers": "1,2", "--rank": "8", "--blocks": "8:1"}[flag]
    result = CliRunner().invoke(cli, ["train-drafter", "--model", "tiny-random", "--kind", kind,
                                      "--out", str(tmp_path / "d"), "--max-steps", "1", flag, value])
    assert result.exit_code == 1 and "Traceback" not in result.output
    other = "dflash" if kind == "lora" else "lora"
    assert f"{flag} is a --kind {other} option; this run trains --kind {kind}" in result.output
    assert not (tmp_path / "d").exists()
