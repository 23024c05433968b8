"""`fastspec bench`: run benchmark prompts through the engine, score them, report speed.

AR always runs first on the same prompts as the reference (unless --no-baseline): speedups and
the `identical` check (token-for-token equality with AR) come from the same run.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fastspec.config import FastspecError, parse_int_list
from fastspec.sampling import SamplingParams


@dataclass
class Record:
    bench: str
    problem_id: str
    method: str
    concurrency: int
    prompt_tokens: int
    new_tokens: int
    rounds: int | None
    forwards: int | None
    tau: float | None
    latency_s: float
    ttft_s: float | None
    finish_reason: str
    correct: bool | None
    identical: bool | None
    completion: str
    accept_lengths: list[int] | None = field(default=None)


@dataclass
class Item:
    bench: str
    id: str
    problem: object            # evals.data.Problem, or the raw text of a --prompts line
    max_new_tokens: int


def parse_methods(methods: str, blocks: list[int], baseline: bool) -> list[tuple[str, str, int | None]]:
    """[(label, method, block)]: AR first as the reference; a block sweep labels `linear@16`."""
    from fastspec.methods import METHODS
    names = list(dict.fromkeys(m.strip() for m in methods.split(",") if m.strip()))
    if not names:
        raise FastspecError("--method needs at least one method")
    for n in names:
        if n not in METHODS:
            raise FastspecError(f"unknown method {n!r} (available: {', '.join(METHODS)})")
    if baseline and "ar" not in names:
        names.insert(0, "ar")
    if "ar" in names:
        names.remove("ar")
        names.insert(0, "ar")
    out = []
    for n in names:
        if n == "ar":
            out.append(("ar", "ar", None))
        else:
            out += [(n if len(blocks) == 1 else f"{n}@{b}", n, b) for b in blocks]
    return out


def load_items(suite, benches, prompts_file, limit, data_dir, max_new_tokens, console) -> list[Item]:
    """Problems for the requested sources; missing data is named in one line and skipped."""
    from fastspec.evals.data import DataNotFound, load_benchmark
    from fastspec.evals.suites import max_new_tokens as suite_budget
    from fastspec.evals.suites import resolve_benches

    items: list[Item] = []
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
                text = (row.get("prompt") or row.get("question")) if isinstance(row, dict) else None
                if not text or not str(text).strip():
                    raise FastspecError(f"{prompts_file}:{i + 1}: no 'prompt' or 'question' field")
                items.append(Item("prompts", str(row.get("id", i)), str(text), max_new_tokens or 256))
        items = items[:limit]
    if suite or benches or not prompts_file:
        names = resolve_benches(suite=suite if (suite or benches) else "math", bench=benches)
        for name in names:
            try:
                problems = load_benchmark(name, data_dir=data_dir, limit=limit)
            except DataNotFound as e:
                console.print(f"[yellow]skipped[/] {e}", highlight=False)
                continue
            budget = max_new_tokens or suite_budget(name)
            items += [Item(name, p.id, p, budget) for p in problems]
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


def run_bench(*, model, dtype, backend, adapter="auto", max_new_tokens, temperature, top_p, top_k, seed, suite,
              benches, prompts_file, limit, methods, blocks, concurrency, data_dir, json_out,
              peers, baseline, console: Console, load_engine):
    from fastspec.evals.prompts import build_messages
    from fastspec.evals.report import metrics, print_report
    from fastspec.evals.scoring import score

    if limit < 1:
        raise FastspecError(f"--limit must be >= 1, got {limit}")
    from fastspec.graphs.runner import BACKENDS
    backends = list(dict.fromkeys(b.strip() for b in str(backend).split(",") if b.strip()))
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        raise FastspecError(f"unknown --backend {', '.join(bad) or repr(backend)} "
                            f"(choose among {', '.join(BACKENDS)})")
    plan = parse_methods(methods, parse_int_list(blocks, "--block"), baseline)
    levels = parse_int_list(concurrency, "--concurrency")
    peer_names = [p.strip() for p in (peers or "").split(",") if p.strip()]
    base = SamplingParams(temperature, top_k, top_p, max_new_tokens or 256, seed)   # validates flags
    items = load_items(suite, benches, prompts_file, limit, data_dir, max_new_tokens, console)
    params = [replace(base, max_new_tokens=it.max_new_tokens) for it in items]

    engine = load_engine(model, dtype, backends[0], adapter=adapter)
    # Later backends share the loaded weights; their rows are labelled "ar (eager)", ...
    from fastspec.engine import Engine
    engines = [(engine, "")] + [(Engine(engine.loaded, backend=b), f" ({b})") for b in backends[1:]]
    texts = [engine.render_chat([{"role": "user", "content": it.problem}]) if isinstance(it.problem, str)
             else engine.render_chat(build_messages(it.problem)) for it in items]
    prompt_ids = [engine.encode(t) for t in texts]
    records: list[Record] = []
    runs: list[dict] = []
    reference: dict[tuple[int, int], list[int]] = {}

    def add(label, c, completions, stats, warm):
        for it, comp in zip(items, completions):
            text = comp.text or ""
            correct = None if isinstance(it.problem, str) else score(it.problem, text)["correct"]
            if label == "ar":
                reference[(c, comp.index)] = comp.token_ids
            ref = reference.get((c, comp.index), reference.get((min(levels), comp.index)))
            rounds = comp.rounds if comp.rounds is not None else None
            records.append(Record(
                it.bench, it.id, label, c, len(comp.prompt_ids), len(comp.token_ids), rounds,
                comp.forwards, comp.tau if rounds else None, comp.latency_s, comp.ttft_s,
                comp.finish_reason, correct, None if ref is None else ref == comp.token_ids, text,
                list(comp.accept_lengths)))
        runs.append({"method": label, "concurrency": c, "warmup_s": warm, **asdict(stats),
                     "tokens_per_s": stats.tokens_per_s, "tokens_per_forward": stats.tokens_per_forward})

    for c in levels:
        for eng, tag in engines:
            for label, method, block in plan:
                out, stats, warm = _run_one(eng, prompt_ids, params, label + tag, method, block, c,
                                            console)
                add(label + tag, c, out, stats, warm)
    if peer_names:
        from fastspec.evals.peers import run_hf_peers
        with console.status(f"peers {', '.join(peer_names)} (transformers, batch 1) ..."):
            peer_runs = run_hf_peers(engine.loaded, prompt_ids, base, peer_names,
                                     log=lambda m: console.print(f"[yellow]{m}[/]"))
        for run in peer_runs:
            add(run.name, 1, run.completions, run.stats, run.stats.warmup_s)

    m = metrics(records, runs)
    print_report(console, m)
    warm = sum(r["warmup_s"] for r in runs)
    recompiles = sum(r.get("recompiles", 0) for r in runs)
    keys = sum(len(eng.runner.keys()) for eng, _ in engines)
    console.print(f"steps: {keys} compiled/captured keys ({', '.join(backends)}), warm-up {warm:.1f} s "
                  f"before timing; recompilations during timed runs: {recompiles}")
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump({"environment": {**environment(model, dtype, backend),
                                       "adapter": getattr(engine.loaded, "adapter_path", None)},
                       "runs": runs,
                       "metrics": m, "records": [asdict(r) for r in records]}, f, indent=1)
        console.print(f"wrote {json_out}  (plots: fastspec bench --plot {json_out})")
    return m


def _run_one(engine, prompt_ids, params, label, method, block, concurrency, console):
    total = sum(p.max_new_tokens for p in params)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(f"{label} C={concurrency}", total=total, info="warming up")
        count = drafted = rounds = 0
        start = time.perf_counter()

        def on_commit(_, ids, n_drafted):
            nonlocal count, drafted, rounds, start
            if count == 0:
                start = time.perf_counter()
            count += len(ids)
            drafted += n_drafted
            rounds += 1
            if rounds % 8 == 0:
                el = time.perf_counter() - start
                progress.update(task, completed=count,
                                info=f"{count / max(el, 1e-9):.1f} tok/s  τ {count / rounds:.2f}")

        out = engine.generate(prompt_ids, params, method=method, block=block,
                              concurrency=concurrency, on_commit=on_commit)
        progress.update(task, completed=total)
    # Compilation for new shapes happens before the timed loop; it is reported, not counted.
    return out, engine.last_stats, engine.warmup_s
