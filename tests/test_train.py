"""Draft-adapter training: layout, loss, checkpoints, data cache (tiny random model, token ids)."""
import json

import pytest
import torch
from conftest import tiny_loaded

from fastspec.draft import adapter_parameters, load_adapter
from fastspec.layout import cache_mask, causal_block
from fastspec.train.data import Example, build_targets, read_target_cache, training_prompts
from fastspec.train.trainer import (DraftTrainer, TrainConfig, draft_block_mask, draft_logits,
                                    draft_loss, make_batch, training_mask)

B = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and a busy machine makes it much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cfg(**kw):
    base = dict(block=B, blocks_per_seq=3, seqs_per_step=2, rank=4, alpha=8.0, lr=1e-2,
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


def test_training_mask_matches_hand_written():
    # Two blocks of 3 after 4 clean columns; starts 1 and 3.
    got = training_mask(torch.tensor([[1, 3]]), 3, 4)
    want = torch.tensor([
        # clean 0..3   | block 0  | block 1
        [1, 0, 0, 0,    1, 0, 0,   0, 0, 0],   # seed of block 0 (s=1): prefix < 1 and itself
        [1, 0, 0, 0,    1, 1, 1,   0, 0, 0],   # masks: prefix + the whole block
        [1, 0, 0, 0,    1, 1, 1,   0, 0, 0],
        [1, 1, 1, 0,    0, 0, 0,   1, 0, 0],   # seed of block 1 (s=3)
        [1, 1, 1, 0,    0, 0, 0,   1, 1, 1],
        [1, 1, 1, 0,    0, 0, 0,   1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(got[0], want)
    # Block 1 cut to size 2: its third position is padding that sees only itself.
    got = training_mask(torch.tensor([[1, 3]]), 3, 4, sizes=torch.tensor([[3, 2]]))
    want[3:, 7:] = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    want[5, :4] = False
    assert torch.equal(got[0], want)


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
    assert b.targets.tolist() == [[-100, 102, 103, -100]]
    assert b.weights.tolist() == [[0, 1, 1, 0]]


@pytest.mark.parametrize("starts,sizes", [([9], [4]), ([6, 13, 9], [4, 2, 3])])
def test_training_block_forward_equals_inference_layout(starts, sizes):
    """Each training block reproduces the engine's LinearSS draft forward (same mask function)."""
    from fastspec.methods.linear import draft_block_mask as linear_block_mask
    loaded = tiny_loaded()
    model = loaded.model
    tr = DraftTrainer(model, random_examples(1), small_cfg())
    perturb_adapter(model)
    ex = tr.examples[0]
    K = len(starts)
    b = make_batch([ex], torch.tensor([starts]), torch.zeros(1, K, B, dtype=torch.bool), B,
                   tr.mask_id, sizes=torch.tensor([sizes]))
    with torch.no_grad():
        train_logits = draft_logits(model, b)[0].view(K, B, -1)
    cfg = model.cfg
    for j, (s, size) in enumerate(zip(starts, sizes)):
        # Inference: prefill the committed prefix (ids < s), then the draft block at s..s+B-1.
        k = torch.zeros(cfg.num_layers, 1, cfg.num_kv_heads, 64, cfg.head_dim)
        v = torch.zeros_like(k)
        slot = torch.zeros(1, dtype=torch.long)
        pre = torch.tensor([ex.ids[:s]])
        cols = torch.arange(s)[None]
        with torch.no_grad():
            model(pre, cols, k, v, cols, cache_mask(slot, causal_block(s), s), slot)
            block = torch.tensor([[ex.ids[s]] + [tr.mask_id] * (B - 1)])
            cols = torch.arange(s, s + B)[None]
            mask = cache_mask(torch.tensor([s]), linear_block_mask(torch.tensor([size]), B), s + B)
            on = torch.tensor([[False] + [True] * (B - 1)])
            ref = model(block, cols, k, v, cols, mask, slot, adapter_on=on)[0]
        assert (train_logits[j, :size] - ref[:size]).abs().max() < 1e-5
        if size == B:
            assert torch.equal(linear_block_mask(torch.tensor([B]), B)[0], draft_block_mask(B))
        # The seed's output is the base model's own next-token distribution.
        with torch.no_grad():
            full = torch.tensor([ex.ids[: s + 1]])
            c = torch.arange(s + 1)[None]
            base = model(full, c, k, v, c, cache_mask(slot, causal_block(s + 1), s + 1), slot)[0, -1]
        assert (train_logits[j, 0] - base).abs().max() < 1e-5


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
    assert torch.equal(got, want)


def test_train_loop_logs_and_resumes(tmp_path):
    examples = random_examples(4)
    log = tmp_path / "log.jsonl"
    t = DraftTrainer(tiny_loaded().model, examples, small_cfg(max_steps=3), out_dir=tmp_path / "d",
                     ckpt_dir=tmp_path / "ck", log_path=log)
    s = t.train(progress=False)
    assert s["steps"] == 3 and not s["resumed"]
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["target_tokens"] == t.target_tokens and all("loss" in r for r in rows)
    assert (tmp_path / "d" / "adapter.safetensors").is_file()
    t2 = DraftTrainer(tiny_loaded().model, examples, small_cfg(max_steps=5), out_dir=tmp_path / "d",
                      ckpt_dir=tmp_path / "ck", log_path=log)
    s2 = t2.train(progress=False)
    assert s2["resumed"] and s2["steps"] == 5 and s2["run_steps"] == 2
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == [1, 2, 3, 4, 5]


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


def test_train_drafter_command_end_to_end(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fastspec.cli.train import train_drafter
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 3?"}) + "\n")
    out = tmp_path / "draft"
    args = ["--model", "tiny-random", "--out", str(out), "--data", str(data), "--max-prompts", "3",
            "--target-tokens", "12", "--block", "4", "--blocks-per-seq", "2", "--seqs-per-step", "2",
            "--rank", "4", "--max-steps", "2", "--gen-concurrency", "2", "--device", "cpu"]
    r = CliRunner().invoke(train_drafter, args)
    assert r.exit_code == 0, r.output
    assert "fastspec train-drafter --model tiny-random" in r.output
    assert (out / "adapter.safetensors").is_file() and (out / "train_log.jsonl").is_file()
    assert len(list((tmp_path / "cache" / "train_targets").glob("*.jsonl"))) == 1
    assert len(list((tmp_path / "cache" / "train").glob("*/checkpoint.safetensors"))) == 1
    # Resume to a larger step count; bad options are one-line errors.
    r = CliRunner().invoke(train_drafter, args[:-6] + ["--max-steps", "3", "--device", "cpu"])
    assert r.exit_code == 0 and "resumed" in r.output, r.output
    r = CliRunner().invoke(train_drafter, args + ["--targets", "q,x"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "error:" in r.output
