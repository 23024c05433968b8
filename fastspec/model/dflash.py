"""DFlash drafters (block diffusion on the target's hidden states), read and written natively.

A DFlash drafter is a few decoder layers that draft a whole block in one forward. Its input is the
block `[seed, MASK × (B−1)]` embedded with the *target's* token embeddings; its keys and values
are the block's own plus a context made from the target's hidden states at every committed
position: the outputs of the target layers `target_layer_ids`, concatenated, projected by `fc`
and normalised by `hidden_norm` (one feature vector of size hidden per committed token). Every
drafter layer projects those features to K/V with its own k/v projections (no input norm), so the
context is to the drafter what the KV cache is to the target. Block position i (i ≥ 1) predicts
the token at L+i in place (no shift; the seed's own output is unused); the final `norm` is the
drafter's and the LM head is the *target's*. Attention is bidirectional over the block and sees
the whole context (a `sliding_attention` layer sees context positions within its window).

    target forward over x0..x(L-1)  ──outputs of layers 1, 9, 17 ...──▶ concat ─▶ fc ─▶ hidden_norm
                                                                                       │ per layer:
    drafter  [x_L, M, M, M] at L..L+3 ─▶ q/k/v ──attends──▶ k_proj/v_proj(context) ◀───┘
                                        logits at L+1..L+3 (target head) = drafts d1 d2 d3

The public checkpoint format (z-lab's DFlash drafters, e.g. `z-lab/Qwen3-8B-DFlash-b16`):

    config.json        architectures ["DFlashDraftModel"], model_type "qwen3", Qwen3 layer fields
                       (hidden_size, num_hidden_layers = drafter layers, num_attention_heads,
                       num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta /
                       rope_scaling / rope_parameters, max_position_embeddings, vocab_size,
                       attention_bias, layer_types, use_sliding_window, sliding_window),
                       num_target_layers, block_size (top level or in dflash_config) and
                       dflash_config {mask_token_id, target_layer_ids}
    model.safetensors  fc.weight [hidden, K·hidden], hidden_norm.weight, norm.weight and per layer
                       layers.N.input_layernorm.weight, layers.N.post_attention_layernorm.weight,
                       layers.N.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias),
                       layers.N.self_attn.{q,k}_norm.weight (per-head RMSNorm), layers.N.mlp.
                       {gate,up,down}_proj.weight; no embeddings and no LM head (the target's)
    (or model.safetensors.index.json + shards; a `model.` prefix on the names is accepted)

The MASK token is a vocabulary entry of the target (`mask_token_id`), embedded by the target's own
row. A checkpoint without q/k norms (every layer) loads without them. Nothing is unpickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.config import FastspecError, ModelConfig
from fastspec.model.llama import MLP, RMSNorm
from fastspec.model.rope import apply_rope, rope_tables

ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DRAFTER_DIR = "dflash"            # where a model's trained drafter lives (beside it, or shipped)


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers spread evenly from layer 1 to layer L−3 (the public format's rule when
    a config names none; one layer: the middle one). 36 layers, 5 -> (1, 9, 17, 25, 33). A target
    too shallow for that range (L < 5) spreads them over all its layers."""
    if count == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    if last - first < count - 1:
        first, last = 0, num_target_layers - 1
    return tuple(int(round(first + i * (last - first) / (count - 1))) for i in range(count))


