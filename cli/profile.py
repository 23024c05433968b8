"""`fastspec profile`: time one forward over batch × block × layout × context, fit the roofline.

Registered by fastspec.cli.main with `cli.add_command(profile)`; the user-error
wrapper and the consoles are looked up when the command runs.
"""
from __future__ import annotations

import os

import click

from fastspec.cli.common import MODEL_HELP, backend_option, device_options, user_errors, weights_option
from fastspec.config import FastspecError, parse_int_list


@click.command()
@click.option("--model", "-m", default="smollm2-135m", show_default=True, help=MODEL_HELP)
@device_options
@weights_option
@backend_option
@click.option("--batch", "batches", default="1,4", show_default=True, help="Comma-separated batch sizes.")
@click.option("--block", "blocks", default="1,4,8,16,32", show_default=True,
              help="Comma-separated new tokens per row.")
@click.option("--layout", "layouts", default="chain,draft", show_default=True,
              help="chain (causal, adapter off: verify/AR) and/or draft (block-bidirectional, adapter on).")
@click.option("--context", "contexts", default="256", show_default=True,
              help="Comma-separated committed context lengths.")
@click.option("--reps", type=int, default=10, show_default=True,
              help="Timed forwards per point in each round.")
@click.option("--passes", type=int, default=3, show_default=True,
              help="Rounds in which the compiled shapes take turns; ms = median of reps × passes calls.")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Profile JSON (default profiles/<device>-<model>[-<kernel>][-<weights>].json, "
                   "the name the planners look up).")
@click.option("--png", "png", type=click.Path(dir_okay=False), default=None,
              help="Heatmap PNG (default: the JSON path with .png).")
@click.option("--trace", "trace", type=click.Path(dir_okay=False), default=None,
              help="Also write a torch.profiler Chrome trace (one forward per shape) to this file.")
@click.option("--bandwidth-mib", type=int, default=1024, show_default=True,
              help="Size of the tensor summed to measure memory bandwidth.")
@user_errors
def profile(model, device, dtype, weights, backend, batches, blocks, layouts, contexts, reps, passes, out,
            png, trace, bandwidth_mib):
    """Profile one forward's time per shape: table, heatmap, roofline fit, JSON.

    \b
    Example:
      fastspec profile --batch 1,4 --block 1,8,16 --context 256
    """
    from fastspec.cli.common import console, err_console
    from fastspec.graphs.profile import (LAYOUTS, default_path, device_name, fit_summary, kernel_ran,
                                         ran_backend, render_table, run_environment, run_profile, write_heatmap)
    from fastspec.graphs.runner import StepRunner
    from fastspec.files import check_writable
    from fastspec.model.loader import load_model, resolve_device
    batch_list = parse_int_list(batches, "--batch")
    block_list = parse_int_list(blocks, "--block")
    ctx_list = parse_int_list(contexts, "--context")
    layout_list = [x.strip() for x in layouts.split(",") if x.strip()]
    bad = [x for x in layout_list if x not in LAYOUTS]
    if bad or not layout_list:
        raise FastspecError(f"--layout takes {' and/or '.join(LAYOUTS)}, got {layouts!r}")
    if reps < 1:
        raise FastspecError(f"--reps must be >= 1, got {reps}")
    if passes < 1:
        raise FastspecError(f"--passes must be >= 1, got {passes}")
    if bandwidth_mib < 1:
        raise FastspecError(f"--bandwidth-mib must be >= 1, got {bandwidth_mib}")
    resolve_device(device)                     # a bad --device fails before the load
    if out:
        check_writable(out, "--out")
    with err_console.status(f"loading {model} ..."):
        loaded = load_model(model, dtype=dtype, device=device)
    from fastspec.weights import apply_weight_precision
    apply_weight_precision(loaded.model, weights)
    param = next(loaded.model.parameters())
    device = param.device
    env = run_environment(device, param.dtype, ran_backend(StepRunner(backend), device), weights,
                          loaded.model)
    console.print(f"[dim]{model} on {env['device']}, {env['dtype']}, backend {env['backend']}, "
                  f"weights {env['weights']}, kernel {env['kernel']}{', ' + env['prefetch'] if env.get('prefetch') else ''} (CPU ISA {env['isa']})[/]",
                  highlight=False)
    out = out or default_path(device_name(device), loaded.name, kernel_ran(env), weights)
    png = png or os.path.splitext(out)[0] + ".png"
    total = len(batch_list) * len(block_list) * len(layout_list) * len(ctx_list)
    done = [0]

    def compiled(p):
        done[0] += 1
        err_console.print(f"[dim]built {done[0]}/{total}  B{p['batch']}×{p['block']} {p['layout']} "
                          f"ctx {p['ctx']}: compile {p['compile_s']:.1f} s, one call {p['ms']:.2f} ms[/]",
                          highlight=False)

    def timed(k, n):
        err_console.print(f"[dim]timed round {k}/{n}: every shape {reps} calls[/]", highlight=False)

    prof = run_profile(loaded, batches=batch_list, blocks=block_list, layouts=layout_list,
                       contexts=ctx_list, backend=backend, reps=reps, passes=passes,
                       bandwidth_mib=bandwidth_mib, trace=trace, on_point=compiled, on_pass=timed,
                       checkpoint=out, environment=env)
    prof.save(out)
    wrote = [out]
    try:
        wrote.append(write_heatmap(prof, png))
    except ImportError:                        # matplotlib is optional: the JSON is the result
        err_console.print("[yellow]no heatmap:[/] matplotlib is not installed (pip install matplotlib)",
                          highlight=False)
    console.print(render_table(prof))
    console.print(fit_summary(prof), highlight=False)
    console.print("\n".join(f"wrote {p}" for p in wrote + ([trace] if trace else [])), highlight=False)
