"""RecGuide's tables and figure, shaped like the paper's, from a bench run's records and runs.

Table 1  transition probabilities of acceptance intervals between adjacent rounds
Table 3  branch coverage and reuse (verification-overlapped drafting)
Table 4  share of rounds choosing each block size, per concurrency
Table 5/6 ablation ladders: tokens/s of each labelled run (`--method 'linear,recguide[...]'`)
Figure 5 aggregate vs per-request tokens/s over concurrency (PNG)
and the other planners' decisions: LibraSpec's lengths, D²SD's branches, BASTION's trees, and
every timed method's measured step times against the device profile.
"""
from __future__ import annotations

import os
from collections import defaultdict

from rich.markup import escape
from rich.table import Table

INTERVALS = ((0.0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.01))
NAMES = ("low [0, ⅓)", "mid [⅓, ⅔)", "high [⅔, 1]")


def _get(r, k):
    return r[k] if isinstance(r, dict) else getattr(r, k)


def _interval(frac: float) -> int:
    frac = min(max(frac, 0.0), 1.0)
    return next(i for i, (lo, hi) in enumerate(INTERVALS) if lo <= frac < hi)


def transitions(records, method: str, block: int) -> list[list[float]] | None:
    """P(interval of round t+1 | interval of round t) of the accepted fraction (accepted drafts /
    (block − 1)) over every request's rounds (the last, budget-cut round excluded)."""
    counts = [[0] * 3 for _ in range(3)]
    for r in records:
        if _get(r, "method") != method or not _get(r, "accept_lengths"):
            continue
        fr = [(a - 1) / (block - 1) for a in _get(r, "accept_lengths")[:-1]]
        for a, b in zip(fr, fr[1:]):
            counts[_interval(a)][_interval(b)] += 1
    if not any(map(sum, counts)):
        return None
    return [[c / max(sum(row), 1) for c in row] for row in counts]


def share_text(by_block: dict | None) -> str:
    """{block: share} as `1:10% 4:90%` (JSON keys are strings: sorted as numbers)."""
    return " ".join(f"{k}:{v:.0%}" for k, v in sorted((by_block or {}).items(), key=lambda kv: int(kv[0])))


def means_text(by_block: dict | None) -> str:
    """{block: expected tokens} as `4:2.90 8:3.43` ("" when the method did not report them)."""
    return " ".join(f"{k}:{v:.2f}" for k, v in sorted((by_block or {}).items(), key=lambda kv: int(kv[0])))


