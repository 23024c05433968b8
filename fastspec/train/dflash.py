"""Training a DFlash drafter by self-distillation (`fastspec train-drafter --kind dflash`).

The data are the LoRA adapter's: each prompt with the target's own greedy continuation
(`fastspec.train.data.build_targets`, cached per model). The target stays frozen (its embeddings
and LM head are the drafter's too); the drafter (fc, hidden_norm, its layers, norm) learns.
One step, for R sequences:

1. target pass (no grad): the whole sequence, causal, capturing the drafter's target layers ->
   the context hidden states at every position, and the teacher logits where a loss is taken.
2. drafter pass (grad): K anchors s per sequence inside the continuation. Block j is exactly the
   inference draft block of a round whose committed prefix ends at s:

       [x_s, MASK × (B−1)]  at positions s .. s+B−1, seeing the context of positions < s

   and its own block bidirectionally; blocks never see each other. The context K/V of a sequence
   is computed once from its features (all positions) and every block masks what it may see:

       anchors 3 and 5, B = 3:   tokens  x3 M M | x5 M M     positions 3 4 5 | 5 6 7
                                 context seen   0..2         0..4

   Block position i >= 1 predicts x_{s+i} (in place, as at inference).

Loss: (1 − kl_weight) · CE(x_{s+i}) + kl_weight · KL(teacher at s+i−1 ‖ drafter), weighted by
pos_decay^(i−1) (a draft counts only if all before it are accepted).

A fresh drafter's layers start as copies of the target's top layers (q/k norms at 1), `fc` as
the mean of the captured layers. The drafter is saved in the public DFlash format
(`fastspec.model.dflash.save_dflash`); training state (drafter, optimizer, RNG, counters) in a
safetensors checkpoint, so an interrupted run resumes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fastspec.config import FastspecError
from fastspec.layout import cache_mask, causal_block
from fastspec.model.dflash import (DFlashDrafter, default_target_layer_ids, drafter_config_for,
                                   save_dflash)
from fastspec.train.data import Example
from fastspec.train.trainer import TrainLoop, precision_check

CHECKPOINT_FILE = "dflash_checkpoint.safetensors"
LOG_FILE = "train_log.jsonl"


@dataclass
class DFlashTrainConfig:
    draft_layers: int = 2
    target_layers: tuple[int, ...] | None = None   # None: 4 spread evenly (default_target_layer_ids)
    block: int = 16                  # training block (seed + masks); inference may use fewer
    mask_token_id: int = -1          # a target vocabulary id; -1: chosen for the model
    blocks_per_seq: int = 8          # anchors per sequence per step
    seqs_per_step: int = 2
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minutes: float = 60.0
    max_steps: int | None = None
    kl_weight: float = 0.5
    pos_decay: float = 0.85
    precision: str = "fp32"          # fp32, or bf16 autocast (see TrainConfig.precision)
    seed: int = 0
    log_every: int = 5
    ckpt_every_s: float = 300.0

    def __post_init__(self):
        if self.target_layers is not None:
            self.target_layers = tuple(int(i) for i in self.target_layers)
        checks = [(self.draft_layers >= 1, "--draft-layers must be >= 1"),
                  (self.block >= 2, "--block must be >= 2"),
                  (self.blocks_per_seq >= 1, "--blocks-per-seq must be >= 1"),
                  (self.seqs_per_step >= 1, "--seqs-per-step must be >= 1"),
                  (self.lr > 0, "--lr must be > 0"), (self.minutes > 0, "--minutes must be > 0"),
                  (0 <= self.kl_weight <= 1, "--kl-weight must be in [0, 1]"),
                  (0 < self.pos_decay <= 1, "--pos-decay must be in (0, 1]"),
                  (self.target_layers is None or len(self.target_layers) >= 1,
                   "--target-layers names no layer"),
                  precision_check(self.precision)]
        for ok, msg in checks:
            if not ok:
                raise FastspecError(msg)


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """A vocabulary id no prompt or answer uses: the tokenizer's last added special token that
    is not BOS/EOS/PAD/UNK (SmolLM2: 16 `<empty_output>`), else the last id."""
    if tokenizer is not None:
        reserved = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids = [int(i) for i in added if int(i) not in reserved and int(i) < vocab_size]
        if ids:
            return max(ids)
    return vocab_size - 1


def init_drafter(target, cfg: DFlashTrainConfig, seed: int = 0) -> DFlashDrafter:
    """A fresh drafter for `target` (a LlamaModel): its layers copied from the target's top
    layers, q/k norms at 1, fc = the mean of the captured layers."""
    t = target.cfg
    ids = cfg.target_layers or default_target_layer_ids(t.num_layers, min(4, t.num_layers))
    mask_id = cfg.mask_token_id if cfg.mask_token_id >= 0 else t.vocab_size - 1
    dcfg = drafter_config_for(t, cfg.draft_layers, ids, cfg.block, mask_id)
    ref = target.embed
    drafter = DFlashDrafter(dcfg, max_positions=target.rope_cos.shape[0]).init_random(seed)
    drafter = drafter.to(ref.device, ref.dtype)
    H, K = t.hidden_size, len(dcfg.target_layer_ids)
    q = t.num_heads * t.head_dim
    with torch.no_grad():
        drafter.fc.copy_(torch.eye(H, device=ref.device).repeat(1, K) / K)
        for j, layer in enumerate(drafter.layers):
            src = target.layers[max(t.num_layers - cfg.draft_layers + j, 0)]
            layer.wq.copy_(src.attn.wqkv[:q])
            layer.wkv.copy_(src.attn.wqkv[q:])
            layer.wo.copy_(src.attn.wo)
            if layer.bq is not None:
                layer.bq.copy_(src.attn.bqkv[:q])
                layer.bkv.copy_(src.attn.bqkv[q:])
                layer.bo.zero_()
            for norm in (layer.q_norm, layer.k_norm):
                if norm is not None:
                    norm.weight.fill_(1.0)
            layer.attn_norm.weight.copy_(src.attn_norm.weight)
            layer.mlp_norm.weight.copy_(src.mlp_norm.weight)
            layer.mlp.w_gate_up.copy_(src.mlp.w_gate_up)
            layer.mlp.w_down.copy_(src.mlp.w_down)
        drafter.norm.weight.copy_(target.norm.weight)
        drafter.hidden_norm.weight.fill_(1.0)
    return drafter


# --- one batch --------------------------------------------------------------------------------
@dataclass
class DFlashBatch:
    ids: torch.Tensor          # [R, T] sequences (padded with 0)
    lengths: torch.Tensor      # [R]
    starts: torch.Tensor       # [R, K] anchors (the block's seed position)

    def to(self, device) -> "DFlashBatch":
        return DFlashBatch(self.ids.to(device), self.lengths.to(device), self.starts.to(device))


def make_dflash_batch(examples: Sequence[Example], starts: torch.Tensor) -> DFlashBatch:
    lens = torch.tensor([len(e.ids) for e in examples])
    ids = torch.zeros(len(examples), int(lens.max()), dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
    return DFlashBatch(ids, lens, starts)


def target_pass(target, drafter: DFlashDrafter, batch: DFlashBatch, teacher_index: torch.Tensor | None):
    """No-grad causal pass of the target: (captured hidden [R, T, K·hidden], teacher logits at
    teacher_index [R, M] or None)."""
    R, T = batch.ids.shape
    dev, c = batch.ids.device, target.cfg
    k = torch.zeros(c.num_layers, R, c.num_kv_heads, T, c.head_dim, dtype=target.embed.dtype, device=dev)
    v = torch.zeros_like(k)
    cols = torch.arange(T, device=dev).expand(R, T)
    mask = cache_mask(torch.zeros(R, dtype=torch.long, device=dev), causal_block(T, dev), T)
    index = teacher_index if teacher_index is not None else torch.zeros(R, 1, dtype=torch.long, device=dev)
    with torch.no_grad():
        logits, hidden = target(batch.ids, cols.clamp(max=target.rope_cos.shape[0] - 1), k, v, cols,
                                mask, torch.arange(R, device=dev), logits_index=index,
                                capture=drafter.cfg.target_layer_ids)
    return hidden, (logits if teacher_index is not None else None)


def block_layout(drafter: DFlashDrafter, batch: DFlashBatch, block: int):
    """The packed blocks: ids, positions [R, K·B], in-block index i [K·B], context mask
    [R, K·B, T] (positions < the block's anchor) and block mask [R, K·B, K·B] (own block)."""
    R, K = batch.starts.shape
    T, dev = batch.ids.shape[1], batch.ids.device
    i = torch.arange(block, device=dev)
    pos = (batch.starts[..., None] + i).view(R, K * block)                     # [R, K·B]
    seed = torch.gather(batch.ids, 1, batch.starts)                            # [R, K]
    ids = torch.where(i == 0, seed[..., None], torch.full_like(seed[..., None], drafter.cfg.mask_token_id))
    anchor = batch.starts[..., None].expand(R, K, block).reshape(R, K * block)
    ctx_mask = torch.arange(T, device=dev)[None, None, :] < anchor[..., None]
    blk = torch.arange(K, device=dev).repeat_interleave(block)
    block_mask = (blk[:, None] == blk[None, :]).expand(R, K * block, K * block)
    return ids.view(R, K * block), pos, i.repeat(K), ctx_mask, block_mask


def dflash_loss(target, drafter: DFlashDrafter, batch: DFlashBatch, block: int,
                kl_weight: float = 0.5, pos_decay: float = 0.85) -> tuple[torch.Tensor, dict]:
    """Weighted CE/KL over every block position >= 1 (see the module doc); (loss, metrics)."""
    R, K = batch.starts.shape
    T, dev = batch.ids.shape[1], batch.ids.device
    ids, pos, inner, ctx_mask, block_mask = block_layout(drafter, batch, block)
    keep = inner > 0                                                   # positions with a target
    q_index = torch.nonzero(keep)[:, 0]                                # [K·(B−1)], same every row
    tgt_pos = pos[:, q_index]                                          # [R, M] predicted position
    target_tok = torch.gather(batch.ids, 1, tgt_pos.clamp(max=T - 1))
    counted = (tgt_pos < batch.lengths[:, None]) & (target_tok != drafter.cfg.mask_token_id)
    hidden, teacher = target_pass(target, drafter, batch,
                                  (tgt_pos - 1).clamp(max=T - 1) if kl_weight > 0 else None)
    ctx_pos = torch.arange(T, device=dev).expand(R, T)
    ctx_k, ctx_v = drafter.context_kv(hidden, ctx_pos)
    x = F.embedding(ids, target.embed).to(drafter.fc.dtype)
    h = drafter(x, pos, ctx_k, ctx_v, ctx_pos, ctx_mask, block_mask)[:, q_index]
    logits = F.linear(h.to(target.head_weight.dtype), target.head_weight).float()
    logits[..., drafter.cfg.mask_token_id] = float("-inf")              # MASK is never a draft
    logp = F.log_softmax(logits, -1)
    ce = -torch.gather(logp, 2, target_tok[..., None])[..., 0]
    per = (1 - kl_weight) * ce
    kl = None
    if teacher is not None:
        # The teacher without MASK too (the drafter can never say it): both laws over the rest.
        teacher = teacher.float()
        teacher[..., drafter.cfg.mask_token_id] = float("-inf")
        tlogp = F.log_softmax(teacher, -1)
        terms = tlogp.exp() * (tlogp - logp)
        kl = torch.where(torch.isfinite(tlogp), terms, torch.zeros_like(terms)).sum(-1)
        per = per + kl_weight * kl
    w = pos_decay ** (inner[q_index] - 1).float()[None, :] * counted.float()
    loss = (per * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        n = counted.sum().clamp(min=1)
        correct = (logits.argmax(-1) == target_tok) & counted
        grid = correct.view(R, K, block - 1)
        run = grid.long().cumprod(-1).sum(-1).float()                  # accepted drafts per block
        metrics = {"loss": loss.detach(), "ce": (ce * counted).sum() / n,
                   "kl": (kl * counted).sum() / n if kl is not None else torch.zeros((), device=dev),
                   "acc": correct.sum() / n, "acc1": grid[..., 0].float().mean(),
                   "accept": run.mean(), "tau": (run + 1).mean(), "target_tokens": counted.sum()}
    return loss, metrics


# --- the trainer ------------------------------------------------------------------------------
class DFlashTrainer(TrainLoop):
    """Trains a fresh (or resumed) DFlash drafter for `target` on `examples`."""

    def __init__(self, target, examples: Sequence[Example], cfg: DFlashTrainConfig,
                 out_dir=None, ckpt_dir=None, log_path=None, model_key: str = "",
                 meta: dict | None = None, tokenizer=None, init_drafter_dir=None):
        """init_drafter_dir: a saved DFlash drafter directory to start from (warm start: its weights,
        a fresh optimizer and schedule) instead of copies of the target's top layers; it must
        have this run's shape (layers, target layers, block, MASK id). A checkpoint of this run,
        when resuming, wins."""
        self.target, self.cfg = target, cfg
        self.examples = [e for e in examples if len(e.target_ids) >= 2]
        if not self.examples:
            raise FastspecError("no training example has a continuation of 2+ tokens")
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.ckpt_dir = None if ckpt_dir is None else Path(ckpt_dir)
        self.log_path = None if log_path is None else Path(log_path)
        self.model_key, self.meta = model_key, dict(meta or {})
        if cfg.mask_token_id < 0:
            cfg.mask_token_id = default_mask_token_id(tokenizer, target.cfg.vocab_size)
        target.requires_grad_(False)
        self.drafter = init_drafter(target, cfg, cfg.seed).train()
        if init_drafter_dir is not None:
            self._init_from(Path(init_drafter_dir))
        self.params = [p for p in self.drafter.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.99),
                                     weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = self.target_tokens = 0
        self.elapsed_s = 0.0
        self.perm = torch.randperm(len(self.examples), generator=self.gen)
        self.cursor = self.epoch = 0

    def _init_from(self, d: Path) -> None:
        from fastspec.model.dflash import load_dflash
        saved = load_dflash(d, self.target, dtype=self.drafter.fc.dtype, attach=False)
        mine, theirs = self.drafter.cfg.to_hf(), saved.cfg.to_hf()
        for k in sorted(set(mine) | set(theirs)):
            if k != "fastspec" and mine.get(k) != theirs.get(k):
                raise FastspecError(f"--init-adapter {d} has {k}={theirs.get(k)!r}, this run "
                                    f"{mine.get(k)!r}: use the same settings")
        src, dst = saved.state_dict_hf(), self.drafter.state_dict_hf()
        if set(src) != set(dst):
            raise FastspecError(f"--init-adapter {d} holds tensors {sorted(set(src) ^ set(dst))} "
                                "this run's drafter does not match")
        with torch.no_grad():
            for name, v in dst.items():
                v.copy_(src[name])
        self.meta.setdefault("init_drafter", str(d))
        # The lineage travels with the drafter (its folder may later hold this run's output).
        self.meta.setdefault("init_drafter_meta", dict(saved.cfg.extra or {}))

    def sample_batch(self) -> DFlashBatch:
        cfg, g = self.cfg, self.gen
        exs = []
        while len(exs) < cfg.seqs_per_step:
            if self.cursor >= len(self.perm):
                self.perm = torch.randperm(len(self.examples), generator=g)
                self.cursor, self.epoch = 0, self.epoch + 1
            exs.append(self.examples[int(self.perm[self.cursor])])
            self.cursor += 1
        lo = torch.tensor([e.prompt_len for e in exs])[:, None]
        hi = torch.tensor([len(e.ids) - 2 for e in exs])[:, None]          # x_{s+1} exists
        hi = torch.minimum(hi, torch.tensor(self.target.rope_cos.shape[0] - cfg.block)).clamp(min=lo)
        u = torch.rand(len(exs), cfg.blocks_per_seq, generator=g)
        starts = lo + (u * (hi - lo + 1)).long().clamp(max=hi - lo)
        return make_dflash_batch(exs, starts).to(self.target.embed.device)

    label = "training DFlash drafter"

    def loss(self, batch: DFlashBatch):
        return dflash_loss(self.target, self.drafter, batch, self.cfg.block, self.cfg.kl_weight,
                           self.cfg.pos_decay)

    def start_fields(self) -> dict:
        return {"kind": "dflash"}

    def save_output(self) -> Path:
        return self.save_drafter()

    # --- saving ---
    def save_drafter(self, directory=None) -> Path:
        d = Path(directory) if directory is not None else self.out_dir
        if d is None:
            raise FastspecError("no output directory")
        self.drafter.cfg.extra = {**self.meta, "steps": self.step, "target_tokens": self.target_tokens,
                                  "train_seconds": round(self.elapsed_s, 1), "recipe": self.recipe()}
        return save_dflash(self.drafter, d)

    def save_checkpoint(self, directory=None) -> Path:
        d = Path(directory) if directory is not None else self.ckpt_dir
        if d is None:
            raise FastspecError("no checkpoint directory")
        d.mkdir(parents=True, exist_ok=True)
        tensors = {f"drafter.{k}": v.detach().float().cpu().clone().contiguous()
                   for k, v in self.drafter.state_dict_hf().items()}
        steps = {}
        for i, s in self.opt.state_dict()["state"].items():
            tensors[f"opt.{i}.exp_avg"] = s["exp_avg"].cpu().contiguous()
            tensors[f"opt.{i}.exp_avg_sq"] = s["exp_avg_sq"].cpu().contiguous()
            steps[str(i)] = float(s["step"])
        tensors["rng"], tensors["perm"] = self.gen.get_state(), self.perm.clone()
        scalars = {"step": self.step, "target_tokens": self.target_tokens, "elapsed_s": self.elapsed_s,
                   "epoch": self.epoch, "cursor": self.cursor, "opt_steps": steps,
                   "num_examples": len(self.examples), "model_key": self.model_key,
                   "drafter_config": self.drafter.cfg.to_hf() | {"fastspec": {}}}
        tmp = d / (CHECKPOINT_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"state": json.dumps(scalars)})
        os.replace(tmp, d / CHECKPOINT_FILE)
        return d / CHECKPOINT_FILE

    def load_checkpoint(self, directory=None) -> bool:
        d = Path(directory) if directory is not None else self.ckpt_dir
        f = None if d is None else d / CHECKPOINT_FILE
        if f is None or not f.is_file():
            return False
        try:
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as h:
                scalars = json.loads(h.metadata()["state"])
            tensors = load_file(str(f))
        except Exception as e:  # corrupt / foreign file: one line
            raise FastspecError(f"cannot read DFlash training checkpoint {f}: "
                                f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
        mine = self.drafter.cfg.to_hf() | {"fastspec": {}}
        if scalars.get("drafter_config") != json.loads(json.dumps(mine)):
            raise FastspecError(f"checkpoint {f} was trained with another drafter shape or target "
                                "layers: use the same settings or --no-resume")
        if self.model_key and scalars.get("model_key") not in ("", None, self.model_key):
            raise FastspecError(f"checkpoint {f} belongs to another model: use --no-resume or another --out")
        with torch.no_grad():
            for k, v in self.drafter.state_dict_hf().items():
                v.copy_(tensors[f"drafter.{k}"])
        opt_sd = self.opt.state_dict()
        opt_sd["state"] = {int(i): {"step": torch.tensor(st),
                                    "exp_avg": tensors[f"opt.{i}.exp_avg"].to(self.params[int(i)]),
                                    "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"].to(self.params[int(i)])}
                           for i, st in scalars["opt_steps"].items()}
        self.opt.load_state_dict(opt_sd)
        self.gen.set_state(tensors["rng"])
        self.step, self.target_tokens = int(scalars["step"]), int(scalars["target_tokens"])
        self.elapsed_s, self.epoch = float(scalars["elapsed_s"]), int(scalars["epoch"])
        if scalars.get("num_examples") == len(self.examples):
            self.perm, self.cursor = tensors["perm"].long(), int(scalars["cursor"])
        return True
