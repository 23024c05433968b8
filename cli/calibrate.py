"""`fastspec calibrate`: fit, on training prompts, what the methods read at run time:

- the survival tables of RecGuide's verification-guided block sizes (default), from same-state
  block-size traces;
- with `--drafter`, a calibration of the drafter's confidences (a temperature and a bias per draft
  position on the log-odds of its draft probability), written as calibration.json beside the adapter.

Registered by fastspec.cli.main with `cli.add_command(calibrate)`.
"""
from __future__ import annotations

import os
import shlex
import time

import click

from fastspec.cli.common import MODEL_HELP, backend_option, device_options, user_errors
from fastspec.config import FastspecError, parse_int_list


def default_tables_path(model_name: str) -> str:
    """Beside the model's profiles: profiles/<model>-survival.json (the repo's own profiles/ when
    that holds one, e.g. the shipped tables of the default model; else under the working dir)."""
    from fastspec.graphs.profile import slug
    name = f"{slug(model_name)}-survival.json"
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles", name)
    return shipped if os.path.isfile(shipped) else os.path.join("profiles", name)


@click.command()
@click.option("--model", "-m", default="smollm2-135m", show_default=True, help=MODEL_HELP)
@click.option("--adapter", default="auto", show_default=True,
              help="Draft adapter folder; auto: the model's own (or the one shipped for it).")
@device_options
@backend_option
@click.option("--drafter", is_flag=True,
              help="Fit a temperature and a bias per draft position for the drafter's confidences instead of "
                   "the survival tables, and write calibration.json beside the adapter.")
@click.option("--train-data", "train_data", default=None,
              help="Training prompt files FILE[:weight],... (default: ../shared/data/train's GSM8K, "
                   "code and general instructions). Benchmark files are refused.")
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=24, show_default=True,
              help="Prompts (mixed as the weights say), none that the drafter or an adapter it was "
                   "initialised from was trained on (rebuilt from the adapter's recorded runs).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the prompts' draw from each file.")
@click.option("--blocks", default=None,
              help="Block sizes to run (default 8,16,32; with --drafter 8).")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests decoded together (greedy: the draws do not depend on it).")
@click.option("--bins", type=click.IntRange(min=1), default=4, show_default=True,
              help="Quantile bins of the history signal.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Output JSON (default profiles/<model>-survival.json; with --drafter "
                   "<adapter>/calibration.json).")
