"""Report on `fastspec bench --json` results: RecGuide-style tables and plots.

    res = load_results("results/bench.json")
    m = metrics(res["records"], res["runs"])
    console.print(table2(m, concurrency=1))          # τ / speedup× per method × benchmark
    write_plots("results/bench.json", "results/plots")

Definitions (AR, method "ar", is the reference at the same concurrency C):
  τ                 Σ(new_tokens − 1) / Σ rounds: tokens per draft-verify round; the first token
                    comes from prefill. Records whose rounds is None (uncounted) are left out.
  tokens/forward    Σ new_tokens / Σ forwards from records' `forwards`, when every record has
                    it; else the run's `tokens_per_forward` (per (method, C) only).
  accept histogram  {commit length: number of rounds} from records' `accept_lengths`.
  per-request tok/s mean over requests of (new_tokens − 1) / (latency_s − ttft_s): the rate a
                    request streams at once it started. The engine stamps every request as
                    submitted when the run starts, so latency alone would count queueing behind
                    other requests at low C; prefill is left out with it.
  aggregate tok/s   the run's tokens_per_s (all requests of one (method, C) together).
  speedup           per (method, C): aggregate tok/s ÷ AR aggregate tok/s. Per benchmark the
                    runs are mixed (a batch holds requests of several benchmarks), so there is no
                    per-benchmark aggregate: per-request tok/s ÷ AR per-request tok/s instead.
  paired speedup    per (method, C): the geometric mean over requests of the request's
                    per-request tok/s ÷ AR's on the same request, with a 95% bootstrap interval
                    (2,000 resamples of the requests, fixed seed). It is what `--interleave`
                    measures well: each pair then ran minutes apart at most.
  accuracy          mean of non-None `correct`; identical: share of records equal to AR.
  macro average     mean over benchmarks of the per-benchmark values (the tables' "avg").
  draft calibration a drafting run's `calibration` block (evals.calibration): ECE, Brier, AUC of
                    the risk for the first rejection, per benchmark; `calibration_tables` prints
                    them, `--plot` draws reliability.png (a panel per benchmark).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fastspec.config import FastspecError
from fastspec.evals.suites import display_name

REFERENCE = "ar"
RUN_KEYS = ("method", "concurrency", "tokens_per_s")
RECORD_KEYS = ("bench", "method", "concurrency", "new_tokens", "latency_s")
MACRO_KEYS = ("tau", "tokens_per_forward", "speedup", "per_request_tokens_per_s", "accuracy", "identical")


# --- loading ------------------------------------------------------------------------------------
def load_results(path: str) -> dict:
    """The bench JSON, checked enough that the rest can index it; one-line FastspecError if not."""
    if not os.path.isfile(path):
        raise FastspecError(f"results file not found: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FastspecError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), list) for k in ("runs", "records")):
        raise FastspecError(f"{path}: not a fastspec bench results file (needs 'runs' and 'records' lists)")
    for part, keys in (("runs", RUN_KEYS), ("records", RECORD_KEYS)):
        for i, row in enumerate(data[part]):
            missing = [k for k in keys if not isinstance(row, dict) or k not in row]
            if missing:
                raise FastspecError(f"{path}: {part}[{i}] lacks {', '.join(map(repr, missing))}")
    return data


# --- metrics ------------------------------------------------------------------------------------
def metrics(records, runs) -> dict:
    """Everything the tables and plots show, as JSON-ready rows (definitions in the module doc).

    Returns {"methods", "benches", "concurrency": ordered names and levels,
             "by_method": rows per (method, C), "by_bench": rows per (bench, method, C),
             "macro": rows per (method, C) averaged over benchmarks}. Find a row with `lookup`.
    """
    recs = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r for r in records]
    # Requests that could not run (error rows) are counted, never averaged in.
    failed = Counter((r["method"], r["concurrency"]) for r in recs if r.get("error"))
    recs = [r for r in recs if not r.get("error")]
    run_at = {(r["method"], r["concurrency"]): r for r in runs}
    methods = _ordered([r["method"] for r in runs] + [r["method"] for r in recs])
    if REFERENCE in methods:
        methods.remove(REFERENCE)
        methods.insert(0, REFERENCE)
    levels = sorted({r["concurrency"] for r in runs} | {r["concurrency"] for r in recs})
    benches = _ordered(r["bench"] for r in recs)
    groups: dict[tuple, list] = {}
    for r in recs:
        groups.setdefault((r["method"], r["concurrency"]), []).append(r)
        groups.setdefault((r["bench"], r["method"], r["concurrency"]), []).append(r)

    by_method, by_bench, macro = [], [], []
    for c in levels:
        for m in methods:
            if (m, c) not in run_at and (m, c) not in groups:
                continue
            run, ref = run_at.get((m, c)), run_at.get((REFERENCE, c))
            row = {"method": m, "concurrency": c, **_stats(groups.get((m, c), [])),
                   "errors": failed.get((m, c), 0)}
            if row["tokens_per_forward"] is None and run is not None:
                row["tokens_per_forward"] = run.get("tokens_per_forward")
            row["tokens_per_s"] = run["tokens_per_s"] if run else None
            row["speedup"] = _ratio(row["tokens_per_s"], ref["tokens_per_s"] if ref else None)
            if m != REFERENCE:
                row["paired_speedup"] = paired_speedup(groups.get((m, c), []), groups.get((REFERENCE, c), []))
            by_method.append(row)
            bench_rows = []
            for b in benches:
                if (b, m, c) not in groups:
                    continue
                brow = {"bench": b, "method": m, "concurrency": c, **_stats(groups[(b, m, c)]),
                        "tokens_per_s": None}
                ref_rate = _stats(groups.get((b, REFERENCE, c), []))["per_request_tokens_per_s"]
                brow["speedup"] = _ratio(brow["per_request_tokens_per_s"], ref_rate)
                bench_rows.append(brow)
            by_bench += bench_rows
            macro.append({"method": m, "concurrency": c, "benches": len(bench_rows),
                          **{k: _mean([br[k] for br in bench_rows]) for k in MACRO_KEYS}})
    return {"methods": methods, "benches": benches, "concurrency": levels,
            "by_method": by_method, "by_bench": by_bench, "macro": macro}


def paired_speedup(rs: list[dict], ref: list[dict], resamples: int = 2000) -> dict | None:
    """Geometric mean of per-request rate ratios against AR on the same requests (bench,
    problem_id), with a 95% bootstrap interval; None with fewer than 2 pairs."""
    import numpy as np
    at = {(r["bench"], r["problem_id"]): _rate(r) for r in ref}
    logs = [np.log(a / b) for r in rs if (a := _rate(r)) and (b := at.get((r["bench"], r["problem_id"])))]
    if len(logs) < 2:
        return None
    x = np.array(logs)
    means = x[np.random.default_rng(0).integers(0, len(x), (resamples, len(x)))].mean(1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {"geomean": float(np.exp(x.mean())), "ci95": [float(np.exp(lo)), float(np.exp(hi))],
            "requests": len(x)}


def paired_lines(m: dict) -> list[str]:
    """One line per (method, C) with a paired speedup, for the console."""
    out = []
    for r in m["by_method"]:
        p = r.get("paired_speedup")
        if p:
            out.append(f"paired per request vs AR, C={r['concurrency']}: {escape(r['method'])} {p['geomean']:.2f}× "
                       f"(95% CI {p['ci95'][0]:.2f}–{p['ci95'][1]:.2f}, {p['requests']} requests)")
    return out


def lookup(m: dict, part: str, **key) -> dict | None:
    """The row of m[part] ("by_method", "by_bench", "macro") matching key, e.g. method="ar"."""
    return next((r for r in m[part] if all(r.get(k) == v for k, v in key.items())), None)


def _stats(rs: list[dict]) -> dict:
    counted = [r for r in rs if r.get("rounds") is not None]
    rounds = sum(r["rounds"] for r in counted)
    n = sum(r["new_tokens"] for r in rs)
    fwd = [r.get("forwards") for r in rs]
    lengths = [r["accept_lengths"] for r in rs if r.get("accept_lengths") is not None]
    hist = Counter(k for ls in lengths for k in ls)
    scored = [r["correct"] for r in rs if r.get("correct") is not None]
    same = [r["identical"] for r in rs if r.get("identical") is not None]
    return {
        "requests": len(rs), "new_tokens": n,
        "tau": sum(r["new_tokens"] - 1 for r in counted) / rounds if rounds > 0 else None,
        "tokens_per_forward": n / sum(fwd) if rs and None not in fwd and sum(fwd) > 0 else None,
        "accept_hist": dict(sorted(hist.items())) if lengths else None,
        "per_request_tokens_per_s": per_request_rate(rs),
        "accuracy": _mean(scored), "identical": _mean(same),
    }


def per_request_rate(rs: list[dict]) -> float | None:
    """Per-request tok/s (module doc): the mean of the requests' own rates; None when none has one."""
    return _mean([_rate(r) for r in rs])


