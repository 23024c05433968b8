"""`fastspec speed`: fastspec AR against transformers `generate` on the same weights, the
memory-bandwidth floor, and the cost of multi-token forwards T(N)/T(1).

    floor (ms/token) = weight bytes read per step / measured read bandwidth
    % of floor       = floor / measured ms per token
"""
from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from fastspec.config import FastspecError
from fastspec.sampling import SamplingParams

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue in three sentences.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a short recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "What are the prime numbers below 50?",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


def same_until_eos(ours: list[int], theirs: list[int], eos_ids) -> bool:
    """Token-for-token equality up to our first EOS: past it the runs differ by design (we
    ignore EOS to time a fixed length, HF's min_new_tokens bans it and picks another token)."""
    cut = next((i for i, t in enumerate(ours) if t in eos_ids), len(ours))
    return ours[:cut] == theirs[:cut]


def hf_model_from(loaded):
    """A transformers LlamaForCausalLM holding exactly the engine's weights, on its device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = loaded.cfg.to_hf()
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    ref = next(loaded.model.parameters())
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=ref.dtype).to(ref.device)
    sd = dict(loaded.model.hf_state_dict())
    if loaded.cfg.tie_word_embeddings:      # transformers 5 lists a tied head as missing otherwise
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    missing, _ = hf.load_state_dict(sd, strict=False)
    if [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"transformers model is missing weights: {missing}")
    return hf.eval()


def hf_generate_tps(hf, tokenizer, prompts: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(hf.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        hf.generate(**enc, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})   # warm-up
        t0 = time.perf_counter()
        out = hf.generate(**enc, **kw)
        dt = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1]:]
    return new.numel() / dt, new.tolist()


def llamacpp_tps(llm, prompt_ids: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], float]:
    """llama.cpp's greedy tokens/s over the prompts one after another (batch 1), no stop token
    (the caller warms it up once: `llamacpp_tps(llm, prompt_ids[:1], 4)`): (tokens/s, the
    tokens, decode tokens/s: the tokens after each prompt's first over the time after it)."""
    from fastspec.evals.peers import llamacpp_generate
    out, decode_s, t0 = [], 0.0, time.perf_counter()
    for ids in prompt_ids:
        t1 = time.perf_counter()
        new, ttft = llamacpp_generate(llm, ids, new_tokens, ())
        decode_s += time.perf_counter() - t1 - ttft
        out.append(new)
    wall = time.perf_counter() - t0
    return sum(map(len, out)) / wall, out, sum(len(o) - 1 for o in out) / max(decode_s, 1e-9)


def forward_times(loaded, batch: int, ns: list[int], context: int, backend: str = "auto",
                  reps: int = 10, passes: int = 3) -> dict:
    """{(n, layout): profile point} for one forward of n new tokens per row after `context`
    committed tokens, on `fastspec profile`'s own inputs, runner and timing (graphs/profile.py):
    every shape is compiled first, then the shapes take turns (`time_in_turns`), `passes` rounds
    of `reps` calls each; `ms` is the median of all of a shape's calls, `ms_min` the fastest."""
    from fastspec.graphs.profile import (LAYOUTS, ensure_adapter, measure_point, runner_forward,
                                         time_in_turns, turn_stats)
    ensure_adapter(loaded.model)
    fwd = runner_forward(loaded.model, backend)
    device = next(loaded.model.parameters()).device
    points = {(n, layout): measure_point(fwd, loaded.model, batch, n, layout, context, reps=1)
              for n in ns for layout in LAYOUTS}
    samples = time_in_turns(fwd, [inputs for _, inputs in points.values()], device, reps, passes)
    return {key: {**point, **turn_stats(got)} for (key, (point, _)), got in zip(points.items(), samples)}


def run_speed(*, model, new_tokens, batches, ns, context, hf, json_out, console: Console,
              device="auto", dtype="auto", backend="auto", bandwidth_mib: int = 1024,
              weights: str = "fp32", peers: list[str] = (), repeats: int = 3):
    from fastspec.engine import Engine
    from fastspec.files import check_writable, write_json
    from fastspec.graphs.profile import (LAYOUTS, check_grid, measure_bandwidth, ran_backend,
                                         run_environment)
    from fastspec.model.loader import load_model, resolve_device
    from fastspec.weights import BYTES, apply_weight_precision

    if new_tokens < 1:
        raise FastspecError(f"--new-tokens must be >= 1, got {new_tokens}")
    if repeats < 1:
        raise FastspecError(f"--repeats must be >= 1, got {repeats}")
    if set(peers) - {"llama.cpp"}:
        raise FastspecError(f"speed runs one peer, llama.cpp (got {', '.join(peers)})")
    from fastspec.evals.peers import check_peers
    check_peers(peers)
    if json_out:
        check_writable(json_out, "--json")
    resolve_device(device)                     # a bad --device fails before the load
    torch.manual_seed(0)
    loaded = load_model(model, dtype=dtype, device=device)
    apply_weight_precision(loaded.model, weights)     # HF generate gets the same rounded weights
    check_grid(loaded.model, [1, 4], ns, LAYOUTS, [context], backend, 1)   # the T(N) table fits
    engine = Engine(loaded, backend=backend)
    cfg = loaded.cfg
    env = run_environment(engine.device, engine.dtype, ran_backend(engine.runner, engine.device), weights,
                          engine.model)
    bw = measure_bandwidth(engine.device, mib=bandwidth_mib) / 1e9
    # The skinny kernel streams packed bf16 / int8 panels; any other path reads --dtype weights.
    packed = env["kernel"].startswith("skinny-") and engine.dtype == torch.float32
    weight_bytes = cfg.weight_bytes(BYTES[weights] if packed else engine.dtype.itemsize)
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    console.print(f"model {model} on {env['device']}, {env['dtype']}, backend {env['backend']}, "
                  f"weights {env['weights']}, kernel {env['kernel']}{', ' + env['prefetch'] if env.get('prefetch') else ''} (CPU ISA {env['isa']}): "
                  f"{weight_bytes / 1e6:.0f} MB of weights per step; read bandwidth {bw:.1f} GB/s -> "
                  f"floor {floor_ms:.1f} ms/token at batch 1", highlight=False)
    hf_model = hf_model_from(loaded) if hf else None
    gguf_dir = llm = llamacpp_error = None
    if "llama.cpp" in peers:
        import tempfile
        from fastspec.evals.peers import llamacpp_model
        gguf_dir = tempfile.TemporaryDirectory(prefix="fastspec-gguf-")
        try:
            llm = llamacpp_model(loaded, gguf_dir.name)
        except FastspecError as e:           # the peer is lost, not fastspec's own figures
            console.print(f"[yellow]{e}[/]")
            llamacpp_error = str(e)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    result = {"model": model, "environment": env, "bandwidth_gbs": bw, "weight_bytes": weight_bytes,
              "floor_ms": floor_ms, "generate": [], "forward": []}
    if llamacpp_error:
        result["llamacpp_error"] = llamacpp_error

    gen = Table(title=f"AR decoding, greedy, {new_tokens} new tokens"
                      + (f" — medians of {repeats} runs{', in turns with llama.cpp' if llm is not None else ''}"
                         if repeats > 1 else ""))
    cols = ["batch", "fastspec tok/s", "ms/step", "% of floor", "HF generate tok/s", "speedup", "same tokens"]
    if llm is not None:
        cols += ["llama.cpp tok/s", "vs llama.cpp", "decode only", "same as llama.cpp"]
    for col in cols + ["warm-up s"]:
        gen.add_column(col, justify="right")
    for b in batches:
        prompts = [engine.render_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(b)]
        engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), concurrency=b)
        warm = engine.warmup_s
        if llm is not None:
            prompt_ids = [engine.encode(p) for p in prompts]
            llamacpp_tps(llm, prompt_ids[:1], 4)                   # its warm-up, outside the pairs
        # fastspec and llama.cpp take turns, `repeats` pairs: one run each moved 15-20% between
        # runs a minute apart on a 2-core VM; the row gives medians and the median paired ratio.
        # Decode only: the steps after the prefill (fastspec: b tokens a step; llama.cpp: the
        # tokens after each prompt's first over the time after it).
        runs, lc_runs, lc_ids = [], [], None
        for _ in range(repeats):
            out = engine.generate(prompts, params, concurrency=b)
            s = engine.last_stats
            step = s.decode_s / max(s.rounds, 1) * 1e3
            runs.append((s.new_tokens / s.wall_s, step, b * 1e3 / step))
            if llm is not None:
                lc_tps, lc_ids, lc_decode = llamacpp_tps(llm, prompt_ids, new_tokens)
                lc_runs.append((lc_tps, lc_decode))
        tps = statistics.median(r[0] for r in runs)
        step_ms = statistics.median(r[1] for r in runs)
        # The floor is per step; a batch shares one read of the weights.
        row = {"batch": b, "tokens_per_s": tps, "step_ms": step_ms,
               "floor_fraction": floor_ms / step_ms, "warmup_s": warm, "runs": len(runs),
               "tokens_per_s_runs": [r[0] for r in runs], "decode_tokens_per_s": b * 1e3 / step_ms}
        if hf_model is not None:
            hf_tps, hf_ids = hf_generate_tps(hf_model, loaded.tokenizer, prompts, new_tokens)
            row.update(hf_tokens_per_s=hf_tps, speedup=tps / hf_tps,
                       same_tokens=sum(same_until_eos(o.token_ids, h, engine.eos_ids)
                                       for o, h in zip(out, hf_ids)) / b)
        if llm is not None:
            row.update(llamacpp_tokens_per_s=statistics.median(lc for lc, _ in lc_runs),
                       llamacpp_tokens_per_s_runs=[lc for lc, _ in lc_runs],
                       vs_llamacpp=statistics.median(r[0] / lc for r, (lc, _) in zip(runs, lc_runs)),
                       llamacpp_decode_tokens_per_s=statistics.median(d for _, d in lc_runs),
                       vs_llamacpp_decode=statistics.median(r[2] / d for r, (_, d) in zip(runs, lc_runs)),
                       same_as_llamacpp=sum(same_until_eos(o.token_ids, h, engine.eos_ids)
                                            for o, h in zip(out, lc_ids)) / b)
        result["generate"].append(row)
        fmt = lambda key, f: format(row[key], f) if key in row else "—"
        cells = [str(b), f"{tps:.1f}", f"{step_ms:.1f}", f"{row['floor_fraction']:.0%}",
                 fmt("hf_tokens_per_s", ".1f"), fmt("speedup", ".2f") + "×", fmt("same_tokens", ".0%")]
        if llm is not None:
            cells += [fmt("llamacpp_tokens_per_s", ".1f"), fmt("vs_llamacpp", ".2f") + "×",
                      fmt("vs_llamacpp_decode", ".2f") + "×", fmt("same_as_llamacpp", ".0%")]
        gen.add_row(*cells, f"{warm:.1f}")
    console.print(gen)
    if gguf_dir is not None:
        del llm
        gguf_dir.cleanup()

    fw = Table(title=f"one forward of N new tokens per row, context {context} — ms and T(N)/T({ns[0]}) "
                     f"(chain: causal, adapter off; draft: block-bidirectional, adapter on)")
    fw.add_column("batch", justify="right")
    fw.add_column("layout")
    for n in ns:
        fw.add_column(f"N={n}", justify="right")
    for b in (1, 4):
        times = forward_times(loaded, b, ns, context, backend)
        for layout in LAYOUTS:
            t1 = times[(ns[0], layout)]["ms"]
            cells = [f"{times[(n, layout)]['ms']:.1f} ({times[(n, layout)]['ms'] / t1:.2f})" for n in ns]
            fw.add_row(str(b), layout, *cells)
            result["forward"] += [{**times[(n, layout)], "ratio": times[(n, layout)]["ms"] / t1}
                                  for n in ns]
    console.print(fw)
    if json_out:
        write_json(json_out, result)
        console.print(f"wrote {json_out}")
    return result
