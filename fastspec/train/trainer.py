"""Training the draft adapter with a block-diffusion objective on self-distilled sequences.

The base model stays frozen; only the LoRA deltas and the MASK embedding (`adapter_parameters`)
learn. One step, for R sequences (prompt + the base model's own greedy continuation):

1. clean pass (no grad): the sequence, causal, adapter off, written into a fresh KV cache. This is
   exactly what the verifier computes, and its logits are the teacher distribution.
2. noisy pass (grad): K blocks at random start positions s inside the continuation, flattened into
   one row of K*B tokens written after the clean columns. Block j is the inference draft layout
   of a round whose committed prefix ends at s:

       [x_s (seed: adapter off, sees clean columns < s and itself),
        MASK x (B-1) (adapter on, see clean columns < s and the whole block)]

   With probability `partial_prob` a block keeps a random subset of its true tokens instead of
   all-MASK (partial masking, as in branch / tree drafts). Output at block position i predicts
   x_{s+i+1} (token shift), so the seed's output is the base model's own next token and block
   position i >= 1 is a draft.

Loss on block positions i >= 1 whose target is not visible in the input (the next input is a MASK,
or i is the last position): (1 - kl_weight) * CE(self-distilled token) + kl_weight * KL(teacher ||
drafter), weighted by pos_decay ** (i - 1) (a draft at i only counts if all before it are
accepted, so early positions matter most).

Gradients flow through the LoRA-produced K/V that the model writes into the cache in place
(autograd records the index_put). The cache handed to the model is a list of per-layer tensors
so that each layer's in-place write is its own autograd node (a single stacked tensor would make
every layer's backward copy the gradient of the whole stack).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fastspec.config import FastspecError
from fastspec.draft import (AdapterConfig, adapter_parameters, adapter_state, attach_adapter,
                            save_adapter)
from fastspec.layout import cache_mask, causal_block
from fastspec.train.data import Example

IGNORE = -100
CHECKPOINT_FILE = "checkpoint.safetensors"
CHECKPOINT_JSON = "checkpoint.json"       # a readable copy of the scalars (the file's metadata)
LOG_FILE = "train_log.jsonl"


@dataclass
class TrainConfig:
    block: int = 16                 # draft block size B (seed + B-1 masks)
    blocks_per_seq: int = 16        # K noisy blocks per sequence per step
    seqs_per_step: int = 4          # sequences (rows) per optimizer step
    rank: int = 32
    alpha: float = 64.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    lr: float = 1e-3
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio at the end of the budget
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minutes: float = 60.0           # total training time (a resumed run continues to this total)
    max_steps: int | None = None    # optional step cap (the schedule then ends at whichever is first)
    kl_weight: float = 0.5          # 0 = CE only, 1 = KL to the teacher only
    pos_decay: float = 0.8          # weight of block position i is pos_decay ** (i - 1)
    partial_prob: float = 0.2       # chance a block is partially masked instead of all-MASK
    max_keep: float = 0.5           # partially masked blocks keep each token with p ~ U(0, max_keep)
    small_block_prob: float = 0.25  # chance a block is a smaller power of two (>= 4) than `block`
    seed: int = 0
    log_every: int = 5
    ckpt_every_s: float = 300.0

    def __post_init__(self):
        self.targets = tuple(self.targets)
        checks = [(self.block >= 2, "--block must be >= 2"),
                  (self.blocks_per_seq >= 1, "--blocks-per-seq must be >= 1"),
                  (self.seqs_per_step >= 1, "--seqs-per-step must be >= 1"),
                  (self.rank >= 1, "--rank must be >= 1"),
                  (bool(self.targets) and set(self.targets) <= set("qkvo"),
                   f"--targets must be among q,k,v,o, got {','.join(self.targets) or 'nothing'}"),
                  (self.lr > 0, "--lr must be > 0"),
                  (self.minutes > 0, "--minutes must be > 0"),
                  (0 <= self.kl_weight <= 1, "--kl-weight must be in [0, 1]"),
                  (0 < self.pos_decay <= 1, "--pos-decay must be in (0, 1]"),
                  (0 <= self.partial_prob <= 1, "--partial-prob must be in [0, 1]"),
                  (0 <= self.small_block_prob <= 1, "--small-block-prob must be in [0, 1]")]
        for ok, msg in checks:
            if not ok:
                raise FastspecError(msg)

    def adapter_config(self) -> AdapterConfig:
        return AdapterConfig(rank=self.rank, alpha=self.alpha, targets=self.targets,
                             block_size=self.block)


# --- layout ---------------------------------------------------------------------------------
def draft_block_mask(block: int, device=None) -> torch.Tensor:
    """[B, B] inference draft block: the seed sees itself; every MASK sees the whole block."""
    m = torch.ones(block, block, dtype=torch.bool, device=device)
    m[0, 1:] = False
    return m


def training_mask(starts: torch.Tensor, block: int, clean_len: int,
                  sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Mask [R, K*B, clean_len + K*B] for K blocks of B tokens written after `clean_len` columns.

    Block j of row r (start s = starts[r, j], size b = sizes[r, j], default B) sees clean columns
    < s, and within its own first b positions: the seed only itself, the other tokens all b.
    Positions >= b are padding that sees only itself and that nobody sees (as in LinearSS rows
    with a smaller block than the batch's widest). Blocks never see each other.
    """
    R, K = starts.shape
    N = K * block
    dev = starts.device
    q = torch.arange(N, device=dev)
    q_block, q_pos = q // block, q % block
    if sizes is None:
        sizes = torch.full_like(starts, block)
    valid = q_pos[None, :] < sizes[:, q_block]                               # [R, N]
    clean = (torch.arange(clean_len, device=dev)[None, None, :] < starts[:, q_block][..., None]) \
        & valid[..., None]
    same = (q_block[:, None] == q_block[None, :]) & ((q_pos != 0)[:, None])   # [N, N]
    inner = same[None] & valid[:, :, None] & valid[:, None, :]
    inner = inner | torch.eye(N, dtype=torch.bool, device=dev)[None]
    return torch.cat([clean, inner], dim=-1)


