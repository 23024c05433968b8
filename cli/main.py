"""`fastspec` command line: chat, bench, speed (profile and train-drafter are registered below).

Every user error becomes one line on stderr and exit code 1 (2 for bad flags, from click).
"""
from __future__ import annotations

import os

import click

from fastspec.config import FastspecError, parse_int_list

from fastspec.cli.common import (BACKEND_HELP, MODEL_HELP, OneLineErrors, backend_option,  # noqa: E402
                                 console, device_options, err_console, report_error, user_errors,
                                 weights_option)

def model_options(fn=None, *, many_backends: bool = False):
    """--model / --adapter / --device / --dtype / --backend. many_backends: --backend takes a comma
    list (bench compares)."""
    if fn is None:
        return lambda f: model_options(f, many_backends=many_backends)
    fn = click.option("--model", "-m", default="smollm2-135m", show_default=True, help=MODEL_HELP)(fn)
    fn = click.option("--adapter", default="auto", show_default=True,
                      help="Draft adapter folder (adapter_config.json + adapter.safetensors); auto: "
                           "the checkpoint's own (draft/, NLD linear_spec_lora/) or the one shipped "
                           "for a built-in model; none: no adapter.")(fn)
    fn = click.option("--dflash", default="auto", show_default=True,
                      help="DFlash drafter folder (config.json + model.safetensors, the public format) "
                           "for --method dflash and drafter=dflash; auto: `dflash/` beside the "
                           "checkpoint or the one shipped for a built-in model; none: no drafter.")(fn)
    fn = device_options(fn)
    fn = weights_option(fn)
    if many_backends:
        fn = click.option("--backend", default="auto", show_default=True,
                          help=BACKEND_HELP + " A comma list (compile,eager) runs every method on each "
                                              "backend; rows of the later ones are labelled (backend) "
                                              "and their speedup is over the first backend's AR.")(fn)
    else:
        fn = backend_option(fn)
    return fn


def sampling_options(fn):
    fn = click.option("--max-new-tokens", type=int, default=256, show_default=True,
                      help="Stop after this many generated tokens.")(fn)
    fn = click.option("--temperature", type=float, default=0.0, show_default=True,
                      help="0 = greedy (deterministic); > 0 samples.")(fn)
    fn = click.option("--top-p", type=float, default=1.0, show_default=True,
                      help="Nucleus sampling: keep the smallest set of tokens with this much mass.")(fn)
    fn = click.option("--top-k", type=int, default=0, show_default=True,
                      help="Keep only the k most likely tokens (0 = off).")(fn)
    fn = click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")(fn)
    return fn


# RecGuide's block set on the command line: paired against the fixed B=8 it ran 1.01-1.03x at C=1
# (it picks B=8 there) and 1.28-1.30x at C=4 (results/recguide_default_ab.json).
DEFAULT_RECGUIDE_BLOCKS = "1,4,8,16,32"     # 1: the plain AR round, where drafting does not pay


