"""`fastspec bench`: run benchmark prompts through the engine, score them, report speed.

AR always runs first on the same prompts as the reference (unless --no-baseline): speedups and
the `identical` check (token-for-token equality with AR) come from the same run.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fastspec.config import FastspecError, parse_int_list
from fastspec.graphs.keys import batch_bucket
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
    finish_reason: str              # eos | length | error
    correct: bool | None
    identical: bool | None
    completion: str
    accept_lengths: list[int] | None = field(default=None)
    batch_bucket: int | None = None  # the step batch a full round ran at (C padded to a bucket)
    error: str | None = None         # why this request could not run (then finish_reason "error")


@dataclass
class Item:
    bench: str
    id: str
    problem: object            # evals.data.Problem, or the raw text of a --prompts line
    max_new_tokens: int


def check_blocks(methods: list[str], blocks: list[int] | None) -> None:
    """Every --block must suit every speculative method asked for, before anything runs (None:
    each method's `default_block`, which checks its bracket options). With AR alone the block is
    checked against the default speculative method (linear), so a typo in a script fails at once
    rather than when a speculative method is added to it."""
    from fastspec.methods import get_method
    for name in [m for m in methods if m != "ar"] or ["linear"]:
        for b in blocks or [default_block(name)]:
            get_method(name, block=b)          # raises the method's own one-line error


def dflash_for(methods, dflash: str) -> str:
    """--dflash as the load needs it: `auto` finds a drafter only when one of `methods` drafts
    with it (a drafter beside the checkpoint or shipped is not loaded into AR or LinearSS runs);
    a directory the user named is loaded as asked."""
    if dflash == "auto" and not any(m.needs_dflash for m in methods):
        return "none"
    return dflash


def split_methods(methods: str) -> list[str]:
    """Split a --method list on commas outside brackets: `ar,recguide[corr=1;cont=0]`."""
    out, depth, cur = [], 0, ""
    for ch in methods:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [m for m in out + [cur.strip()] if m]


DEFAULT_BLOCK = 8


def default_block(method: str) -> int | str:
    """The block a method runs at when --block is not given: its own `bench_block` (TiDAR:
    "auto", its own choice per run from the device's profile), else DEFAULT_BLOCK."""
    from fastspec.methods import METHODS, parse_method_spec
    name = parse_method_spec(method)[0]
    return (METHODS[name].bench_block if name in METHODS else None) or DEFAULT_BLOCK


def parse_methods(methods: str, blocks: list[int] | None, baseline: bool) -> list[tuple[str, str, int | str | None]]:
    """[(label, method, block)]: AR first as the reference; a block sweep labels `linear@16`.
    blocks None (no --block): every method at DEFAULT_BLOCK, or at its own `bench_block`
    (TiDAR: "auto"); a block in the spec's brackets wins either way."""
    from fastspec.methods import METHODS, parse_method_spec
    names = list(dict.fromkeys(split_methods(methods)))
    if not names:
        raise FastspecError("--method needs at least one method")
    for n in names:
        if parse_method_spec(n)[0] not in METHODS:
            raise FastspecError(f"unknown method {n!r} (available: {', '.join(METHODS)})")
    check_blocks(names, blocks)
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
            out += [(n if blocks is None or len(blocks) == 1 else f"{n}@{b}", n, b)
                    for b in blocks or [default_block(n)]]
    return out


def read_prompts(path: str, max_new_tokens: int | None) -> list[Item]:
    """--prompts: one JSON object per line with a 'prompt' (or 'question') field, UTF-8."""
    if not os.path.isfile(path):
        raise FastspecError(f"prompts file not found: {path}")
    items: list[Item] = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise FastspecError(f"{path}:{i + 1}: not valid JSON") from None
                text = (row.get("prompt") or row.get("question")) if isinstance(row, dict) else None
                if not text or not str(text).strip():
                    raise FastspecError(f"{path}:{i + 1}: no 'prompt' or 'question' field")
                items.append(Item("prompts", str(row.get("id", i)), str(text), max_new_tokens or 256))
    except UnicodeDecodeError as e:
        raise FastspecError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                            f"{e.start} of a line)") from None
    return items


def load_items(suite, benches, prompts_file, limit, data_dir, max_new_tokens, console) -> list[Item]:
    """Problems for the requested sources; missing data is named in one line and skipped."""
    from fastspec.evals.data import DataNotFound, load_benchmark
    from fastspec.evals.suites import max_new_tokens as suite_budget
    from fastspec.evals.suites import resolve_benches

    items: list[Item] = []
    if prompts_file:
        items = read_prompts(prompts_file, max_new_tokens)[:limit]
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


def parse_backends(backend: str) -> list[str]:
    from fastspec.graphs.runner import BACKENDS
    backends = list(dict.fromkeys(b.strip() for b in str(backend).split(",") if b.strip()))
    bad = [b for b in backends if b not in BACKENDS]
    if not backends or bad:
        raise FastspecError(f"unknown --backend {', '.join(bad) or repr(backend)} "
                            f"(choose among {', '.join(BACKENDS)})")
    return backends


def environment(engines, model: str) -> dict:
    """Where the run ran: device name, dtype, the backend(s) that actually ran, versions, commit."""
    from fastspec.graphs.profile import ran_backend, run_environment
    from fastspec.weights import weight_precision
    first = engines[0]
    try:
        here = os.path.dirname(__file__)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=here).stdout.strip() or None
        # A run of uncommitted code says so: "ba0b747+dirty" (tracked files changed).
        if commit and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True, cwd=here).stdout.strip():
            commit += "+dirty"
    except OSError:
        commit = None
    ran = ",".join(ran_backend(e.runner, e.device) for e in engines)
    return {**run_environment(first.device, first.dtype, ran, weight_precision(first.model), first.model),
            "model": model, "commit": commit,
            "adapter": getattr(first.loaded, "adapter_path", None),
            "dflash": getattr(getattr(first.model, "dflash", None), "source_path", None),
            "cost_model": first.forward_cost.describe(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _too_long(engine, method: str, block, ids: list[int], p: SamplingParams) -> str | None:
    """Why this request cannot run on this engine (None if it can): the prompt and the new tokens
    must fit the context (the rule of Engine.prepare, asked per request so one long prompt fails
    alone instead of failing its whole batch)."""
    need = len(ids) + p.max_new_tokens        # speculative headroom lies past the context
    if need <= engine.max_context:
        return None
    return (f"prompt of {len(ids)} tokens plus {p.max_new_tokens} new tokens needs {need} positions "
            f"but the context is {engine.max_context}")


def prompt_token_ids(engine, items: list[Item]) -> list[list[int]]:
    """Each item's prompt through the model's chat template: its own text as one user turn, or
    the benchmark's messages (evals/prompts.py)."""
    from fastspec.evals.prompts import build_messages
    return [engine.encode(engine.render_chat([{"role": "user", "content": it.problem}])
                          if isinstance(it.problem, str) else engine.render_chat(build_messages(it.problem)))
            for it in items]


def run_bench(*, model, dtype, backend, device="auto", adapter="auto", dflash="auto", max_new_tokens, temperature,
              top_p, top_k, seed, suite, benches, prompts_file, limit, methods, blocks, concurrency,
              data_dir, json_out, peers, baseline, console: Console, load_engine, weights="fp32",
              interleave: int = 0):
    from fastspec.draft import has_adapter
    from fastspec.engine import Engine
    from fastspec.evals.report import metrics, print_report
    from fastspec.evals.scoring import score
    from fastspec.files import check_writable, write_json

    # Every flag is checked before the model loads or anything runs.
    if limit < 1:
        raise FastspecError(f"--limit must be >= 1, got {limit}")
    if interleave < 0:
        raise FastspecError(f"--interleave must be >= 0 (0: off), got {interleave}")
    backends = parse_backends(backend)
    block_list = None if blocks is None else parse_int_list(blocks, "--block")
    plan = parse_methods(methods, block_list, baseline)
    levels = parse_int_list(concurrency, "--concurrency")
    peer_names = [p.strip() for p in (peers or "").split(",") if p.strip()]
    from fastspec.evals.peers import check_peers
    check_peers(peer_names)
    base = SamplingParams(temperature, top_k, top_p, max_new_tokens or 256, seed)   # validates flags
    items = load_items(suite, benches, prompts_file, limit, data_dir, max_new_tokens, console)
    params = [replace(base, max_new_tokens=it.max_new_tokens) for it in items]
    if json_out:
        check_writable(json_out, "--json")

    from fastspec.methods import get_method
    # Built before the load: whether any of them drafts with a DFlash drafter decides what loads.
    wanted = [get_method(method, **({} if block is None else {"block": block})) for _, method, block in plan]
    engine = load_engine(model, dtype, backends[0], adapter=adapter, device=device, weights=weights,
                         dflash=dflash_for(wanted, dflash))
    # Later backends share the loaded weights; their rows are labelled "ar (eager)", ...
    engines = [(engine, "")] + [(Engine(engine.loaded, backend=b), f" ({b})") for b in backends[1:]]
    for (_, method, _), meth in zip(plan, wanted):   # before any run: not one error row per request
        if meth.needs_adapter and not has_adapter(engine.model):
            raise FastspecError(f"method {method!r} needs a draft adapter and {model} has none: train "
                                f"one with `fastspec train-drafter --model {model}` or pass --adapter")
        if meth.needs_dflash and getattr(engine.model, "dflash", None) is None:
            raise FastspecError(f"method {method!r} needs a DFlash drafter and {model} has none: train "
                                f"one with `fastspec train-drafter --kind dflash --model {model}` or "
                                f"pass --dflash DIR")
    env = environment([e for e, _ in engines], model)
    env["interleave"] = interleave                   # 0: each method ran every prompt in turn
    console.print(f"[dim]{model} on {env['device']}, {env['dtype']}, backend {env['backend']}, "
                  f"weights {env['weights']}, kernel {env['kernel']}{', ' + env['prefetch'] if env.get('prefetch') else ''} (CPU ISA {env['isa']})[/]",
                  highlight=False)
    if interleave:
        console.print(f"[dim]interleaved: the methods take turns on groups of max({interleave}, C) prompts[/]",
                      highlight=False)
    # What LibraSpec, BASTION and RecGuide price forwards with (graphs/profile.ForwardCost).
    console.print(f"[dim]cost model of the planners: {env['cost_model']}[/]", highlight=False)
    prompt_ids = prompt_token_ids(engine, items)
    records: list[Record] = []
    runs: list[dict] = []
    reference: dict[tuple[int, int], list[int]] = {}

    def save() -> None:
        # After every (method, concurrency) run, atomically: Ctrl-C keeps every finished run.
        if json_out:
            write_json(json_out, {"environment": env, "runs": runs, "metrics": metrics(records, runs),
                                  "records": [asdict(r) for r in records]})

    def add(label, c, completions, stats, warm, bucket, which, errors, method_report=None,
            calibration=None, block=None):
        """Records of one run: completions[j] answers items[which[j]]; errors: {item: message}."""
        for comp in completions:
            i, it = which[comp.index], items[which[comp.index]]
            text = comp.text or ""
            correct = None if isinstance(it.problem, str) else score(it.problem, text)["correct"]
            if label == "ar":
                reference[(c, i)] = comp.token_ids
            ref = reference.get((c, i), reference.get((min(levels), i)))
            rounds = comp.rounds if comp.rounds is not None else None
            records.append(Record(
                it.bench, it.id, label, c, len(comp.prompt_ids), len(comp.token_ids), rounds,
                comp.forwards, comp.tau if rounds else None, comp.latency_s, comp.ttft_s,
                comp.finish_reason, correct, None if ref is None else ref == comp.token_ids, text,
                list(comp.accept_lengths), bucket))
        for i, msg in errors.items():
            records.append(Record(items[i].bench, items[i].id, label, c, len(prompt_ids[i]), 0, None,
                                  None, None, 0.0, None, "error", None, None, "", None, bucket, msg))
        if completions:
            runs.append({"method": label, "concurrency": c, "batch_bucket": bucket, "warmup_s": warm,
                         **({"block": block} if block else {}),
                         **asdict(stats), "tokens_per_s": stats.tokens_per_s,
                         "tokens_per_forward": stats.tokens_per_forward, "errors": len(errors),
                         **({"method_report": method_report} if method_report else {}),
                         **({"calibration": calibration} if calibration else {})})
        save()

    def finish(mr: MethodRun, eng, tag: str, c: int) -> None:
        bucket, calib = None, None
        if mr.out:
            # The GraphKey batch of a full round: C in flight, padded to a bucket.
            bucket = batch_bucket(min(c, len(mr.which)))
            calib = _calibration(eng, mr.draft_stats, [items[i].bench for i in mr.which])
        meth = eng.method(mr.method, mr.block) if mr.method != "ar" else None
        report = meth.report() if mr.out and hasattr(meth, "report") else None
        add(mr.label + tag, c, mr.out, mr.stats, mr.warm, bucket, mr.which if mr.out else [],
            mr.errors, report, calib, block=meth.block if meth is not None else None)

    def run_part(mr: MethodRun, part: list[int], eng, tag: str, c: int) -> None:
        first = mr.stats is None
        try:
            out, stats, warm, mr.draft_stats = _run_one(
                eng, [prompt_ids[i] for i in part], [params[i] for i in part], mr.label + tag,
                mr.method, mr.block, c, console, draft_stats=mr.draft_stats, index_base=len(mr.out))
        except FastspecError as e:                   # the run as a whole failed: it is reported
            mr.errors.update({i: str(e) for i in mr.which})
            mr.failed, mr.out = True, []
            return
        base = len(mr.out)                           # completion j of this part answers mr.which[base + j]
        mr.out += [replace(comp, index=base + comp.index) for comp in out]
        mr.stats = stats if first else add_stats(mr.stats, stats)
        mr.warm += warm

    for c in levels:
        for eng, tag in engines:
            # A request that cannot run becomes an error row; the others still run.
            runs_here = []
            for label, method, block in plan:
                errors = {i: why for i, ids in enumerate(prompt_ids)
                          if (why := _too_long(eng, method, block, ids, params[i])) is not None}
                runs_here.append(MethodRun(label, method, block,
                                           [i for i in range(len(items)) if i not in errors], errors))
            # One part per method (each method over every prompt in turn), or with --interleave
            # the methods take turns on each group of prompts, the order rotated group by group.
            size = max(interleave, c) if interleave else len(items)
            runnable = {i for mr in runs_here for i in mr.which}
            if runnable:
                # One KV cache for every part and every C of the sweep: a part with a longer
                # prompt or fewer requests than the first, or a larger C, would otherwise get a
                # new cache, and every step built so far would compile again when next used
                # (a C=2 run's 1- and 2-row steps did, inside C=4's timed rounds).
                try:
                    eng.reserve(max(levels), max(len(prompt_ids[i]) + params[i].max_new_tokens for i in runnable),
                                [eng.method(mr.method, mr.block) for mr in runs_here])
                except FastspecError:
                    pass                             # a method that cannot run says so in its part
            groups = [set(range(j, min(j + size, len(items)))) for j in range(0, len(items), size)]
            for g, group in enumerate(groups):
                order = runs_here[g % len(runs_here):] + runs_here[:g % len(runs_here)] if interleave else runs_here
                for mr in order:
                    part = [i for i in mr.which if i in group]
                    if part and not mr.failed:
                        run_part(mr, part, eng, tag, c)
                    if not interleave:               # saved as soon as it ends (Ctrl-C keeps it)
                        finish(mr, eng, tag, c)
            if interleave:
                for mr in runs_here:
                    finish(mr, eng, tag, c)
    if peer_names:
        from fastspec.evals.peers import run_hf_peers
        which = [i for i, ids in enumerate(prompt_ids) if _too_long(engine, "ar", None, ids, base) is None]
        with console.status(f"peers {', '.join(peer_names)} (batch 1) ..."):
            peer_runs = run_hf_peers(engine.loaded, [prompt_ids[i] for i in which], base, peer_names,
                                     log=lambda m: console.print(f"[yellow]{m}[/]"))
        for run in peer_runs:
            add(run.name, 1, run.completions, run.stats, run.stats.warmup_s, 1, which, {})

    failed = [r for r in records if r.error]
    if failed and len(failed) == len(records):
        raise FastspecError(f"no request could run: {failed[0].error}")
    m = metrics(records, runs)
    print_report(console, m)
    if interleave:
        from fastspec.evals.report import paired_lines
        for line in paired_lines(m):
            console.print(line, highlight=False)
    from fastspec.evals.recguide_report import print_tables
    print_tables(console, runs, records, block_list[0] if block_list and len(block_list) == 1 else None)
    from fastspec.evals.report import calibration_tables
    for table in calibration_tables(runs):
        console.print(table)
    by_error: dict[str, list[str]] = {}
    for r in failed:
        by_error.setdefault(r.error, []).append(f"{r.bench}/{r.problem_id} {r.method} C={r.concurrency}")
    for msg, where in by_error.items():
        console.print(f"[yellow]could not run[/] ({len(where)}: {', '.join(where[:3])}"
                      f"{', ...' if len(where) > 3 else ''}): {escape(msg)}", highlight=False, soft_wrap=True)
    warm = sum(r["warmup_s"] for r in runs)
    recompiles = sum(r.get("recompiles", 0) for r in runs)
    keys = sum(len(eng.runner.keys()) for eng, _ in engines)
    console.print(f"steps: {keys} compiled/captured keys ({env['backend']}), warm-up {warm:.1f} s "
                  f"before timing; recompilations during timed runs: {recompiles}")
    if json_out:
        console.print(f"wrote {json_out}  (plots: fastspec bench --plot {json_out})")
    return m


@dataclass
class MethodRun:
    """One (method, C) run being gathered: with --interleave it comes in parts."""
    label: str
    method: str
    block: int | None
    which: list[int]                    # the items it runs, in order
    errors: dict[int, str]              # item -> why it could not run
    out: list = field(default_factory=list)       # completions; index = position in `which`
    stats: object = None                # RunStats, summed over the parts
    warm: float = 0.0
    draft_stats: object = None
    failed: bool = False


def add_stats(a, b):
    """Two parts of one run as one RunStats: every field is a count or a duration."""
    from dataclasses import fields
    return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)})


