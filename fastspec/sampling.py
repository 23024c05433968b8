"""Sampling: greedy and temperature / top-k / top-p, per request, without host syncs.

Per-request parameters live in tensors so one batched call serves a mix of greedy and sampled
requests. Sampling is Gumbel-max over the filtered log-probabilities, drawn from an explicit
generator: reproducible for a seed, and the same `probs` feed lossless speculative sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastspec.config import FastspecError


@dataclass
class SamplingParams:
    temperature: float = 0.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    max_new_tokens: int = 256
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise FastspecError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FastspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FastspecError(f"--top-k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise FastspecError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SamplerState:
    """Per-slot sampling parameters as tensors, plus the generator."""

    def __init__(self, num_slots: int, device="cpu", seed: int = 0):
        self.temperature = torch.zeros(num_slots, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(num_slots, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.any_sampled = False      # host-side: skip all filtering when every request is greedy
        self.any_filtered = False

    def set(self, slot: int, p: SamplingParams) -> None:
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.any_sampled |= not p.greedy
        self.any_filtered |= (not p.greedy) and (p.top_k > 0 or p.top_p < 1)


def filtered_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, apply_filters: bool = True) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p; logits [B, ..., V], params [B].

    Greedy rows (temperature 0) get a one-hot distribution at the argmax, so the same code path
    serves greedy verification too.
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    t = temperature.view(shape)
    x = logits.float() / t.clamp_min(1e-5)
    if apply_filters:
        sorted_x, _ = x.sort(dim=-1, descending=True)
        V = x.shape[-1]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(1, V).view(shape)
        kth = sorted_x.gather(-1, (k - 1).expand(*x.shape[:-1], 1))
        # top-p: keep the smallest prefix of sorted tokens whose mass reaches p (always >= 1 token)
        sorted_p = sorted_x.softmax(-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = mass_before < top_p.view(shape)
        n_keep = keep_sorted.sum(-1, keepdim=True).clamp_min(1)
        pth = sorted_x.gather(-1, n_keep - 1)
        x = x.masked_fill((x < kth) | (x < pth), float("-inf"))
    logp = x.log_softmax(-1)
    greedy = (temperature == 0).view(shape)
    onehot = torch.full_like(logp, float("-inf")).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    return torch.where(greedy, onehot, logp)


def sample_tokens(logits: torch.Tensor, state: SamplerState, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [B, ..., V]; greedy rows take the argmax (ties: lowest id)."""
    if not state.any_sampled:
        return logits.argmax(-1)
    temp, top_k, top_p = state.temperature, state.top_k, state.top_p
    if slots is not None:
        temp, top_k, top_p = temp[slots], top_k[slots], top_p[slots]
    logp = filtered_logprobs(logits, temp, top_k, top_p, apply_filters=state.any_filtered)
    return sample_from_logprobs(logp, state.generator)


def sample_from_logprobs(logp: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gumbel-max: argmax(log p + G) is a draw from p (rows with one finite entry stay greedy)."""
    u = torch.rand(logp.shape, generator=generator, device=logp.device).clamp_(1e-20, 1.0)
    return (logp - torch.log(-torch.log(u))).argmax(-1)