@dataclass
class Batch:
    clean_ids: torch.Tensor        # [R, Tc] sequence tokens (padded with 0), causal pass
    block_ids: torch.Tensor        # [R, K*B] seed, then MASK (or a kept true token)
    positions: torch.Tensor        # [R, K*B] RoPE positions s + i
    starts: torch.Tensor           # [R, K]
    targets: torch.Tensor          # [R, K*B] next-token target, IGNORE where none
    weights: torch.Tensor          # [R, K*B] loss weight (0 = not counted; always 0 at seeds)
    all_masked: torch.Tensor       # [R, K] block is all-MASK (the inference layout)
    sizes: torch.Tensor            # [R, K] block sizes (<= block; the rest is padding)
    block: int

    @property
    def clean_len(self) -> int:
        return self.clean_ids.shape[1]

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f).to(device) for f in
                       ("clean_ids", "block_ids", "positions", "starts", "targets", "weights",
                        "all_masked", "sizes")), block=self.block)


def make_batch(examples: Sequence[Example], starts: torch.Tensor, keep: torch.Tensor, block: int,
               mask_id: int, pos_decay: float = 1.0, max_position: int | None = None,
               sizes: torch.Tensor | None = None) -> Batch:
    """Deterministic batch: `starts [R, K]` block starts (>= prompt length, <= len - 2), `keep
    [R, K, B]` bool (True keeps the true token at that block position; position 0, the seed, is
    always the true token), `sizes [R, K]` block sizes (default: all `block`)."""
    R, K = starts.shape
    sizes = torch.full_like(starts, block) if sizes is None else sizes
    B = block
    lens = torch.tensor([len(e.ids) for e in examples])
    span = int(starts.max()) + B + 1
    ids = torch.full((R, max(int(lens.max()), span)), -1, dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
    i = torch.arange(B)
    pos = starts[..., None] + i                                     # [R, K, B]
    true_tok = torch.gather(ids, 1, pos.view(R, -1)).view(R, K, B)
    nxt = torch.gather(ids, 1, (pos + 1).view(R, -1)).view(R, K, B)
    keep = keep.clone()
    keep[..., 0] = True
    inp = torch.where(keep & (true_tok >= 0), true_tok, torch.full_like(true_tok, mask_id))
    valid = i < sizes[..., None]                                    # [R, K, B] inside the block
    # A target is counted when it exists and the drafter cannot read it off the next input
    # (the next position is a MASK, or this is the block's last position).
    next_hidden = torch.ones_like(keep)
    next_hidden[..., :-1] = (inp[..., 1:] == mask_id) | ~valid[..., 1:]
    counted = (nxt >= 0) & next_hidden & (i > 0) & valid
    targets = torch.where(counted, nxt, torch.full_like(nxt, IGNORE))
    w = (pos_decay ** (i - 1).clamp(min=0).float()) * counted.float()
    # The clean pass needs columns < s (prefix) and rows up to s + B - 1 (teacher logits).
    clean_len = int(torch.minimum(lens, starts.max(1).values + B).max())
    clean = ids[:, :clean_len].clamp(min=0)
    if max_position is not None:
        pos = pos.clamp(max=max_position - 1)
    all_masked = ((inp == mask_id) | ~valid)[..., 1:].all(-1)
    return Batch(clean, inp.view(R, -1), pos.view(R, -1), starts, targets.view(R, -1),
                 w.view(R, -1), all_masked, sizes, B)


class _LayerCache(list):
    """Per-layer K (or V) buffers: the model indexes `cache[layer]` and reads `.dtype`."""

    @property
    def dtype(self) -> torch.dtype:
        return self[0].dtype


def _fresh_cache(model, rows: int, ctx: int, device, dtype) -> tuple[_LayerCache, _LayerCache]:
    cfg = model.cfg
    shape = (rows, cfg.num_kv_heads, ctx, cfg.head_dim)
    k = _LayerCache(torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers))
    v = _LayerCache(torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers))
    return k, v


