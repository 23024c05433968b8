"""Is the drafter's confidence worth trusting? Calibration of draft probabilities against acceptance.

Per round the engine reports, for every draft position j (drafts[:, j] proposes d(j+1)), the
drafter's probability of the token it proposed (`draft_prob`), its top-1 probability
(`draft_confidence`) and the top-1 − top-2 margin (`draft_margin`), plus how many drafts were
accepted (`n_drafted`) and the row's block size b. Only the accepted run and the first rejection
say anything about a position, so each round contributes

    j <  skip                     not counted (an exact draft: fastspec's d1 is the verifier's own
                                  next token and always accepted; see `exact_positions`). skip
                                  is per round where rounds differ: a TiDAR warm round's d1
                                  and a DFlash drafter's are guesses (Method.exact_drafts)
    j <  accepted                 label 1 (accepted)
    j == accepted, j < b - 1      label 0 (the first rejection)
    later positions               not counted (never judged on their own)

`calibration_metrics` returns the expected calibration error (ECE) of draft_prob (and of the
top-1 confidence) against that label, the reliability table behind it, the ECE a perfectly
calibrated drafter would show on as many positions (`ece_floor`: sampling noise alone; an ECE
near it cannot be told from calibrated), the Brier score and log loss, and the AUC of the risk score 1 − (p_top1 − p_top2) for "this position is the first
rejection" (1.0: the risk ranks every first rejection above every accepted draft; 0.5: no better
than chance). Given a fitted `DraftCalibration` (fastspec.draft) it also reports the calibrated
ECE, Brier and log loss.

`fit_temperatures` fits that calibration: a temperature and a bias per aligned index on the
log-odds of the draft probability, p_cal = sigmoid(logit(p) / T_i + b_i), by minimising the log
loss of "accepted" (T_i > 1: overconfident at index i; b_i > 0: under-confident throughout).

`DraftStats` gathers the per-round numbers while Engine.generate runs (no host read inside a
round); `bench_calibration` turns them into the block `fastspec bench` writes per run.
`reliability_diagram` draws a reliability table as a PNG (matplotlib, optional).
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

MIN_COUNT = 100          # judged positions an index needs for its own temperature
T_RANGE = (0.05, 20.0)   # fitted temperatures are clamped here (separable data would run away)


def _np(x, dtype) -> np.ndarray:
    return np.asarray(x.detach().cpu().double().numpy() if hasattr(x, "detach") else x, dtype=dtype)


def _rows(x) -> list[np.ndarray]:
    """[R, n] array, tensor or ragged list of rows -> list of 1-D float arrays."""
    if hasattr(x, "detach"):
        x = _np(x, np.float64)
    return [_np(r, np.float64).reshape(-1) for r in x]


def exact_positions(convention) -> int:
    """Leading aligned draft indices whose draft is exact (always accepted, so no evidence about
    the drafter): 1 under fastspec's convention (the seed runs causal and without the adapter, so
    its logit is the verifier's own next token), 0 when the seed sees the block or the adapter."""
    return int(convention.shift and convention.seed_attention == "causal"
               and not convention.seed_adapter)


def position_labels(n_drafted, block, width: int | Sequence[int],
                    skip: int | Sequence[int] = 0) -> list[np.ndarray]:
    """Per round: 1 accepted, 0 first rejection, -1 not counted, for each of the row's positions.
    skip: leading exact indices, for every round or per round."""
    acc, blk = _np(n_drafted, np.int64).reshape(-1), _np(block, np.int64).reshape(-1)
    widths = [width] * len(acc) if isinstance(width, int) else list(width)
    skips = [skip] * len(acc) if isinstance(skip, (int, np.integer)) else list(skip)
    if len(skips) != len(acc):
        raise ValueError("skip must be one number or one per round")
    out = []
    for a, b, n, skip in zip(acc, blk, widths, skips):
        j = np.arange(n)
        lab = np.full(n, -1, dtype=np.int64)
        lab[j < a] = 1
        lab[(j == a) & (j < b - 1)] = 0
        lab[j < skip] = -1
        out.append(lab)
    return out


