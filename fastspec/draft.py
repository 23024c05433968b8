"""The draft adapter: what turns an AR backbone into a self-speculative drafter.

LoRA on the attention projections (optionally the MLP's too) plus a learned MASK embedding, switched on per token by the
model's `adapter_on` flag (draft tokens) and off for everything the verifier sees, so verification
is exactly the base model. Stored as `adapter.safetensors` + `adapter_config.json` in a `draft/`
folder beside (or inside) the checkpoint.

The config records the adapter's drafting convention (`fastspec.convention`: token shift, seed
attention, adapter at the seed, LoRA compute dtype); attaching an adapter sets
`model.draft_convention`, which every method reads. A config without the field is fastspec's.

A fitted calibration of the drafter's confidences (`calibration.json`, written by `fastspec
calibrate --drafter`) may sit beside the adapter; loading the adapter sets
`model.draft_calibration` (None without one, or when the file was fitted for other weights).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastspec.config import FastspecError
from fastspec.convention import convention_from_dict
from fastspec.model.llama import LlamaModel, LoRA
from fastspec.weights import weights_changed

ADAPTER_FILE = "adapter.safetensors"
CONFIG_FILE = "adapter_config.json"
CALIBRATION_FILE = "calibration.json"
ATTN_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")     # LoRA on the MLP: capacity for long blocks


@dataclass
class AdapterConfig:
    rank: int = 32
    alpha: float = 64.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    mask_token_id: int = -1          # -1: one past the vocab (a token no text can contain)
    block_size: int = 16             # largest trained block size
    convention: dict | None = None   # DraftConvention fields (None: fastspec's)
    meta: dict = field(default_factory=dict)   # training recipe, data, steps: for provenance


def attach_adapter(model: LlamaModel, cfg: AdapterConfig, seed: int = 0) -> LlamaModel:
    """Add fresh LoRA modules (B = 0, so the adapter starts as the identity) and a MASK embedding,
    and set the model's drafting convention from the config."""
    mcfg = model.cfg
    conv = convention_from_dict(cfg.convention)
    if cfg.mask_token_id < 0:
        cfg.mask_token_id = mcfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    h, inter = mcfg.hidden_size, mcfg.intermediate_size
    dims = {"q": (h, mcfg.num_heads * mcfg.head_dim),
            "k": (h, mcfg.num_kv_heads * mcfg.head_dim),
            "v": (h, mcfg.num_kv_heads * mcfg.head_dim),
            "o": (mcfg.num_heads * mcfg.head_dim, h),
            "gate": (h, inter), "up": (h, inter), "down": (inter, h)}
    unknown = set(cfg.targets) - set(dims)
    if unknown:
        raise FastspecError(f"unknown adapter targets {sorted(unknown)} "
                            f"(choose among {', '.join(ATTN_TARGETS + MLP_TARGETS)})")
    ref = model.embed
    fp32 = conv.lora_dtype == "fp32"
    for blk in model.layers:
        for part, names in ((blk.attn, ATTN_TARGETS), (blk.mlp, MLP_TARGETS)):
            loras = nn.ModuleDict()
            for t in (t for t in cfg.targets if t in names):
                lora = LoRA(*dims[t], rank=cfg.rank, alpha=cfg.alpha, fp32=fp32)
                with torch.no_grad():
                    lora.A.copy_(torch.randn(lora.A.shape, generator=g) / dims[t][0] ** 0.5)
                loras[t] = lora
            part.lora = loras.to(ref.device, torch.float32 if fp32 else ref.dtype) if len(loras) else None
            part.fused = None               # fresh LoRA: an earlier fused form is stale
    # The MASK embedding starts at the mean token embedding: a neutral "some token" input
    # (summed in fp32 by chunks: a bf16 mean would upcast the whole vocabulary at once).
    total = sum(chunk.float().sum(0) for chunk in ref.detach().split(4096))
    model.mask_embed = nn.Parameter((total / ref.shape[0]).to(ref.dtype))
    model.mask_token_id = cfg.mask_token_id
    model.adapter_config = cfg
    model.draft_convention = conv
    model.draft_calibration = None          # fresh weights: nothing fitted for them yet
    return model


def adapter_loras(model: LlamaModel):
    """(layer, target, LoRA) for every attached LoRA: attention's, then the MLP's."""
    for i, blk in enumerate(model.layers):
        for part in (blk.attn, blk.mlp):
            for t, lora in (part.lora or {}).items():
                yield i, t, lora


def adapter_state(model: LlamaModel) -> dict[str, torch.Tensor]:
    sd = {"mask_embed": model.mask_embed.detach()}
    for i, t, lora in adapter_loras(model):
        sd[f"layers.{i}.{t}.A"] = lora.A.detach()
        sd[f"layers.{i}.{t}.B"] = lora.B.detach()
    return sd


