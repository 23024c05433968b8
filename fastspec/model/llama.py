"""A Llama-family decoder written for the engine.

One forward serves every method: it takes new tokens with explicit positions, writes their K/V into
the static cache after each row's committed length, and attends under an explicit mask over cache
columns (see `fastspec.layout`). A per-token flag switches the draft adapter (LoRA + learned MASK
embedding, attached by the self-speculation code) on for some tokens and off for others.

Weights are fused per layer (`wqkv`, `w_gate_up`) so each step issues 4 GEMMs per layer instead
of 7: on CPU the skinny-GEMM overhead per call is what multi-token forwards pay for.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from fastspec.config import ModelConfig
from fastspec.model.rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LoRA(nn.Module):
    """Low-rank delta `scale * B(A(x))`, gated per token by the adapter flag. With fp32=True the
    delta is computed in fp32 (weights kept in fp32) and cast to the activations' dtype, as
    adapters trained that way under a bf16 model expect."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, fp32: bool = False):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, in_features) / in_features ** 0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank
        self.fp32 = fp32

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            d = F.linear(F.linear(x.float(), self.A.float()), self.B.float())
            return (d * (self.scale * gate.float())).to(x.dtype)
        return F.linear(F.linear(x, self.A), self.B) * (self.scale * gate)


class FusedLoRA(nn.Module):
    """LoRAs that read one input, as one A [Σr, in] and one block-diagonal B [Σout, Σr] with the
    scales folded in, so q/k/v (or gate/up) cost 2 small GEMMs instead of 6 (4) per draft forward.
    The output spans the whole fused projection; a part without LoRA gets zero rows:

        q k v with LoRA on q and v:   B = [[Bq·s  0   ]     rows of q
                                           [ 0    0   ]     rows of k
                                           [ 0    Bv·s]]    rows of v

    A snapshot of its LoRAs (buffers, no gradients): the inference form, built by
    `fastspec.draft.fuse_adapter`; training keeps the per-target LoRA modules."""

    def __init__(self, loras: list[LoRA | None], outs: list[int]):
        super().__init__()
        present = [lora for lora in loras if lora is not None]
        a = torch.cat([lora.A.detach() for lora in present])
        b = a.new_zeros(sum(outs), a.shape[0])
        row = col = 0
        for lora, n in zip(loras, outs):
            if lora is not None:
                r = lora.A.shape[0]
                b[row: row + n, col: col + r] = lora.B.detach() * lora.scale
                col += r
            row += n
        self.register_buffer("A", a.contiguous())
        self.register_buffer("B", b)
        self.fp32 = present[0].fp32

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return (F.linear(F.linear(x.float(), self.A), self.B) * gate.float()).to(x.dtype)
        return F.linear(F.linear(x, self.A), self.B) * gate


def fuse_loras(lora: nn.ModuleDict | None, groups: dict[str, tuple[tuple[str, ...], tuple[int, ...]]]
               ) -> nn.ModuleDict | None:
    """{fused projection: FusedLoRA} for each group (its targets and their output sizes) that has
    a LoRA on at least one target; None when nothing is left."""
    if lora is None:
        return None
    fused = nn.ModuleDict({name: FusedLoRA([lora[t] if t in lora else None for t in targets], list(outs))
                           for name, (targets, outs) in groups.items() if any(t in lora for t in targets)})
    return fused if len(fused) else None


