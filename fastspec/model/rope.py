"""Rotary position embeddings with the config's scaling (none, linear, llama3, yarn).

Tables are precomputed once for all positions; a forward gathers rows by `positions`, so a
draft block, a branch or a tree node can sit at any position without recomputing anything.
"""
from __future__ import annotations

import math

import torch

from fastspec.config import FastspecError, ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling factor applied to cos/sin."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default")) if sc else "default"
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(sc["factor"]), 1.0
    if kind == "llama3":
        factor = float(sc["factor"])
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        # Between the two wavelengths: interpolate smoothly between scaled and unscaled.
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        factor = float(sc["factor"])
        old_ctx = float(sc.get("original_max_position_embeddings", cfg.max_position_embeddings))
        beta_fast = float(sc.get("beta_fast", 32.0))
        beta_slow = float(sc.get("beta_slow", 1.0))
        mscale = sc.get("mscale")
        mscale_all = sc.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if sc.get("attention_factor") is not None:
            attn_factor = float(sc["attention_factor"])
        elif mscale and mscale_all:
            attn_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attn_factor = get_mscale(factor)

        def correction_dim(n_rot: float) -> float:
            return (dim * math.log(old_ctx / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        low = math.floor(correction_dim(beta_fast))
        high = math.ceil(correction_dim(beta_slow))
        if sc.get("truncate", True) is False:
            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        inv_interp = inv_freq / factor
        return inv_interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight, attn_factor
    raise FastspecError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, yarn)")


def rope_tables(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] in fp32 (HF's rotate-half convention)."""
    inv_freq, attn_factor = rope_inv_freq(cfg)
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attn_factor).float(), (emb.sin() * attn_factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, H, D]; cos/sin [B, N, D] gathered at the tokens' positions."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
