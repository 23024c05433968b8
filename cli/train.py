"""`fastspec train-drafter`: self-distill targets, then train the draft adapter on them.

    fastspec train-drafter                        # SmolLM2-135M, GSM8K train + built-in prompts
    fastspec train-drafter --minutes 240 --max-prompts 3000 --train-data gsm8k_train.jsonl:0.4,code.jsonl:0.3
    fastspec train-drafter --init-adapter fastspec/adapters/smollm2-135m/draft --out DIR  # warm start
    fastspec train-drafter --kind dflash --minutes 120   # a separate DFlash drafter (same targets)

The adapter lands where `load_model` looks for it (`fastspec/adapters/<name>/draft` for built-in
names, `<checkpoint dir>/draft` otherwise). Training state (adapter + optimizer + RNG, safetensors
with JSON scalars) is checkpointed under $FASTSPEC_CACHE/train/, so an interrupted run resumes
with the same command (SIGTERM saves a checkpoint too); the loss / acceptance log is
`<out>/train_log.jsonl`, whose first line per (re)start records the command, data and convention.
One adapter serves every block size: `--blocks` is the mixture of block sizes drawn per block.
`--seedless P` also trains a share P of the blocks in TiDAR's seedless pre-draft layout (the seed
slot masked too: drafting past a correction not emitted yet), the layout `--method tidar` and
`recguide[seed=mask]` pre-draft with; the adapter's convention then records `seedless`.

`--kind dflash` trains a DFlash drafter instead (fastspec/train/dflash.py): `--draft-layers`
decoder layers reading the target layers `--target-layers`, blocks of `--draft-block`, saved in the
public DFlash format (config.json + model.safetensors) in `<name>/dflash` beside the adapter's
place (`fastspec.model.dflash.find_dflash` looks there); `--init-adapter DIR` there warm-starts
from a saved DFlash drafter of the same shape; the adapter-only options are ignored.
"""
from __future__ import annotations

import hashlib
import shlex
import signal
import sys
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
    from fastspec.model.loader import resolve_device
    return str(resolve_device(device))


def _load_base(model: str, dtype: str):
    from fastspec.model.loader import load_model
    try:
        return load_model(model, dtype=dtype, adapter=None)   # train from the plain base model
    except TypeError:       # a loader without adapter support
        return load_model(model, dtype=dtype)


DEFAULT_BLOCKS = "4:0.2,8:0.3,16:0.25,32:0.25"


@click.command("train-drafter")
@click.option("--model", "-m", default="smollm2-135m", show_default=True,
              help="Base model: built-in name, HF directory or .gguf file.")
@click.option("--kind", type=click.Choice(["lora", "dflash"]), default="lora", show_default=True,
              help="lora: the self-speculative draft adapter; dflash: a separate DFlash drafter (a "
                   "few layers on the target's hidden states, public DFlash format).")
@click.option("--draft-layers", type=int, default=2, show_default=True,
              help="dflash: decoder layers of the drafter.")
@click.option("--target-layers", default=None,
              help="dflash: target layers whose outputs the drafter reads, e.g. 1,10,18,27 "
                   "[default: 4 spread evenly].")
@click.option("--draft-block", type=int, default=16, show_default=True,
              help="dflash: training block size (seed + masks).")
@click.option("--mask-token-id", type=int, default=None,
              help="dflash: the MASK token, a vocabulary id [default: the tokenizer's last special "
                   "token that is not BOS/EOS/PAD/UNK].")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Adapter directory [default: fastspec/adapters/<name>/draft for built-in names, "
                   "<checkpoint dir>/draft otherwise].")
@click.option("--train-data", "--data", "train_data", default=None,
              help="Prompt files FILE[:weight],... (jsonl, field 'question' or 'prompt'), mixed by "
                   "weight [default: $FASTSPEC_TRAIN_DATA or ../shared/data/train/gsm8k_train.jsonl, "
                   "plus built-in general prompts]. Benchmark data is refused.")
@click.option("--max-prompts", type=int, default=1000, show_default=True,
              help="Training prompts in all.")
@click.option("--target-tokens", type=int, default=256, show_default=True,
              help="Max new tokens of each self-distilled continuation.")
@click.option("--blocks", default=DEFAULT_BLOCKS, show_default=True,
              help="Draft block sizes SIZE[:weight],..., drawn per training block by weight.")