def clean_pass(model, batch: Batch, teacher_index: torch.Tensor | None):
    """No-grad causal pass, adapter off: fills a fresh cache; teacher logits at teacher_index."""
    R, Tc = batch.clean_ids.shape
    dev = batch.clean_ids.device
    dtype = model.embed.dtype
    k, v = _fresh_cache(model, R, Tc + batch.block_ids.shape[1], dev, dtype)
    cols = torch.arange(Tc, device=dev).expand(R, Tc)
    mask = cache_mask(torch.zeros(R, dtype=torch.long, device=dev), causal_block(Tc, dev), Tc)
    slots = torch.arange(R, device=dev)
    index = teacher_index if teacher_index is not None else torch.zeros(R, 1, dtype=torch.long, device=dev)
    with torch.no_grad():
        teacher = model(batch.clean_ids, cols, k, v, cols, mask, slots, adapter_on=None,
                        logits_index=index)
    return k, v, (teacher if teacher_index is not None else None)


def block_forward(model, batch: Batch, k, v, logits_index: torch.Tensor | None = None) -> torch.Tensor:
    """The noisy pass over the cache filled by `clean_pass`: logits [R, K*B or len(index), V]."""
    R, N = batch.block_ids.shape
    Tc, B = batch.clean_len, batch.block
    dev = batch.block_ids.device
    cols = (Tc + torch.arange(N, device=dev)).expand(R, N)
    mask = training_mask(batch.starts, B, Tc, batch.sizes)
    adapter_on = (torch.arange(N, device=dev) % B != 0).expand(R, N)
    return model(batch.block_ids, batch.positions, k, v, cols, mask, torch.arange(R, device=dev),
                 adapter_on=adapter_on, logits_index=logits_index)


def draft_logits(model, batch: Batch) -> torch.Tensor:
    """Logits of every block token [R, K*B, V] (clean pass + noisy pass, no loss)."""
    k, v, _ = clean_pass(model, batch, None)
    return block_forward(model, batch, k, v)