def lora_delta(lora: nn.ModuleDict | None, name: str, x: torch.Tensor,
               gate: torch.Tensor | None) -> torch.Tensor | None:
    """The draft adapter's delta for projection `name` of input x, or None (no LoRA there, or no
    adapter gate: the verifier's forward)."""
    if lora is None or gate is None or name not in lora:
        return None
    return lora[name](x, gate)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q, kv, kv)
        self.wqkv = nn.Parameter(torch.empty(q + 2 * kv, cfg.hidden_size))
        self.bqkv = nn.Parameter(torch.zeros(q + 2 * kv)) if cfg.attention_bias else None
        self.wo = nn.Parameter(torch.empty(cfg.hidden_size, q))
        self.lora: nn.ModuleDict | None = None   # keys among q, k, v, o
        self.fused: nn.ModuleDict | None = None  # inference form: keys among qkv, o (fuse_lora)

    def fuse_lora(self) -> None:
        """Build (or refresh) the fused inference form of this layer's LoRA."""
        self.fused = fuse_loras(self.lora, {"qkv": (("q", "k", "v"), self.split),
                                            "o": (("o",), (self.wo.shape[0],))})

    def forward(self, x, cos, sin, k_layer, v_layer, write_cols, mask, slots, adapter_gate, q_scale=None):
        """k_layer, v_layer: this layer's cache [slots, kv_heads, max_len, head_dim] (a view of the
        model's cache, passed in rather than indexed by layer number here, so that every layer
        runs the same code and one compiled region serves them all)."""
        B, N, _ = x.shape
        qkv = F.linear(x, self.wqkv, self.bqkv)
        if (d := lora_delta(self.fused, "qkv", x, adapter_gate)) is not None:
            qkv = qkv + d
        q, k, v = qkv.split(self.split, dim=-1)
        if self.fused is None and self.lora is not None and adapter_gate is not None:
            # (plain statements: dynamo cannot trace a walrus inside a comprehension here)
            dq, dk, dv = [lora_delta(self.lora, n, x, adapter_gate) for n in "qkv"]
            q = q if dq is None else q + dq
            k = k if dk is None else k + dk
            v = v if dv is None else v + dv
        q = apply_rope(q.view(B, N, self.n_heads, self.head_dim), cos, sin)
        if q_scale is not None:                       # [B, N, 1, 1]
            q = q * q_scale
        k = apply_rope(k.view(B, N, self.n_kv, self.head_dim), cos, sin)
        v = v.view(B, N, self.n_kv, self.head_dim)

        # Write the new K/V at columns write_cols[b, i] of each row's slot: [B, N] indices
        # against cache [slots, kv_heads, max_len, head_dim] -> values laid out [B, N, kv, D].
        k_layer[slots[:, None], :, write_cols] = k.to(k_layer.dtype)
        v_layer[slots[:, None], :, write_cols] = v.to(v_layer.dtype)
        if (_CPU_ATTENTION is not None and torch.compiler.is_compiling() and q.device.type == "cpu"
                and q.dtype == k_layer.dtype == torch.float32 and N <= CPU_ATTENTION_MAX_QUERIES):
            out = _CPU_ATTENTION(q, k_layer, v_layer, slots, mask)
        else:
            out = attend_cache(q, k_layer, v_layer, slots, mask)
        y = F.linear(out, self.wo)
        if (d := lora_delta(self.lora if self.fused is None else self.fused, "o", out, adapter_gate)) is not None:
            y = y + d
        return y


def attend_cache(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Attention of new queries q [B, N, H, D] over the first ctx = mask.shape[-1] columns of
    their slots' cache (k_layer, v_layer [slots, kv_heads, len, D]; mask [B, N, ctx] bool):
    [B, N, H * D]. SDPA over each row's gathered K/V."""
    B, N, H, D = q.shape
    ctx = mask.shape[-1]
    keys = k_layer[:, :, :ctx].index_select(0, slots)
    values = v_layer[:, :, :ctx].index_select(0, slots)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
        attn_mask=mask[:, None, :, :], enable_gqa=k_layer.shape[1] != H)
    return out.transpose(1, 2).reshape(B, N, H * D)


# Set by the StepRunner when fastspec's CPU backend has a kernel (graphs/kernels.py
# `attention_op`): compiled fp32 CPU steps then trace attention as that one opaque op, whose
# reference is `attend_cache` and which the backend swaps for the kernel's cache_attention (reads
# each slot's K/V in place instead of gathering copies). None: `attend_cache` everywhere.
_CPU_ATTENTION = None
# The kernel computes each query's sums alone (its K/V loads shared by a few queries); past 8 new
# tokens per row, SDPA's blocked products over the gathered copy are as fast or faster
# at batch 1 (SmolLM2-135M fp32, ctx 256, 2 threads, alternated `fastspec profile` runs with the
# cap at 8 and at 64: 16 tokens 0.97-0.99x, 32 tokens 0.94-0.97x the SDPA forward's speed; at
# batch 4 the kernel was 1.00-1.08x, one pair only).
# The choice is made per step shape, at trace time.
CPU_ATTENTION_MAX_QUERIES = 8