@click.option("--convention", type=click.Choice(["fastspec", "nld"]), default="fastspec",
              show_default=True, help="Drafting convention the adapter is trained for.")
@click.option("--blocks-per-seq", type=int, default=16, show_default=True,
              help="Noisy blocks per sequence per step.")
@click.option("--seqs-per-step", type=int, default=4, show_default=True,
              help="Sequences per optimizer step.")
@click.option("--rank", type=int, default=32, show_default=True, help="LoRA rank.")
@click.option("--alpha", type=float, default=None, help="LoRA alpha [default: 2 * rank].")
@click.option("--targets", default="q,k,v,o", show_default=True,
              help="Projections that get LoRA: attention's q,k,v,o and the MLP's gate,up,down.")
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
@click.option("--seedless", type=float, default=0.0, show_default=True,
              help="Chance that a block is TiDAR's seedless pre-draft (its seed slot masked "
                   "too), the layout tidar pre-drafts with.")
@click.option("--init-adapter", type=click.Path(file_okay=False), default=None,
              help="Start from this saved adapter (same rank; its targets among this run's, new "
                   "ones start as the identity) instead of a fresh one; with --kind dflash, from "
                   "this saved DFlash drafter (same shape). A checkpoint of --out, when resuming, "
                   "wins.")
@click.option("--gen-concurrency", type=int, default=16, show_default=True,
              help="Requests decoded together while generating the targets.")
@click.option("--gen-backend", type=click.Choice(["auto", "compile", "eager"]), default="auto",
              show_default=True, help="Engine backend that generates the targets (same tokens).")
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Training compute: bf16 runs forward and backward under bf16 autocast (weights, "
                   "gradients and optimizer state stay fp32); faster on CPUs with native bf16 "
                   "(AVX512-BF16, AMX: 1.35x a step on Zen 4), slower elsewhere.")