def print_tables(console, runs: list[dict], records, block: int | None = None) -> None:
    reports = [r for r in runs if "proposed" in (r.get("method_report") or {})]    # RecGuide's
    libra = [r for r in runs if "gamma_share" in (r.get("method_report") or {})]   # LibraSpec's
    spec = [r for r in runs if r["method"] != "ar" and "@" not in r["method"]]
    ran = {r["method"]: r["block"] for r in spec if r.get("block")}    # the B each run used
    if block or ran:
        for name in sorted({r["method"] for r in spec}):
            if "adaptive" in name or "blocks=" in name:
                continue
            from fastspec.methods import parse_method_spec
            # linear[block=16]: its own B (JSONs before runs recorded their block)
            own = ran.get(name) or parse_method_spec(name)[1].get("block", block)
            own = own if isinstance(own, int) and own > 1 else block
            t = transitions(records, name, own) if own else None
            if t is None:
                continue
            tab = Table(title=f"Table 1 — {escape(name)}: acceptance interval, round t → t+1")
            tab.add_column("round t")
            for n in NAMES:
                tab.add_column(n, justify="right")
            for n, row in zip(NAMES, t):
                tab.add_row(n, *(f"{p:.2f}" for p in row))
            console.print(tab)
    if libra:
        widths = sorted({int(w) for r in libra for w in r["method_report"]["width_share"]})
        tab = Table(title="LibraSpec — chosen length γ (drafts judged) and verify width, per C")
        for col in ("method", "C", "rows", "rounds", "mean γ", "γ (share)"):
            tab.add_column(col, justify="left" if col in ("method", "γ (share)") else "right")
        for w in widths:
            tab.add_column("AR" if w == 1 else f"W={w}", justify="right")
        for r in libra:
            m = r["method_report"]
            sh = {int(k): v for k, v in m["width_share"].items()}
            gam = " ".join(f"{k}:{v:.0%}" for k, v in m["gamma_share"].items() if v >= 0.05)
            tab.add_row(escape(r["method"]), str(r["concurrency"]), str(m["rows"]), str(m["rounds"]),
                        f"{m['mean_gamma']:.2f}", gam, *(f"{sh.get(w, 0):.0%}" for w in widths))
        console.print(tab)
    d2sd = [r for r in runs if "branch_share" in (r.get("method_report") or {})]
    if d2sd:
        tab = Table(title="D²SD — branches laid out per round (the gate) and what each boundary's "
                          "branch buys: share of rounds it covered, tokens it adds when laid out; "
                          "the chain's block per round (1: AR) and what a chain of each commits (E_b)")
        for col in ("method", "C", "rounds", "branches (share)", "covered", "adds", "chain tokens",
                    "blocks (share)", "E_b", "prices"):
            tab.add_column(col, justify="left" if col in ("method", "branches (share)", "blocks (share)",
                                                          "E_b", "prices") else "right")
        for r in d2sd:
            m = r["method_report"]
            tab.add_row(escape(r["method"]), str(r["concurrency"]), str(m["rounds"]),
                        " ".join(f"{k}:{v:.0%}" for k, v in m["branch_share"].items()),
                        " ".join(f"{h:.0%}" for h in m["hit_rates"]),
                        " ".join(f"{x:.2f}" for x in m["mean_extra"]),
                        f"{m['mean_chain_tokens']:.2f}", share_text(m.get("block_share")),
                        means_text(m.get("expected_chain")), m.get("prices", ""))
        console.print(tab)
    trees = [r for r in runs if "budget_share" in (r.get("method_report") or {})]
    if trees:
        tab = Table(title="BASTION — tree size (nodes wanted by the stop rule, laid out, budget), "
                          "budgets per round (1: AR) and what a tree of each would commit (E_b), per C")
        for col in ("method", "C", "rounds", "wanted", "nodes", "budget", "tokens/round",
                    "budgets (share)", "E_b", "looks", "prices"):
            tab.add_column(col, justify="left" if col in ("method", "budgets (share)", "E_b", "prices")
                           else "right")
        for r in trees:
            m = r["method_report"]
            tab.add_row(escape(r["method"]), str(r["concurrency"]), str(m["rounds"]),
                        f"{m['mean_wanted_nodes']:.1f}", f"{m['mean_nodes']:.1f}", f"{m['mean_budget']:.1f}",
                        f"{m['tau']:.2f}", share_text(m["budget_share"]), means_text(m.get("expected_tokens")),
                        str(m.get("looks", 0)), m.get("prices", ""))
        console.print(tab)
    tidar = [r for r in runs if "block_choice" in (r.get("method_report") or {})]
    if tidar:
        tab = Table(title="TiDAR — the block each run chose (argmax V(B) / T(C, B + B²)): the "
                          "acceptance rate a it judged by, its best three blocks' tokens per ms, "
                          "and the share of plain AR rounds")
        for col in ("method", "C", "rows", "a", "B", "best blocks (tokens/ms)", "τ", "seed hits",
                    "AR rounds", "looks"):
            tab.add_column(col, justify="left" if col in ("method", "best blocks (tokens/ms)") else "right")
        for r in tidar:
            m = r["method_report"]
            ch = m["block_choice"]
            top = sorted(ch["tokens_per_ms"].items(), key=lambda kv: -kv[1])[:3]
            tab.add_row(escape(r["method"]), str(r["concurrency"]), str(ch["rows"]),
                        f"{ch['accept_rate']:.2f}", str(m.get("block", ch["block"])),
                        " ".join(f"{b}:{v:.4f}" for b, v in top), f"{m['tau']:.2f}",
                        f"{m.get('seed_hit_share', 0):.0%}", f"{m.get('ar_share', 0):.0%}",
                        str(m.get("looks", 0)))
        console.print(tab)
    checks = [r for r in runs if ((r.get("method_report") or {}).get("profile_check") or {}).get("steps")]
    if checks:
        tab = Table(title="Step time: device-profile estimate vs measured step (ms)")
        for col in ("method", "C", "step", "measured", "profile", "error"):
            tab.add_column(col, justify="left" if col in ("method", "step") else "right")
        for r in checks:
            pc = r["method_report"]["profile_check"]
            for key, x in pc["steps"].items():
                tab.add_row(escape(r["method"]), str(r["concurrency"]), key, f"{x['measured']:.1f}",
                            f"{x['profile']:.1f}", f"{x['error']:+.0%}")
            tab.add_row(escape(r["method"]), str(r["concurrency"]), "mean |error|", "", "",
                        f"{pc['mean_abs_error']:.0%}", end_section=True)
        console.print(tab)
    if not reports:
        return
    tab = Table(title="Table 3 — RecGuide branches: proposed, coverage, reuse (per round)")
    for col in ("method", "C", "rounds", "proposed/round", "laid out/round", "coverage", "reuse",
                "no hit", "slots chosen"):
        tab.add_column(col, justify="left" if col in ("method", "slots chosen") else "right")
    for r in reports:
        m = r["method_report"]
        n = max(m["rounds"], 1)
        tab.add_row(escape(r["method"]), str(r["concurrency"]), str(m["rounds"]), f"{m['proposed'] / n:.2f}",
                    f"{m['laid_out'] / n:.2f}", f"{m['coverage']:.1%}", f"{m['reuse']:.1%}",
                    f"{m['no_hit']:.1%}", " ".join(f"{k}:{v}" for k, v in m["slots_chosen"].items()))
    console.print(tab)
    bounds = [r for r in reports if len(r["method_report"].get("gate_bound") or []) > 1]
    if bounds:
        tab = Table(title="Gate bound — tok/s ÷ plain rounds at best with k slots every round "
                          "(this run's hit rates; measured steps | device profile)")
        for col in ("method", "C", "slots k", "hit rate H_k", "bound (measured)", "bound (profile)"):
            tab.add_column(col, justify="left" if col == "method" else "right")
        for r in bounds:
            rows = r["method_report"]["gate_bound"]
            for i, b in enumerate(rows):
                tab.add_row(escape(r["method"]), str(r["concurrency"]), str(b["slots"]), f"{b['hit_rate']:.0%}",
                            f"{b['measured']:.2f}×", f"{b['profile']:.2f}×", end_section=i == len(rows) - 1)
        console.print(tab)
    shares = [r for r in reports if len(r["method_report"].get("block_share", {})) > 1]
    if shares:
        blocks = sorted({int(b) for r in shares for b in r["method_report"]["block_share"]})
        tab = Table(title="Table 4 — share of rounds choosing each block size")
        tab.add_column("method")
        tab.add_column("C", justify="right")
        for b in blocks:
            tab.add_column(f"B={b}", justify="right")
        for r in shares:
            sh = {int(k): v for k, v in r["method_report"]["block_share"].items()}
            tab.add_row(escape(r["method"]), str(r["concurrency"]), *(f"{sh.get(b, 0):.0%}" for b in blocks))
        console.print(tab)
    ladder = [r for r in runs if r["method"] != "ar"]
    if len(ladder) > 1:
        tab = Table(title="Tables 5/6 — ablation ladder: tokens/s (aggregate) and tokens per forward")
        tab.add_column("method")
        by_c = defaultdict(dict)
        for r in ladder:
            by_c[r["concurrency"]][r["method"]] = r
        cs = sorted(by_c)
        for c in cs:
            tab.add_column(f"C={c} tok/s", justify="right")
            tab.add_column(f"C={c} tok/fwd", justify="right")
        tab.add_column("mean tok/s", justify="right")
        for name in dict.fromkeys(r["method"] for r in ladder):
            cells, tps = [], []
            for c in cs:
                r = by_c[c].get(name)
                cells += [f"{r['tokens_per_s']:.1f}" if r else "—",
                          f"{r['tokens_per_forward']:.2f}" if r else "—"]
                if r:
                    tps.append(r["tokens_per_s"])
            tab.add_row(escape(name), *cells, f"{sum(tps) / max(len(tps), 1):.1f}")
        console.print(tab)


