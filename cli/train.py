"""`fastspec train-drafter`: self-distill targets, then train the draft adapter on them.

    fastspec train-drafter                        # SmolLM2-135M, GSM8K train + built-in prompts
    fastspec train-drafter --minutes 240 --max-prompts 3000

The adapter lands where `load_model` looks for it (`fastspec/adapters/<name>/draft` for built-in
names, `<checkpoint dir>/draft` otherwise). Training state (adapter + optimizer + RNG, safetensors
with JSON scalars) is checkpointed under $FASTSPEC_CACHE/train/, so an interrupted run resumes
with the same command; the loss / acceptance log is `<out>/train_log.jsonl`.
"""
from __future__ import annotations

import hashlib
import shlex
import time
from pathlib import Path

import click

from fastspec.cli.common import user_errors
from fastspec.config import FastspecError


def default_out(model: str, path: str | None) -> Path:
    """Where `load_model` finds the adapter: the package for built-in names, else beside the
    checkpoint."""
    from fastspec.model.loader import BUILTINS
    base_name = model.partition(":")[0]
    if model in BUILTINS or base_name == "tiny-random" or path is None:
        return Path(__file__).resolve().parent.parent / "adapters" / model.replace(":", "-") / "draft"
    p = Path(path)
    return (p if p.is_dir() else p.parent) / "draft"


def checkpoint_dir(model: str, out: Path) -> Path:
    from fastspec.model.loader import cache_dir
    tag = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:8]
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(model).name) or "model"
    return cache_dir() / "train" / f"{slug}-{tag}"


def _r(x, nd):
    return "n/a" if x is None else round(x, nd)


def _pick_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FastspecError("--device cuda requested but no CUDA device is available")
    return device


def _load_base(model: str, dtype: str):
    from fastspec.model.loader import load_model
    try:
        return load_model(model, dtype=dtype, adapter=None)   # train from the plain base model
    except TypeError:       # a loader without adapter support
        return load_model(model, dtype=dtype)


@click.command("train-drafter")
@click.option("--model", "-m", default="smollm2-135m", show_default=True,
              help="Base model: built-in name, HF directory or .gguf file.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Adapter directory [default: fastspec/adapters/<name>/draft for built-in names, "
                   "<checkpoint dir>/draft otherwise].")
@click.option("--data", type=click.Path(dir_okay=False), default=None,
              help="jsonl of prompts (field 'question') [default: $FASTSPEC_TRAIN_DATA or "
                   "../shared/data/train/gsm8k_train.jsonl].")
@click.option("--max-prompts", type=int, default=1000, show_default=True,
              help="Training prompts in all (the built-in general prompts count).")
@click.option("--target-tokens", type=int, default=256, show_default=True,
              help="Max new tokens of each self-distilled continuation.")
@click.option("--block", type=int, default=16, show_default=True, help="Draft block size.")
@click.option("--blocks-per-seq", type=int, default=16, show_default=True,
              help="Noisy blocks per sequence per step.")
@click.option("--seqs-per-step", type=int, default=4, show_default=True,
              help="Sequences per optimizer step.")
@click.option("--rank", type=int, default=32, show_default=True, help="LoRA rank.")
@click.option("--alpha", type=float, default=None, help="LoRA alpha [default: 2 * rank].")
@click.option("--targets", default="q,k,v,o", show_default=True,
              help="Attention projections that get LoRA (among q,k,v,o).")
@click.option("--lr", type=float, default=1e-3, show_default=True, help="Peak learning rate.")
@click.option("--warmup-steps", type=int, default=20, show_default=True)
@click.option("--minutes", type=float, default=60.0, show_default=True,
              help="Training time budget in all (a resumed run continues up to this total).")
@click.option("--max-steps", type=int, default=None, help="Stop after this many steps in all.")
@click.option("--kl-weight", type=float, default=0.5, show_default=True,
              help="Loss = (1-w) * CE(distilled token) + w * KL(teacher || drafter).")
@click.option("--pos-decay", type=float, default=0.8, show_default=True,
              help="Loss weight of block position i is decay**(i-1).")
@click.option("--partial-prob", type=float, default=0.2, show_default=True,
              help="Chance that a block is partially masked instead of all-MASK.")
@click.option("--small-block-prob", type=float, default=0.25, show_default=True,
              help="Chance that a block is a smaller power of two (4, 8, ...) than --block, so one "
                   "adapter serves every block size the engine may pick.")
@click.option("--gen-concurrency", type=int, default=16, show_default=True,
              help="Requests decoded together while generating the targets.")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda[:N].")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from this --out's checkpoint when there is one.")