@click.option("--threads", type=int, default=None, help="torch CPU threads [default: torch's].")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda[:N].")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from this --out's checkpoint when there is one.")
@click.option("--seed", type=int, default=0, show_default=True)
@user_errors(interrupted="interrupted (the last checkpoint is kept: rerun the same command to resume)")
def train_drafter(**opts):
    """Train the draft adapter (LoRA + MASK embedding) by block diffusion on self-distilled data."""
    import torch
    from rich.console import Console

    from fastspec.train.data import (build_targets, default_data_path, mixture_prompts,
                                     model_fingerprint, parse_mixture, target_cache_path,
                                     training_prompts)
    from fastspec.train.trainer import LOG_FILE, DraftTrainer

    o = opts
    console = Console()
    check_kind_options(o["kind"], click.get_current_context())
    cfg = train_config(o) if o["kind"] == "lora" else dflash_config(o)
    if o["target_tokens"] < 2:
        raise FastspecError(f"--target-tokens must be >= 2, got {o['target_tokens']}")
    if o["gen_concurrency"] < 1:
        raise FastspecError(f"--gen-concurrency must be >= 1, got {o['gen_concurrency']}")
    if o["threads"]:
        torch.set_num_threads(o["threads"])
    dev = _pick_device(o["device"])
    if cfg.precision == "bf16" and dev == "cpu" and not _native_bf16():
        console.print("[yellow]note:[/] this CPU has no native bf16 (AVX512-BF16 or AMX): "
                      "--precision bf16 runs emulated, likely slower than fp32", soft_wrap=True)
    if o["train_data"]:
        prompts, mixture = mixture_prompts(parse_mixture(o["train_data"]), o["max_prompts"], o["seed"])
    else:
        data_path = default_data_path()
        if data_path is None:
            console.print("[yellow]warning:[/] no GSM8K train file found (set $FASTSPEC_TRAIN_DATA "
                          "or --train-data): training on the built-in general prompts only")
        prompts = training_prompts(data_path, o["max_prompts"], seed=o["seed"])
        mixture = [{"path": str(data_path) if data_path else None, "builtin_general_prompts": True,
                    "prompts": len(prompts)}]

    with console.status(f"loading {o['model']} ..."):
        loaded = _load_base(o["model"], "float32")
    loaded.model.to(dev)
    out_dir = Path(o["out"]) if o["out"] else default_out(o["model"], loaded.path)
    if o["kind"] == "dflash" and not o["out"]:
        out_dir = out_dir.parent / "dflash"
    ckpt = checkpoint_dir(o["model"], out_dir)
    if loaded.tokenizer is None:
        raise FastspecError(f"{o['model']} has no tokenizer: train-drafter needs text prompts")

    cache_file = target_cache_path(loaded, o["target_tokens"])
    t0 = time.perf_counter()
    # Targets come from the compiled engine by default (several times faster than eager at C=16).
    examples = build_targets(loaded, prompts, o["target_tokens"], cache_file,
                             concurrency=o["gen_concurrency"], console=console,
                             backend=o["gen_backend"])
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(e.target_ids) for e in examples)
    console.print(f"targets: {len(examples)} sequences, {n_tok} tokens ({cache_file}"
                  f"{', generated in %.0f s' % gen_s if gen_s > 5 else ''})", soft_wrap=True)

    command = (full_command if o["kind"] == "lora" else dflash_command)({**o, "out": str(out_dir)}, cfg)
    meta = {"model": o["model"], "model_fingerprint": model_fingerprint(loaded.model, loaded.name),
            "data": mixture, "prompts": len(prompts), "sequences": len(examples),
            "target_tokens_per_seq": o["target_tokens"], "max_prompts": o["max_prompts"],
            "objective": "block diffusion, self-distilled targets", "command": command,
            "argv": shlex.join(["fastspec", *sys.argv[1:]])
                    if Path(sys.argv[0]).name == "fastspec" else None,
            "device": dev, "threads": torch.get_num_threads()}
    if o["kind"] == "dflash":
        from fastspec.train.dflash import DFlashTrainer
        trainer = DFlashTrainer(loaded.model, examples, cfg, out_dir=out_dir, ckpt_dir=ckpt,
                                log_path=out_dir / LOG_FILE, model_key=meta["model_fingerprint"],
                                meta=meta, tokenizer=loaded.tokenizer,
                                init_drafter_dir=o["init_adapter"])
    else:
        trainer = DraftTrainer(loaded.model, examples, cfg, out_dir=out_dir, ckpt_dir=ckpt,
                               log_path=out_dir / LOG_FILE, model_key=meta["model_fingerprint"],
                               meta=meta, init_adapter=o["init_adapter"])
    # `kill` (SIGTERM) unwinds like Ctrl-C, so the run saves a checkpoint before it ends.
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = trainer.train(resume=o["resume"], console=console)
    finally:
        signal.signal(signal.SIGTERM, before)

    what = "draft adapter" if o["kind"] == "lora" else "DFlash drafter"
    console.print(
        f"\n{what} -> {out_dir}\n"
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


def _native_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX)."""
    import torch
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _interrupt(*_):
    raise KeyboardInterrupt


def _num(x: float) -> str:
    return f"{x:g}" if float(f"{x:g}") == x else repr(float(x))


# Options only one kind of drafter reads (the other kind would ignore them without a word).
KIND_OPTIONS = {"dflash": ("draft_layers", "target_layers", "draft_block", "mask_token_id"),
                "lora": ("blocks", "convention", "rank", "alpha", "targets", "partial_prob", "seedless")}


def check_kind_options(kind: str, ctx: click.Context) -> None:
    """A FastspecError when an option of the other kind of drafter was given on the command line."""
    from click.core import ParameterSource
    other = "dflash" if kind == "lora" else "lora"
    for name in KIND_OPTIONS[other]:
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            raise FastspecError(f"{flag} is a --kind {other} option; this run trains --kind {kind}")


def train_config(o: dict):
    """The TrainConfig of the command's options."""
    from fastspec.train.trainer import TrainConfig, parse_block_mix
    sizes, weights = parse_block_mix(o["blocks"])
    return TrainConfig(block_sizes=sizes, block_weights=weights, convention=o["convention"],
                       blocks_per_seq=o["blocks_per_seq"], seqs_per_step=o["seqs_per_step"],
                       rank=o["rank"], alpha=float(o["alpha"] if o["alpha"] is not None else 2 * o["rank"]),
                       targets=tuple(t.strip() for t in o["targets"].split(",") if t.strip()),
                       lr=o["lr"], warmup_steps=o["warmup_steps"], minutes=o["minutes"],
                       max_steps=o["max_steps"], kl_weight=o["kl_weight"], pos_decay=o["pos_decay"],
                       partial_prob=o["partial_prob"], seedless_prob=o["seedless"],
                       precision=o["precision"], seed=o["seed"])