def set_cpu_attention(op) -> None:
    global _CPU_ATTENTION
    _CPU_ATTENTION = op


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size))
        self.w_down = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size))
        self.lora: nn.ModuleDict | None = None   # keys among gate, up, down (draft adapter)
        self.fused: nn.ModuleDict | None = None  # inference form: keys among gate_up, down

    def fuse_lora(self) -> None:
        """Build (or refresh) the fused inference form of this MLP's LoRA."""
        self.fused = fuse_loras(self.lora, {"gate_up": (("gate", "up"), (self.inter, self.inter)),
                                            "down": (("down",), (self.w_down.shape[0],))})

    def forward(self, x: torch.Tensor, adapter_gate: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = F.linear(x, self.w_gate_up)
        if (d := lora_delta(self.fused, "gate_up", x, adapter_gate)) is not None:
            gate_up = gate_up + d
        gate, up = gate_up.split(self.inter, dim=-1)
        if self.fused is None:
            if (d := lora_delta(self.lora, "gate", x, adapter_gate)) is not None:
                gate = gate + d
            if (d := lora_delta(self.lora, "up", x, adapter_gate)) is not None:
                up = up + d
        h = F.silu(gate) * up
        y = F.linear(h, self.w_down)
        if (d := lora_delta(self.lora if self.fused is None else self.fused, "down", h, adapter_gate)) is not None:
            y = y + d
        return y


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_layer, v_layer, write_cols, mask, slots, adapter_gate, q_scale=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, k_layer, v_layer, write_cols, mask, slots,
                          adapter_gate, q_scale)
        return x + self.mlp(self.mlp_norm(x), adapter_gate)


def regional_compile() -> bool:
    """Whether torch.compile sees each decoder layer as one nested compile region
    (FASTSPEC_REGIONAL=0 turns it off: the whole step is then traced and compiled layer by layer)."""
    return os.environ.get("FASTSPEC_REGIONAL", "1") != "0"


@torch.compiler.nested_compile_region
def _block_region(block: Block, *args):
    # Regional compilation: dynamo traces the first layer into a subgraph and reuses it for the
    # others (their weights and cache views are its inputs), so inductor lowers and builds one
    # layer per step shape instead of all of them. Outside torch.compile it is a plain call.
    return block(*args)