def _calibration(engine, draft_stats, bench_of: list[str]) -> dict | None:
    """The run's draft-calibration block (None for a method that does not draft): metrics over
    all rounds and per benchmark, raw and under the adapter's fitted calibration when it has one."""
    from fastspec.convention import model_convention
    from fastspec.evals.calibration import bench_calibration, exact_positions
    arrays = draft_stats.arrays()
    if arrays is None:
        return None
    return bench_calibration(arrays, bench_of, exact_positions(model_convention(engine.model)),
                             getattr(engine.model, "draft_calibration", None),
                             collect_s=draft_stats.seconds)


def _run_one(engine, prompt_ids, params, label, method, block, concurrency, console,
             draft_stats=None, index_base=0):
    """One (method, C) run, or a later part of it (given the earlier parts' draft_stats, which
    carries on with its requests numbered from index_base, and the method's report counts carry
    on too): completions, the engine's stats, its warm-up seconds and the rounds' draft
    statistics (evals.calibration.DraftStats, gathered as rounds commit)."""
    later_part = draft_stats is not None
    from fastspec.evals.calibration import DraftStats
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

        if draft_stats is None:
            draft_stats = DraftStats(engine)
        else:
            draft_stats.resume(index_base)
        out = engine.generate(prompt_ids, params, method=method, block=block,
                              concurrency=concurrency, on_commit=draft_stats.chain(on_commit),
                              keep_counts=later_part)
        progress.update(task, completed=total)
    # Compilation for new shapes happens before the timed loop; it is reported, not counted.
    return out, engine.last_stats, engine.warmup_s, draft_stats