def recguide_options(fn):
    """Flags that set RecGuide's options (and its ablations) for every `recguide` in --method; a
    spec's own brackets win: --method 'linear,recguide[corr=1;cont=0],recguide'."""
    opts = [
        click.option("--branches", default=None, help="RecGuide branch slots: gate (the cost gate "
                     "picks per round, default) or a fixed count 0..3 (0..--branch-slots)."),
        click.option("--max-corrections", type=click.IntRange(0, 2), default=None,
                     help="RecGuide correction branches at most (default 2)."),
        click.option("--no-continuation", is_flag=True, help="RecGuide: no continuation branch."),
        click.option("--branch-policy", type=click.Choice(["reference", "likelihood"]), default=None,
                     help="RecGuide: which branches (the paper's risk policy, or by hit likelihood)."),
        click.option("--branch-slots", type=click.IntRange(1, 6), default=None,
                     help="RecGuide, likelihood policy: candidates (and branch slots at most) per row (3)."),
        click.option("--correction-seed", type=click.Choice(["guess", "mask", "mix"]), default=None,
                     help="RecGuide: correction branches start from the alternative token (guess), a "
                          "MASK (seedless), or either per candidate (mix; likelihood policy)."),
        click.option("--risk-threshold", type=click.FloatRange(0, 1), default=None,
                     help="RecGuide: a draft position is risky when 1 − (p1 − p2) exceeds this (0.5)."),
        click.option("--adaptive-blocks", default=DEFAULT_RECGUIDE_BLOCKS, show_default=True,
                     help="RecGuide: per-request block sizes chosen each round from this set "
                          "(one size, e.g. 8, fixes the block; 1 adds the plain AR round, taken "
                          "where drafting does not pay; a spec's own blocks= wins)."),
        click.option("--tables", type=click.Path(dir_okay=False), default=None,
                     help="RecGuide survival tables (default profiles/<model>-survival.json if present)."),
        click.option("--no-signal", is_flag=True, help="RecGuide ablation: ignore the history signal s_t."),
        click.option("--no-stratum", is_flag=True, help="RecGuide ablation: ignore the stratum z_t."),
        click.option("--no-bucketing", is_flag=True,
                     help="RecGuide ablation: one step at the widest block instead of one per block size."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def with_recguide_options(methods: str, model: str, branches=None, max_corrections=None,
                          no_continuation=False, branch_policy=None, branch_slots=None,
                          correction_seed=None, risk_threshold=None, adaptive_blocks=None, tables=None, no_signal=False, no_stratum=False,
                          no_bucketing=False) -> str:
    """Fold the RecGuide flags into every `recguide` of the --method list as bracket options."""
    from fastspec.evals.runner import split_methods
    from fastspec.methods import parse_method_spec
    opts = {}
    if branches is not None:
        opts["branches"] = branches
    if max_corrections is not None:
        opts["corr"] = max_corrections
    if no_continuation:
        opts["cont"] = 0
    if branch_policy:
        opts["policy"] = branch_policy
    if branch_slots is not None:
        opts["slots"] = branch_slots
    if correction_seed:
        opts["seed"] = correction_seed
    if risk_threshold is not None:
        opts["t"] = risk_threshold
    if adaptive_blocks:
        opts["blocks"] = "/".join(str(b) for b in parse_int_list(adaptive_blocks, "--adaptive-blocks"))
    for flag, key in ((no_signal, "signal"), (no_stratum, "stratum"), (no_bucketing, "bucketing")):
        if flag:
            opts[key] = 0
    if tables:
        if not os.path.isfile(tables):
            raise FastspecError(f"--tables {tables}: no such file")
        opts["tables"] = tables
    elif adaptive_blocks or "blocks=" in methods:
        from fastspec.cli.calibrate import default_tables_path
        default = default_tables_path(model)
        if os.path.isfile(default):
            # Relative to the working dir when under it: the spec is the run's method label.
            rel = os.path.relpath(default)
            opts["tables"] = default if rel.startswith("..") else rel
    out = []
    for spec in split_methods(methods):
        name, own = parse_method_spec(spec)
        if name == "recguide" and opts:
            merged = {**opts, **{k: v for k, v in (i.split("=", 1) for i in
                                                   spec[len(name) + 1:-1].split(";") if "=" in i)}}
            spec = "recguide[" + ";".join(f"{k}={v}" for k, v in merged.items()) + "]"
        out.append(spec)
    return ",".join(out)


def load_engine(model: str, dtype: str, backend: str, adapter: str = "auto", device: str = "auto",
                weights: str = "fp32", dflash: str = "auto"):
    """The model on --device (auto: the GPU when there is one) in --dtype, its big linears rounded
    to --weights, behind an Engine whose steps run on --backend (auto: CUDA graphs on a GPU)."""
    from fastspec.engine import Engine
    from fastspec.model.loader import load_model, resolve_device
    from fastspec.weights import apply_weight_precision
    if adapter not in ("auto", "none") and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        raise FastspecError(f"--adapter {adapter}: no adapter_config.json there")
    if dflash not in ("auto", "none") and not os.path.isfile(os.path.join(dflash, "config.json")):
        raise FastspecError(f"--dflash {dflash}: no config.json there")
    resolve_device(device)                         # a bad --device fails before the load
    with err_console.status(f"loading {model} ..."):
        loaded = load_model(model, dtype=dtype, device=device,
                            adapter=None if adapter == "none" else adapter,
                            dflash=None if dflash == "none" else dflash)
    apply_weight_precision(loaded.model, weights)      # before the Engine: its runner packs them
    return Engine(loaded, backend=backend)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """fastspec: self-speculative decoding on one model backbone.

    \b
    Quick start:
      fastspec chat --prompt "What is 7 * 8?"     one answer, streamed
      fastspec chat                              interactive chat
      fastspec bench --suite math --limit 5      speed (and accuracy) on GSM8K & co.
      fastspec speed                             fastspec vs transformers, CPU roofline
      fastspec profile                           step cost per (batch, block, layout) + roofline fit
      fastspec train-drafter                     train the draft adapter
    """


@cli.command()
@model_options
@sampling_options
@click.option("--method", default="ar", show_default=True,
              help="Decoding method: ar (plain autoregressive), linear (LinearSS: draft a block, "
                   "verify it), recguide, libraspec, d2sd, bastion, tidar or dflash; options in "
                   "brackets, e.g. 'bastion[budgets=8/16]' or 'libraspec[drafter=dflash]' (draft with "
                   "the model's DFlash drafter). Accepted draft tokens are shown in green.")
@click.option("--block", type=int, default=None,
              help="Draft block size for speculative methods (4, 8, 16 or 32). Default: 8 (TiDAR: its own "
                   "per run, from the device's profile).")
@click.option("--prompt", "-p", default=None, help="Answer this one prompt and exit.")
@click.option("--system", default=None, help="System message (default: the chat template's).")
@user_errors
def chat(model, dtype, device, weights, dflash, adapter, backend, max_new_tokens, temperature, top_p, top_k, seed,
         method, block, prompt, system):
    """Chat with the model; tokens stream as they are committed. Ctrl-C stops the current answer."""
    from fastspec.evals.runner import check_blocks, default_block, dflash_for
    from fastspec.methods import get_method
    from fastspec.sampling import SamplingParams
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens, seed)
    if prompt is not None and not prompt.strip():
        raise FastspecError("empty prompt: give --prompt some text")
    block = default_block(method) if block is None else block
    meth = get_method(method, block=block)   # a bad name or block fails before loading
    check_blocks([method], [block])
    engine = load_engine(model, dtype, backend, adapter=adapter, device=device, weights=weights,
                         dflash=dflash_for([meth], dflash))
    history: list[dict] = [{"role": "system", "content": system}] if system else []

    def answer(user_text: str) -> None:
        text = engine.render_chat(history + [{"role": "user", "content": user_text}])
        shown: list[int] = []
        printed = ""

        def stream(_, new_ids, n_drafted):
            # Accepted draft tokens in green, the verifier's own tokens plain.
            nonlocal printed
            drafted = engine.decode(shown + new_ids[:n_drafted]) or ""
            shown.extend(new_ids)
            full = engine.decode(shown) or ""
            console.print(drafted[len(printed):], end="", style="green", highlight=False, markup=False)
            console.print(full[max(len(drafted), len(printed)):], end="", highlight=False, markup=False)
            printed = full

        out = engine.generate([text], params, method=method, block=block, on_commit=stream)[0]
        console.print()
        s = engine.last_stats
        err_console.print(f"[dim]{len(out.token_ids)} tokens, {s.tokens_per_s:.1f} tok/s, "
                          f"{s.tokens_per_forward:.2f} tokens/forward, τ {out.tau:.2f}, "
                          f"warm-up {engine.warmup_s:.1f}s[/]")
        # Only a finished turn joins the history: a failed or cancelled one leaves no trace.
        history.extend([{"role": "user", "content": user_text},
                        {"role": "assistant", "content": out.text or ""}])

    if prompt is not None:
        answer(prompt)
        return
    err_console.print("[dim]fastspec chat — empty line or Ctrl-D to quit; Ctrl-C stops an answer[/]")
    while True:
        try:
            user_text = console.input("[bold cyan]> [/]")
        except (EOFError, KeyboardInterrupt):        # Ctrl-D / Ctrl-C at the prompt: leave
            console.print()
            break
        if not user_text.strip():
            break
        # One turn that cannot run (too long for the context, ...) or is cancelled is reported,
        # and the conversation goes on.
        try:
            answer(user_text)
        except FastspecError as e:
            console.print()
            report_error(e)
        except KeyboardInterrupt:
            console.print()
            err_console.print("[dim](answer cancelled)[/]")


@cli.command()
@model_options(many_backends=True)
@click.option("--suite", default=None, help="Benchmark suite: math (GSM8K, MATH-500, AIME25), code "
              "(HumanEval, MBPP, LiveCodeBench*), qa (GPQA, IFEval), all. Default: math.")
@click.option("--bench", "benches", default=None, help="Comma-separated benchmarks, e.g. gsm8k,math500.")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Your own prompts: a jsonl file with a 'prompt' (or 'question') field per line.")
@click.option("--limit", type=int, default=5, show_default=True, help="Problems per benchmark.")
@click.option("--method", "methods", default="ar", show_default=True,
              help="Comma-separated methods to compare: ar, linear, recguide, libraspec, d2sd, bastion, "
                   "tidar, dflash (options in brackets, e.g. 'tidar[block=4]'). AR always runs as the reference.")
@click.option("--block", "blocks", default=None,
              help="Draft block size(s) for speculative methods; a list (8,16,32) sweeps them. "
                   "Default: 8 (TiDAR: its own per run from the device's profile, its B + B² tokens a forward).")
@click.option("--concurrency", default="1", show_default=True,
              help="Comma-separated numbers of requests decoded together, e.g. 1,2,8,32.")
@click.option("--max-new-tokens", type=int, default=None,
              help="Generated tokens per request (default: per suite, math/code 256, qa 128).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Top-k sampling (0 = off).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None, envvar="FASTSPEC_DATA",
              help="Folder of benchmark jsonl files (env FASTSPEC_DATA).")
@click.option("--peers", default=None,
              help="Also run peers on the same weights and prompts, greedy, batch 1: hf (transformers "
                   "generate), hf-pld (prompt-lookup assisted generation), llama.cpp (llama-cpp-python "
                   "on a GGUF of the weights at their precision; pip install 'fastspec[llamacpp]'); "
                   "comma-separated.")
@click.option("--no-baseline", is_flag=True, help="Do not run AR as the reference.")
@click.option("--interleave", type=int, default=0, show_default=True, metavar="N",
              help="Paired timing for machines whose speed drifts (shared or throttled CPUs): the "
                   "methods take turns on each group of N prompts (at least C), the order rotated "
                   "group by group, instead of each method running every prompt in turn. The "
                   "tokens are the same; at C>1 every group drains before the next starts. 0: off.")
@recguide_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write every per-request record, the metrics and the environment to this JSON file.")
@click.option("--plot", "plot_from", type=click.Path(dir_okay=False), default=None,
              help="Instead of running: draw PNG plots from a results JSON written by --json.")
@user_errors(interrupted="interrupted: every finished (method, concurrency) run is in the --json file")
def bench(model, dtype, device, weights, dflash, adapter, backend, suite, benches, prompts_file, limit, methods, blocks,
          concurrency, max_new_tokens, temperature, top_p, top_k, seed, data_dir, peers, no_baseline,
          interleave, json_out, plot_from, **recguide):
    """Benchmark decoding methods: τ, tokens/forward, tokens/s, speedup over AR, accuracy.

    \b
    Examples:
      fastspec bench --suite math --limit 5
      fastspec bench --suite all --method ar,linear --limit 3 --concurrency 1,4 --json r.json
      fastspec bench --plot r.json
      fastspec bench --bench gsm8k --backend compile,eager      compiled vs eager steps
      fastspec bench --method ar,linear --interleave 1         AR and LinearSS paired prompt by prompt
    """
    if plot_from:
        from fastspec.evals.report import write_plots
        out_dir = os.path.splitext(plot_from)[0] + "_plots"
        for path in write_plots(plot_from, out_dir):
            console.print(f"wrote {path}")
        from fastspec.evals.recguide_report import plot_throughput
        from fastspec.evals.report import load_results
        res = load_results(plot_from)
        if (path := plot_throughput(res["runs"], res["records"], out_dir)) is not None:
            console.print(f"wrote {path}")
        return
    if max_new_tokens is not None and max_new_tokens < 1:
        raise FastspecError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    from fastspec.evals.runner import run_bench
    methods = with_recguide_options(methods, model, **recguide)
    run_bench(model=model, dtype=dtype, device=device, adapter=adapter, dflash=dflash, backend=backend,
              weights=weights, max_new_tokens=max_new_tokens,
              temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, suite=suite,
              benches=benches, prompts_file=prompts_file, limit=limit, methods=methods, blocks=blocks,
              concurrency=concurrency, data_dir=data_dir, json_out=json_out, peers=peers,
              baseline=not no_baseline, console=console, load_engine=load_engine, interleave=interleave)


@cli.command()
@click.option("--model", "-m", default="smollm2-135m", show_default=True, help=MODEL_HELP)
@device_options
@weights_option
@backend_option
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens generated per run.")
@click.option("--batch", "batches", default="1,8", show_default=True, help="Comma-separated batch sizes.")
@click.option("--tokens-per-forward", "ns", default="1,2,4,8,16,32", show_default=True,
              help="N for the T(N)/T(1) multi-token forward table.")
@click.option("--context", type=int, default=256, show_default=True,
              help="Committed context length for the T(N) table.")
@click.option("--no-hf", is_flag=True, help="Skip the transformers generate baseline.")
@click.option("--peers", default=None,
              help="llama.cpp: also time llama-cpp-python on a GGUF of the same weights at their "
                   "precision (greedy, same token ids, prompts one after another); "
                   "pip install 'fastspec[llamacpp]'.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed AR runs per batch (medians; with --peers, fastspec and llama.cpp take turns "
                   "and the ratio is the median of the pairs).")
@click.option("--bandwidth-mib", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Size of the tensor summed to measure memory bandwidth.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Write results as JSON.")
@user_errors
def speed(model, device, dtype, weights, backend, new_tokens, batches, ns, context, no_hf, peers,
          repeats, bandwidth_mib, json_out):
    """Speed: fastspec AR vs transformers generate, % of the memory-bandwidth floor, T(N)/T(1)."""
    from fastspec.evals.speed import run_speed
    run_speed(model=model, device=device, dtype=dtype, weights=weights, backend=backend,
              new_tokens=new_tokens,
              batches=parse_int_list(batches, "--batch"),
              ns=parse_int_list(ns, "--tokens-per-forward"), context=context, hf=not no_hf,
              peers=[p.strip() for p in (peers or "").split(",") if p.strip()],
              bandwidth_mib=bandwidth_mib, json_out=json_out, console=console, repeats=repeats)


def _register_commands() -> None:
    from fastspec.cli.calibrate import calibrate
    from fastspec.cli.profile import profile
    from fastspec.cli.train import train_drafter
    cli.add_command(train_drafter)
    cli.add_command(profile)
    cli.add_command(calibrate)


_register_commands()


def main():
    cli(prog_name="fastspec")


if __name__ == "__main__":
    main()