def _block_call(block: Block, *args):
    return block(*args)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.init_buffers(max_positions)
        # Draft adapter pieces (attached by fastspec's self-speculation code): a learned MASK
        # embedding replaces the token embedding wherever `mask_token` appears.
        self.mask_embed: nn.Parameter | None = None
        self.mask_token_id: int | None = None

    def init_buffers(self, max_positions: int | None = None, device=None, dtype=None) -> None:
        """RoPE tables (and the query temperature) for positions < max_positions (default: the
        config's), computed in fp32 and stored in `dtype` (default fp32; a model cast with .to()
        casts them too). Called again after a meta-device build, once weights have storage."""
        cfg = self.cfg
        n_pos = max_positions or cfg.max_position_embeddings
        cos, sin = rope_tables(cfg, n_pos)
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)
        # Llama-4-style query temperature per position (Ministral3); None when the config has none.
        scale = None
        if cfg.attn_temperature_beta:
            pos = torch.arange(n_pos, dtype=torch.float32)
            scale = 1 + cfg.attn_temperature_beta * torch.log1p(torch.floor(pos / cfg.attn_temperature_length))
        self.register_buffer("q_scale", None if scale is None else scale.to(device, dtype),
                             persistent=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.mask_embed is None:
            return F.embedding(input_ids, self.embed)
        # The MASK id may lie one past the vocab (no text can produce it): clamp for the lookup.
        x = F.embedding(input_ids.clamp(max=self.embed.shape[0] - 1), self.embed)
        is_mask = (input_ids == self.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embed.to(x.dtype), x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, write_cols: torch.Tensor, mask: torch.Tensor,
                slots: torch.Tensor, adapter_on: torch.Tensor | None = None,
                logits_index: torch.Tensor | None = None,
                capture: tuple[int, ...] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for new tokens.

        input_ids, positions, write_cols [B, N]: token ids, RoPE positions, cache columns to write.
        mask [B, N, ctx]: which of the first `ctx` cache columns each new token attends to.
        slots [B]: cache slot of each row. adapter_on [B, N] bool: draft adapter per token.
        logits_index [B, K]: compute logits only at these new-token indices (default: all N).
        capture: layer indices whose outputs to return too (opt-in; a DFlash drafter reads them):
        the result is then (logits, hidden [B, N, len(capture) * hidden_size]), the outputs of
        those layers for every new token, concatenated in the order given. As in HF's
        `output_hidden_states[i + 1]`, the last layer's output is taken after the final norm.
        """
        if capture is not None and not all(0 <= i < len(self.layers) for i in capture):
            raise ValueError(f"capture layers {capture} outside 0..{len(self.layers) - 1}")
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        q_scale = None if self.q_scale is None else self.q_scale[positions][..., None, None].to(x.dtype)
        gate = None if adapter_on is None else adapter_on[..., None].to(x.dtype)
        captured: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        run_block = _block_region if regional_compile() else _block_call
        for i, block in enumerate(self.layers):
            x = run_block(block, x, cos, sin, k_cache[i], v_cache[i], write_cols, mask, slots, gate, q_scale)
            if capture is not None and i in capture:
                captured[i] = self.norm(x) if i == last else x
        if logits_index is not None:
            x = torch.gather(x, 1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
        logits = F.linear(self.norm(x), self.head_weight).float()
        if capture is None:
            return logits
        return logits, torch.cat([captured[i] for i in capture], dim=-1)

    # --- weights ---------------------------------------------------------------------------
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF Llama names (`model.layers.0.self_attn.q_proj.weight`, ...) into fused weights."""
        def take(name: str) -> torch.Tensor:
            for key in (name, "model." + name):
                if key in sd:
                    return sd[key]
            raise KeyError(name)

        with torch.no_grad():
            self.embed.copy_(take("embed_tokens.weight"))
            self.norm.weight.copy_(take("norm.weight"))
            if self.lm_head is not None:
                self.lm_head.copy_(sd["lm_head.weight"] if "lm_head.weight" in sd
                                   else take("embed_tokens.weight"))
            for i, blk in enumerate(self.layers):
                p = f"layers.{i}."
                blk.attn_norm.weight.copy_(take(p + "input_layernorm.weight"))
                blk.mlp_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
                blk.attn.wqkv.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if blk.attn.bqkv is not None:
                    blk.attn.bqkv.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                blk.attn.wo.copy_(take(p + "self_attn.o_proj.weight"))
                blk.mlp.w_gate_up.copy_(torch.cat([take(p + "mlp.gate_proj.weight"),
                                                   take(p + "mlp.up_proj.weight")]))
                blk.mlp.w_down.copy_(take(p + "mlp.down_proj.weight"))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of `load_hf_state_dict` (used to write HF checkpoints)."""
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sd = {"model.embed_tokens.weight": self.embed.data, "model.norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            sd["lm_head.weight"] = self.lm_head.data
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = blk.attn_norm.weight.data
            sd[p + "post_attention_layernorm.weight"] = blk.mlp_norm.weight.data
            wq, wk, wv = blk.attn.wqkv.data.split((q, kv, kv))
            sd.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                       p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": blk.attn.wo.data})
            if blk.attn.bqkv is not None:
                bq, bk, bv = blk.attn.bqkv.data.split((q, kv, kv))
                sd.update({p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk,
                           p + "self_attn.v_proj.bias": bv})
            g, u = blk.mlp.w_gate_up.data.split(cfg.intermediate_size)
            sd.update({p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u,
                       p + "mlp.down_proj.weight": blk.mlp.w_down.data})
        return {k: v.contiguous() for k, v in sd.items()}

    def init_random(self, seed: int = 0, std: float = 0.02) -> "LlamaModel":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self