@user_errors
def calibrate(model, adapter, device, dtype, backend, drafter, train_data, n_prompts, seed, blocks,
              max_new_tokens, concurrency, bins, out):
    """Fit RecGuide's block-size survival tables (or, with --drafter, the drafter's confidence
    calibration) on training prompts.

    \b
    Survival tables: every round of a fixed-B trajectory also drafts and verifies every other
    block size from the same state (greedy), so each state gives how far B = 8, 16, 32 would each
    have been accepted.
    --drafter: greedy LinearSS runs at each block size; per aligned draft index i, the T and b that
    best predicts "accepted" from sigmoid(logit(p_draft) / T + b) (log loss), written with the counts
    and the ECE before and after to calibration.json, which loading the adapter then reads.
    """
    from fastspec.cli.common import err_console
    from fastspec.cli.main import load_engine
    from fastspec.methods.linear import BLOCK_SIZES
    from fastspec.train.data import lineage_training_prompts, mixture_prompts, parse_mixture
    block_list = parse_int_list(blocks or ("8" if drafter else "8,16,32"), "--blocks")
    if any(b not in BLOCK_SIZES for b in block_list):
        raise FastspecError(f"--blocks must be among {BLOCK_SIZES}, got {block_list}")
    engine = load_engine(model, dtype, backend, adapter=adapter, device=device)
    train_data = train_data or default_train_data()
    sources = parse_mixture(train_data)
    # Held-out prompts: on its own training prompts a drafter is accepted more often than on new
    # text, which would bias both fits upwards.
    seen = lineage_training_prompts(adapter_meta(engine), sources)
    texts, record = mixture_prompts(sources, n_prompts, seed=seed, exclude=seen)
    if not texts:
        raise FastspecError(f"every prompt in --train-data is one this drafter was trained on "
                            f"({len(seen)} held out): pass files with other prompts")
    prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in texts]
    command = full_command(click.get_current_context(), skip=("bins",) if drafter else (),
                           train_data=train_data, blocks=",".join(map(str, block_list)))
    if drafter:
        fit_drafter(engine, prompts, record, block_list, max_new_tokens, concurrency, out, command)
        return
    from fastspec.calibrate import collect, fit_tables
    from fastspec.cli.common import console
    from fastspec.files import write_json
    t0 = time.perf_counter()
    obs = collect(engine, prompts, tuple(block_list), max_new_tokens, concurrency,
                  progress=lambda b, n: err_console.print(f"B={b} trajectory: {n} states so far"))
    adapter_dir = getattr(engine.loaded, "adapter_path", None)
    meta = {"model": engine.name, "adapter": adapter_dir and os.path.relpath(adapter_dir),
            "prompts": len(prompts), "blocks": block_list,
            "max_new_tokens": max_new_tokens, "observations": len(obs),
            "data": record, "seconds": round(time.perf_counter() - t0, 1), "command": command}
    tables = fit_tables(obs, block_list, meta=meta, bins=bins)
    path = out or default_tables_path(engine.name)
    write_json(path, {**tables.to_dict(), "observations": [o.__dict__ for o in obs]})
    console.print(f"{len(obs)} observations from {len(prompts)} prompts -> {path}")
    for b in block_list:
        vals = " ".join(f"{tables.value(b, s, '*'):.2f}" for s in (0.1, 0.3, 0.5, 0.7, 0.9))
        console.print(f"  V_{b}(s = .1 .3 .5 .7 .9) = {vals}")


def adapter_meta(engine) -> dict | None:
    """The training record (`meta`) of the engine's adapter, None without one."""
    import json
    from fastspec.draft import CONFIG_FILE
    path = getattr(engine.loaded, "adapter_path", None)
    if path is None or not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return None
    with open(os.path.join(path, CONFIG_FILE)) as f:
        meta = json.load(f).get("meta")
    return meta if isinstance(meta, dict) else None


def full_command(ctx: click.Context, skip: tuple[str, ...] = (), **resolved) -> str:
    """The command line that reruns this one with every option spelled out (defaults and the
    `resolved` values included; `skip`: options that play no part), so a file it writes says
    exactly how it was made."""
    params = {**ctx.params, **resolved}
    words = ["fastspec", ctx.info_name or "calibrate"]
    for opt in ctx.command.params:
        value = params.get(opt.name)
        if opt.name in skip:
            continue
        flag = max((o for o in opt.opts if o.startswith("--")), key=len, default=None)
        if flag is None or value is None or value is False:
            continue
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def default_train_data() -> str:
    """../shared/data/train's GSM8K, code and general instruction files, equal weights."""
    from fastspec.train.data import default_data_path
    gsm = default_data_path()
    if gsm is None:
        raise FastspecError("no training prompts found: pass --train-data FILE[:weight],...")
    names = ("gsm8k_train.jsonl", "code_instructions.jsonl", "general_instructions.jsonl")
    # Relative to the working directory (the repo root in `make` and the README): the command
    # recorded with the results then reruns on another machine.
    return ",".join(os.path.relpath(gsm.parent / n) for n in names if (gsm.parent / n).is_file())


