"""Paired A/B results (`method_ab` JSONs) as one table over concurrency, the paper's Table-6 /
Figure-5 view: per arm and C the mean aggregate tok/s over reps (and per-request tok/s), then
the candidate arm's ratio to the best other arm at each C and to a named reference arm, averaged
over C. Several files merge (e.g. one method_ab run per C with more prompts at higher C).

    python -m fastspec.graphs.ab_table results/recguide_ab_sweep_c*.json --candidate recguide \\
        --reference "linear[block=16]" --json results/recguide_ab_sweep.json --png results/x.png
"""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fastspec.config import FastspecError


def merge(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """Every file's arm rows (one per arm and C) and environments; a (arm, C) seen twice is an error."""
    rows, envs, seen = [], [], set()
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
            arms, env = d["arms"], d["environment"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FastspecError(f"{p}: not a method_ab results file ({e})") from None
        for r in arms:
            if (r["arm"], r["concurrency"]) in seen:
                raise FastspecError(f"{p}: arm {r['arm']} at C={r['concurrency']} appears twice")
            seen.add((r["arm"], r["concurrency"]))
            rows.append(r)
        envs.append(env)
    return rows, envs


def summarize(rows: list[dict], candidate: str, reference: str | None) -> dict:
    """Per C: each arm's mean tok/s and per-request tok/s; the candidate ÷ the best other arm
    (aggregate and per-request, each against that measure's best) and ÷ the reference; the
    ratios' means over C. Worked example: C=1 arms {B4: 30, B16: 20, rec: 33} ->
    vs best 33/30 = 1.10, vs B16 33/20 = 1.65."""
    cs = sorted({r["concurrency"] for r in rows})
    by = {(r["arm"], r["concurrency"]): r for r in rows}
    if not any(a == candidate for a, _ in by):
        raise FastspecError(f"no arm named {candidate!r}; arms: {sorted({a for a, _ in by})}")
    per_c = []
    for c in cs:
        mine = {a: r for (a, cc), r in by.items() if cc == c}
        cand = mine.get(candidate)
        others = [r for a, r in mine.items() if a != candidate]
        if cand is None or not others:
            continue
        row = {"concurrency": c, "identical_to_ar": all(r["identical_to_ar"] for r in mine.values()),
               "arms": {a: {"tok_s": r["mean_tok_s"], "per_request_tok_s": r.get("mean_per_request_tok_s")}
                        for a, r in mine.items()}}
        best = max(others, key=lambda r: r["mean_tok_s"])
        row["best_other"] = best["arm"]
        row["vs_best"] = cand["mean_tok_s"] / best["mean_tok_s"]
        rates = [r.get("mean_per_request_tok_s") for r in others]
        if cand.get("mean_per_request_tok_s") and all(rates):
            row["per_request_vs_best"] = cand["mean_per_request_tok_s"] / max(rates)
        if reference in mine:
            row["vs_reference"] = cand["mean_tok_s"] / mine[reference]["mean_tok_s"]
        per_c.append(row)

    def mean(k):
        xs = [r[k] for r in per_c if k in r]
        return sum(xs) / len(xs) if xs else None
    return {"candidate": candidate, "reference": reference, "per_c": per_c,
            "mean_vs_best": mean("vs_best"), "mean_per_request_vs_best": mean("per_request_vs_best"),
            "mean_vs_reference": mean("vs_reference"),
            "min_vs_best": min((r["vs_best"] for r in per_c), default=None)}


def table(summary: dict) -> Table:
    per_c = summary["per_c"]
    t = Table(title="aggregate tok/s (per-request) by concurrency, paired reps",
              caption=f"{summary['candidate']} ÷ best other arm at each C; "
                      + escape(f"÷ {summary['reference']}") + "; every request identical to AR: "
                      + ("yes" if all(r["identical_to_ar"] for r in per_c) else "NO"))
    t.add_column("arm", no_wrap=True)
    for r in per_c:
        t.add_column(f"C={r['concurrency']}", justify="right")
    t.add_column("mean", justify="right")
    for a in dict.fromkeys(a for r in per_c for a in r["arms"]):
        cells = [r["arms"].get(a) for r in per_c]
        xs = [x["tok_s"] for x in cells if x]
        t.add_row(escape(a), *(f"{x['tok_s']:.1f} ({x['per_request_tok_s'] or float('nan'):.1f})" if x else "—"
                       for x in cells), f"{sum(xs) / len(xs):.1f}")
    fmt = lambda x: f"{x:.2f}" if x is not None else "—"     # noqa: E731
    t.add_row("÷ best other", *(fmt(r["vs_best"]) for r in per_c), fmt(summary["mean_vs_best"]))
    t.add_row("per-request ÷ best", *(fmt(r.get("per_request_vs_best")) for r in per_c),
              fmt(summary["mean_per_request_vs_best"]))
    if summary["reference"]:
        t.add_row(escape(f"÷ {summary['reference']}"), *(fmt(r.get("vs_reference")) for r in per_c),
                  fmt(summary["mean_vs_reference"]))
    return t


def plot(summary: dict, path: str) -> None:
    """Figure 5: aggregate vs per-request tok/s, one curve per arm over C."""
    from fastspec.evals.recguide_report import plot_points
    arms = dict.fromkeys(a for r in summary["per_c"] for a in r["arms"])
    pts = {a: [(r["concurrency"], r["arms"][a]["tok_s"], r["arms"][a]["per_request_tok_s"])
               for r in summary["per_c"] if a in r["arms"] and r["arms"][a]["per_request_tok_s"]]
           for a in arms}
    plot_points(pts, path, "aggregate vs per-request throughput (paired A/B)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--candidate", default="recguide")
    ap.add_argument("--reference", help="arm for the 'candidate ÷ reference' row, e.g. linear[block=16]")
    ap.add_argument("--json", help="write the merged rows, environments and summary here")
    ap.add_argument("--png", help="write Figure 5 here")
    args = ap.parse_args()
    console = Console()
    try:
        rows, envs = merge(args.files)
        summary = summarize(rows, args.candidate, args.reference)
    except FastspecError as e:
        console.print(f"[red]error:[/] {e}")
        raise SystemExit(2)
    console.print(table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environments": envs, "arms": rows, "summary": summary}, f, indent=1)
    if args.png:
        plot(summary, args.png)
        console.print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