@dataclass
class DFlashConfig:
    layers: ModelConfig                 # the drafter's layer shapes and RoPE (num_layers = its layers)
    target_layer_ids: tuple[int, ...]   # target layers whose outputs make the context
    num_target_layers: int | None       # layers of the target it was trained for (None: unsaid)
    block_size: int                     # block (seed + masks) it was trained with
    mask_token_id: int                  # a target vocabulary id
    layer_types: tuple[str, ...] = ()   # per layer: full_attention | sliding_attention
    sliding_window: int | None = None   # the window of sliding_attention layers (None: off)
    qk_norm: bool = True                # per-head RMSNorm on q and k (Qwen3 layers)
    extra: dict = field(default_factory=dict)   # `fastspec` provenance (training recipe), kept as is

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        n = self.layers.num_layers
        self.layer_types = tuple(self.layer_types) or ("full_attention",) * n
        if len(self.layer_types) != n:
            raise FastspecError(f"DFlash config: layer_types has {len(self.layer_types)} entries for "
                                f"{n} layers")
        if not self.target_layer_ids:
            raise FastspecError("DFlash config: target_layer_ids is empty")
        if self.block_size < 2:
            raise FastspecError(f"DFlash config: block_size must be >= 2, got {self.block_size}")

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, d: dict) -> "DFlashConfig":
        if ARCHITECTURE not in (d.get("architectures") or []) and "dflash_config" not in d:
            raise FastspecError(f"not a DFlash drafter config (architectures {d.get('architectures')}, "
                                "no dflash_config)")
        dc = d.get("dflash_config") or {}
        # The layers are plain Qwen3/Llama fields: read them (RoPE variants included) as one.
        layers = ModelConfig.from_hf({**d, "architectures": ["LlamaForCausalLM"]})
        mask = dc.get("mask_token_id", d.get("mask_token_id"))
        block = dc.get("block_size", d.get("block_size"))
        num_target = d.get("num_target_layers")
        ids = dc.get("target_layer_ids")
        for value, what in ((mask, "dflash_config.mask_token_id"), (block, "block_size"),
                            (num_target if ids is None else 0, "num_target_layers")):
            if value is None:
                raise FastspecError(f"DFlash config.json has no {what}")
        if ids is None:
            ids = default_target_layer_ids(int(num_target), layers.num_layers)
        window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
        return cls(layers, tuple(ids), None if num_target is None else int(num_target),
                   int(block), int(mask), tuple(d.get("layer_types") or ()),
                   None if window is None else int(window), extra=dict(d.get("fastspec") or {}))

    def to_hf(self) -> dict:
        c = self.layers
        hf = {"architectures": [ARCHITECTURE], "model_type": "qwen3",
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_position_embeddings,
              "vocab_size": c.vocab_size, "attention_bias": c.attention_bias, "hidden_act": "silu",
              "tie_word_embeddings": c.tie_word_embeddings, "layer_types": list(self.layer_types),
              "use_sliding_window": self.sliding_window is not None,
              "sliding_window": self.sliding_window,
              "block_size": self.block_size,
              "dflash_config": {"mask_token_id": self.mask_token_id, "block_size": self.block_size,
                                "target_layer_ids": list(self.target_layer_ids)}}
        if self.num_target_layers is not None:
            hf["num_target_layers"] = self.num_target_layers
        if self.extra:
            hf["fastspec"] = self.extra
        return hf