def throughput_points(runs: list[dict], records) -> dict[str, list[tuple[int, float, float]]]:
    """Figure 5's points: per method, (C, aggregate tok/s, per-request tok/s) sorted by C. The
    per-request rate is the table's (`report.per_request_rate`: streaming rate after the first
    token), so the plot and the table agree; a run without a rated request has no point."""
    from fastspec.evals.report import per_request_rate
    def field(r, k):        # records are dicts (a results JSON, older ones lack keys) or objects
        return r.get(k) if isinstance(r, dict) else getattr(r, k, None)
    by_run = defaultdict(list)
    for r in records:
        if field(r, "error") or not field(r, "latency_s"):
            continue
        by_run[(field(r, "method"), field(r, "concurrency"))].append(
            {k: field(r, k) for k in ("new_tokens", "latency_s", "ttft_s")})
    pts = defaultdict(list)
    for r in runs:
        rate = per_request_rate(by_run.get((r["method"], r["concurrency"]), []))
        if rate is not None:
            pts[r["method"]].append((r["concurrency"], r["tokens_per_s"], rate))
    return {m: sorted(p) for m, p in pts.items()}


def plot_throughput(runs: list[dict], records, out_dir: str) -> str | None:
    """Figure 5: aggregate vs per-request tokens/s, one curve per method over concurrency."""
    pts = throughput_points(runs, records)
    if not any(len(v) > 1 for v in pts.values()):
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "throughput_pareto_recguide.png")
    plot_points(pts, path, "Figure 5 — aggregate vs per-request throughput")
    return path


def plot_points(pts: dict[str, list[tuple[int, float, float]]], path: str, title: str) -> None:
    """Curves of (C, aggregate tok/s, per-request tok/s) points, per-request on x, one per name."""
    from fastspec.evals.report import _figure
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, p in pts.items():
        ax.plot([x[2] for x in p], [x[1] for x in p], marker="o", label=name)
        for c, agg, req in p:
            ax.annotate(f"C={c}", (req, agg), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("per-request tokens/s")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