def draft_loss(model, batch: Batch, kl_weight: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Weighted CE/KL over the draft positions; returns (loss, metrics)."""
    R, N = batch.block_ids.shape
    B, K = batch.block, batch.starts.shape[1]
    dev = batch.block_ids.device
    # Draft rows only (block positions 1..B-1): the seed's output is the base model's own.
    nonseed = torch.arange(N, device=dev)
    nonseed = nonseed[nonseed % B != 0].expand(R, -1)
    teacher_index = None
    if kl_weight > 0:
        # Teacher for the draft at (s, i) is the clean pass at position s + i.
        teacher_index = torch.gather(batch.positions, 1, nonseed).clamp(max=batch.clean_len - 1)
    k, v, teacher = clean_pass(model, batch, teacher_index)
    logits = block_forward(model, batch, k, v, logits_index=nonseed)
    tgt = torch.gather(batch.targets, 1, nonseed)
    w = torch.gather(batch.weights, 1, nonseed)
    logp = F.log_softmax(logits.float(), dim=-1)
    ce = -torch.gather(logp, 2, tgt.clamp(min=0)[..., None])[..., 0]
    per = (1 - kl_weight) * ce
    kl = None
    if teacher is not None:
        tlogp = F.log_softmax(teacher.float(), dim=-1)
        kl = (tlogp.exp() * (tlogp - logp)).sum(-1)
        per = per + kl_weight * kl
    wsum = w.sum().clamp(min=1e-9)
    loss = (per * w).sum() / wsum
    with torch.no_grad():
        counted = tgt != IGNORE
        n = counted.sum().clamp(min=1)
        correct = (logits.argmax(-1) == tgt) & counted
        # Greedy LinearSS on an all-MASK block of size b: the seed's draft is always right, then
        # the leading run of correct mask drafts, then a bonus token: tau = min(run + 2, b).
        run = correct.view(R, K, B - 1).long().cumprod(-1).sum(-1).float()
        tau = torch.minimum(run + 2, batch.sizes.float())
        am = batch.all_masked
        metrics = {
            "loss": loss.detach(),
            "ce": (ce * counted).sum() / n,
            "kl": (kl * counted).sum() / n if kl is not None else torch.zeros((), device=dev),
            "acc": correct.sum() / n,
            "acc1": correct.view(R, K, B - 1)[..., 0].sum()
                    / counted.view(R, K, B - 1)[..., 0].sum().clamp(min=1),
            "accept": (run * am).sum() / am.sum().clamp(min=1),
            "tau": (tau * am).sum() / am.sum().clamp(min=1),
            "target_tokens": counted.sum(),
        }
    return loss, metrics


# --- the trainer ----------------------------------------------------------------------------
class DraftTrainer:
    """Trains a fresh (or resumed) draft adapter on `examples`; see the module doc for the recipe."""

    def __init__(self, model, examples: Sequence[Example], cfg: TrainConfig,
                 out_dir: str | os.PathLike | None = None,
                 ckpt_dir: str | os.PathLike | None = None,
                 log_path: str | os.PathLike | None = None,
                 model_key: str = "", meta: dict | None = None):
        self.model = model
        self.cfg = cfg
        self.examples = [e for e in examples if len(e.target_ids) >= 2]
        if not self.examples:
            raise FastspecError("no training example has a continuation of 2+ tokens")
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.ckpt_dir = None if ckpt_dir is None else Path(ckpt_dir)
        self.log_path = None if log_path is None else Path(log_path)
        self.model_key = model_key
        self.meta = dict(meta or {})
        self.device = model.embed.device
        self.max_position = model.rope_cos.shape[0]

        self.adapter_cfg = cfg.adapter_config()
        attach_adapter(model, self.adapter_cfg, seed=cfg.seed)
        model.requires_grad_(False)
        self.params = adapter_parameters(model)
        for p in self.params:
            p.requires_grad_(True)
        self.mask_id = self.adapter_cfg.mask_token_id
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.99),
                                     weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.target_tokens = 0
        self.elapsed_s = 0.0
        self.perm = torch.randperm(len(self.examples), generator=self.gen)
        self.cursor = 0
        self.epoch = 0
        h = hashlib.sha256()
        for e in self.examples:
            h.update(json.dumps([e.prompt_ids, e.target_ids]).encode())
        self.data_key = h.hexdigest()[:16]

    # --- sampling ---
    def _next_examples(self) -> list[Example]:
        out = []
        while len(out) < self.cfg.seqs_per_step:
            if self.cursor >= len(self.perm):
                self.perm = torch.randperm(len(self.examples), generator=self.gen)
                self.cursor, self.epoch = 0, self.epoch + 1
            out.append(self.examples[int(self.perm[self.cursor])])
            self.cursor += 1
        return out

    def sample_batch(self) -> Batch:
        cfg, g = self.cfg, self.gen
        exs = self._next_examples()
        R, K, B = len(exs), cfg.blocks_per_seq, cfg.block
        lo = torch.tensor([e.prompt_len for e in exs])
        hi = torch.tensor([len(e.ids) - 2 for e in exs])        # need s + 1 inside the sequence
        u = torch.rand(R, K, generator=g)
        starts = lo[:, None] + (u * (hi - lo + 1)[:, None]).long().clamp(max=(hi - lo)[:, None])
        partial = torch.rand(R, K, 1, generator=g) < cfg.partial_prob
        rate = torch.rand(R, K, 1, generator=g) * cfg.max_keep
        keep = partial & (torch.rand(R, K, B, generator=g) < rate)
        sizes = torch.full((R, K), B, dtype=torch.long)
        smaller = [b for b in (4, 8, 16, 32, 64) if b < B]
        if smaller and cfg.small_block_prob > 0:
            pick = torch.tensor(smaller)[torch.randint(len(smaller), (R, K), generator=g)]
            sizes = torch.where(torch.rand(R, K, generator=g) < cfg.small_block_prob, pick, sizes)
        return make_batch(exs, starts, keep, B, self.mask_id, cfg.pos_decay,
                          self.max_position, sizes).to(self.device)

    # --- optimization ---
    def lr_at(self, step: int, elapsed_s: float) -> float:
        cfg = self.cfg
        frac = elapsed_s / (cfg.minutes * 60)
        if cfg.max_steps:
            frac = max(frac, step / cfg.max_steps)
        frac = min(max(frac, 0.0), 1.0)
        warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return cfg.lr * warm * cos

    def train_step(self, batch: Batch | None = None) -> dict:
        batch = batch if batch is not None else self.sample_batch()
        lr = self.lr_at(self.step, self.elapsed_s)
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss, metrics = draft_loss(self.model, batch, self.cfg.kl_weight)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        out = {k: float(v) for k, v in metrics.items()}
        out.update(lr=lr, grad_norm=float(gnorm))
        self.target_tokens += int(out["target_tokens"])
        return out

    def done(self) -> bool:
        return (self.elapsed_s >= self.cfg.minutes * 60
                or (self.cfg.max_steps is not None and self.step >= self.cfg.max_steps))

    # --- checkpoints ---
    def state_scalars(self) -> dict:
        opt_steps = {str(i): float(s["step"]) for i, s in self.opt.state_dict()["state"].items()}
        return {"version": 1, "step": self.step, "target_tokens": self.target_tokens,
                "elapsed_s": self.elapsed_s, "epoch": self.epoch, "cursor": self.cursor,
                "num_examples": len(self.examples), "data_key": self.data_key, "opt_steps": opt_steps,
                "model_key": self.model_key, "adapter_config": asdict(self.adapter_cfg),
                "train_config": asdict(self.cfg)}

    def save_checkpoint(self, directory: str | os.PathLike | None = None) -> Path:
        d = Path(directory) if directory is not None else self.ckpt_dir
        if d is None:
            raise FastspecError("no checkpoint directory")
        d.mkdir(parents=True, exist_ok=True)
        tensors = {f"adapter.{k}": v.float().cpu().contiguous()
                   for k, v in adapter_state(self.model).items()}
        for i, s in self.opt.state_dict()["state"].items():
            tensors[f"opt.{i}.exp_avg"] = s["exp_avg"].cpu().contiguous()
            tensors[f"opt.{i}.exp_avg_sq"] = s["exp_avg_sq"].cpu().contiguous()
        tensors["rng"] = self.gen.get_state()
        tensors["perm"] = self.perm.clone()
        scalars = self.state_scalars()
        tmp = d / (CHECKPOINT_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"state": json.dumps(scalars)})
        os.replace(tmp, d / CHECKPOINT_FILE)          # atomic: a crash keeps the previous one
        (d / CHECKPOINT_JSON).write_text(json.dumps(scalars, indent=1))
        return d / CHECKPOINT_FILE

    def load_checkpoint(self, directory: str | os.PathLike | None = None) -> bool:
        """Restore adapter, optimizer, RNG and counters; False when there is no checkpoint."""
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
            raise FastspecError(f"cannot read training checkpoint {f}: {e}") from None
        saved = scalars.get("adapter_config", {})
        mine = asdict(self.adapter_cfg)
        for k in ("rank", "alpha", "targets", "block_size", "mask_token_id"):
            if k in saved and (tuple(saved[k]) if k == "targets" else saved[k]) != (
                    tuple(mine[k]) if k == "targets" else mine[k]):
                raise FastspecError(f"checkpoint {f} was trained with {k}={saved[k]} (now "
                                    f"{mine[k]}): use the same settings or --no-resume")
        if self.model_key and scalars.get("model_key") and scalars["model_key"] != self.model_key:
            raise FastspecError(f"checkpoint {f} belongs to another model: use --no-resume or "
                                "another --out")
        with torch.no_grad():
            self.model.mask_embed.copy_(tensors["adapter.mask_embed"])
            for i, blk in enumerate(self.model.layers):
                for t, lora in blk.attn.lora.items():
                    lora.A.copy_(tensors[f"adapter.layers.{i}.{t}.A"])
                    lora.B.copy_(tensors[f"adapter.layers.{i}.{t}.B"])
        opt_sd = self.opt.state_dict()
        state = {}
        for key, st in scalars["opt_steps"].items():
            i = int(key)
            p = self.params[i]
            state[i] = {"step": torch.tensor(st),
                        "exp_avg": tensors[f"opt.{i}.exp_avg"].to(p.device, p.dtype),
                        "exp_avg_sq": tensors[f"opt.{i}.exp_avg_sq"].to(p.device, p.dtype)}
        opt_sd["state"] = state
        self.opt.load_state_dict(opt_sd)
        self.gen.set_state(tensors["rng"])
        self.step, self.target_tokens = int(scalars["step"]), int(scalars["target_tokens"])
        self.elapsed_s, self.epoch = float(scalars["elapsed_s"]), int(scalars["epoch"])
        if scalars.get("data_key") == self.data_key:
            self.perm, self.cursor = tensors["perm"].long(), int(scalars["cursor"])
        else:  # the data changed size: start a fresh epoch order
            self.perm, self.cursor = torch.randperm(len(self.examples), generator=self.gen), 0
        return True

    def save_adapter(self, directory: str | os.PathLike | None = None) -> Path:
        d = Path(directory) if directory is not None else self.out_dir
        if d is None:
            raise FastspecError("no output directory")
        self.adapter_cfg.meta = {**self.meta, "steps": self.step, "target_tokens": self.target_tokens,
                                 "train_seconds": round(self.elapsed_s, 1),
                                 "recipe": {k: v for k, v in asdict(self.cfg).items()
                                            if k not in ("log_every", "ckpt_every_s")}}
        save_adapter(self.model, str(d))
        return d

    # --- the loop ---
    def _log(self, row: dict) -> None:
        if self.log_path is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _trim_log(self) -> None:
        """After a resume, drop log lines past the checkpoint's step (they will be redone)."""
        if self.log_path is None or not self.log_path.is_file():
            return
        keep = []
        for line in self.log_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= self.step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        self.log_path.write_text("".join(l + "\n" for l in keep))

    def train(self, resume: bool = True, console=None, progress: bool = True) -> dict:
        """Run until the time budget (or max_steps); checkpoints, log and adapter along the way."""
        resumed = False
        if resume:
            resumed = self.load_checkpoint()
            self._trim_log()
        elif self.log_path is not None and self.log_path.is_file():
            self.log_path.unlink()
        cfg = self.cfg
        budget = cfg.minutes * 60
        bar = task = None
        if progress:
            bar = _train_progress(console)
            bar.start()
            task = bar.add_task("training drafter", total=budget, completed=min(self.elapsed_s, budget),
                                step=self.step, loss=float("nan"), tau=float("nan"), tps=0.0,
                                sps=0.0, eta="?")
        acc: dict[str, float] = {}
        n_acc, last_ckpt, log_t = 0, time.perf_counter(), self.elapsed_s
        run_steps, run_tokens, run_time = 0, 0, 0.0
        ema_loss = ema_accept = ema_tau = None
        try:
            while not self.done():
                t0 = time.perf_counter()
                m = self.train_step()
                dt = time.perf_counter() - t0
                self.elapsed_s += dt
                run_steps, run_tokens, run_time = run_steps + 1, run_tokens + int(m["target_tokens"]), run_time + dt
                for k, v in m.items():
                    acc[k] = acc.get(k, 0.0) + v
                n_acc += 1
                ema_loss = m["loss"] if ema_loss is None else 0.9 * ema_loss + 0.1 * m["loss"]
                ema_accept = m["accept"] if ema_accept is None else 0.9 * ema_accept + 0.1 * m["accept"]
                ema_tau = m["tau"] if ema_tau is None else 0.9 * ema_tau + 0.1 * m["tau"]
                if self.step % cfg.log_every == 0 or self.done():
                    row = {k: round(v / n_acc, 5) for k, v in acc.items() if k != "target_tokens"}
                    self._log({"step": self.step, "target_tokens": self.target_tokens,
                               "elapsed_s": round(self.elapsed_s, 2),
                               "step_s": round((self.elapsed_s - log_t) / n_acc, 3), **row})
                    log_t = self.elapsed_s
                    acc, n_acc = {}, 0
                if bar is not None:
                    per_step = run_time / run_steps
                    left = budget - self.elapsed_s
                    if cfg.max_steps:
                        left = min(left, (cfg.max_steps - self.step) * per_step)
                    bar.update(task, completed=min(self.elapsed_s, budget), step=self.step,
                               loss=ema_loss, tau=ema_tau, tps=run_tokens / run_time,
                               sps=per_step, eta=_fmt_s(max(left, 0.0)))
                if self.ckpt_dir is not None and time.perf_counter() - last_ckpt >= cfg.ckpt_every_s:
                    self.save_checkpoint()
                    if self.out_dir is not None:
                        self.save_adapter()
                    last_ckpt = time.perf_counter()
        finally:
            if bar is not None:
                bar.stop()
            if self.ckpt_dir is not None:
                self.save_checkpoint()
            if self.out_dir is not None:
                self.save_adapter()
        return {"steps": self.step, "target_tokens": self.target_tokens, "elapsed_s": self.elapsed_s,
                "resumed": resumed, "run_steps": run_steps, "run_target_tokens": run_tokens,
                "run_seconds": run_time, "seconds_per_step": run_time / max(run_steps, 1),
                "target_tokens_per_s": run_tokens / max(run_time, 1e-9),
                "loss": ema_loss, "accept": ema_accept, "tau": ema_tau}


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _train_progress(console):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("step {task.fields[step]}"),
                    TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("τ≈{task.fields[tau]:.2f}"),
                    TextColumn("{task.fields[tps]:.0f} tgt tok/s"),
                    TextColumn("{task.fields[sps]:.2f} s/step"),
                    TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                    console=console, transient=False)