def dflash_config(o: dict):
    """The DFlashTrainConfig of the command's options."""
    from fastspec.train.dflash import DFlashTrainConfig
    layers = None
    if o["target_layers"]:
        try:
            layers = tuple(int(x) for x in o["target_layers"].split(",") if x.strip())
        except ValueError:
            raise FastspecError(f"--target-layers takes comma-separated layer indices, got "
                                f"{o['target_layers']!r}") from None
    return DFlashTrainConfig(draft_layers=o["draft_layers"], target_layers=layers,
                             block=o["draft_block"],
                             mask_token_id=-1 if o["mask_token_id"] is None else o["mask_token_id"],
                             blocks_per_seq=o["blocks_per_seq"], seqs_per_step=o["seqs_per_step"],
                             lr=o["lr"], warmup_steps=o["warmup_steps"], minutes=o["minutes"],
                             max_steps=o["max_steps"], kl_weight=o["kl_weight"],
                             pos_decay=o["pos_decay"], precision=o["precision"], seed=o["seed"])


def dflash_command(o: dict, cfg) -> str:
    """The --kind dflash command with every setting spelled out (rerunning it resumes)."""
    argv = ["fastspec", "train-drafter", "--kind", "dflash", "--model", o["model"], "--out", str(o["out"])]
    if o["train_data"]:
        argv += ["--train-data", o["train_data"]]
    argv += ["--max-prompts", str(o["max_prompts"]), "--target-tokens", str(o["target_tokens"]),
             "--draft-layers", str(cfg.draft_layers), "--draft-block", str(cfg.block),
             "--blocks-per-seq", str(cfg.blocks_per_seq), "--seqs-per-step", str(cfg.seqs_per_step),
             "--lr", _num(cfg.lr), "--warmup-steps", str(cfg.warmup_steps),
             "--minutes", _num(cfg.minutes), "--kl-weight", _num(cfg.kl_weight),
             "--pos-decay", _num(cfg.pos_decay), "--seed", str(cfg.seed)]
    if cfg.target_layers is not None:
        argv += ["--target-layers", ",".join(map(str, cfg.target_layers))]
    if cfg.mask_token_id >= 0:
        argv += ["--mask-token-id", str(cfg.mask_token_id)]
    if cfg.precision != "fp32":
        argv += ["--precision", cfg.precision]
    if cfg.max_steps is not None:
        argv += ["--max-steps", str(cfg.max_steps)]
    if o.get("init_adapter"):
        argv += ["--init-adapter", str(o["init_adapter"])]
    if o.get("threads"):
        argv += ["--threads", str(o["threads"])]
    return shlex.join(argv)


def full_command(o: dict, cfg) -> str:
    """The command with every setting spelled out: rerunning it resumes (or repeats) this run."""
    argv = ["fastspec", "train-drafter", "--model", o["model"], "--out", str(o["out"])]
    if o["train_data"]:
        argv += ["--train-data", o["train_data"]]
    if o["init_adapter"]:
        argv += ["--init-adapter", str(o["init_adapter"])]
    argv += ["--max-prompts", str(o["max_prompts"]), "--target-tokens", str(o["target_tokens"]),
             "--blocks", ",".join(f"{b}:{_num(w)}" for b, w in zip(cfg.block_sizes, cfg.block_weights)),
             "--convention", cfg.convention, "--blocks-per-seq", str(cfg.blocks_per_seq),
             "--seqs-per-step", str(cfg.seqs_per_step), "--rank", str(cfg.rank),
             "--alpha", _num(cfg.alpha), "--targets", ",".join(cfg.targets), "--lr", _num(cfg.lr),
             "--warmup-steps", str(cfg.warmup_steps), "--minutes", _num(cfg.minutes),
             "--kl-weight", _num(cfg.kl_weight), "--pos-decay", _num(cfg.pos_decay),
             "--partial-prob", _num(cfg.partial_prob), "--seed", str(cfg.seed)]
    if cfg.seedless_prob > 0:
        argv += ["--seedless", _num(cfg.seedless_prob)]
    if cfg.precision != "fp32":
        argv += ["--precision", cfg.precision]
    if cfg.max_steps is not None:
        argv += ["--max-steps", str(cfg.max_steps)]
    if o.get("threads"):
        argv += ["--threads", str(o["threads"])]
    return shlex.join(argv)
