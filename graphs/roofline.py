"""BASTION's roofline cost model for one forward, fitted to measured step times.

    T(tokens, ctx) = max(α_c · FLOPs / peak + β_c,  α_m · bytes / BW + β_m)

FLOPs and bytes come from the model's shape (weights read once per forward, K/V read per row,
2 FLOPs per weight per token plus attention). α absorbs how far the kernels fall short of the
hardware's peak and bandwidth, β the fixed per-forward overhead (launches, Python, syncs).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from fastspec.config import ModelConfig


def forward_flops(cfg: ModelConfig, batch: int, tokens: int, ctx: int) -> float:
    """FLOPs of one forward: batch rows of `tokens` new tokens over `ctx` cache columns."""
    weights = cfg.weight_bytes(1) - cfg.hidden_size       # parameter count streamed per token
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx
    return float(batch * tokens * (2 * weights + attn))


def forward_bytes(cfg: ModelConfig, batch: int, tokens: int, ctx: int, bytes_per_param: int = 4) -> float:
    """Bytes one forward must move: the weights once, each row's K/V over ctx, new K/V written."""
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_param
    return float(cfg.weight_bytes(bytes_per_param) + batch * (ctx + tokens) * kv)


@dataclass
class Roofline:
    alpha_c: float
    beta_c: float
    alpha_m: float
    beta_m: float
    peak_flops: float          # nominal FLOP/s the α_c is relative to
    bandwidth: float           # nominal bytes/s the α_m is relative to

    def predict(self, flops, nbytes):
        flops, nbytes = np.asarray(flops, float), np.asarray(nbytes, float)
        return np.maximum(self.alpha_c * flops / self.peak_flops + self.beta_c,
                          self.alpha_m * nbytes / self.bandwidth + self.beta_m)

    def to_dict(self) -> dict:
        return asdict(self)


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """y ≈ a·x + b, relative error weighting (short and long forwards count alike)."""
    w = 1.0 / np.maximum(y, 1e-12)
    A = np.stack([x * w, w], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    return max(float(a), 0.0), float(b)


def fit_roofline(flops, nbytes, seconds, peak_flops: float, bandwidth: float,
                 iters: int = 50) -> Roofline:
    """Fit the two lines and the max between them.

    Alternate: assign every point to the regime that predicts the larger time, refit each regime
    by weighted least squares. Start from the arithmetic-intensity split (median FLOPs/byte).
    """
    f, m, t = (np.asarray(v, float) for v in (flops, nbytes, seconds))
    xc, xm = f / peak_flops, m / bandwidth
    intensity = f / m
    compute = intensity > np.median(intensity)
    best, best_err = None, np.inf
    for _ in range(iters):
        if compute.sum() >= 2:
            ac, bc = _lstsq(xc[compute], t[compute])
        else:
            ac, bc = 0.0, 0.0
        if (~compute).sum() >= 2:
            am, bm = _lstsq(xm[~compute], t[~compute])
        else:
            am, bm = 0.0, 0.0
        model = Roofline(ac, bc, am, bm, peak_flops, bandwidth)
        err = float(np.mean(((model.predict(f, m) - t) / t) ** 2))
        if err < best_err - 1e-15:
            best, best_err = model, err
        new = (ac * xc + bc) > (am * xm + bm)
        if np.array_equal(new, compute):
            break
        compute = new
    return best
