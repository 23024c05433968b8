"""Is the drafter's confidence worth trusting? Calibration of draft probabilities against acceptance.

Per round the engine reports, for every draft position j (drafts[:, j] proposes d(j+1)), the
drafter's probability of the token it proposed (`draft_prob`), its top-1 probability
(`draft_confidence`) and the top-1 − top-2 margin (`draft_margin`), plus how many drafts were
accepted (`n_drafted`) and the row's block size b. Only the accepted run and the first rejection
say anything about a position, so each round contributes

    j <  accepted                 label 1 (accepted)
    j == accepted, j < b - 1      label 0 (the first rejection)
    later positions               not counted (never judged on their own)

`calibration_metrics` returns the expected calibration error (ECE) of draft_prob (and of the
top-1 confidence) against that label, the reliability table behind it, the Brier score, and the
AUC of the risk score 1 − (p_top1 − p_top2) for "this position is the first rejection" (1.0: the
risk ranks every first rejection above every accepted draft; 0.5: no better than chance).
`reliability_diagram` draws the table as a PNG (matplotlib, optional).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import numpy as np


def _np(x, dtype) -> np.ndarray:
    return np.asarray(x.detach().cpu().double().numpy() if hasattr(x, "detach") else x, dtype=dtype)


def _rows(x) -> list[np.ndarray]:
    """[R, n] array, tensor or ragged list of rows -> list of 1-D float arrays."""
    if hasattr(x, "detach"):
        x = _np(x, np.float64)
    return [_np(r, np.float64).reshape(-1) for r in x]


def position_labels(n_drafted, block, width: int | Sequence[int]) -> list[np.ndarray]:
    """Per round: 1 accepted, 0 first rejection, -1 not counted, for each of the row's positions."""
    acc, blk = _np(n_drafted, np.int64).reshape(-1), _np(block, np.int64).reshape(-1)
    widths = [width] * len(acc) if isinstance(width, int) else list(width)
    out = []
    for a, b, n in zip(acc, blk, widths):
        j = np.arange(n)
        lab = np.full(n, -1, dtype=np.int64)
        lab[j < a] = 1
        lab[(j == a) & (j < b - 1)] = 0
        out.append(lab)
    return out


def ece(conf: np.ndarray, label: np.ndarray, bins: int = 10) -> tuple[float, list[dict]]:
    """Expected calibration error over equal-width confidence bins, and the bins
    (lo, hi, count, mean confidence, accept rate; empty bins have count 0 and None rates)."""
    conf, label = np.asarray(conf, dtype=np.float64), np.asarray(label, dtype=np.float64)
    idx = np.clip((conf * bins).astype(np.int64), 0, bins - 1)       # conf == 1 -> last bin
    table, err = [], 0.0
    for k in range(bins):
        sel = idx == k
        n = int(sel.sum())
        row = {"lo": k / bins, "hi": (k + 1) / bins, "count": n, "confidence": None, "accept_rate": None}
        if n:
            row["confidence"], row["accept_rate"] = float(conf[sel].mean()), float(label[sel].mean())
            err += n * abs(row["confidence"] - row["accept_rate"])
        table.append(row)
    return (err / len(conf) if len(conf) else float("nan")), table


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC of `score` for the positives (Mann-Whitney U, ties counted half); NaN without both
    classes."""
    score, positive = np.asarray(score, dtype=np.float64), np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):                           # average rank over runs of equal scores
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def calibration_metrics(draft_prob, draft_confidence, draft_margin, n_drafted, block,
                        bins: int = 10) -> dict:
    """Metrics from per-round arrays: draft_prob / draft_confidence / draft_margin [R, n] (or
    ragged rows), n_drafted [R] accepted drafts, block [R] block sizes. See the module doc."""
    prob, top1, margin = _rows(draft_prob), _rows(draft_confidence), _rows(draft_margin)
    labels = position_labels(n_drafted, block, [len(r) for r in prob])
    if not (len(prob) == len(top1) == len(margin) == len(labels)):
        raise ValueError("draft_prob, draft_confidence, draft_margin, n_drafted and block "
                         "must have one entry per round")
    lab = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
    keep = lab >= 0
    p = np.concatenate(prob)[keep] if prob else np.zeros(0)
    c = np.concatenate(top1)[keep] if top1 else np.zeros(0)
    risk = 1 - np.concatenate(margin)[keep] if margin else np.zeros(0)
    y = lab[keep]
    e, table = ece(p, y, bins)
    return {
        "rounds": len(labels),
        "positions": int(keep.sum()),
        "accepted": int(y.sum()),
        "first_rejections": int((y == 0).sum()),
        "accept_rate": float(y.mean()) if len(y) else float("nan"),
        "mean_draft_prob": float(p.mean()) if len(p) else float("nan"),
        "ece": e,
        "ece_confidence": ece(c, y, bins)[0],
        "brier": float(((p - y) ** 2).mean()) if len(p) else float("nan"),
        "auc_first_rejection": auc(risk, y == 0),
        "reliability": table,
    }


def reliability_diagram(metrics: dict, path: str | Path, title: str | None = None) -> Path | None:
    """Draw `calibration_metrics(...)["reliability"]` (accept rate against draft probability per
    bin, bar width ~ count) as a PNG; None, with one line on stderr, when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("no reliability diagram: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
        return None
    table = metrics["reliability"]
    fig = Figure(figsize=(4.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="perfectly calibrated")
    full = [r for r in table if r["count"]]
    width = table[0]["hi"] - table[0]["lo"] if table else 0.1
    ax.bar([r["lo"] for r in full], [r["accept_rate"] for r in full], width=width, align="edge",
           edgecolor="black", alpha=0.7, label="accept rate")
    ax.plot([r["confidence"] for r in full], [r["accept_rate"] for r in full], "o-", c="C3", ms=3,
            label="mean draft prob")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="drafter's probability of its draft",
           ylabel="accepted fraction",
           title=title or f"ECE {metrics['ece']:.3f}, AUC(first rejection) "
                          f"{metrics['auc_first_rejection']:.3f}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
