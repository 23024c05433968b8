"""Sampling: greedy and temperature / top-k / top-p, per request, without host syncs.

Per-request parameters live in tensors so one batched call serves a mix of greedy and sampled
requests. A sample is an inverse-CDF draw from the filtered probabilities with one uniform from a
counter-based random stream per request (`uniform`): reproducible for a seed whatever the batch
and the slot, free of generator state (so it compiles and replays in a captured step), and the
same probabilities feed lossless speculative sampling.
"""
from __future__ import annotations

import math
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
        # "not in range" rather than "out of range": NaN fails every comparison, so it is rejected.
        if not 0 <= self.temperature < math.inf:
            raise FastspecError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FastspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise FastspecError(f"--top-k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise FastspecError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Streams: independent random draws a round may need, so no two uses share numbers.
STREAM_TOKEN, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (bijective, good avalanche) on int64 tensors holding values < 2^32.
    Products stay below 2^63, so there is no signed overflow on any backend."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def request_seeds(seed: int, indices: torch.Tensor) -> torch.Tensor:
    """The random streams of requests `indices` under SamplingParams.seed: one per request, so a
    request's samples do not depend on which slot it lands in or what runs beside it."""
    return _mix32((_mix32(torch.tensor(seed & _M32)) + (indices & _M32)) & _M32)


# The code a step needs for its requests, least to most: argmax only, sampling, sampling + filters.
MODES = ("greedy", "sample", "filtered")


def sampling_mode(params) -> str:
    """The widest mode any of `params` (SamplingParams) needs."""
    need = 0
    for p in params:
        if not p.greedy:
            need = max(need, 2 if (p.top_k > 0 or p.top_p < 1) else 1)
    return MODES[need]


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): [S, *shape] from per-row (seed, counter) and a stream id.

    Stateless (a pure function of its inputs, like Philox in JAX): no generator object, so a
    compiled or captured step replays it without host state, and a row's draws depend only on
    its own request and round.
    """
    n = 1
    for d in shape:
        n *= d
    h = _mix32((_mix32(seed & _M32) + counter) & _M32)
    h = _mix32((h + 0x9E3779B9 * (stream + 1)) & _M32)
    idx = torch.arange(n, device=seed.device)
    x = _mix32(_mix32((h[:, None] + idx[None, :]) & _M32) ^ h[:, None])
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))              # 24 random bits, never 0 or 1
    return u.view(seed.shape[0], *shape)


class SamplerState:
    """Per-slot sampling parameters and random streams as tensors.

    seed [S]: each slot's request stream (`request_seeds`); counter [S]: the request's round, so
    every round draws fresh numbers. `mode` (host side) says which code a step needs."""

    def __init__(self, num_slots: int, device="cpu", seed: int = 0, mode: str = "greedy"):
        self.temperature = torch.zeros(num_slots, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.top_p = torch.ones(num_slots, device=device)
        # Until `set` assigns requests, slot i draws from request i's stream.
        self.seed = request_seeds(seed, torch.arange(num_slots)).to(device)
        self.counter = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.mode = mode

    @property
    def mode(self) -> str:
        """What the step must compute: greedy (argmax only), sample, or sample with filters."""
        return "filtered" if self.any_filtered else "sample" if self.any_sampled else "greedy"

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown sampling mode {mode!r} (one of {MODES})")
        self.any_sampled = mode != "greedy"       # host-side: greedy steps skip all sampling code
        self.any_filtered = mode == "filtered"

    def set(self, slot: int, p: SamplingParams, index: int = 0) -> None:
        """Slot `slot` now serves request `index` with params `p`."""
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.seed[slot] = request_seeds(p.seed, torch.tensor(index))
        self.counter[slot] = 0
        self.mode = max(self.mode, sampling_mode([p]), key=MODES.index)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.seed, self.counter

    @classmethod
    def view(cls, tensors: tuple[torch.Tensor, ...], mode: str) -> "SamplerState":
        """A SamplerState over given tensors (inside a compiled step: its inputs)."""
        s = cls.__new__(cls)
        s.temperature, s.top_k, s.top_p, s.seed, s.counter = tensors
        s.mode = mode
        return s

    def uniform(self, stream: int, shape: tuple[int, ...] = (), rows: int | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Uniforms [rows, *shape] for the first `rows` slots (or the given slots)."""
        seed, counter = self.seed, self.counter
        if slots is not None:
            seed, counter = seed[slots], counter[slots]
        elif rows is not None:
            seed, counter = seed[:rows], counter[:rows]
        return uniform(seed, counter, stream, shape)


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
    return torch.where(greedy, point_mass_logp(logits.argmax(-1), logp), logp)


def point_mass_logp(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[..., V] log-probs of a law that puts all its mass on `tokens` [...]: 0 there, -inf elsewhere
    (a greedy row's law; a deterministic drafter's q)."""
    return torch.full_like(like, float("-inf")).scatter_(-1, tokens[..., None], 0.0)


def sample_tokens(logits: torch.Tensor, state: SamplerState, slots: torch.Tensor | None = None,
                  stream: int = STREAM_TOKEN) -> torch.Tensor:
    """One token per row of logits [B, V]; greedy rows take the argmax (ties: lowest id)."""
    if not state.any_sampled:
        return logits.argmax(-1)
    B = logits.shape[0]
    temp, top_k, top_p = state.temperature, state.top_k, state.top_p
    if slots is not None:
        temp, top_k, top_p = temp[slots], top_k[slots], top_p[slots]
    else:
        temp, top_k, top_p = temp[:B], top_k[:B], top_p[:B]
    logp = filtered_logprobs(logits, temp, top_k, top_p, apply_filters=state.any_filtered)
    return sample_from_logprobs(logp, state.uniform(stream, tuple(logits.shape[1:-1]), rows=B, slots=slots))


def sample_categorical(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalized weights [..., V] >= 0 with one uniform per row u [...].

    One uniform per distribution (Gumbel-max needs V); a zero-weight token is never drawn: the
    first index whose running sum exceeds u * total always has weight > 0, and the clamp keeps
    float rounding at the very top from stepping past the last positive entry.
    """
    cdf = weights.float().cumsum(-1)
    x = (u * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf, x, right=True)[..., 0]
    last_positive = (weights > 0).long().cumsum(-1).argmax(-1)     # first index of the final count
    return torch.minimum(idx, last_positive)


def sample_from_logprobs(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from exp(logp) per row (rows with one finite entry stay greedy)."""
    return sample_categorical(logp.exp(), u)