def fit_drafter(engine, prompts: list[str], record: list[dict], blocks: list[int],
                max_new_tokens: int, concurrency: int, out: str | None, command: str) -> str:
    """Greedy LinearSS over the training prompts at each block size, the per-round draft stats of
    every round (evals.calibration.DraftStats), a temperature and bias per aligned index fitted on them,
    and calibration.json (beside the adapter unless --out) with the command, data, counts and
    ECE before and after."""
    from fastspec.cli.common import console, err_console
    from fastspec.convention import model_convention
    from fastspec.draft import CALIBRATION_FILE, has_adapter, save_calibration
    from fastspec.evals.calibration import (DraftStats, calibration_metrics, exact_positions,
                                            fit_temperatures)
    from fastspec.sampling import SamplingParams
    adapter_dir = getattr(engine.loaded, "adapter_path", None)
    if not has_adapter(engine.model) or adapter_dir is None:
        raise FastspecError(f"{engine.name} has no draft adapter to calibrate (pass --adapter)")
    skip = exact_positions(model_convention(engine.model))
    arrays = {k: [] for k in ("draft_prob", "draft_confidence", "draft_margin", "n_drafted", "block")}
    t0, tokens = time.perf_counter(), 0
    for b in blocks:
        stats = DraftStats(engine)
        with err_console.status(f"LinearSS B={b} on {len(prompts)} training prompts ...") as status:
            count = 0

            def progress(index, ids, n_drafted):
                nonlocal count
                count += len(ids)
                status.update(f"LinearSS B={b} on {len(prompts)} training prompts: {count} tokens, "
                              f"{len(stats.blocks)} rounds, {time.perf_counter() - t0:.0f} s")

            done = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens),
                                   method="linear", block=b, concurrency=concurrency,
                                   on_commit=stats.chain(progress))
        tokens += sum(len(c.token_ids) for c in done)
        got = stats.arrays() or {k: [] for k in arrays}
        for k in arrays:
            arrays[k] += got[k]
        err_console.print(f"B={b}: {len(got['block'])} rounds, τ "
                          f"{sum(len(c.token_ids) - 1 for c in done) / max(sum(c.rounds for c in done), 1):.2f}")
    cal = fit_temperatures(arrays["draft_prob"], arrays["n_drafted"], arrays["block"], skip=skip,
                           width=max(max(blocks), 32))
    m = calibration_metrics(**arrays, skip=skip, calibration=cal)
    cal.meta.update({
        "model": engine.name, "adapter": os.path.relpath(adapter_dir), "method": "linear", "blocks": blocks,
        "sampling": "greedy", "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "new_tokens": tokens, "data": record, "command": command,
        "seconds": round(time.perf_counter() - t0, 1),
        "ece_before": m["ece"], "ece_after": m["ece_calibrated"], "ece_floor": m["ece_floor"],
        "brier_before": m["brier"], "brier_after": m["brier_calibrated"],
        "auc_first_rejection": m["auc_first_rejection"],
    })
    path = save_calibration(cal, adapter_dir, out)
    fitted = cal.meta["fitted_indices"]
    console.print(f"{m['positions']} judged draft positions from {len(prompts)} prompts -> {path}")
    temps = " ".join(f"{i}:{cal.temperature[i]:.2f}/{cal.bias[i] if cal.bias else 0:+.2f}"
                     for i in range(max(blocks)))
    console.print(f"  T/b per aligned index {temps}; own fits at {fitted or 'none'}, the others "
                  f"pooled ({cal.meta['pooled_temperature']:.2f}/{cal.meta.get('pooled_bias', 0):+.2f}) "
                  f"or exact (1.00/+0.00)")
    console.print(f"  ECE {m['ece']:.4f} -> {m['ece_calibrated']:.4f} (a calibrated drafter: ~"
                  f"{m['ece_floor']:.4f} on as many positions), Brier {m['brier']:.4f} -> "
                  f"{m['brier_calibrated']:.4f}, log loss {m['log_loss']:.4f} -> "
                  f"{m['log_loss_calibrated']:.4f} (training prompts)")
    if out is not None and os.path.basename(out) != CALIBRATION_FILE:
        console.print(f"  (loading reads {CALIBRATION_FILE} beside the adapter; copy it there to use it)")
    return path
