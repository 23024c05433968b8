"""The GPU check: whole round steps, captured per GraphKey, against eager; then a saved profile.

    python -m fastspec.graphs.gpu_check                       # on a GPU: NLD-8B-shaped random weights
    python -m fastspec.graphs.gpu_check --tiny --device cpu --compiler aot_eager   # CPU dry run

Installs nothing and downloads nothing. For every method (AR, LinearSS, ... every one in
fastspec.methods), block size B, concurrency C and sampling mode it decodes the same C prompts
(of about `--context` tokens) twice through the engine: once with every step eager, once with the
steps compiled (CUDA graphs on a GPU, torch.compile on the CPU; one step per GraphKey, built in the
warm-up and replayed by every round). It compares the tokens, the tokens committed per round
(accepted lengths) and the K/V the rounds committed, then times single forwards with `fastspec
profile`'s code and fits the roofline. Results go to one profile JSON (`meta.check`); any mismatch
exits 1.

Tokens are compared exactly, so the check decodes in --check-dtype, float32 by default: compiled
and eager fp32 agree to ~1e-6, far below the gaps an argmax or an inverse-CDF draw resolves,
whereas in bf16 random weights make near-ties common and a flipped token would say nothing about
the step. The profile is timed in --dtype (bf16 on a GPU). `--min-identical` lets a few requests
differ (a near-tie of fp32 random logits) before the check fails; the default tolerates none.
Cost on a GPU: one capture per (method, B, C, sampling) key (tens of seconds each for the 8B
shape) plus the profile's keys: size --blocks / --concurrency / --sampling to the time you have.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from types import SimpleNamespace

import torch

from fastspec.config import ModelConfig
from fastspec.graphs import profile as prof
from fastspec.graphs import runner as runner_mod
from fastspec.model.llama import LlamaModel
from fastspec.model.rope import rope_tables

# Nemotron-Labs-Diffusion-8B's backbone shape (Ministral3-8B).
NLD_8B = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_layers=34,
              num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=4096,
              rope_theta=1e6, tie_word_embeddings=False, architecture="Ministral3ForCausalLM")
# SmolLM2-135M's shape (the default model): its forward costs on a GPU, without its weights.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                    rope_theta=1e5, tie_word_embeddings=True, architecture="LlamaForCausalLM")
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
            architecture="Ministral3ForCausalLM")
SHAPES = {"nld-8b": NLD_8B, "smollm2-135m": SMOLLM2_135M, "tiny": TINY}
SAMPLINGS = {"greedy": dict(), "filtered": dict(temperature=0.8, top_k=50, top_p=0.9, seed=7)}


def random_model(shape: dict, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """Random weights made on the device itself (an 8B model never passes through host memory),
    with a draft adapter whose LoRA is not the identity (so drafts, and acceptance, vary) and a
    one-layer DFlash drafter reading the first and last layers (so the dflash method runs too)."""
    from fastspec.draft import AdapterConfig, attach_adapter
    from fastspec.model.dflash import DFlashDrafter, attach_dflash, drafter_config_for
    cfg = ModelConfig(**shape)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=cfg.max_position_embeddings)
    model = model.to_empty(device=device)
    attach_adapter(model, AdapterConfig(rank=16, alpha=32.0, mask_token_id=100))
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name != "mask_embed":       # the mean token embedding, as attach_adapter made it
                p.normal_(0.0, 0.02, generator=g)
        model.mask_embed.copy_(model.embed.mean(0))
        # Buffers came from the meta device empty: rebuild the RoPE tables on the device.
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    dcfg = drafter_config_for(cfg, 1, (0, cfg.num_layers - 1), 8, 100)
    drafter = DFlashDrafter(dcfg, max_positions=cfg.max_position_embeddings).init_random(seed + 1, std=0.02)
    attach_dflash(model, drafter.to(device))
    return model.to(dtype).eval().requires_grad_(False)


def random_prompts(n: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(max(1, context // 2), context + 1))]
            for _ in range(n)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_rounds(loaded, method: str, block: int | None, prompts: list[list[int]], params,
                 backend: str, compiler=None) -> dict:
    """Decode `prompts` (one per slot: request i decodes in slot i) eager and compiled; compare.

    Returns {identical: share of requests with equal tokens and accepted lengths, kv_err: max
    relative K/V difference over the columns both runs committed from equal tokens, steps:
    compilations + captures of the compiled engine (0 would mean eager was compared with eager),
    step_ms: a timed method's measured step times per (rows, width, variant)}.
    """
    from fastspec.engine import Engine
    c = len(prompts)
    eager = Engine(loaded, backend="eager")
    ref = eager.generate(prompts, params, method=method, block=block, concurrency=c)
    graph = Engine(loaded, backend=backend, compiler=compiler)
    out = graph.generate(prompts, params, method=method, block=block, concurrency=c)
    same, kv_err = 0, 0.0
    for i, (r, o) in enumerate(zip(ref, out)):
        same += r.token_ids == o.token_ids and r.accept_lengths == o.accept_lengths
        # Columns committed from equal inputs: the prompt and the agreed tokens but the last
        # (the last emitted token is the next round's seed, not yet in the cache).
        n = len(r.prompt_ids) + _common_prefix(r.token_ids, o.token_ids) - 1
        for a, b in ((eager.cache.k, graph.cache.k), (eager.cache.v, graph.cache.v)):
            a, b = a[:, i, :, :n].float(), b[:, i, :, :n].float()
            kv_err = max(kv_err, ((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item())
    steps = sum(s["compiles"] + s.get("captures", 0) for s in graph.runner.stats().values())
    keys = [str(k) for k in graph.runner.keys()]
    # A timed method's (RecGuide's) captured steps as they ran: ms per (rows, width, variant).
    step_ms = {f"{rows}x{width}:{variant}": round(ms, 4)
               for times in graph.step_ms.values() for (rows, width, variant), ms in sorted(times.items())}
    del eager, graph
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"identical": same / c, "kv_err": kv_err, "steps": steps, "keys": keys, "step_ms": step_ms}


def main(argv=None) -> int:
    from fastspec.methods import METHODS
    from fastspec.model.loader import resolve_dtype
    from fastspec.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (dry run of the code path)")
    ap.add_argument("--shape", default=None, choices=tuple(SHAPES),
                    help="the random model's shape (default nld-8b; --tiny means tiny)")
    ap.add_argument("--profile-blocks", default=None, help="block sizes profiled (default --blocks)")
    ap.add_argument("--profile-concurrency", default=None, help="batches profiled (default --concurrency)")
    ap.add_argument("--no-profile", action="store_true", help="round checks only")
    ap.add_argument("--methods", default=",".join(METHODS), help="methods whose round steps to check")
    ap.add_argument("--blocks", default="8", help="block sizes of the speculative methods")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--sampling", default="greedy,filtered", help=f"among {', '.join(SAMPLINGS)}")
    ap.add_argument("--context", type=int, default=512, help="prompt length (about) and profile context")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mode", default="default", help="inductor mode for captured steps")
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda-graph", "compile"),
                    help="the compiled path checked against eager (auto: CUDA graphs on a GPU)")
    ap.add_argument("--compiler", default=None,
                    help="torch.compile backend under it (default fastspec's; aot_eager for a quick dry run; none: capture the eager kernels)")
    ap.add_argument("--check-dtype", default="float32", help="dtype of the round checks")
    ap.add_argument("--dtype", default="auto", help="dtype of the profile (auto: bf16 on a GPU)")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max relative K/V error (default 1e-3 in float32, 3e-2 otherwise)")
    ap.add_argument("--min-identical", type=float, default=1.0,
                    help="share of requests that must decode identically")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    methods = [m for m in a.methods.split(",") if m]
    blocks = [int(x) for x in a.blocks.split(",")]
    levels = [int(x) for x in a.concurrency.split(",")]
    samplings = [s for s in a.sampling.split(",") if s]
    check_dtype, dtype = resolve_dtype(a.check_dtype, a.device), resolve_dtype(a.dtype, a.device)
    tolerance = a.tolerance if a.tolerance is not None else (1e-3 if check_dtype == torch.float32 else 3e-2)
    runner_mod.CUDA_GRAPH_MODE = a.mode

    t0 = time.perf_counter()
    shape = a.shape or ("tiny" if a.tiny else "nld-8b")
    model = random_model(SHAPES[shape], a.device, check_dtype)
    name = "tiny-ministral3-random" if shape == "tiny" else f"{shape}-shaped-random"
    loaded = SimpleNamespace(model=model, cfg=model.cfg, name=name, tokenizer=None, path=None)
    print(f"built {name} on {a.device} in {time.perf_counter() - t0:.1f} s", flush=True)

    checks, ok = [], True
    for method in methods:
        for block in ([None] if method == "ar" else blocks):
            for c in levels:
                prompts = random_prompts(c, a.context, model.cfg.vocab_size, seed=c)
                for mode in samplings:
                    params = SamplingParams(max_new_tokens=a.new_tokens, **SAMPLINGS[mode])
                    try:
                        r = check_rounds(loaded, method, block, prompts, params, a.backend, a.compiler)
                    except Exception as e:      # one broken step must not hide the others' results
                        import traceback
                        traceback.print_exc()
                        r = {"identical": 0.0, "kv_err": float("inf"), "steps": 0, "keys": [],
                             "error": f"{type(e).__name__}: {e}"[:500]}
                    good = r["identical"] >= a.min_identical and r["kv_err"] <= tolerance and r["steps"] > 0
                    ok &= good
                    checks.append({"method": method, "block": block, "concurrency": c, "sampling": mode,
                                   **r, "ok": good})
                    print(f"{method:<6} B={block or 1:>3} C={c:>3} {mode:<8} steps vs eager: "
                          f"identical {r['identical']:.0%}, K/V err {r['kv_err']:.1e}, "
                          f"{r['steps']} steps built {'ok' if good else 'MISMATCH'}", flush=True)
                    if r.get("step_ms"):
                        print("    step ms " + ", ".join(f"{k} {v:.3f}" for k, v in r["step_ms"].items()),
                              flush=True)
    summary = (f"round steps {'match' if ok else 'DO NOT match'} eager "
               f"({sum(c['ok'] for c in checks)}/{len(checks)} checks)")
    if a.no_profile:
        if a.out:
            import json
            with open(a.out, "w") as f:
                json.dump({"checks": checks, "ok": ok, "model": name, "backend": a.backend,
                           "compiler": a.compiler, "torch": torch.__version__,
                           "device": prof.device_name(a.device)}, f, indent=1)
        print(summary)
        return 0 if ok else 1

    model.to(dtype)
    p_blocks = [int(x) for x in (a.profile_blocks or a.blocks).split(",")]
    p_levels = [int(x) for x in (a.profile_concurrency or a.concurrency).split(",")]
    profile = prof.run_profile(loaded, batches=p_levels, blocks=p_blocks, layouts=("chain", "draft"),
                               contexts=(a.context,), backend=a.backend, reps=a.reps,
                               bandwidth_mib=4096 if a.device.startswith("cuda") else 64,
                               compiler=a.compiler,
                               on_point=lambda p: print(f"  built {p['batch']}×{p['block']} {p['layout']} "
                                                        f"({p['compile_s']:.1f} s)", flush=True))
    for p in profile.points:                   # timed in turns after every shape was built
        print(f"  {p['batch']:>3}×{p['block']:<3} {p['layout']:<5} {p['ms']:.3f} ms", flush=True)
    profile.meta.update(check={"ok": ok, "dtype": str(check_dtype).replace("torch.", ""),
                               "tolerance": tolerance, "min_identical": a.min_identical,
                               "mode": a.mode, "compiler": a.compiler, "rounds": checks},
                        wall_s=time.perf_counter() - t0)
    out = a.out or prof.default_path(prof.device_name(a.device), name)
    profile.save(out)
    print(f"wrote {out}; {summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
