"""`fastspec calibrate`: collect same-state block-size traces on training prompts and fit the
survival tables that RecGuide's verification-guided block sizes read.

Registered by fastspec.cli.main with `cli.add_command(calibrate)`.
"""
from __future__ import annotations

import os
import shlex
import sys
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
@device_options
@backend_option
@click.option("--train-data", "train_data", default=None,
              help="Training prompt files FILE[:weight],... (default: ../shared/data/train's GSM8K, "
                   "code and general instructions). Benchmark files are refused.")
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=24, show_default=True,
              help="Prompts (mixed as the weights say).")
@click.option("--blocks", default="8,16,32", show_default=True, help="Block sizes to measure.")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--bins", type=click.IntRange(min=1), default=4, show_default=True,
              help="Quantile bins of the history signal.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Tables JSON (default profiles/<model>-survival.json).")
@user_errors
def calibrate(model, device, dtype, backend, train_data, n_prompts, blocks, max_new_tokens, bins, out):
    """Fit RecGuide's block-size survival tables from fixed-block runs of every block size.

    \b
    Every round of a fixed-B trajectory also drafts and verifies every other block size from the
    same state (greedy), so each state gives how far B = 8, 16, 32 would each have been accepted.
    """
    from fastspec.calibrate import collect, fit_tables
    from fastspec.cli.common import console, err_console
    from fastspec.cli.main import load_engine
    from fastspec.files import write_json
    from fastspec.train.data import default_data_path, mixture_prompts, parse_mixture
    block_list = parse_int_list(blocks, "--blocks")
    from fastspec.methods.linear import BLOCK_SIZES
    if any(b not in BLOCK_SIZES for b in block_list):
        raise FastspecError(f"--blocks must be among {BLOCK_SIZES}, got {block_list}")
    engine = load_engine(model, dtype, backend, device=device)
    if train_data is None:
        gsm = default_data_path()
        if gsm is None:
            raise FastspecError("no training prompts found: pass --train-data FILE[:weight],...")
        names = ("gsm8k_train.jsonl", "code_instructions.jsonl", "general_instructions.jsonl")
        train_data = ",".join(str(gsm.parent / n) for n in names if (gsm.parent / n).is_file())
    texts, record = mixture_prompts(parse_mixture(train_data), n_prompts)
    prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in texts]
    t0 = time.perf_counter()
    obs = collect(engine, prompts, tuple(block_list), max_new_tokens,
                  progress=lambda b, n: err_console.print(f"B={b} trajectory: {n} states so far"))
    meta = {"model": engine.name, "prompts": len(prompts), "blocks": block_list,
            "max_new_tokens": max_new_tokens, "observations": len(obs),
            "data": record, "seconds": round(time.perf_counter() - t0, 1),
            "command": shlex.join(["fastspec", *sys.argv[1:]])}
    tables = fit_tables(obs, block_list, meta=meta, bins=bins)
    path = out or default_tables_path(engine.name)
    write_json(path, {**tables.to_dict(), "observations": [o.__dict__ for o in obs]})
    console.print(f"{len(obs)} observations from {len(prompts)} prompts -> {path}")
    for b in block_list:
        vals = " ".join(f"{tables.value(b, s, '*'):.2f}" for s in (0.1, 0.3, 0.5, 0.7, 0.9))
        console.print(f"  V_{b}(s = .1 .3 .5 .7 .9) = {vals}")
