"""The GPU check: NLD-8B-shaped random weights, captured graphs vs eager, and a saved profile.

    python -m fastspec.graphs.gpu_check                       # on the H200: profiles/<device>-nld-8b-shaped.json
    python -m fastspec.graphs.gpu_check --tiny --device cpu   # the same code path on a tiny model (dry run)

Installs nothing and downloads nothing. For every block size B and concurrency C it builds the
forward inputs the engine would (a context of `--context` committed tokens, chain and draft
layouts), checks that the step through the StepRunner (CUDA graphs on a GPU) gives the eager
logits and K/V, then times it with `fastspec profile`'s code and fits the roofline. Results go to
one profile JSON; a mismatch exits non-zero. `--mode max-autotune-no-cudagraphs` autotunes every
GEMM shape (the design's mode; minutes per shape), `default` fits the 10-minute GPU budget.
"""
from __future__ import annotations

import argparse
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
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
            architecture="Ministral3ForCausalLM")


def random_model(shape: dict, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """Random weights made on the device itself (an 8B model never passes through host memory)."""
    cfg = ModelConfig(**shape)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=cfg.max_position_embeddings)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        # Buffers came from the meta device empty: rebuild the RoPE tables on the device.
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model.to(dtype).eval().requires_grad_(False)


def check_point(model, fwd, batch: int, block: int, layout: str, ctx: int) -> float:
    """Max |graph − eager| over logits and the written K/V, relative to the logits' scale."""
    cfg = model.cfg
    p = next(model.parameters())
    inputs = prof.forward_inputs(cfg, batch, block, layout, ctx, p.device, p.dtype, model.mask_token_id)
    ids, pos, k, v, cols, mask, slots, on = inputs
    k_ref, v_ref = k.clone(), v.clone()
    with torch.no_grad():
        ref = model(ids, pos, k_ref, v_ref, cols, mask, slots, on)
        out = fwd(ids, pos, k, v, cols, mask, slots, on)[0]
        out = fwd(ids, pos, k, v, cols, mask, slots, on)[0]         # a replay, not the capture run
    scale = ref.abs().max().clamp_min(1e-6)
    return max(((out - ref).abs().max() / scale).item(),
               ((k - k_ref).abs().max() / k_ref.abs().max().clamp_min(1e-6)).item())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (dry run of the code path)")
    ap.add_argument("--blocks", default="8,16,32")
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mode", default="default", help="inductor mode for captured steps")
    ap.add_argument("--backend", default="compile", choices=("compile", "eager"),
                    help="compile: CUDA graphs on a GPU (torch.compile on CPU); eager: the reference")
    ap.add_argument("--tolerance", type=float, default=2e-2, help="relative, bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    blocks = [int(x) for x in a.blocks.split(",")]
    levels = [int(x) for x in a.concurrency.split(",")]
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = random_model(TINY if a.tiny else NLD_8B, a.device, dtype)
    from fastspec.draft import AdapterConfig, attach_adapter
    attach_adapter(model, AdapterConfig(rank=32, alpha=64.0, mask_token_id=100))
    model.to(dtype).requires_grad_(False)
    name = "tiny-ministral3-random" if a.tiny else "nld-8b-shaped-random"
    print(f"built {name} on {a.device} in {time.perf_counter() - t0:.1f} s", flush=True)
    runner_mod.CUDA_GRAPH_MODE = a.mode
    fwd = prof.runner_forward(model, a.backend)
    worst = 0.0
    for block in blocks:
        for c in levels:
            for layout in ("chain", "draft"):
                err = check_point(model, fwd, c, block, layout, a.context)
                worst = max(worst, err)
                print(f"B={block:>3} C={c:>3} {layout:<5} graph vs eager: {err:.2e}", flush=True)
    loaded = SimpleNamespace(model=model, cfg=model.cfg, name=name)
    profile = prof.run_profile(loaded, batches=levels, blocks=blocks, layouts=("chain", "draft"),
                               contexts=(a.context,), backend=a.backend, reps=a.reps,
                               bandwidth_mib=4096 if a.device.startswith("cuda") else 64,
                               on_point=lambda p: print(f"  {p['batch']:>3}×{p['block']:<3} "
                                                        f"{p['layout']:<5} {p['ms']:.3f} ms", flush=True))
    profile.meta.update(check={"max_rel_err": worst, "tolerance": a.tolerance, "mode": a.mode},
                        wall_s=time.perf_counter() - t0)
    out = a.out or prof.default_path(prof.device_name(a.device), name)
    profile.save(out)
    print(f"wrote {out}; worst graph-vs-eager error {worst:.2e} (tolerance {a.tolerance})")
    return 0 if worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
