"""Training the draft adapter with a block-diffusion objective on self-distilled sequences.

The base model stays frozen; only the LoRA deltas and the MASK embedding (`adapter_parameters`)
learn. One step, for R sequences (prompt + the base model's own greedy continuation):

1. clean pass (no grad): the sequence, causal, adapter off, written into a fresh KV cache. This is
   exactly what the verifier computes, and its logits are the teacher distribution.
2. noisy pass (grad): K blocks at random start positions s inside the continuation, each of a
   size drawn from the block-size mixture, packed one after another into one row written after
   the clean columns. Block j is the inference draft block of a round whose committed prefix ends
   at s, laid out by the adapter's drafting convention (`fastspec.convention`: the attention
   inside the block, where the adapter is on, whether outputs are token-shifted):

       [x_s (seed), MASK x (b-1)]  at positions s .. s+b-1, seeing clean columns < s

   With probability `partial_prob` a block keeps a random subset of its true tokens instead of
   all-MASK (partial masking, as in branch / tree drafts). Block position i's target is
   x_{s+i+1} under a shifted convention (fastspec: the seed's output is the base model's own next
   token), x_{s+i} under an unshifted one (nld); the seed's own output is never trained.

With probability `seedless_prob` a block is TiDAR's seedless pre-draft instead: its seed slot is
a MASK too (adapter on, the whole block bidirectional), as when a verify forward pre-drafts the
block after a correction the verifier has not emitted yet; its position 0 is then trained too
(shifted: x_{s+1} without knowing x_s; unshifted: x_s itself). Such an adapter records
`seedless: true` in its convention.

Loss on block positions i >= 1 (and 0 in a seedless block) whose target is not visible in the
input: (1 - kl_weight) * CE(self-distilled token) + kl_weight * KL(teacher || drafter), weighted by pos_decay ** (i - 1)
(a draft at i only counts if all before it are accepted, so early positions matter most).

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fastspec.config import FastspecError
from fastspec.convention import (CONVENTIONS, FASTSPEC, DraftConvention, convention_from_dict,
                                 draft_adapter_flags, draft_block_mask)
from fastspec.draft import (ATTN_TARGETS, MLP_TARGETS, AdapterConfig, adapter_parameters,
                            adapter_state, attach_adapter, read_adapter, save_adapter,
                            set_adapter_state)
from fastspec.layout import cache_mask, causal_block
from fastspec.train.data import Example

IGNORE = -100
CHECKPOINT_FILE = "checkpoint.safetensors"
CHECKPOINT_JSON = "checkpoint.json"       # a readable copy of the scalars (the file's metadata)
LOG_FILE = "train_log.jsonl"
BLOCK_SIZES = (4, 8, 16, 32)              # what LinearSS may run with
PRECISIONS = ("fp32", "bf16")             # training compute precision (weights stay fp32)


def precision_check(precision: str) -> tuple[bool, str]:
    """The (ok, message) entry both trainer configs put in their checks."""
    return (precision in PRECISIONS,
            f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def parse_block_mix(spec: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """`4:0.2,8:0.3,16:0.25,32:0.25` (or `16`) -> sizes, weights."""
    sizes, weights = [], []
    for item in (x.strip() for x in str(spec).split(",") if x.strip()):
        b, _, w = item.partition(":")
        try:
            sizes.append(int(b))
            weights.append(float(w) if w else 1.0)
        except ValueError:
            raise FastspecError(f"--blocks: bad item {item!r} (use SIZE[:weight],...)") from None
    return tuple(sizes), tuple(weights)


@dataclass
class TrainConfig:
    block_sizes: tuple[int, ...] = BLOCK_SIZES         # draft block sizes (seed + b-1 masks) ...
    block_weights: tuple[float, ...] = (0.2, 0.3, 0.25, 0.25)   # ... drawn per block by weight
    convention: str = "fastspec"    # drafting convention (fastspec.convention.CONVENTIONS)
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
    seedless_prob: float = 0.0      # chance a block is TiDAR's seedless pre-draft (seed slot masked)
    precision: str = "fp32"         # fp32, or bf16: forward/backward under bf16 autocast, fp32 weights
    seed: int = 0
    log_every: int = 5
    ckpt_every_s: float = 300.0

    def __post_init__(self):
        self.targets = tuple(self.targets)
        self.block_sizes = tuple(int(b) for b in self.block_sizes)
        self.block_weights = tuple(float(w) for w in self.block_weights)
        checks = [(bool(self.block_sizes) and min(self.block_sizes) >= 2, "--blocks: sizes must be >= 2"),
                  (len(self.block_weights) == len(self.block_sizes)
                   and all(w >= 0 for w in self.block_weights) and sum(self.block_weights) > 0,
                   "--blocks: one weight >= 0 per size, not all 0"),
                  (self.convention in CONVENTIONS,
                   f"--convention must be one of {', '.join(CONVENTIONS)}, got {self.convention!r}"),
                  (self.blocks_per_seq >= 1, "--blocks-per-seq must be >= 1"),
                  (self.seqs_per_step >= 1, "--seqs-per-step must be >= 1"),
                  (self.rank >= 1, "--rank must be >= 1"),
                  (bool(self.targets) and set(self.targets) <= set(ATTN_TARGETS + MLP_TARGETS),
                   f"--targets must be among {','.join(ATTN_TARGETS + MLP_TARGETS)}, "
                   f"got {','.join(self.targets) or 'nothing'}"),
                  (self.lr > 0, "--lr must be > 0"),
                  (self.minutes > 0, "--minutes must be > 0"),
                  (0 <= self.kl_weight <= 1, "--kl-weight must be in [0, 1]"),
                  (0 < self.pos_decay <= 1, "--pos-decay must be in (0, 1]"),
                  (0 <= self.partial_prob <= 1, "--partial-prob must be in [0, 1]"),
                  (0 <= self.seedless_prob <= 1, "--seedless must be in [0, 1]"),
                  precision_check(self.precision)]
        for ok, msg in checks:
            if not ok:
                raise FastspecError(msg)

    @property
    def block(self) -> int:
        """The widest block (the adapter's recorded block_size)."""
        return max(self.block_sizes)

    @property
    def draft_convention(self) -> DraftConvention:
        return replace(CONVENTIONS[self.convention], seedless=self.seedless_prob > 0)

    def adapter_config(self) -> AdapterConfig:
        return AdapterConfig(rank=self.rank, alpha=self.alpha, targets=self.targets,
                             block_size=self.block, convention=self.draft_convention.to_dict())


# --- layout ---------------------------------------------------------------------------------
@dataclass
class Batch:
    """K blocks per row packed back to back: token t of row r is position tok_pos[r, t] of block
    tok_block[r, t] (-1: padding after the row's last block)."""
    clean_ids: torch.Tensor        # [R, Tc] sequence tokens (padded with 0), causal pass
    block_ids: torch.Tensor        # [R, N] seed, then MASK (or a kept true token)
    positions: torch.Tensor        # [R, N] RoPE positions s + i
    tok_block: torch.Tensor        # [R, N] block index j of each token, -1 = padding
    tok_pos: torch.Tensor          # [R, N] position i inside its block
    targets: torch.Tensor          # [R, N] target token, IGNORE where none
    weights: torch.Tensor          # [R, N] loss weight (0 = not counted; always 0 at seeds)
    starts: torch.Tensor           # [R, K]
    sizes: torch.Tensor            # [R, K] block sizes
    all_masked: torch.Tensor       # [R, K] block is all-MASK after a true seed (the chain layout)
    seedless: torch.Tensor         # [R, K] block is seedless: its seed slot is a MASK too (TiDAR)
    conv: DraftConvention = field(default=FASTSPEC)

    @property
    def clean_len(self) -> int:
        return self.clean_ids.shape[1]

    @property
    def block(self) -> int:
        return int(self.sizes.max())

    @property
    def tok_seedless(self) -> torch.Tensor:
        """[R, N] the packed token belongs to a seedless block."""
        return torch.gather(self.seedless, 1, self.tok_block.clamp(min=0)) & (self.tok_block >= 0)

    @property
    def offsets(self) -> torch.Tensor:
        """[R, K] index of each block's seed in the packed row."""
        return self.sizes.cumsum(1) - self.sizes

    def to(self, device) -> "Batch":
        names = [f for f in self.__dataclass_fields__ if f != "conv"]
        return Batch(*(getattr(self, f).to(device) for f in names), conv=self.conv)


def make_batch(examples: Sequence[Example], starts: torch.Tensor, keep: torch.Tensor, block: int,
               mask_id: int, pos_decay: float = 1.0, max_position: int | None = None,
               sizes: torch.Tensor | None = None, conv: DraftConvention = FASTSPEC,
               seedless: torch.Tensor | None = None) -> Batch:
    """Deterministic batch: `starts [R, K]` block starts (>= prompt length, <= len - 2), `keep
    [R, K, block]` bool (True keeps the true token at that block position; position 0, the seed,
    is always the true token), `sizes [R, K]` block sizes <= block (default: all `block`),
    `seedless [R, K]` bool: the block is seedless (all MASK, seed slot included; keep ignored)."""
    R, K = starts.shape
    sizes = torch.full_like(starts, block) if sizes is None else sizes
    seedless = torch.zeros(R, K, dtype=torch.bool) if seedless is None else seedless.bool()
    B, shift = block, int(conv.shift)
    lens = torch.tensor([len(e.ids) for e in examples])
    ids = torch.full((R, max(int(lens.max()), int(starts.max()) + B + 1)), -1, dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, : len(e.ids)] = torch.tensor(e.ids)
    i = torch.arange(B)
    pos = starts[..., None] + i                                     # [R, K, B]
    true_tok = torch.gather(ids, 1, pos.view(R, -1)).view(R, K, B)
    tgt = torch.gather(ids, 1, (pos + shift).view(R, -1)).view(R, K, B)
    keep = keep.clone()
    keep[..., 0] = True
    keep &= ~seedless[..., None]
    inp = torch.where(keep & (true_tok >= 0), true_tok, torch.full_like(true_tok, mask_id))
    valid = i < sizes[..., None]                                    # [R, K, B] inside the block
    # A target counts when it exists and the drafter cannot read it off the input: its own block
    # position (i + shift) holds a MASK, or lies past the block's end.
    hidden = torch.ones_like(keep)
    hidden[..., : B - shift] = (inp[..., shift:] == mask_id) | ~valid[..., shift:]
    counted = (tgt >= 0) & hidden & ((i > 0) | seedless[..., None]) & valid
    targets = torch.where(counted, tgt, torch.full_like(tgt, IGNORE))
    w = (pos_decay ** (i - 1).clamp(min=0).float()) * counted.float()
    # The clean pass needs columns < s (prefix) and rows up to s + b - 1 (teacher logits).
    clean_len = int(torch.minimum(lens, (starts + sizes).max(1).values).max())
    clean = ids[:, :clean_len].clamp(min=0)
    if max_position is not None:
        pos = pos.clamp(max=max_position - 1)
    all_masked = ((inp == mask_id) | ~valid)[..., 1:].all(-1) & ~seedless
    # Pack: each row's in-block tokens in order, then padding up to the widest row.
    N = int(sizes.sum(1).max())
    order = torch.sort((~valid).view(R, -1).int(), dim=1, stable=True).indices[:, :N]
    real = torch.gather(valid.view(R, -1), 1, order)

    def pack(x: torch.Tensor, pad) -> torch.Tensor:
        x = torch.gather(x.reshape(R, -1), 1, order)
        return torch.where(real, x, torch.full_like(x, pad))

    kb = torch.arange(K)[:, None].expand(K, B)
    return Batch(clean, pack(inp, mask_id), pack(pos, 0), pack(kb.expand(R, K, B), -1),
                 pack(i.expand(R, K, B), 0), pack(targets, IGNORE), pack(w, 0.0), starts, sizes,
                 all_masked, seedless, conv)


def training_mask(batch: Batch) -> torch.Tensor:
    """Mask [R, N, Tc + N] of the packed blocks written after the Tc clean columns.

    A token of block j (start s) sees clean columns < s and, inside its own block, what the
    convention's `draft_block_mask` lets it see; blocks never see each other; padding sees only
    itself and nobody sees it.
    """
    blk, pos, starts = batch.tok_block, batch.tok_pos, batch.starts
    R, N = blk.shape
    K, B = starts.shape[1], batch.block
    dev = blk.device
    real = blk >= 0
    j = blk.clamp(min=0)
    s = torch.gather(starts, 1, j)
    clean = (torch.arange(batch.clean_len, device=dev)[None, None, :] < s[..., None]) & real[..., None]
    sizes = batch.sizes.reshape(-1)
    pattern = torch.where(batch.seedless.reshape(-1)[:, None, None],
                          draft_block_mask(batch.conv, sizes, B, seedless=True),
                          draft_block_mask(batch.conv, sizes, B)).view(R, K, B, B)
    rows = pattern[torch.arange(R, device=dev)[:, None], j, pos]               # [R, N(q), B]
    inner = torch.gather(rows, 2, pos[:, None, :].expand(R, N, N))              # [R, N, N(k)]
    inner = inner & (blk[:, :, None] == blk[:, None, :]) & real[:, :, None]
    inner = inner | torch.eye(N, dtype=torch.bool, device=dev)[None]
    return torch.cat([clean, inner], dim=-1)


def training_adapter_flags(batch: Batch) -> torch.Tensor:
    """[R, N] adapter on/off per packed token, from the convention's draft flags (a seedless
    block's own)."""
    dev = batch.tok_pos.device
    flags = draft_adapter_flags(batch.conv, 1, batch.block, dev)[0]
    seedless = draft_adapter_flags(batch.conv, 1, batch.block, dev, seedless=True)[0]
    on = torch.where(batch.tok_seedless, seedless[batch.tok_pos], flags[batch.tok_pos])
    return on & (batch.tok_block >= 0)


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
    """The noisy pass over the cache filled by `clean_pass`: logits [R, N or len(index), V]."""
    R, N = batch.block_ids.shape
    dev = batch.block_ids.device
    cols = (batch.clean_len + torch.arange(N, device=dev)).expand(R, N)
    return model(batch.block_ids, batch.positions, k, v, cols, training_mask(batch),
                 torch.arange(R, device=dev), adapter_on=training_adapter_flags(batch),
                 logits_index=logits_index)


def draft_logits(model, batch: Batch) -> torch.Tensor:
    """Logits of every packed block token [R, N, V] (clean pass + noisy pass, no loss)."""
    k, v, _ = clean_pass(model, batch, None)
    return block_forward(model, batch, k, v)


def draft_loss(model, batch: Batch, kl_weight: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Weighted CE/KL over the draft positions; returns (loss, metrics)."""
    R, N = batch.block_ids.shape
    K, B = batch.starts.shape[1], batch.block
    shift = int(batch.conv.shift)
    dev = batch.block_ids.device
    # Logits only where a loss can be: block positions >= 1, and a seedless block's 0 (each
    # row's first M such tokens).
    cand = ((batch.tok_pos > 0) | batch.tok_seedless) & (batch.tok_block >= 0)
    M = int(cand.sum(1).max())
    index = torch.sort((~cand).int(), dim=1, stable=True).indices[:, :M]
    teacher_index = None
    if kl_weight > 0:
        # The teacher for a target at sequence position p is the clean pass at p - 1.
        tpos = torch.gather(batch.positions, 1, index) + shift - 1
        teacher_index = tpos.clamp(min=0, max=batch.clean_len - 1)
    k, v, teacher = clean_pass(model, batch, teacher_index)
    logits = block_forward(model, batch, k, v, logits_index=index)
    tgt = torch.gather(batch.targets, 1, index)
    w = torch.gather(batch.weights, 1, index)
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
        # Back to [R, K, B] per block position (padding and non-candidates go to a spare column).
        cell = torch.gather(batch.tok_block * B + batch.tok_pos, 1, index)
        cell = torch.where(torch.gather(cand, 1, index), cell, torch.full_like(cell, K * B))
        grid = torch.zeros(R, K * B + 1, dtype=torch.bool, device=dev).scatter(1, cell, correct)
        grid = grid[:, :-1].view(R, K, B)
        seen1 = torch.zeros(R, K * B + 1, dtype=torch.bool, device=dev).scatter(1, cell, counted)
        # Greedy LinearSS on an all-MASK block of size b accepts the leading run of correct drafts
        # (plus, when shifted, d1 = the seed's own output, always right), then a bonus token.
        run = grid[..., 1:].long().cumprod(-1).sum(-1).float()
        tau = torch.minimum(run + 1 + shift, batch.sizes.float())
        am = batch.all_masked
        # A seedless pre-draft verified after the true seed: its first draft is position 0's
        # output when shifted (1's when not, 0 guessing the seed itself); the verifier's seed
        # plus the leading run of right drafts are committed.
        sl = batch.seedless
        run_sl = grid[..., 1 - shift:].long().cumprod(-1).sum(-1).float()
        tau_sl = torch.minimum(run_sl + 1, batch.sizes.float())
        metrics = {
            "loss": loss.detach(),
            "ce": (ce * counted).sum() / n,
            "kl": (kl * counted).sum() / n if kl is not None else torch.zeros((), device=dev),
            "acc": correct.sum() / n,
            "acc1": grid[..., 1].sum() / seen1[:, :-1].view(R, K, B)[..., 1].sum().clamp(min=1),
            "accept": (run * am).sum() / am.sum().clamp(min=1),
            "tau": (tau * am).sum() / am.sum().clamp(min=1),
            "target_tokens": counted.sum(),
        }
        if sl.any():
            metrics["tau_seedless"] = (tau_sl * sl).sum() / sl.sum()
        for b in sorted(set(batch.sizes.view(-1).tolist())):     # tau per block size
            sel = am & (batch.sizes == b)
            if sel.any():
                metrics[f"tau_b{b}"] = (tau * sel).sum() / sel.sum()
    return loss, metrics


# --- the loop both trainers share ------------------------------------------------------------
class TrainLoop:
    """The time-budgeted optimisation loop of a drafter trainer: cosine learning rate with warm-up,
    gradient clipping, a JSONL log (one line per `log_every` steps, every (re)start a line of its
    own), a rich progress bar, and periodic atomic checkpoints plus the trained artifact.

    A trainer sets cfg (minutes, max_steps, lr, warmup_steps, min_lr_ratio, grad_clip, log_every,
    ckpt_every_s), opt, params, step, elapsed_s, target_tokens, log_path, ckpt_dir, out_dir, meta
    and defines loss(batch) -> (loss, metrics with "target_tokens", "loss", "accept", "tau"),
    sample_batch(), save_checkpoint(), load_checkpoint() -> bool, save_output() and
    start_fields() (what its start line records)."""

    label = "training drafter"

    def lr_at(self, step: int, elapsed_s: float) -> float:
        cfg = self.cfg
        frac = elapsed_s / (cfg.minutes * 60)
        if cfg.max_steps:
            frac = max(frac, step / cfg.max_steps)
        frac = min(max(frac, 0.0), 1.0)
        warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
        cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return cfg.lr * warm * cos

    def train_step(self, batch=None) -> dict:
        batch = batch if batch is not None else self.sample_batch()
        lr = self.lr_at(self.step, self.elapsed_s)
        for group in self.opt.param_groups:
            group["lr"] = lr
        # bf16 autocast: matmuls (forward and backward) in bf16, the trained parameters, their
        # gradients and the optimizer state stay fp32; the losses are taken in fp32 (`.float()`).
        dev = self.params[0].device.type
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
            loss, metrics = self.loss(batch)
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

    def recipe(self) -> dict:
        """The settings that shape the result (the config less logging cadence)."""
        return {k: v for k, v in asdict(self.cfg).items() if k not in ("log_every", "ckpt_every_s")}

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

    def _save_all(self) -> None:
        if self.ckpt_dir is not None:
            self.save_checkpoint()
        if self.out_dir is not None:
            self.save_output()

    def train(self, resume: bool = True, console=None, progress: bool = True) -> dict:
        """Run until the time budget (or max_steps); checkpoints, log and result along the way."""
        resumed = False
        if resume:
            resumed = self.load_checkpoint()
            self._trim_log()
        elif self.log_path is not None and self.log_path.is_file():
            self.log_path.unlink()
        cfg = self.cfg
        # Every (re)start is a line of the log: what ran, on what, from where.
        self._log({"event": "resume" if resumed else "start", "step": self.step,
                   "target_tokens": self.target_tokens, **self.start_fields(),
                   **{k: self.meta[k] for k in ("command", "argv", "data", "init_adapter", "init_drafter")
                      if k in self.meta},
                   "examples": len(self.examples), "recipe": self.recipe()})
        budget = cfg.minutes * 60
        bar = task = None
        if progress:
            bar = _train_progress(console)
            bar.start()
            task = bar.add_task(self.label, total=budget, completed=min(self.elapsed_s, budget),
                                step=self.step, loss=float("nan"), tau=float("nan"), tps=0.0,
                                sps=0.0, eta="?")
        acc: dict[str, float] = {}
        seen: dict[str, int] = {}
        n_acc, last_ckpt, log_t = 0, time.perf_counter(), self.elapsed_s
        run_steps, run_tokens, run_time = 0, 0, 0.0
        ema: dict[str, float] = {}
        try:
            while not self.done():
                t0 = time.perf_counter()
                m = self.train_step()
                dt = time.perf_counter() - t0
                self.elapsed_s += dt
                run_steps, run_tokens, run_time = run_steps + 1, run_tokens + int(m["target_tokens"]), run_time + dt
                for k, v in m.items():
                    acc[k], seen[k] = acc.get(k, 0.0) + v, seen.get(k, 0) + 1
                n_acc += 1
                for k in ("loss", "accept", "tau"):
                    ema[k] = m[k] if k not in ema else 0.9 * ema[k] + 0.1 * m[k]
                if self.step % cfg.log_every == 0 or self.done():
                    row = {k: round(v / seen[k], 5) for k, v in acc.items() if k != "target_tokens"}
                    self._log({"step": self.step, "target_tokens": self.target_tokens,
                               "elapsed_s": round(self.elapsed_s, 2),
                               "step_s": round((self.elapsed_s - log_t) / n_acc, 3), **row})
                    log_t = self.elapsed_s
                    acc, seen, n_acc = {}, {}, 0
                if bar is not None:
                    per_step = run_time / run_steps
                    left = budget - self.elapsed_s
                    if cfg.max_steps:
                        left = min(left, (cfg.max_steps - self.step) * per_step)
                    bar.update(task, completed=min(self.elapsed_s, budget), step=self.step,
                               loss=ema["loss"], tau=ema["tau"], tps=run_tokens / run_time,
                               sps=per_step, eta=_fmt_s(max(left, 0.0)))
                if self.ckpt_dir is not None and time.perf_counter() - last_ckpt >= cfg.ckpt_every_s:
                    self._save_all()
                    last_ckpt = time.perf_counter()
        finally:
            if bar is not None:
                bar.stop()
            self._save_all()
        return {"steps": self.step, "target_tokens": self.target_tokens, "elapsed_s": self.elapsed_s,
                "resumed": resumed, "run_steps": run_steps, "run_target_tokens": run_tokens,
                "run_seconds": run_time, "seconds_per_step": run_time / max(run_steps, 1),
                "target_tokens_per_s": run_tokens / max(run_time, 1e-9),
                "loss": ema.get("loss"), "accept": ema.get("accept"), "tau": ema.get("tau")}


# --- the trainer ----------------------------------------------------------------------------
class DraftTrainer(TrainLoop):
    """Trains a fresh (or resumed) draft adapter on `examples`; see the module doc for the recipe.
    `init_adapter`: a saved adapter directory to start from (warm start) instead of a fresh
    adapter; a checkpoint, when resuming, takes precedence over it."""

    def __init__(self, model, examples: Sequence[Example], cfg: TrainConfig,
                 out_dir: str | os.PathLike | None = None,
                 ckpt_dir: str | os.PathLike | None = None,
                 log_path: str | os.PathLike | None = None,
                 model_key: str = "", meta: dict | None = None,
                 init_adapter: str | os.PathLike | None = None):
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
        self.conv = cfg.draft_convention
        if self.max_position < cfg.block + 2:
            raise FastspecError(f"the model's {self.max_position} positions leave no room for "
                                f"blocks of {cfg.block}")

        self.adapter_cfg = cfg.adapter_config()
        attach_adapter(model, self.adapter_cfg, seed=cfg.seed)
        if init_adapter is not None:
            self._init_from(Path(init_adapter))
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

    def _init_from(self, d: Path) -> None:
        saved, sd = read_adapter(str(d))
        mine = self.adapter_cfg
        for k in ("rank", "mask_token_id"):
            if getattr(saved, k) != getattr(mine, k):
                raise FastspecError(f"--init-adapter {d} has {k}={getattr(saved, k)}, this run "
                                    f"{getattr(mine, k)}: use the same settings")
        # A run may add targets to its parent's (e.g. the MLP's): those start as the identity.
        if not set(saved.targets) <= set(mine.targets):
            raise FastspecError(f"--init-adapter {d} has targets {','.join(saved.targets)}, not all "
                                f"among this run's {','.join(mine.targets)}")
        set_adapter_state(self.model, sd, str(d), only=tuple(saved.targets))
        self.meta.setdefault("init_adapter", str(d))
        # The lineage travels with the adapter: a warm start's own recipe, data and steps (the
        # folder it came from may later hold this run's adapter).
        self.meta.setdefault("init_adapter_meta", saved.meta)

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
        w = torch.tensor(cfg.block_weights, dtype=torch.float)
        sizes = torch.tensor(cfg.block_sizes)[torch.multinomial(w, R * K, True, generator=g)].view(R, K)
        lo = torch.tensor([e.prompt_len for e in exs])[:, None]
        # s + 1 inside the sequence, and the whole block inside the model's positions.
        hi = torch.minimum(torch.tensor([len(e.ids) - 2 for e in exs])[:, None],
                           self.max_position - sizes).clamp(min=lo)
        u = torch.rand(R, K, generator=g)
        starts = lo + (u * (hi - lo + 1)).long().clamp(max=hi - lo)
        partial = torch.rand(R, K, 1, generator=g) < cfg.partial_prob
        rate = torch.rand(R, K, 1, generator=g) * cfg.max_keep
        keep = partial & (torch.rand(R, K, B, generator=g) < rate)
        seedless = None
        if cfg.seedless_prob > 0:   # drawn only then, so runs without it keep their batches
            seedless = torch.rand(R, K, generator=g) < cfg.seedless_prob
        return make_batch(exs, starts, keep, B, self.mask_id, cfg.pos_decay,
                          self.max_position, sizes, self.conv, seedless).to(self.device)

    def loss(self, batch: Batch):
        return draft_loss(self.model, batch, self.cfg.kl_weight)

    def start_fields(self) -> dict:
        return {"convention": self.conv.to_dict()}

    def save_output(self) -> Path:
        return self.save_adapter()

    # --- checkpoints ---
    def state_scalars(self) -> dict:
        opt_steps = {str(i): float(s["step"]) for i, s in self.opt.state_dict()["state"].items()}
        return {"version": 2, "step": self.step, "target_tokens": self.target_tokens,
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
        def norm(x):
            return json.loads(json.dumps(x))          # tuples -> lists, as stored
        saved = scalars.get("adapter_config", {})
        mine = asdict(self.adapter_cfg)
        if isinstance(saved.get("convention"), dict):    # fields added since default as before
            saved = {**saved, "convention": convention_from_dict(saved["convention"]).to_dict()}
        for k in ("rank", "alpha", "targets", "block_size", "mask_token_id", "convention"):
            if norm(saved.get(k, mine[k] if k != "convention" else None)) != norm(mine[k]):
                raise FastspecError(f"checkpoint {f} was trained with {k}={saved.get(k)} (now "
                                    f"{mine[k]}): use the same settings or --no-resume")
        if self.model_key and scalars.get("model_key") and scalars["model_key"] != self.model_key:
            raise FastspecError(f"checkpoint {f} belongs to another model: use --no-resume or "
                                "another --out")
        set_adapter_state(self.model, {k[len("adapter."):]: v for k, v in tensors.items()
                                       if k.startswith("adapter.")}, str(f))
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
                                 "train_seconds": round(self.elapsed_s, 1), "recipe": self.recipe()}
        save_adapter(self.model, str(d))
        return d


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