class DFlashLayer(nn.Module):
    """One drafter layer: attention over [context K/V | block K/V], then a SwiGLU MLP."""

    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        c = cfg.layers
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.kv = kv
        self.window = cfg.window(layer)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.wq = nn.Parameter(torch.empty(q, c.hidden_size))
        self.wkv = nn.Parameter(torch.empty(2 * kv, c.hidden_size))     # k rows, then v rows
        self.wo = nn.Parameter(torch.empty(c.hidden_size, q))
        bias = c.attention_bias
        self.bq = nn.Parameter(torch.zeros(q)) if bias else None
        self.bkv = nn.Parameter(torch.zeros(2 * kv)) if bias else None
        self.bo = nn.Parameter(torch.zeros(c.hidden_size)) if bias else None
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if cfg.qk_norm else None
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V [B, kv_heads, N, head_dim] of inputs x [B, N, hidden]."""
        B, N, _ = x.shape
        k, v = F.linear(x, self.wkv, self.bkv).split(self.kv, dim=-1)
        k = k.view(B, N, self.n_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k, cos, sin)
        return k.transpose(1, 2), v.view(B, N, self.n_kv, self.head_dim).transpose(1, 2)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        B, N, _ = x.shape
        h = self.attn_norm(x)
        q = F.linear(h, self.wq, self.bq).view(B, N, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k, v = self.project_kv(h, cos, sin)
        keys = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        values = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                             enable_gqa=self.n_kv != self.n_heads)
        x = x + F.linear(out.transpose(1, 2).reshape(B, N, -1), self.wo, self.bo)
        return x + self.mlp(self.mlp_norm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights (fc, hidden_norm, layers, norm); the target's embeddings and LM
    head are passed in by the caller. Context K/V are computed once per committed token
    (`context_kv`) and kept by the caller (the DFlash method carries them per request)."""

    def __init__(self, cfg: DFlashConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Parameter(torch.empty(H, len(cfg.target_layer_ids) * H))
        self.hidden_norm = RMSNorm(H, cfg.layers.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.layers.num_layers))
        self.norm = RMSNorm(H, cfg.layers.rms_norm_eps)
        self.init_buffers(max_positions)

    def init_buffers(self, max_positions: int | None = None, device=None, dtype=None) -> None:
        cos, sin = rope_tables(self.cfg.layers, max_positions or self.cfg.layers.max_position_embeddings)
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)

    @property
    def max_position(self) -> int:
        return self.rope_cos.shape[0] - 1

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of one committed token's context K (or V)."""
        c = self.cfg.layers
        return c.num_layers, c.num_kv_heads, c.head_dim

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.clamp(0, self.max_position)
        return self.rope_cos[pos].to(dtype), self.rope_sin[pos].to(dtype)

    def context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[..., K·hidden] captured target layer outputs -> [..., hidden] context features."""
        return self.hidden_norm(F.linear(target_hidden.to(self.fc.dtype), self.fc))

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor):
        """Context K and V [B, layers, kv_heads, N, head_dim] of N committed tokens from their
        captured target hidden states [B, N, K·hidden] at RoPE positions [B, N]."""
        feats = self.context_features(target_hidden)
        cos, sin = self._rope(positions, feats.dtype)
        kv = [layer.project_kv(feats, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kv], 1), torch.stack([v for _, v in kv], 1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_pos: torch.Tensor, ctx_mask: torch.Tensor,
                block_mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states [B, N, hidden] of a block (apply the target's LM head to them).

        x [B, N, hidden]: the block's embeddings (target embeddings of seed / MASK ids);
        positions [B, N]; ctx_k, ctx_v [B, layers, kv_heads, C, head_dim] (`context_kv`);
        ctx_pos [B, C]: each context entry's position; ctx_mask [B, N, C]: which context entries
        each block token sees (a sliding layer further drops those past its window);
        block_mask [B, N, N]: attention inside the block (DFlash: the whole valid block)."""
        cos, sin = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            seen = ctx_mask
            if layer.window is not None:
                seen = seen & ((positions[:, :, None] - ctx_pos[:, None, :]) < layer.window)
            x = layer(x, cos, sin, ctx_k[:, i], ctx_v[:, i], torch.cat([seen, block_mask], -1))
        return self.norm(x)

    # --- weights in the public format ---------------------------------------------------------
    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Public-format names -> views of this drafter's weights."""
        cfg = self.cfg.layers
        kv = cfg.num_kv_heads * cfg.head_dim
        sd = {"fc.weight": self.fc.data, "hidden_norm.weight": self.hidden_norm.weight.data,
              "norm.weight": self.norm.weight.data}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            wk, wv = layer.wkv.data.split(kv)
            sd.update({p + "input_layernorm.weight": layer.attn_norm.weight.data,
                       p + "post_attention_layernorm.weight": layer.mlp_norm.weight.data,
                       p + "self_attn.q_proj.weight": layer.wq.data,
                       p + "self_attn.k_proj.weight": wk, p + "self_attn.v_proj.weight": wv,
                       p + "self_attn.o_proj.weight": layer.wo.data})
            if layer.bq is not None:
                bk, bv = layer.bkv.data.split(kv)
                sd.update({p + "self_attn.q_proj.bias": layer.bq.data, p + "self_attn.k_proj.bias": bk,
                           p + "self_attn.v_proj.bias": bv, p + "self_attn.o_proj.bias": layer.bo.data})
            if layer.q_norm is not None:
                sd[p + "self_attn.q_norm.weight"] = layer.q_norm.weight.data
                sd[p + "self_attn.k_norm.weight"] = layer.k_norm.weight.data
            gate, up = layer.mlp.w_gate_up.data.split(cfg.intermediate_size)
            sd.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                       p + "mlp.down_proj.weight": layer.mlp.w_down.data})
        return sd

    def init_random(self, seed: int = 0, std: float = 0.02) -> "DFlashDrafter":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self


# --- building, reading, writing -----------------------------------------------------------------
def drafter_config_for(target_cfg: ModelConfig, draft_layers: int, target_layer_ids, block_size: int,
                       mask_token_id: int, extra: dict | None = None) -> DFlashConfig:
    """A drafter config for `target_cfg`: its layers shaped like the target's."""
    layers = target_cfg.replace(num_layers=draft_layers, architecture="LlamaForCausalLM", extra={})
    return DFlashConfig(layers, tuple(target_layer_ids), target_cfg.num_layers, block_size,
                        mask_token_id, extra=dict(extra or {}))