def adapter_parameters(model: LlamaModel) -> list[nn.Parameter]:
    params = [model.mask_embed]
    for _, _, lora in adapter_loras(model):
        params += [lora.A, lora.B]
    return params


def save_adapter(model: LlamaModel, directory: str) -> None:
    cfg: AdapterConfig = model.adapter_config
    os.makedirs(directory, exist_ok=True)
    # fp16 halves the shipped file; drafts only steer speed, verification stays exact.
    save_file({k: v.half().contiguous() for k, v in adapter_state(model).items()},
              os.path.join(directory, ADAPTER_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(asdict(cfg), f, indent=1)


def fuse_adapter(model: LlamaModel) -> LlamaModel:
    """The adapter's inference form: per layer, the LoRAs that share an input become one
    `FusedLoRA` (q/k/v, gate/up), so a draft forward runs 8 LoRA GEMMs per layer instead of 14
    with LoRA on every projection. A snapshot: `set_adapter_state` refreshes it; code that edits
    LoRA weights in place must call this again (training never fuses)."""
    for blk in model.layers:
        blk.attn.fuse_lora()
        blk.mlp.fuse_lora()
    weights_changed(model)          # compiled steps packed the old fused tensors
    return model


def is_fused(model: LlamaModel) -> bool:
    return any(blk.attn.fused is not None or blk.mlp.fused is not None for blk in model.layers)


def read_adapter(directory: str) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    cfg_path, w_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, ADAPTER_FILE)
    if not (os.path.exists(cfg_path) and os.path.exists(w_path)):
        raise FastspecError(f"no draft adapter in {directory} (expected {CONFIG_FILE} and {ADAPTER_FILE})")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
        cfg = AdapterConfig(**{**raw, "targets": tuple(raw.get("targets", ("q", "k", "v", "o")))})
        convention_from_dict(cfg.convention)            # a bad convention fails here, in one line
        return cfg, load_file(w_path)
    except FastspecError:
        raise
    except Exception as e:  # corrupt file: one line for the user
        raise FastspecError(f"cannot read draft adapter in {directory}: {e}") from None


def set_adapter_state(model: LlamaModel, sd: dict[str, torch.Tensor], where: str = "adapter",
                      only: tuple[str, ...] | None = None) -> None:
    """Copy `adapter_state`-named tensors into the model's attached adapter (`only`: just these
    targets, the others keep their values: a warm start that adds targets to its parent's)."""
    with torch.no_grad():
        try:
            model.mask_embed.copy_(sd["mask_embed"])
            for i, t, lora in adapter_loras(model):
                if only is None or t in only:
                    lora.A.copy_(sd[f"layers.{i}.{t}.A"])
                    lora.B.copy_(sd[f"layers.{i}.{t}.B"])
        except (KeyError, RuntimeError) as e:
            raise FastspecError(f"draft adapter in {where} does not fit this model: {e}") from None
    if is_fused(model):
        fuse_adapter(model)


def load_adapter(model: LlamaModel, directory: str) -> AdapterConfig:
    cfg, sd = read_adapter(directory)
    attach_adapter(model, cfg)
    set_adapter_state(model, sd, directory)
    model.requires_grad_(False)
    fuse_adapter(model)
    model.draft_calibration = load_calibration(directory)
    return cfg


def has_adapter(model: LlamaModel) -> bool:
    return model.mask_embed is not None


# --- a fitted calibration of the drafter's confidences, shipped beside the adapter ------------
def _per_index(table: list[float], n: int, default: float, device=None) -> torch.Tensor:
    """[n] float32 entries of a per-index table for indices 0..n-1: the last entry repeats past
    its end; an empty table is `default` everywhere."""
    return torch.tensor([table[min(i, len(table) - 1)] if table else default for i in range(n)],
                        dtype=torch.float32, device=device)


@dataclass
class DraftCalibration:
    """Temperatures (and biases) on the log-odds of the drafter's probability of its own draft,
    one per aligned draft index i (the draft of d(i+1), as RoundOutput.draft_prob indexes it),
    fitted on training prompts so that the scaled probability predicts acceptance:

        p_cal = sigmoid(logit(p) / T[i] + b[i])   T > 1 pulls an overconfident p toward 1/2;
                                                  b > 0 lifts an under-confident drafter's p

    `temperature` (`bias`) pools every block size; `by_block` (`by_block_bias`) holds a table per
    block size where the data allowed one (else the pooled table serves that block). Indices past
    a table's end use its last entry; no bias table means b = 0."""
    temperature: list[float]
    by_block: dict[int, list[float]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    bias: list[float] = field(default_factory=list)
    by_block_bias: dict[int, list[float]] = field(default_factory=dict)

    def table(self, block: int | None = None) -> list[float]:
        """Per-index temperatures for rows of this block size."""
        return list(self.by_block.get(int(block), self.temperature) if block is not None
                    else self.temperature)

    def bias_table(self, block: int | None = None) -> list[float]:
        """Per-index biases for rows of this block size ([] when none was fitted: b = 0)."""
        return list(self.by_block_bias.get(int(block), self.bias) if block is not None else self.bias)

    def temperatures(self, n: int, block: int | None = None, device=None) -> torch.Tensor:
        """[n] float32 temperatures of aligned indices 0..n-1 (the last entry repeats past the end)."""
        return _per_index(self.table(block), n, 1.0, device)

    def biases(self, n: int, block: int | None = None, device=None) -> torch.Tensor:
        """[n] float32 biases of aligned indices 0..n-1 (zeros when none was fitted)."""
        return _per_index(self.bias_table(block), n, 0.0, device)

    def apply(self, prob: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Calibrated probabilities of [..., n] draft probabilities (index i along the last dim).
        Host side (it builds the temperature tensor each call): a traced round should close over
        `temperatures(n, device=...)` made once outside it."""
        n, eps = prob.shape[-1], 1e-6
        return torch.sigmoid(torch.logit(prob.float().clamp(eps, 1 - eps)) / self.temperatures(n, block, prob.device)
                             + self.biases(n, block, prob.device))

    def to_dict(self) -> dict:
        out = {"temperature": [float(t) for t in self.temperature],
               "by_block": {str(b): [float(t) for t in ts] for b, ts in sorted(self.by_block.items())}}
        if self.bias:
            out["bias"] = [float(x) for x in self.bias]
            out["by_block_bias"] = {str(b): [float(x) for x in xs] for b, xs in sorted(self.by_block_bias.items())}
        return {**out, **self.meta}

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftCalibration":
        temps = raw.get("temperature")
        by_block = raw.get("by_block") or {}
        tables = [temps, *by_block.values()]
        if not isinstance(temps, list) or not temps or not all(
                isinstance(t, list) and t and all(isinstance(x, (int, float)) and math.isfinite(x)
                                                  and x > 0 for x in t) for t in tables):
            raise FastspecError("a draft calibration needs 'temperature': a list of positive numbers")
        bias, by_block_bias = raw.get("bias") or [], raw.get("by_block_bias") or {}
        if not isinstance(by_block_bias, dict) or not all(
                isinstance(t, list) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in t)
                for t in [bias, *by_block_bias.values()]):
            raise FastspecError("a draft calibration's 'bias' must be lists of finite numbers")
        meta = {k: v for k, v in raw.items() if k not in ("temperature", "by_block", "bias", "by_block_bias")}
        return cls([float(t) for t in temps], {int(b): [float(t) for t in ts] for b, ts in by_block.items()},
                   meta, [float(x) for x in bias],
                   {int(b): [float(x) for x in xs] for b, xs in by_block_bias.items()})


def adapter_digest(directory: str) -> str:
    """Short sha256 of the adapter's weights file: a calibration is valid for these weights only."""
    h = hashlib.sha256()
    with open(os.path.join(directory, ADAPTER_FILE), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def save_calibration(cal: DraftCalibration, directory: str, path: str | None = None) -> str:
    """Write the calibration of the adapter in `directory`, stamped with the adapter's digest, as
    calibration.json beside it (or to `path`); returns where."""
    from fastspec.files import write_json
    stamped = DraftCalibration(cal.temperature, cal.by_block,
                               {**cal.meta, "adapter_sha256": adapter_digest(directory)},
                               cal.bias, cal.by_block_bias)
    return write_json(path or os.path.join(directory, CALIBRATION_FILE), stamped.to_dict())


def load_calibration(directory: str) -> DraftCalibration | None:
    """The calibration beside the adapter in `directory`, or None when there is none. A file fitted
    for other adapter weights (its digest differs: the adapter was retrained) is ignored with one
    line on stderr; an unreadable one is a one-line FastspecError."""
    path = os.path.join(directory, CALIBRATION_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cal = DraftCalibration.from_dict(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError, ValueError) as e:
        raise FastspecError(f"cannot read the draft calibration {path}: {e}") from None
    except FastspecError as e:
        raise FastspecError(f"{path}: {e}") from None
    digest = cal.meta.get("adapter_sha256")
    if digest != adapter_digest(directory):
        print(f"ignoring {path}: fitted for other adapter weights (refit: fastspec calibrate --drafter)",
              file=sys.stderr)
        return None
    return cal