def _rate(r: dict) -> float | None:
    """Streaming tok/s of one request (see module doc); n / latency when ttft is unknown."""
    ttft = r.get("ttft_s")
    if ttft is None:
        return r["new_tokens"] / r["latency_s"] if r["latency_s"] > 0 else None
    busy = r["latency_s"] - ttft
    return (r["new_tokens"] - 1) / busy if r["new_tokens"] > 1 and busy > 0 else None


def _mean(xs):
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _ordered(xs) -> list:
    return list(dict.fromkeys(xs))


# --- tables -------------------------------------------------------------------------------------
def _fmt(v, spec: str, suffix: str = "") -> str:
    return "—" if v is None else format(v, spec) + suffix


def _level(m: dict, concurrency: int | None) -> int:
    if concurrency is None:
        if not m["concurrency"]:
            raise FastspecError("no results to report")
        return m["concurrency"][0]
    if concurrency not in m["concurrency"]:
        raise FastspecError(f"no results at concurrency {concurrency} (have {m['concurrency']})")
    return concurrency


def _per_bench_table(m, c, title, caption, cell) -> Table:
    t = Table(title=title, caption=caption)
    t.add_column("method")
    for b in m["benches"] + ["avg"]:
        t.add_column(display_name(b), justify="right")      # lcb* marks the LiveCodeBench stand-in
    for meth in m["methods"]:
        if lookup(m, "macro", method=meth, concurrency=c) is None:
            continue
        cells = [lookup(m, "by_bench", bench=b, method=meth, concurrency=c) for b in m["benches"]]
        cells.append(lookup(m, "macro", method=meth, concurrency=c))
        t.add_row(escape(meth), *("" if r is None else cell(r) for r in cells))
    return t