@click.option("--seed", type=int, default=0, show_default=True)
@user_errors(interrupted="interrupted (the last checkpoint is kept: rerun the same command to resume)")
def train_drafter(model, out, data, max_prompts, target_tokens, block, blocks_per_seq, seqs_per_step,
                  rank, alpha, targets, lr, warmup_steps, minutes, max_steps, kl_weight, pos_decay,
                  partial_prob, small_block_prob, gen_concurrency, device, resume, seed):
    """Train the draft adapter (LoRA + MASK embedding) by block diffusion on self-distilled data."""
    from rich.console import Console

    from fastspec.train.data import (build_targets, default_data_path, model_fingerprint,
                                     target_cache_path, training_prompts)
    from fastspec.train.trainer import LOG_FILE, DraftTrainer, TrainConfig

    console = Console()
    target_list = tuple(t.strip() for t in targets.split(",") if t.strip())
    cfg = TrainConfig(block=block, blocks_per_seq=blocks_per_seq, seqs_per_step=seqs_per_step,
                      rank=rank, alpha=float(alpha if alpha is not None else 2 * rank),
                      targets=target_list, lr=lr, warmup_steps=warmup_steps, minutes=minutes,
                      max_steps=max_steps, kl_weight=kl_weight, pos_decay=pos_decay,
                      partial_prob=partial_prob, small_block_prob=small_block_prob, seed=seed)
    if target_tokens < 2:
        raise FastspecError(f"--target-tokens must be >= 2, got {target_tokens}")
    if gen_concurrency < 1:
        raise FastspecError(f"--gen-concurrency must be >= 1, got {gen_concurrency}")
    dev = _pick_device(device)
    data_path = Path(data) if data else default_data_path()
    if data_path is None:
        console.print("[yellow]warning:[/] no GSM8K train file found (set $FASTSPEC_TRAIN_DATA or "
                      "--data): training on the built-in general prompts only")

    with console.status(f"loading {model} ..."):
        loaded = _load_base(model, "float32")
    loaded.model.to(dev)
    out_dir = Path(out) if out else default_out(model, loaded.path)
    ckpt = checkpoint_dir(model, out_dir)
    prompts = training_prompts(data_path, max_prompts, seed=seed)
    if loaded.tokenizer is None:
        raise FastspecError(f"{model} has no tokenizer: train-drafter needs text prompts")

    cache_file = target_cache_path(loaded, target_tokens)
    t0 = time.perf_counter()
    # Targets come from the compiled engine (several times faster than eager at C=16).
    examples = build_targets(loaded, prompts, target_tokens, cache_file, concurrency=gen_concurrency,
                             console=console, backend="auto")
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(e.target_ids) for e in examples)
    console.print(f"targets: {len(examples)} sequences, {n_tok} tokens ({cache_file}"
                  f"{', generated in %.0f s' % gen_s if gen_s > 5 else ''})", soft_wrap=True)

    argv = ["fastspec", "train-drafter", "--model", model, "--out", str(out_dir)]
    if data:
        argv += ["--data", str(data)]
    argv += ["--max-prompts", str(max_prompts), "--target-tokens", str(target_tokens),
             "--block", str(block), "--blocks-per-seq", str(blocks_per_seq),
             "--seqs-per-step", str(seqs_per_step), "--rank", str(rank), "--alpha", f"{cfg.alpha:g}",
             "--targets", ",".join(target_list), "--lr", f"{lr:g}", "--warmup-steps", str(warmup_steps),
             "--minutes", f"{minutes:g}", "--kl-weight", f"{kl_weight:g}", "--pos-decay", f"{pos_decay:g}",
             "--partial-prob", f"{partial_prob:g}", "--small-block-prob", f"{small_block_prob:g}",
             "--seed", str(seed)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    command = shlex.join(argv)

    meta = {"model": model, "model_fingerprint": model_fingerprint(loaded.model, loaded.name),
            "data": str(data_path) if data_path else None, "prompts": len(prompts),
            "sequences": len(examples), "target_tokens_per_seq": target_tokens,
            "objective": "block diffusion, self-distilled targets", "command": command}
    trainer = DraftTrainer(loaded.model, examples, cfg, out_dir=out_dir, ckpt_dir=ckpt,
                           log_path=out_dir / LOG_FILE, model_key=meta["model_fingerprint"],
                           meta=meta)
    summary = trainer.train(resume=resume, console=console)

    console.print(
        f"\ndraft adapter -> {out_dir}\n"
        f"  steps {summary['steps']} ({'resumed, ' if summary['resumed'] else ''}"
        f"{summary['run_steps']} this run), {summary['target_tokens']} target tokens, "
        f"{summary['elapsed_s'] / 60:.1f} min of training\n"
        f"  this run: {summary['target_tokens_per_s']:.0f} target tok/s, "
        f"{summary['seconds_per_step']:.2f} s/step on {dev}\n"
        f"  loss {_r(summary['loss'], 4)}, accepted mask drafts per block {_r(summary['accept'], 2)}, "
        f"greedy tau proxy {_r(summary['tau'], 2)} (teacher-forced, training data)\n"
        f"  log {out_dir / LOG_FILE}; checkpoint {ckpt}\n"
        f"command (rerun to resume, raise --minutes to train longer):\n  {command}",
        highlight=False, markup=False, soft_wrap=True)