def check_target(cfg: DFlashConfig, target, where: str = "the DFlash drafter") -> None:
    """One-line errors when the drafter cannot run on this target."""
    t = target.cfg
    problems = []
    if cfg.hidden_size != t.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} (the model's is {t.hidden_size})")
    if cfg.layers.vocab_size != t.vocab_size:
        problems.append(f"vocabulary {cfg.layers.vocab_size} (the model's is {t.vocab_size})")
    if cfg.num_target_layers not in (None, t.num_layers):
        problems.append(f"a target of {cfg.num_target_layers} layers (the model has {t.num_layers})")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        problems.append(f"target layers {bad} (the model has {t.num_layers})")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the vocabulary")
    if problems:
        raise FastspecError(f"{where} does not fit this model: it has " + "; ".join(problems))


def save_dflash(drafter: DFlashDrafter, directory, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors in the public DFlash format."""
    from safetensors.torch import save_file
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # clone: k/v (and gate/up) are views of fused weights; safetensors refuses shared storage.
    sd = {k: v.detach().to("cpu", dtype or v.dtype).clone().contiguous()
          for k, v in drafter.state_dict_hf().items()}
    hf = drafter.cfg.to_hf() | {"torch_dtype": str(next(iter(sd.values())).dtype).removeprefix("torch.")}
    (d / CONFIG_FILE).write_text(json.dumps(hf, indent=2))
    save_file(sd, str(d / WEIGHTS_FILE), metadata={"format": "pt"})
    return d


def read_dflash_config(directory) -> DFlashConfig:
    d = Path(directory)
    if not d.is_dir():
        raise FastspecError(f"no DFlash drafter at {d} (expected a directory with {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE})")
    try:
        hf = json.loads((d / CONFIG_FILE).read_text())
        if not isinstance(hf, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FastspecError(f"cannot read {d / CONFIG_FILE}: {msg}") from None
    try:
        return DFlashConfig.from_hf(hf)
    except FastspecError as e:
        raise FastspecError(f"{d / CONFIG_FILE}: {e}") from None
    except (TypeError, ValueError) as e:
        raise FastspecError(f"{d / CONFIG_FILE}: bad DFlash config ({e})") from None


def _weight_files(d: Path) -> list[Path]:
    index = d / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise FastspecError(f"cannot read {index}: {e}") from None
    elif (d / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    elif list(d.glob("*.bin")) or list(d.glob("*.pt")):
        raise FastspecError(f"{d} has only PyTorch pickle weights: fastspec loads safetensors only")
    else:
        raise FastspecError(f"{d} has no {WEIGHTS_FILE} (or {INDEX_FILE})")
    for f in files:
        if not (d / f).is_file():
            raise FastspecError(f"DFlash checkpoint shard {d / f} is missing")
    return [d / f for f in files]


def load_dflash(path, target_model, dtype: torch.dtype | None = None, device=None,
                attach: bool = True) -> DFlashDrafter:
    """Read a DFlash drafter (public format) for `target_model` (a LlamaModel): checks that it
    fits the target (hidden size, vocabulary, target layers, MASK id), reads every tensor into
    place (dtype / device: the target's by default) and, with `attach`, sets
    `target_model.dflash` so the DFlash method finds it. Any problem is one FastspecError line."""
    from fastspec.model.loader import SafetensorsSource
    d = Path(path).expanduser()
    cfg = read_dflash_config(d)
    check_target(cfg, target_model, f"the DFlash drafter in {d}")
    src = SafetensorsSource(_weight_files(d), lambda n: n.removeprefix("model."))
    cfg.qk_norm = src.shape("layers.0.self_attn.q_norm.weight") is not None
    ref = target_model.embed
    dtype = dtype or ref.dtype
    device = device or ref.device
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, max_positions=1)
    plan = {}
    for name, want in drafter.state_dict_hf().items():
        shape = src.shape(name)
        if shape is None:
            raise FastspecError(f"DFlash checkpoint {d} is missing tensor {name}")
        if shape != tuple(want.shape):
            raise FastspecError(f"DFlash checkpoint {d}: tensor {name} has shape {list(shape)}, "
                                f"its config expects {list(want.shape)}")
        plan[name] = want
    drafter = drafter.to(dtype).to_empty(device=device)
    dst = drafter.state_dict_hf()
    for name in plan:
        src.read_into(name, dst[name])
    drafter.init_buffers(target_model.rope_cos.shape[0], device, dtype)
    drafter.eval().requires_grad_(False)
    drafter.source_path = str(d)            # run headers name the drafter that ran
    if attach:
        attach_dflash(target_model, drafter)
    return drafter


def attach_dflash(target_model, drafter: DFlashDrafter) -> DFlashDrafter:
    """Make `drafter` the target's DFlash drafter (`target_model.dflash`), after checking it fits."""
    check_target(drafter.cfg, target_model)
    target_model.dflash = drafter
    return drafter


def find_dflash(name: str, path: str | None) -> Path | None:
    """Where a model's DFlash drafter lives: `dflash/` beside its checkpoint, else the one shipped
    in the package for a built-in name (fastspec/adapters/<name>/dflash)."""
    candidates = []
    if path is not None:
        p = Path(path)
        candidates.append((p if p.is_dir() else p.parent) / DRAFTER_DIR)
    candidates.append(Path(__file__).resolve().parent.parent / "adapters" / name / DRAFTER_DIR)
    return next((c for c in candidates if (c / CONFIG_FILE).is_file()), None)
