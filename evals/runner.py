"""`fastspec bench`: run benchmark prompts through the engine, score them, report speed.

AR always runs first on the same prompts as the reference: speedups and the `identical` check
(token-for-token equality with AR) come from the same run.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fastspec.config import FastspecError
from fastspec.sampling import SamplingParams


@dataclass
class Record:
    bench: str
    problem_id: str
    method: str
    concurrency: int
    prompt_tokens: int
    new_tokens: int
    rounds: int
    tau: float
    latency_s: float
    ttft_s: float
    finish_reason: str
    correct: bool | None
    identical: bool | None
    completion: str


def load_prompts(suite, benches, prompts_file, limit, data_dir, console) -> list[tuple[str, str, object]]:
    """[(bench, id, problem-or-text)] for the requested sources; missing data is named and skipped."""
    from fastspec.evals.data import DataNotFound, load_benchmark
    from fastspec.evals.suites import resolve_benches

    items = []
    if prompts_file:
        if not os.path.exists(prompts_file):
            raise FastspecError(f"prompts file not found: {prompts_file}")
        with open(prompts_file) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise FastspecError(f"{prompts_file}:{i + 1}: not valid JSON") from None
                text = row.get("prompt") or row.get("question") if isinstance(row, dict) else None
                if not text:
                    raise FastspecError(f"{prompts_file}:{i + 1}: no 'prompt' or 'question' field")
                items.append(("prompts", str(row.get("id", i)), text))
        items = items[:limit]
    if suite or benches or not prompts_file:
        names = resolve_benches(suite=suite if (suite or benches) else "math", bench=benches)
        for name in names:
            try:
                problems = load_benchmark(name, data_dir=data_dir, limit=limit)
            except DataNotFound as e:
                console.print(f"[yellow]skipped[/] {e}", highlight=False)
                continue
            items += [(name, p.id, p) for p in problems]
    if not items:
        raise FastspecError("no benchmark data found (set --data-dir or FASTSPEC_DATA)")
    return items


def environment(model: str, dtype: str, backend: str) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        commit = None
    return {"torch": torch.__version__, "device": "cpu", "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "model": model, "dtype": dtype, "backend": backend, "commit": commit,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run_bench(*, model, dtype, backend, max_new_tokens, temperature, top_p, top_k, seed, suite,
              benches, prompts_file, limit, methods, concurrency, data_dir, json_out,
              console: Console, load_engine):
    from fastspec.cli.main import parse_int_list
    from fastspec.evals.prompts import build_messages
    from fastspec.evals.scoring import score

    if limit < 1:
        raise FastspecError(f"--limit must be >= 1, got {limit}")
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    if not method_list:
        raise FastspecError("--method needs at least one method")
    if "ar" in method_list:
        method_list.remove("ar")
    method_list = ["ar"] + method_list          # AR is the reference, always first
    levels = parse_int_list(concurrency, "--concurrency")
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens, seed)
    items = load_prompts(suite, benches, prompts_file, limit, data_dir, console)

    engine = load_engine(model, dtype, backend)
    texts = [engine.render_chat(build_messages(p)) if not isinstance(p, str)
             else engine.render_chat([{"role": "user", "content": p}]) for _, _, p in items]
    records: list[Record] = []
    runs = []
    reference: dict[tuple[int, int], list[int]] = {}
    for c in levels:
        for method in method_list:
            out, stats, warm = _run_one(engine, texts, params, method, c, console)
            for (bench_name, pid, problem), comp in zip(items, out):
                correct = None if isinstance(problem, str) else score(problem, comp.text or "")["correct"]
                if method == "ar":
                    reference[(c, comp.index)] = comp.token_ids
                ref = reference.get((c, comp.index))
                records.append(Record(bench_name, pid, method, c, len(comp.prompt_ids),
                                      len(comp.token_ids), comp.rounds, comp.tau, comp.latency_s,
                                      comp.ttft_s, comp.finish_reason, correct,
                                      None if ref is None else ref == comp.token_ids, comp.text or ""))
            runs.append({"method": method, "concurrency": c, "warmup_s": warm, **asdict(stats),
                         "tokens_per_s": stats.tokens_per_s, "tokens_per_forward": stats.tokens_per_forward})
    summary = summarize(records, runs)
    print_summary(console, summary, model, backend)
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump({"environment": environment(model, dtype, backend), "runs": runs,
                       "summary": summary, "records": [asdict(r) for r in records]}, f, indent=1)
        console.print(f"wrote {json_out}")
    return summary


def _run_one(engine, texts, params, method, concurrency, console):
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(f"{method} C={concurrency}", total=len(texts) * params.max_new_tokens,
                                 info="warming up")
        count = 0

        def on_commit(_, ids, __):
            nonlocal count
            count += len(ids)
            if count % 16 == 0:
                el = time.perf_counter() - start
                progress.update(task, completed=count, info=f"{count / max(el, 1e-9):.1f} tok/s")

        start = time.perf_counter()
        out = engine.generate(texts, params, method=method, concurrency=concurrency, on_commit=on_commit)
        progress.update(task, completed=len(texts) * params.max_new_tokens)
    # The step compiles when the engine first meets these shapes; that time is not in wall_s.
    return out, engine.last_stats, engine.warmup_s


def summarize(records: list[Record], runs: list[dict]) -> list[dict]:
    rows = []
    ar_tps = {r["concurrency"]: r["tokens_per_s"] for r in runs if r["method"] == "ar"}
    for run in runs:
        recs = [r for r in records if r.method == run["method"] and r.concurrency == run["concurrency"]]
        scored = [r.correct for r in recs if r.correct is not None]
        same = [r.identical for r in recs if r.identical is not None]
        rows.append({
            "method": run["method"], "concurrency": run["concurrency"], "requests": len(recs),
            "new_tokens": sum(r.new_tokens for r in recs),
            "tokens_per_s": run["tokens_per_s"],
            "per_request_tokens_per_s": sum(r.new_tokens / max(r.latency_s, 1e-9) for r in recs) / max(len(recs), 1),
            "tokens_per_forward": run["tokens_per_forward"],
            "tau": sum(r.new_tokens - 1 for r in recs) / max(sum(r.rounds for r in recs), 1),
            "speedup": run["tokens_per_s"] / ar_tps[run["concurrency"]] if run["concurrency"] in ar_tps else None,
            "accuracy": sum(scored) / len(scored) if scored else None,
            "identical": sum(same) / len(same) if same else None,
            "warmup_s": run["warmup_s"],
        })
    return rows


def print_summary(console: Console, summary: list[dict], model: str, backend: str) -> None:
    t = Table(title=f"fastspec bench — {model} ({backend})")
    for col in ("method", "C", "requests", "tokens", "tok/s", "per-req tok/s", "tokens/fwd", "τ",
                "speedup", "accuracy", "identical", "warm-up s"):
        t.add_column(col, justify="right" if col not in ("method",) else "left")
    fmt = lambda v, f: "—" if v is None else format(v, f)
    for r in summary:
        t.add_row(r["method"], str(r["concurrency"]), str(r["requests"]), str(r["new_tokens"]),
                  fmt(r["tokens_per_s"], ".1f"), fmt(r["per_request_tokens_per_s"], ".1f"),
                  fmt(r["tokens_per_forward"], ".2f"), fmt(r["tau"], ".2f"), fmt(r["speedup"], ".2f") + "×",
                  fmt(r["accuracy"], ".0%"), fmt(r["identical"], ".0%"), fmt(r["warmup_s"], ".1f"))
    console.print(t)