def table2(m: dict, concurrency: int | None = None) -> Table:
    """RecGuide Table 2: methods × benchmarks, cells "τ / speedup×", at one C (default: lowest)."""
    c = _level(m, concurrency)
    return _per_bench_table(
        m, c, f"τ / speedup× — C={c}",
        "speedup: per-request tok/s ÷ AR; avg: mean over benchmarks",
        lambda r: f"{_fmt(r['tau'], '.2f')} / {_fmt(r['speedup'], '.2f', '×')}")


def accuracy_table(m: dict, concurrency: int | None = None) -> Table:
    """Methods × benchmarks, cells "accuracy / identical-to-AR", at one C (default: lowest)."""
    c = _level(m, concurrency)
    return _per_bench_table(
        m, c, f"accuracy / identical to AR — C={c}", "avg: mean over benchmarks",
        lambda r: f"{_fmt(r['accuracy'], '.0%')} / {_fmt(r['identical'], '.0%')}")


def figure5_table(m: dict) -> Table:
    """Throughput per method × C: aggregate and per-request tok/s (the data behind the Pareto plot)."""
    t = Table(title="throughput by concurrency", caption="speedup: aggregate tok/s ÷ AR at the same C")
    for col in ("method", "C", "aggregate tok/s", "per-request tok/s", "speedup", "tokens/fwd", "τ"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for meth in m["methods"]:
        for r in (r for r in m["by_method"] if r["method"] == meth):
            t.add_row(escape(meth), str(r["concurrency"]), _fmt(r["tokens_per_s"], ".1f"),
                      _fmt(r["per_request_tokens_per_s"], ".1f"), _fmt(r["speedup"], ".2f", "×"),
                      _fmt(r["tokens_per_forward"], ".2f"), _fmt(r["tau"], ".2f"))
    return t


def calibration_tables(runs: list[dict]) -> list[Table]:
    """Draft calibration per concurrency, benchmark × method (runs with a `calibration` block):
    judged positions, accept rate, mean draft probability, ECE of the draft probability (and under
    the adapter's fitted calibration), ECE of the top-1 confidence, Brier, and the AUC of the risk
    1 − (p1 − p2) for the first rejection. Definitions: fastspec.evals.calibration."""
    runs = [r for r in runs if r.get("calibration")]
    tables = []
    for c in sorted({r["concurrency"] for r in runs}):
        mine = [r for r in runs if r["concurrency"] == c]
        calibrated = any(r["calibration"].get("calibrated") for r in mine)
        skip = max(r["calibration"].get("exact_positions", 0) for r in mine)
        t = Table(title=f"Draft calibration — C={c}",
                  caption="positions: judged drafts (the accepted run and the first rejection"
                          + (f"; d1{f'..d{skip}' if skip > 1 else ''} exact, left out, where a draft "
                             "forward ran after the seed (TiDAR's pre-drafts and DFlash's d1 are judged)"
                             if skip else "")
                          + "); ECE noise: the ECE of a perfectly calibrated drafter on as many "
                          "positions; AUC: risk 1 − (p1 − p2) ranks first rejections above accepted "
                          "drafts")
        cols = ["benchmark", "method", "positions", "accept rate", "mean p", "ECE", "ECE noise"]
        cols += ["ECE cal."] if calibrated else []
        cols += ["ECE top-1", "Brier", "AUC risk"]
        for col in cols:
            t.add_column(col, justify="left" if col in ("benchmark", "method") else "right")
        benches = _ordered(b for r in mine for b in r["calibration"]["by_bench"])
        for b in benches + ["all"]:
            for r in mine:
                cal = r["calibration"]
                m = cal["all"] if b == "all" else cal["by_bench"].get(b)
                if m is None or (b == "all" and len(cal["by_bench"]) < 2):
                    continue
                cells = [display_name(b), escape(r["method"]), str(m["positions"]), _fmt(m["accept_rate"], ".3f"),
                         _fmt(m["mean_draft_prob"], ".3f"), _fmt(m["ece"], ".3f"),
                         _fmt(m.get("ece_floor"), ".3f")]
                cells += [_fmt(m.get("ece_calibrated"), ".3f")] if calibrated else []
                cells += [_fmt(m["ece_confidence"], ".3f"), _fmt(m["brier"], ".3f"),
                          _fmt(m["auc_first_rejection"], ".3f")]
                t.add_row(*cells)
        tables.append(t)
    return tables


def print_report(console: Console, m: dict) -> None:
    for c in m["concurrency"]:
        console.print(table2(m, c))
    console.print(figure5_table(m))
    for c in m["concurrency"]:
        console.print(accuracy_table(m, c))


# --- plots --------------------------------------------------------------------------------------
def pareto_optimal(points: list[tuple[float, float]]) -> list[bool]:
    """For each (x, y), whether no other point is at least as good on both and better on one."""
    return [not any(qx >= px and qy >= py and (qx, qy) != (px, py) for qx, qy in points)
            for px, py in points]


def write_plots(results_json_path: str, out_dir: str) -> list[str]:
    """Pareto front, τ per benchmark, acceptance histogram as PNGs in out_dir; the paths written.

    A plot with no data (e.g. no record has accept_lengths) is not written.
    """
    res = load_results(results_json_path)
    try:
        import matplotlib  # noqa: F401  (an optional dependency: only the plots need it)
    except ImportError:
        raise FastspecError("--plot needs matplotlib: pip install matplotlib") from None
    m = metrics(res["records"], res["runs"])
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, draw in (("pareto.png", _plot_pareto), ("tau_by_bench.png", _plot_tau),
                       ("accept_hist.png", _plot_accept)):
        fig = _figure()
        if draw(fig, m):
            path = os.path.join(out_dir, name)
            fig.savefig(path, dpi=120, bbox_inches="tight")
            paths.append(path)
    fig = _figure()
    if _plot_reliability(fig, res["runs"]):
        path = os.path.join(out_dir, "reliability.png")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        paths.append(path)
    return paths


def _figure():
    # An Agg canvas on a bare Figure: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    return fig


def _plot_pareto(fig, m) -> bool:
    pts = [(r["per_request_tokens_per_s"], r["tokens_per_s"], r) for r in m["by_method"]
           if r["per_request_tokens_per_s"] is not None and r["tokens_per_s"] is not None]
    if not pts:
        return False
    ax = fig.add_subplot()
    for meth in m["methods"]:
        mine = sorted((p for p in pts if p[2]["method"] == meth), key=lambda p: p[2]["concurrency"])
        if not mine:
            continue
        ax.plot([p[0] for p in mine], [p[1] for p in mine], marker="o", label=meth)
        for x, y, r in mine:
            ax.annotate(f"C={r['concurrency']}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    best = [p for p, ok in zip(pts, pareto_optimal([(x, y) for x, y, _ in pts])) if ok]
    ax.scatter([p[0] for p in best], [p[1] for p in best], s=160, facecolors="none", edgecolors="black",
               linewidths=1.5, label="Pareto-optimal", zorder=3)
    ax.set(title="Aggregate vs per-request throughput", xlabel="per-request throughput (tokens/s)",
           ylabel="aggregate throughput (tokens/s)")
    ax.grid(alpha=0.3)
    # Beside the axes, not on them: with many methods an inside legend covers the points.
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    return True


def _grouped_bars(ax, groups: list[str], series: dict[str, list]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [0 if v is None else v for v in values], width, label=label)
    ax.set_xticks(range(len(groups)), groups)


def _plot_tau(fig, m) -> bool:
    c = m["concurrency"][0] if m["concurrency"] else None
    series = {}
    for meth in m["methods"]:
        rows = [lookup(m, "by_bench", bench=b, method=meth, concurrency=c) for b in m["benches"]]
        rows.append(lookup(m, "macro", method=meth, concurrency=c))
        values = [None if r is None else r["tau"] for r in rows]
        if any(v is not None for v in values):
            series[meth] = values
    if not series:
        return False
    ax = fig.add_subplot()
    _grouped_bars(ax, [display_name(b) for b in m["benches"]] + ["avg"], series)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")     # AR commits one per round
    ax.set(title=f"τ per benchmark (C={c})", xlabel="benchmark", ylabel="τ (tokens per round)")
    ax.legend()
    return True


def _plot_accept(fig, m) -> bool:
    hists = {}
    for meth in (x for x in m["methods"] if x != REFERENCE):      # AR commits 1 per round
        total = Counter()
        for r in m["by_method"]:                   # pooled over concurrency levels
            if r["method"] == meth and r["accept_hist"]:
                total.update(r["accept_hist"])
        if total:
            hists[meth] = total
    if not hists:
        return False
    lengths = sorted({int(k) for h in hists.values() for k in h})
    series = {meth: [100 * h.get(k, 0) / sum(h.values()) for k in lengths] for meth, h in hists.items()}
    ax = fig.add_subplot()
    _grouped_bars(ax, [str(k) for k in lengths], series)
    ax.set(title="Acceptance length per round", xlabel="tokens committed per round",
           ylabel="share of rounds (%)")
    ax.legend()
    return True


def _plot_reliability(fig, runs: list[dict]) -> bool:
    """Reliability diagram, one panel per benchmark: accept rate against the drafter's probability
    of its draft, one curve per drafting method at the lowest concurrency (dashed: under the
    adapter's fitted calibration)."""
    from fastspec.evals.calibration import draw_reliability
    runs = [r for r in runs if r.get("calibration")]
    if not runs:
        return False
    c = min(r["concurrency"] for r in runs)
    runs = [r for r in runs if r["concurrency"] == c]
    benches = _ordered(b for r in runs for b in r["calibration"]["by_bench"])
    fig.set_size_inches(4 * len(benches), 4.3)
    for k, b in enumerate(benches):
        ax = fig.add_subplot(1, len(benches), k + 1)
        for j, r in enumerate(runs):
            m = r["calibration"]["by_bench"].get(b)
            if m and m["positions"]:
                draw_reliability(ax, m, r["method"], color=f"C{j}")
        ax.set_title(f"{display_name(b)} (C={c})")
        ax.legend(loc="upper left", fontsize=7)
        if k:
            ax.set_ylabel("")
    return True