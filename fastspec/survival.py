"""Verification-guided block sizes: how far a block of B drafts will be accepted, from what the
verifier did in a request's recent rounds.

State of a request before a round: s = its mean accepted fraction over the last rounds
(accepted drafts / (B − 1), a verifier-side signal, not a draft-logit feature) and a stratum
z = (previous block size, was it fully accepted?). A fully accepted block of 8 is a censored
observation of a longer block: its run of accepted drafts was >= 7, nobody knows how much more.

Survival table: P(A_B >= k | s, z) for k = 1..B, A_B = tokens a round of block B commits
(accepted drafts + 1). Fitted per (B, z, bin of s) with a discrete Kaplan–Meier estimator over
the run R of accepted drafts, so exact runs (a rejection was seen) and censored runs (the block
was accepted whole) both count:

    hazard h_j = #(R == j, seen) / #(at risk at j),   P(R >= j) = Π_{i<j} (1 − h_i),
    P(A_B >= k) = P(R >= k − 1)

Bins are quantiles of s; each table is made non-decreasing in s (isotonic, pool adjacent
violators, weighted by counts) and non-increasing in k; a stratum with fewer than `min_count`
observations in a bin is blended with the table pooled over strata.

V_B(s, z) = Σ_{k=1..B} P(A_B >= k) is the expected commit of a round; the chooser takes
argmax_B V_B / T_C(B) (tokens per second) or argmax_B V_B − ρ·T_C(B), T_C(B) being the measured
time of a round of block B at the current batch bucket.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from fastspec.config import FastspecError

WINDOW = 3              # rounds the history signal s averages over
START = "start"         # the stratum of a request's first round


@dataclass(frozen=True)
class Observation:
    """One round (or one counterfactual probe) from a state: the history signal, the stratum,
    the block size tried and the tokens it committed."""
    s: float
    z: str
    block: int
    commit: int          # accepted drafts + 1, in 1..block


def stratum(prev_block: int | None, prev_commit: int | None) -> str:
    if prev_block is None:
        return START
    return f"{prev_block}{'F' if prev_commit >= prev_block else 'P'}"     # F: fully accepted


def history_signal(blocks: list[int], commits: list[int], prior: float = 0.3) -> float:
    """Mean accepted fraction over the last WINDOW rounds (prior when there are none)."""
    fr = [(c - 1) / max(b - 1, 1) for b, c in zip(blocks[-WINDOW:], commits[-WINDOW:])]
    return float(np.mean(fr)) if fr else prior


def km_survival(runs: np.ndarray, censored: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """P(R >= j) for j = 0..horizon from runs R (censored: R >= that value, nothing more known),
    and the number at risk at each j."""
    surv = np.ones(horizon + 1)
    at_risk = np.zeros(horizon + 1)
    for j in range(horizon):
        # At risk at j: runs seen to reach j (exact runs >= j, censored runs > j).
        risk = np.sum(np.where(censored, runs > j, runs >= j))
        events = np.sum(~censored & (runs == j))
        at_risk[j] = risk
        h = events / risk if risk > 0 else 0.0
        surv[j + 1] = surv[j] * (1 - h)
    at_risk[horizon] = np.sum(runs >= horizon)
    return surv, at_risk


def isotonic_increasing(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks = [[float(v), float(max(wt, 1e-9)), 1] for v, wt in zip(y, w)]
    merged: list[list[float]] = []
    for b in blocks:
        merged.append(b)
        while len(merged) > 1 and merged[-2][0] > merged[-1][0]:
            v2, w2, n2 = merged.pop()
            v1, w1, n1 = merged.pop()
            merged.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([[v] * int(n) for v, _, n in merged])


@dataclass
class SurvivalTables:
    blocks: tuple[int, ...]
    edges: list[float]                        # inner quantile edges of s (len = bins − 1)
    tables: dict = field(default_factory=dict)    # "B|z" -> [bins][B] P(A_B >= k), k = 1..B
    counts: dict = field(default_factory=dict)    # "B|z" -> [bins] observations
    meta: dict = field(default_factory=dict)

    # --- fitting ------------------------------------------------------------------------------
    @classmethod
    def fit(cls, obs: list[Observation], blocks=(8, 16, 32), bins: int = 4,
            min_count: int = 20, meta: dict | None = None) -> "SurvivalTables":
        if not obs:
            raise FastspecError("no observations to fit survival tables from")
        s = np.array([o.s for o in obs])
        qs = np.quantile(s, np.linspace(0, 1, bins + 1)[1:-1]) if bins > 1 else np.array([])
        edges = sorted(set(float(e) for e in qs))
        t = cls(tuple(blocks), edges, meta=dict(meta or {}))
        zs = sorted({o.z for o in obs})
        nb = len(edges) + 1
        bin_of = np.array([t.bin(o.s) for o in obs])
        blk = np.array([o.block for o in obs])
        run = np.array([o.commit - 1 for o in obs])
        cens = np.array([o.commit >= o.block for o in obs])          # accepted whole: R >= B − 1
        zz = np.array([o.z for o in obs])
        for B in blocks:
            # A block of B is judged from tries of B and, censored, from shorter blocks' tries.
            use = blk <= B
            pooled = []
            for b in range(nb):
                sel = use & (bin_of == b)
                surv, _ = km_survival(run[sel], cens[sel], B)
                pooled.append(surv[:B])
            for z in zs + ["*"]:
                rows, ns = [], []
                for b in range(nb):
                    sel = use & (bin_of == b) & ((zz == z) if z != "*" else True)
                    n = int(sel.sum())
                    surv, _ = km_survival(run[sel], cens[sel], B)
                    row = surv[:B] if n else pooled[b]
                    if z != "*" and n < min_count:                  # thin: lean on the pool
                        row = (n * row + (min_count - n) * pooled[b]) / min_count
                    rows.append(row)
                    ns.append(n)
                t.tables[f"{B}|{z}"] = t._monotone(np.array(rows), np.array(ns)).tolist()
                t.counts[f"{B}|{z}"] = ns
        return t

    @staticmethod
    def _monotone(rows: np.ndarray, ns: np.ndarray) -> np.ndarray:
        """Non-decreasing in s (isotonic per k across bins), non-increasing in k, P(A >= 1) = 1."""
        out = rows.copy()
        for k in range(rows.shape[1]):
            out[:, k] = isotonic_increasing(rows[:, k], ns + 1)
        out = np.minimum.accumulate(np.clip(out, 0, 1), axis=1)
        out[:, 0] = 1.0
        return out

    # --- queries ------------------------------------------------------------------------------
    def bin(self, s: float) -> int:
        return int(np.searchsorted(self.edges, s, side="right"))

    def survival(self, block: int, s: float, z: str) -> np.ndarray:
        key = f"{block}|{z}"
        if key not in self.tables:
            key = f"{block}|*"
        return np.asarray(self.tables[key][self.bin(s)])

    def value(self, block: int, s: float, z: str) -> float:
        """V_B(s, z): the expected tokens a round of block B commits."""
        return float(self.survival(block, s, z).sum())

    # --- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"blocks": list(self.blocks), "edges": self.edges, "tables": self.tables,
                "counts": self.counts, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "SurvivalTables":
        try:
            return cls(tuple(d["blocks"]), list(d["edges"]), d["tables"], d.get("counts", {}),
                       d.get("meta", {}))
        except (KeyError, TypeError) as e:
            raise FastspecError(f"not a survival-table file: {e}") from None

    @classmethod
    def load(cls, path: str) -> "SurvivalTables":
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, ValueError) as e:
            raise FastspecError(f"cannot read survival tables {path}: {e}") from None
        except FastspecError as e:
            raise FastspecError(f"survival tables {path}: {e}") from None


def choose_block(values: dict[int, float], costs: dict[int, float], objective: str = "ratio",
                 rho: float = 0.0) -> int:
    """argmax_B V_B / T(B) ("ratio": tokens per unit time) or argmax_B V_B − ρ·T(B) ("penalty")."""
    if objective == "ratio":
        return max(values, key=lambda b: (values[b] / costs[b], -b))
    if objective == "penalty":
        return max(values, key=lambda b: (values[b] - rho * costs[b], -b))
    raise FastspecError(f"unknown block objective {objective!r} (ratio or penalty)")