def scaled(p, temperature, bias=0.0) -> np.ndarray:
    """sigmoid(logit(p) / T + b), elementwise (p clipped off 0 and 1)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    z = np.log(p / (1 - p)) / np.asarray(temperature, dtype=np.float64) + np.asarray(bias, dtype=np.float64)
    return 1 / (1 + np.exp(-z))


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


def ece_floor(conf: np.ndarray, bins: int = 10) -> float:
    """The ECE a perfectly calibrated drafter would still show on these positions, from sampling
    noise alone: labels drawn as Bernoulli(conf) leave each bin's accept rate off its mean
    confidence by E|N(0, Σ p(1 − p)) / n_b| = sqrt(2/π) sqrt(Σ p(1 − p)) / n_b (normal
    approximation), so the floor is sqrt(2/π) Σ_b sqrt(Σ_b p(1 − p)) / N. An ECE near it says
    "calibrated, as far as this many positions can tell"."""
    conf = np.asarray(conf, dtype=np.float64)
    if not len(conf):
        return float("nan")
    idx = np.clip((conf * bins).astype(np.int64), 0, bins - 1)
    var = np.bincount(idx, weights=conf * (1 - conf), minlength=bins)
    return float(np.sqrt(2 / np.pi) * np.sqrt(var).sum() / len(conf))


def log_loss(p, label) -> float:
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    y = np.asarray(label, dtype=np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()) if len(p) else float("nan")


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


def _judged(draft_prob, n_drafted, block, skip):
    """Flattened judged positions: probability, label, aligned index, block, and the keep mask
    over the concatenated rows."""
    prob = _rows(draft_prob)
    blocks = _np(block, np.int64).reshape(-1)
    labels = position_labels(n_drafted, blocks, [len(r) for r in prob], skip)
    if not (len(prob) == len(labels) == len(blocks)):
        raise ValueError("draft_prob, n_drafted and block must have one entry per round")
    if not prob:
        z = np.zeros(0)
        return z, z.astype(np.int64), z.astype(np.int64), z.astype(np.int64), z.astype(bool)
    lab = np.concatenate(labels)
    keep = lab >= 0
    index = np.concatenate([np.arange(len(r)) for r in prob])
    blk = np.concatenate([np.full(len(r), b) for r, b in zip(prob, blocks)])
    return np.concatenate(prob)[keep], lab[keep], index[keep], blk[keep], keep


def calibrated_probs(p: np.ndarray, index: np.ndarray, block: np.ndarray, calibration) -> np.ndarray:
    """Judged probabilities under a DraftCalibration (its table for each row's block size)."""
    temps, bias = np.ones(len(p)), np.zeros(len(p))
    for b in np.unique(block):
        sel = block == b
        for out, table in ((temps, calibration.table(int(b))), (bias, calibration.bias_table(int(b)))):
            table = np.asarray(table, dtype=np.float64)
            if len(table):
                out[sel] = table[np.minimum(index[sel], len(table) - 1)]
    return scaled(p, temps, bias)


def calibration_metrics(draft_prob, draft_confidence, draft_margin, n_drafted, block,
                        bins: int = 10, skip: int = 0, calibration=None) -> dict:
    """Metrics from per-round arrays: draft_prob / draft_confidence / draft_margin [R, n] (or
    ragged rows), n_drafted [R] accepted drafts, block [R] block sizes; skip: leading exact
    indices left out (one number, or one per round); calibration: a fastspec.draft.DraftCalibration whose calibrated ECE, Brier
    and log loss are reported beside the raw ones. See the module doc."""
    top1, margin = _rows(draft_confidence), _rows(draft_margin)
    p, y, index, blk, keep = _judged(draft_prob, n_drafted, block, skip)
    if not (len(top1) == len(margin) == len(_rows(draft_prob))):
        raise ValueError("draft_prob, draft_confidence, draft_margin, n_drafted and block "
                         "must have one entry per round")
    c = np.concatenate(top1)[keep] if top1 else np.zeros(0)
    risk = 1 - np.concatenate(margin)[keep] if margin else np.zeros(0)
    e, table = ece(p, y, bins)
    out = {
        "rounds": len(top1),
        "positions": int(len(y)),
        "exact_positions": skip if isinstance(skip, (int, np.integer)) else max(skip, default=0),
        **({} if isinstance(skip, (int, np.integer)) else {"exact_rounds": int(sum(s > 0 for s in skip))}),
        "accepted": int(y.sum()),
        "first_rejections": int((y == 0).sum()),
        "accept_rate": float(y.mean()) if len(y) else float("nan"),
        "mean_draft_prob": float(p.mean()) if len(p) else float("nan"),
        "ece": e,
        "ece_floor": ece_floor(p, bins),
        "ece_confidence": ece(c, y, bins)[0],
        "brier": float(((p - y) ** 2).mean()) if len(p) else float("nan"),
        "log_loss": log_loss(p, y),
        "auc_first_rejection": auc(risk, y == 0),
        "reliability": table,
        "by_index": [{"index": int(i), "count": int((index == i).sum()),
                      "accept_rate": float(y[index == i].mean()),
                      "mean_draft_prob": float(p[index == i].mean())} for i in np.unique(index)],
    }
    if calibration is not None:
        q = calibrated_probs(p, index, blk, calibration)
        e_cal, table_cal = ece(q, y, bins)
        out.update(ece_calibrated=e_cal, brier_calibrated=float(((q - y) ** 2).mean()) if len(q) else float("nan"),
                   log_loss_calibrated=log_loss(q, y),
                   mean_calibrated_prob=float(q.mean()) if len(q) else float("nan"),
                   reliability_calibrated=table_cal)
    return out


# --- fitting a temperature per position -----------------------------------------------------------
def fit_platt(p, label, intercept: bool = True) -> tuple[float, float]:
    """(T, b) minimising the log loss of `label` under sigmoid(logit(p) / T + b): logistic
    regression of the label on z = logit(p), slope β = 1/T, with an intercept b (or b = 0),
    convex in (β, b) (Newton steps, halved while the loss does not fall). The intercept fixes a
    drafter that is under- or over-confident throughout, which a temperature alone cannot (it
    only stretches the log-odds about 1/2). T clamped to T_RANGE; (1, 0) without data."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    y = np.asarray(label, dtype=np.float64)
    z = np.log(p / (1 - p))
    if not len(z) or not (intercept or np.any(z)):
        return 1.0, 0.0
    lo, hi = 1 / T_RANGE[1], 1 / T_RANGE[0]
    x = np.stack([z, np.ones_like(z)] if intercept else [z], axis=1)

    def loss(w):
        u = x @ w
        return float(np.sum(np.logaddexp(0, u) - y * u))

    w = np.zeros(x.shape[1])
    w[0] = 1.0
    cur = loss(w)
    for _ in range(100):
        s = 1 / (1 + np.exp(-(x @ w)))
        g = x.T @ (s - y)
        h = (x * (s * (1 - s))[:, None]).T @ x + 1e-12 * np.eye(len(w))
        step = np.linalg.solve(h, g)
        t = 1.0
        while True:
            new = w - t * step
            new[0] = min(max(new[0], lo), hi)
            new_loss = loss(new)
            if new_loss <= cur or t < 1e-6:
                break
            t /= 2
        done = np.max(np.abs(new - w)) < 1e-9 * max(1.0, abs(w[0]))
        if new_loss <= cur:
            w, cur = new, new_loss
        if done:
            break
    return float(1 / w[0]), float(w[1]) if intercept else 0.0


def fit_temperature(p, label) -> float:
    """The T of `fit_platt` without an intercept: sigmoid(logit(p) / T)."""
    return fit_platt(p, label, intercept=False)[0]


def fit_temperatures(draft_prob, n_drafted, block, skip: int = 0, min_count: int = MIN_COUNT,
                     width: int = 32, intercept: bool = True):
    """A DraftCalibration from per-round stats: a temperature and (intercept=True) a bias per
    aligned index 0..width-1 (`fit_platt`; intercept=False: the temperature alone).

    An index with at least `min_count` judged positions gets its own fit; a thinner one, the
    fit over every judged position (pooled); exact indices (< skip) keep T = 1, b = 0. With more than one
    block size in the data, each block size with data gets its own table the same way, its thin
    indices falling back to the pooled table's. Counts and log losses are in `meta`."""
    from fastspec.draft import DraftCalibration
    p, y, index, blk, _ = _judged(draft_prob, n_drafted, block, skip)
    fit = lambda p, y: fit_platt(p, y, intercept)      # noqa: E731
    pooled = fit(p, y)

    def table(sel, fallback):
        out = []
        for i in range(width):
            mine = sel & (index == i)
            out.append((1.0, 0.0) if i < skip else
                       fit(p[mine], y[mine]) if mine.sum() >= min_count else fallback[i])
        return out

    every = np.ones(len(p), dtype=bool)
    both = table(every, [pooled] * width)
    by_block = {}
    if len(np.unique(blk)) > 1:
        by_block = {int(b): table(blk == b, both) for b in np.unique(blk)}
    temps = lambda rows: [t for t, _ in rows]      # noqa: E731
    biases = lambda rows: [b for _, b in rows] if intercept else []    # noqa: E731
    cal = DraftCalibration(temps(both), {b: temps(r) for b, r in by_block.items()},
                           bias=biases(both), by_block_bias={b: biases(r) for b, r in by_block.items()}
                           if intercept else {})
    q = calibrated_probs(p, index, blk, cal)
    cal.meta = {
        "fit": "T and b per aligned draft index minimising the log loss of 'accepted' under "
               "sigmoid(logit(draft_prob) / T + b)" if intercept else
               "T per aligned draft index minimising the log loss of 'accepted' under "
               "sigmoid(logit(draft_prob) / T)",
        "exact_positions": skip, "min_count": min_count, "pooled_temperature": pooled[0],
        "pooled_bias": pooled[1],
        "counts": {"rounds": int(_np(n_drafted, np.int64).size),
                   "positions": int(len(y)), "accepted": int(y.sum()),
                   "by_index": [int((index == i).sum()) for i in range(width)],
                   "by_block": {str(int(b)): int((blk == b).sum()) for b in np.unique(blk)}},
        "fitted_indices": [i for i in range(width) if i >= skip and (index == i).sum() >= min_count],
        "log_loss_before": log_loss(p, y), "log_loss_after": log_loss(q, y),
    }
    return cal


# --- gathering the per-round numbers during a run -------------------------------------------------
class DraftStats:
    """Per-round draft statistics of Engine.generate runs, gathered as rounds commit.

        stats = DraftStats(engine)
        engine.generate(prompts, params, method="linear", on_commit=stats.on_commit)
        arrays = stats.arrays()          # None when no round drafted (AR)

    The first commit of a round finds the round's outputs in `engine.last_rounds`; their
    draft_prob / draft_confidence / draft_margin / n_drafted rows are copied on the device (one
    cat per step group: no host read, and a copy, since a captured graph reuses its output
    buffers) and read once in `arrays()` after the run. Block sizes and request indices are host
    values the engine already has. `seconds` is the host time spent collecting (its whole cost)."""

    def __init__(self, engine):
        self.engine = engine
        self._seen = engine.last_rounds          # rounds before this run are not ours
        self._parts: list[tuple[int, torch.Tensor]] = []
        self.requests: list[int] = []
        self.blocks: list[int] = []
        self.exact: list[bool] = []              # per row: its first draft may be exact (Method.exact_drafts)
        self.seconds = 0.0
        self.index_base = 0                      # added to the generate indices (resume)

    def resume(self, index_base: int) -> None:
        """Before a further generate call of the same run (bench --interleave): its rounds are
        ours from now on, and its request j is request `index_base + j` of the run."""
        self._seen = self.engine.last_rounds
        self.index_base = index_base

    def on_commit(self, index: int, ids: list[int], n_drafted: int) -> None:
        rounds = self.engine.last_rounds
        if rounds is self._seen:                 # a later commit of the same round, or a prefill
            return
        t0 = time.perf_counter()
        self._seen = rounds
        meth = getattr(self.engine, "last_method", None)
        for plan, members, out in rounds:
            stats = (out.draft_prob, out.draft_confidence, out.draft_margin)
            if any(t is None for t in stats):
                continue
            self._parts.append((stats[0].shape[1],
                                torch.cat([*(t.float() for t in stats), out.n_drafted[:, None].float()], 1)))
            self.requests += [self.index_base + q.index for q in members]
            self.blocks += [q.block for q in members]
            self.exact += [meth is None or meth.exact_drafts(plan.variant)] * len(members)
        self.seconds += time.perf_counter() - t0

    def chain(self, on_commit=None):
        """An on_commit for generate that collects, then calls `on_commit` (if any)."""
        def both(index, ids, n_drafted):
            self.on_commit(index, ids, n_drafted)
            if on_commit is not None:
                on_commit(index, ids, n_drafted)
        return both

    def arrays(self) -> dict | None:
        """Rows in round order: draft_prob / draft_confidence / draft_margin (ragged float rows),
        n_drafted, block, request (the generate index), exact (the row's first draft may be
        exact: Method.exact_drafts); None when nothing drafted."""
        if not self._parts:
            return None
        t0 = time.perf_counter()
        by_width: dict[int, list[torch.Tensor]] = {}
        for w, t in self._parts:
            by_width.setdefault(w, []).append(t)
        host = {w: torch.cat(ts).cpu().numpy().astype(np.float64) for w, ts in by_width.items()}
        at = dict.fromkeys(host, 0)
        prob, conf, margin, nd = [], [], [], []
        for w, t in self._parts:
            x = host[w][at[w]: at[w] + t.shape[0]]
            at[w] += t.shape[0]
            prob += list(x[:, :w])
            conf += list(x[:, w: 2 * w])
            margin += list(x[:, 2 * w: 3 * w])
            nd += x[:, 3 * w].astype(np.int64).tolist()
        self.seconds += time.perf_counter() - t0
        return {"draft_prob": prob, "draft_confidence": conf, "draft_margin": margin,
                "n_drafted": nd, "block": list(self.blocks), "request": list(self.requests),
                "exact": list(self.exact)}


def _clean(x):
    """NaN -> None, recursively (the results file stays standard JSON)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def bench_calibration(arrays: dict, bench_of: Sequence[str], skip: int = 0, calibration=None,
                      bins: int = 10, collect_s: float | None = None) -> dict:
    """The `calibration` block of a bench run: metrics over all rounds and per benchmark.
    arrays: DraftStats.arrays(); bench_of[i]: the benchmark of generate request i; skip: the
    convention's exact indices, left out of the rounds whose first draft may be exact."""
    def metrics(sel):
        return calibration_metrics(*([arrays[k][i] for i in sel] for k in
                                     ("draft_prob", "draft_confidence", "draft_margin")),
                                   [arrays["n_drafted"][i] for i in sel], [arrays["block"][i] for i in sel],
                                   bins=bins, skip=[skip if arrays["exact"][i] else 0 for i in sel],
                                   calibration=calibration)
    benches = [bench_of[r] for r in arrays["request"]]
    everything = range(len(benches))
    out = {"exact_positions": skip, "calibrated": calibration is not None, "all": metrics(everything),
           "by_bench": {b: metrics([i for i in everything if benches[i] == b])
                        for b in dict.fromkeys(benches)}}
    if calibration is not None:
        out["temperature"] = calibration.temperature
        if calibration.by_block:
            out["temperature_by_block"] = {str(b): t for b, t in calibration.by_block.items()}
    if collect_s is not None:
        out["collect_s"] = round(collect_s, 4)
    return _clean(out)


# --- drawing --------------------------------------------------------------------------------------
def draw_reliability(ax, metrics: dict, label: str = "", color=None, calibrated: bool = True) -> None:
    """Accept rate against mean draft probability per bin on `ax` (marker area ~ count); the
    calibrated table dashed beside it when `metrics` has one."""
    tables = [("reliability", "-", "")]
    if calibrated and metrics.get("reliability_calibrated"):
        tables.append(("reliability_calibrated", "--", " (calibrated)"))
    total = max(sum(r["count"] for r in metrics["reliability"]), 1)
    for key, style, suffix in tables:
        full = [r for r in metrics[key] if r["count"]]
        e = metrics["ece" if key == "reliability" else "ece_calibrated"]
        floor = metrics.get("ece_floor") if key == "reliability" else None
        noise = f" (noise {floor:.3f})" if floor is not None else ""
        line, = ax.plot([r["confidence"] for r in full], [r["accept_rate"] for r in full], style,
                        c=color, lw=1.2, label=f"{label}{suffix} ECE {e:.3f}{noise}".strip())
        ax.scatter([r["confidence"] for r in full], [r["accept_rate"] for r in full],
                   s=[8 + 200 * r["count"] / total for r in full], c=line.get_color(), alpha=0.6)
    ax.plot([0, 1], [0, 1], ls=":", c="grey", lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="drafter's probability of its draft",
           ylabel="accepted fraction")


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
    fig = Figure(figsize=(4.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    draw_reliability(ax, metrics, "draft prob", color="C3")
    a = metrics.get("auc_first_rejection")
    ax.set_title(title or f"ECE {metrics['ece']:.3f}, AUC(first rejection) "
                          f"{'—' if a is None else format(a, '.3f')}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
