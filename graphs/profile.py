"""Forward-cost profiles: measured step times over batch × block × layout × context, plus a roofline.

    prof = run_profile(loaded, batches=[1, 4], blocks=[1, 8, 16], contexts=[256])
    prof.save("profiles/cpu-amd-epyc-smollm2-135m.json")
    Profile.load(path).cost_ms(batch=4, block=8, layout="chain", ctx=256)

One point is one forward of `block` new tokens in each of `batch` rows after `ctx` committed tokens
(the attention spans ctx + block cache columns), through the engine's StepRunner (`runner_forward`):
  chain  causal among the new tokens, adapter off (a verify / AR forward);
  draft  block-bidirectional (draft_block_mask: the seed causal, masks see the whole block),
         adapter on for every token but the seed (a LinearSS draft forward).
The layout does not change the FLOP or byte count; both are measured because kernels may differ.

`cost_ms` returns the measured time when the point was measured, else the roofline
(graphs/roofline.py) fitted to all measured points against a nominal peak (an fp32 GEMM
microbenchmark) and bandwidth (a sum over a large tensor).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from fastspec.config import FastspecError, ModelConfig
from fastspec.files import write_json
from fastspec.graphs.roofline import Roofline, fit_roofline, forward_bytes, forward_flops
from fastspec.layout import block_placement, causal_block

LAYOUTS = ("chain", "draft")
FORMAT = 1


# --- microbenchmarks ----------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device="cpu", n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an fp32 n×n×n GEMM, best of `reps` (the nominal compute peak)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def measure_bandwidth(device="cpu", mib: int = 1024, reps: int = 5) -> float:
    """Read bytes/s over a `mib` MiB fp32 tensor (default 1 GiB): the best of `reps` runs of two
    streaming reductions (sum, max). The floor must use the best read rate the machine shows,
    else the "% of floor" flatters the engine."""
    device = torch.device(device)
    x = torch.ones(mib * 1024 * 1024 // 4, device=device)
    best = math.inf
    for reduce in (torch.sum, torch.amax):
        reduce(x)
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            reduce(x)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
    nbytes = x.numel() * 4
    del x
    return nbytes / best


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on a GPU, the process's max RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux: KiB


# --- names ------------------------------------------------------------------------------------
def device_name(device="cpu") -> str:
    """A readable device string: the GPU's name, or the CPU model and torch's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu {cpu} ({torch.get_num_threads()} threads)"


def ran_backend(runner, device) -> str:
    """The backend a StepRunner actually runs steps with on `device`: `auto` resolved, and a
    cuda-graph runner fed CPU tensors falls back to compile (StepRunner._kind_for)."""
    kind = runner.resolved
    return "compile" if kind == "cuda-graph" and torch.device(device).type != "cuda" else kind


def run_environment(device, dtype, backend: str, weights: str = "fp32", model=None) -> dict:
    """What bench, speed and profile record about where they ran: the device's name (GPU model,
    or CPU model and threads), the dtype (activations), the backend(s) that ran (a comma list),
    torch and the host; the CPU's widest kernel ISA (`isa`: avx512 / avx2 / neon, else torch's
    capability), the skinny-GEMM path compiled CPU steps take (`kernel`: skinny-avx512 /
    skinny-avx2 / skinny-neon / fallback — also fallback for non-fp32 activations, which the kernel
    does not take; "none" when no compiled CPU step runs: eager, or a GPU), its software-prefetch
    policy (`prefetch`: kernels.prefetch_summary, measured on `model`'s shapes on first use; None
    without the kernel), the weight precision
    (`weights`: fp32 / bf16 / int8, fastspec/weights.py) and torch's threads."""
    from fastspec.graphs import kernels
    isas = kernels.cpu_isas()
    compiled_cpu = torch.device(device).type == "cpu" and "compile" in str(backend).split(",")
    kernel, prefetch = "none", None
    if compiled_cpu:
        kernel = kernels.kernel_path() if dtype in (torch.float32, "float32") else "fallback"
        if kernel.startswith("skinny-"):
            kernels.tune_prefetch(kernels.active(), weights, kernels.model_gemms(model)[1])
            prefetch = kernels.prefetch_summary(weights)
    return {"device": device_name(device), "dtype": str(dtype).replace("torch.", ""),
            "backend": backend, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "isa": isas[0] if isas else torch.backends.cpu.get_cpu_capability().lower(),
            "kernel": kernel, "prefetch": prefetch, "weights": weights}


def slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|\bcpu @.*|\bprocessor\b", "", text.lower())
    text = re.sub(r"\(\d+ threads\)", "", text)
    return re.sub(r"[^a-z0-9.]+", "-", text).strip("-") or "device"


def default_path(device: str, model: str, kernel: str | None = None, weights: str = "fp32") -> str:
    """profiles/<device>-<model>[-<kernel>][-<weights>].json: one CPU model name covers machines
    with different kernels (an AMD EPYC is Zen 3 with AVX2 or Zen 4 with AVX-512), and the weight
    precision changes the cost's shape (Zen 4, 2 cores: T(8)/T(1) 1.18 at fp32, 1.84 at int8,
    where 8 rows are compute-bound), so a profile names both; the planners look it up by the same
    name (ForwardCost.for_model). No kernel (a GPU) and fp32 weights add nothing."""
    name = f"{slug(device)}-{slug(os.path.basename(model.rstrip('/')))}"
    if kernel and kernel not in ("none", ""):
        name += f"-{slug(kernel)}"
    if weights != "fp32":
        name += f"-{weights}"
    return os.path.join("profiles", name + ".json")


# --- the profile ------------------------------------------------------------------------------
def _config_dict(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["eos_token_ids"] = list(d["eos_token_ids"])
    return d


def _config_from(d: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    d = {k: v for k, v in d.items() if k in names}
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return ModelConfig(**d)


@dataclass
class Profile:
    device: str
    model: str
    dtype: str
    torch: str
    backend: str
    config: dict                        # the ModelConfig fields: FLOPs and bytes for the roofline
    points: list[dict]                  # {batch, block, layout, ctx, ms, ms_min, compile_s, peak_mem_mb}
    roofline: dict | None               # Roofline.to_dict(), None when too few points to fit
    peak_flops: float                   # nominal FLOP/s (fp32 GEMM microbenchmark)
    bandwidth: float                    # nominal bytes/s (sum over a large tensor)
    bytes_per_param: int = 4
    meta: dict = field(default_factory=dict)
    format: int = FORMAT

    # --- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str) -> str:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FastspecError(f"no profile at {path}: run `fastspec profile` first") from None
        except (OSError, ValueError) as e:
            raise FastspecError(f"cannot read profile {path}: {e}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"device", "model", "points", "config", "peak_flops", "bandwidth"} - set(raw)
        if not isinstance(raw, dict) or missing:
            raise FastspecError(f"{path} is not a fastspec profile (missing {sorted(missing)})")
        raw.setdefault("dtype", "float32")
        raw.setdefault("torch", "?")
        raw.setdefault("backend", "?")
        raw.setdefault("roofline", None)
        return cls(**{k: v for k, v in raw.items() if k in names})

    # --- queries -----------------------------------------------------------------------------
    @property
    def cfg(self) -> ModelConfig:
        return _config_from(self.config)

    def fit(self) -> Roofline | None:
        return None if self.roofline is None else Roofline(**self.roofline)

    def measured(self, batch: int, block: int, layout: str, ctx: int) -> dict | None:
        for p in self.points:
            if (p["batch"], p["block"], p["layout"], p["ctx"]) == (batch, block, layout, ctx):
                return p
        return None

    def predict_ms(self, batch: int, block: int, ctx: int) -> float:
        """The fitted roofline's forward time (any layout: the FLOPs and bytes are the same)."""
        fit = self.fit()
        if fit is None:
            raise FastspecError("this profile has no roofline fit (too few measured points)")
        cfg = self.cfg
        t = fit.predict(forward_flops(cfg, batch, block, ctx),
                        forward_bytes(cfg, batch, block, ctx, self.bytes_per_param))
        return float(t) * 1e3

    def cost_ms(self, batch: int, block: int, layout: str, ctx: int) -> float:
        """Measured ms of one forward when this point was profiled, else the roofline prediction."""
        p = self.measured(batch, block, layout, ctx)
        return float(p["ms"]) if p is not None else self.predict_ms(batch, block, ctx)

    def fit_error(self) -> float | None:
        """Root-mean-square relative error of the fit over the measured points."""
        if self.roofline is None or not self.points:
            return None
        errs = [(self.predict_ms(p["batch"], p["block"], p["ctx"]) - p["ms"]) / p["ms"]
                for p in self.points]
        return float(np.sqrt(np.mean(np.square(errs))))


def fit_points(cfg: ModelConfig, points: list[dict], peak_flops: float, bandwidth: float,
               bytes_per_param: int = 4) -> Roofline | None:
    """The roofline through the measured points (None with fewer than 2 distinct shapes)."""
    if len({(p["batch"], p["block"], p["ctx"]) for p in points}) < 2:
        return None
    f = [forward_flops(cfg, p["batch"], p["block"], p["ctx"]) for p in points]
    m = [forward_bytes(cfg, p["batch"], p["block"], p["ctx"], bytes_per_param) for p in points]
    s = [p["ms"] / 1e3 for p in points]
    return fit_roofline(f, m, s, peak_flops, bandwidth)


# --- measuring ------------------------------------------------------------------------------
def _draft_mask(n: int, device) -> torch.Tensor:
    from fastspec.convention import FASTSPEC, draft_block_mask
    return draft_block_mask(FASTSPEC, torch.tensor([n], device=device), n)[0]


def forward_inputs(cfg: ModelConfig, batch: int, block: int, layout: str, ctx: int,
                   device, dtype, mask_token_id: int | None = None, seed: int = 0) -> tuple:
    """Inputs of LlamaModel.forward for one profile point (a fresh cache of ctx + block columns)."""
    if layout not in LAYOUTS:
        raise FastspecError(f"unknown layout {layout!r} (choose {', '.join(LAYOUTS)})")
    g = torch.Generator().manual_seed(seed)
    width = ctx + block
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, width, cfg.head_dim)
    k = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, block), generator=g).to(device)
    lengths = torch.full((batch,), ctx, device=device)
    block_mask = causal_block(block, device) if layout == "chain" else _draft_mask(block, device)
    cols, mask, slots = block_placement(lengths, block, block_mask, width)      # as the engine lays them out
    adapter_on = None
    if layout != "chain":
        adapter_on = (torch.arange(block, device=device) > 0)[None, :].expand(batch, block).contiguous()
        if mask_token_id is not None:
            ids[:, 1:] = mask_token_id
    return ids, cols, k, v, cols, mask, slots, adapter_on


def runner_forward(model, backend: str = "auto", compiler=None) -> Callable:
    """Forwards through the engine's own StepRunner, one key per (batch, block, layout), so the
    profile times exactly what the engine runs. compiler: the torch.compile backend under
    compile / cuda-graph (None: fastspec's; tests pass "aot_eager"). `fwd.runner` is the runner."""
    from fastspec.graphs.keys import GraphKey
    from fastspec.graphs.runner import StepRunner
    runner = StepRunner(backend, model=model, compiler=compiler)

    def fwd(ids, pos, k, v, cols, mask, slots, adapter_on):
        key = GraphKey(ids.shape[0], ids.shape[1], "chain" if adapter_on is None else "draft")
        return runner.run(key, model.forward, ids, pos, k, v, cols, mask, slots, adapter_on,
                          static=(2, 3))
    fwd.runner = runner
    return fwd


def forward_samples(fwd: Callable, inputs: tuple, device: torch.device, reps: int) -> list[float]:
    """ms of each of `reps` timed calls of an already compiled forward."""
    times = []
    with torch.no_grad():
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            fwd(*inputs)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_in_turns(fwd: Callable, shapes: list[tuple], device: torch.device, reps: int, passes: int,
                  after_pass: Callable[[int, list[list[float]]], None] | None = None) -> list[list[float]]:
    """ms of every call of each of `shapes` (forward inputs, every one already compiled): `passes`
    rounds in which each shape in turn makes `reps` timed calls. Timed one after another, a shape
    measured right after its own compilation ran up to 25% slow on a 2-core VM (Zen 4, int8:
    T(16) 41 ms alone, 31-32 ms in turns); taking turns spreads the machine's drift over all
    shapes alike. after_pass(k, samples) runs after round k (1-based)."""
    samples: list[list[float]] = [[] for _ in shapes]
    for k in range(passes):
        for got, inputs in zip(samples, shapes):
            got += forward_samples(fwd, inputs, device, reps)
        if after_pass is not None:
            after_pass(k + 1, samples)
    return samples


def turn_stats(samples: list[float]) -> dict:
    """A point's timing from its calls in turns: ms = the median, ms_min the fastest."""
    return {"ms": statistics.median(samples), "ms_min": min(samples), "samples": len(samples)}


def time_forward(fwd: Callable, inputs: tuple, device: torch.device, reps: int) -> tuple[float, float, float]:
    """(first-call seconds, median ms, min ms) of `reps` further calls after one warm-up call.
    `measure_point` builds a shape with it; `fastspec profile` and `fastspec speed` (reps=1 there)
    then time every shape with `time_in_turns`."""
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        fwd(*inputs)
        _sync(device)
        first = time.perf_counter() - t0
        fwd(*inputs)
    times = forward_samples(fwd, inputs, device, reps)
    return first, statistics.median(times), min(times)


def measure_point(fwd: Callable, model, batch: int, block: int, layout: str, ctx: int,
                  reps: int) -> tuple[dict, tuple]:
    """One profile point (and its inputs): a forward of `block` new tokens in `batch` rows after
    `ctx` committed tokens, timed with `time_forward`."""
    p = next(model.parameters())
    device = p.device
    inputs = forward_inputs(model.cfg, batch, block, layout, ctx, device, p.dtype, model.mask_token_id)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, ms, ms_min = time_forward(fwd, inputs, device, reps)
    point = {"batch": batch, "block": block, "layout": layout, "ctx": ctx, "ms": ms, "ms_min": ms_min,
             "compile_s": max(first - ms / 1e3, 0.0), "peak_mem_mb": peak_memory_mb(device)}
    return point, inputs


def check_grid(model, batches, blocks, layouts, contexts, backend: str, reps: int,
               passes: int = 1) -> None:
    """One-line errors for a profile grid the model cannot run, before anything is measured."""
    from fastspec.graphs.runner import BACKENDS
    if backend not in BACKENDS:
        raise FastspecError(f"unknown backend {backend!r} (choose {', '.join(BACKENDS)})")
    for name, vals in (("batch", batches), ("block", blocks), ("context", contexts)):
        if not vals or any(int(v) < 1 for v in vals):
            raise FastspecError(f"--{name} takes positive integers, got {vals}")
    if reps < 1:
        raise FastspecError(f"--reps must be >= 1, got {reps}")
    if passes < 1:
        raise FastspecError(f"--passes must be >= 1, got {passes}")
    bad = [l for l in layouts if l not in LAYOUTS]
    if bad or not layouts:
        raise FastspecError(f"unknown layout {', '.join(bad) or '(none)'} (choose {', '.join(LAYOUTS)})")
    limit = model.rope_cos.shape[0]
    if max(contexts) + max(blocks) > limit:
        raise FastspecError(f"--context {max(contexts)} plus {max(blocks)} new tokens exceeds the "
                            f"model's {limit} positions")


def ensure_adapter(model) -> str:
    """A draft layout needs an adapter: attach a fresh one (LoRA B = 0, same FLOPs as a trained
    one) to a model without; says which it timed."""
    from fastspec.draft import AdapterConfig, attach_adapter, has_adapter
    if has_adapter(model):
        return "loaded"
    ref = next(model.parameters())
    attach_adapter(model, AdapterConfig())
    model.to(ref.device, ref.dtype).requires_grad_(False)
    return "fresh (LoRA B = 0; timing only)"


def run_profile(loaded, batches: Iterable[int] = (1, 4), blocks: Iterable[int] = (1, 4, 8, 16, 32),
                layouts: Iterable[str] = LAYOUTS, contexts: Iterable[int] = (256,),
                backend: str = "auto", reps: int = 10, passes: int = 3, bandwidth_mib: int = 1024,
                gemm_n: int = 1024, trace: str | None = None,
                on_point: Callable[[dict], None] | None = None,
                on_pass: Callable[[int, int], None] | None = None,
                checkpoint: str | None = None, compiler=None,
                environment: dict | None = None) -> Profile:
    """Measure every (batch, block, layout, ctx) point and fit the roofline.

    Every shape is compiled first (on_point(point) after each, its `ms` from one call); then the
    shapes take turns, `passes` rounds of `reps` timed calls each (on_pass(k, passes) after round
    k), and a point's `ms` is the median of all its calls, `ms_min` the fastest, `samples` their
    number.

    loaded: a LoadedModel. backend: a StepRunner backend (auto | cuda-graph | compile | eager);
    the profile records the one that ran. A draft layout on a model without a draft adapter
    attaches a fresh one (same FLOPs as a trained one).
    trace: write a torch.profiler Chrome trace of one forward per shape to this file.
    checkpoint: save the profile measured so far to this path after every compiled point and
    every round (an interrupted run keeps its points, timed as far as it got).
    environment: `run_environment`'s record of what ran, kept as meta["environment"].
    """
    batches, blocks, layouts, contexts = (sorted(set(x)) for x in (batches, blocks, layouts, contexts))
    model, cfg = loaded.model, loaded.cfg
    check_grid(model, batches, blocks, layouts, contexts, backend, reps, passes)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    meta = {"threads": torch.get_num_threads(), "reps": reps, "passes": passes,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if environment is not None:            # in every checkpoint too, not only the final save
        meta["environment"] = environment
    if "draft" in layouts:
        meta["adapter"] = ensure_adapter(model)
    peak = measure_peak_flops(device, n=gemm_n)
    bw = measure_bandwidth(device, mib=bandwidth_mib)
    meta["microbench"] = {"gemm_n": gemm_n, "bandwidth_mib": bandwidth_mib}
    fwd = runner_forward(model, backend, compiler)
    ran = ran_backend(fwd.runner, device)
    # Bytes a step streams per weight: the big linears' precision (fastspec/weights.py) on the
    # CPU kernel, else the parameters' dtype.
    from fastspec.weights import BYTES, weight_precision
    bpp = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    if kernel_ran(environment or {}):
        bpp = BYTES[weight_precision(model)]
    points, shapes = [], []

    def assemble() -> Profile:
        fit = fit_points(cfg, points, peak, bw, bpp)
        return Profile(device=device_name(device), model=loaded.name,
                       dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
                       backend=ran, config=_config_dict(cfg), points=list(points),
                       roofline=None if fit is None else fit.to_dict(), peak_flops=peak,
                       bandwidth=bw, bytes_per_param=bpp, meta=meta)

    for ctx in contexts:
        for batch in batches:
            for block in blocks:
                for layout in layouts:
                    p, inputs = measure_point(fwd, model, batch, block, layout, ctx, reps=1)
                    p["samples"] = 1
                    points.append(p)
                    shapes.append((p, inputs))
                    if on_point is not None:
                        on_point(p)
                    if checkpoint:
                        assemble().save(checkpoint)

    def after_pass(k: int, samples: list[list[float]]) -> None:
        for p, got in zip(points, samples):
            p.update(turn_stats(got))
        if checkpoint:
            assemble().save(checkpoint)
        if on_pass is not None:
            on_pass(k, passes)
    time_in_turns(fwd, [inputs for _, inputs in shapes], device, reps, passes, after_pass)
    if trace:
        write_trace(fwd, shapes, device, trace)
    return assemble()


def write_trace(fwd: Callable, shapes: list[tuple[dict, tuple]], device: torch.device, path: str) -> str:
    """A torch.profiler Chrome trace holding one (already compiled) forward per shape."""
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with profile(activities=acts) as prof, torch.no_grad():
        for p, inputs in shapes:
            with record_function(f"B{p['batch']}xN{p['block']} {p['layout']} ctx{p['ctx']}"):
                fwd(*inputs)
                _sync(device)
    prof.export_chrome_trace(path)
    return path


# --- reporting --------------------------------------------------------------------------------
def _axes(points: list[dict]) -> tuple[list, list, list, list]:
    return tuple(sorted({p[k] for p in points}) for k in ("batch", "block", "layout", "ctx"))


def render_table(prof: Profile):
    """A rich Table: rows batch × layout (× ctx), columns block; cells ms and T(N)/T(N_min)."""
    from rich.table import Table
    batches, blocks, layouts, ctxs = _axes(prof.points)
    base = blocks[0] if blocks else 1
    table = Table(title=f"one forward, ms (T(N)/T({base})) — {prof.model} on {prof.device}, "
                        f"{prof.backend}, {prof.dtype}")
    table.add_column("batch", justify="right")
    table.add_column("layout")
    if len(ctxs) > 1:
        table.add_column("ctx", justify="right")
    for n in blocks:
        table.add_column(f"N={n}", justify="right")
    for ctx in ctxs:
        for b in batches:
            for lay in layouts:
                ref = prof.measured(b, base, lay, ctx)
                cells = []
                for n in blocks:
                    p = prof.measured(b, n, lay, ctx)
                    if p is None:
                        cells.append("—")
                    elif ref is None:
                        cells.append(f"{p['ms']:.2f}")
                    else:
                        cells.append(f"{p['ms']:.2f} ({p['ms'] / ref['ms']:.2f}×)")
                table.add_row(str(b), lay, *([str(ctx)] if len(ctxs) > 1 else []), *cells)
    return table


def fit_summary(prof: Profile) -> str:
    lines = [f"nominal peak {prof.peak_flops / 1e9:.1f} GFLOP/s (fp32 GEMM), "
             f"bandwidth {prof.bandwidth / 1e9:.1f} GB/s"]
    fit = prof.fit()
    if fit is None:
        lines.append("roofline: too few shapes to fit")
    else:
        lines.append(f"roofline: T = max({fit.alpha_c:.2f}·FLOPs/peak + {fit.beta_c * 1e3:.2f} ms, "
                     f"{fit.alpha_m:.2f}·bytes/BW + {fit.beta_m * 1e3:.2f} ms), "
                     f"rms rel. error {prof.fit_error():.1%}")
    comp = [p["compile_s"] for p in prof.points]
    if comp:
        lines.append(f"compile: {sum(comp):.1f} s total, {max(comp):.1f} s max per shape; "
                     f"peak memory {max(p['peak_mem_mb'] for p in prof.points):.0f} MiB")
    return "\n".join(lines)


def write_heatmap(prof: Profile, path: str) -> str:
    """PNG heatmap per (layout, ctx): rows batch, columns block, colour = ms per token."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches, blocks, layouts, ctxs = _axes(prof.points)
    panels = [(lay, ctx) for ctx in ctxs for lay in layouts]
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 1.1 * len(blocks) * len(panels) + 1,
                                                      1.2 + 0.7 * len(batches)), squeeze=False)
    for ax, (lay, ctx) in zip(axes[0], panels):
        grid = np.full((len(batches), len(blocks)), np.nan)
        for i, b in enumerate(batches):
            for j, n in enumerate(blocks):
                p = prof.measured(b, n, lay, ctx)
                if p is not None:
                    grid[i, j] = p["ms"] / (b * n)
        im = ax.imshow(grid, cmap="viridis_r", aspect="auto", origin="lower")
        for i in range(len(batches)):
            for j in range(len(blocks)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2g}", ha="center", va="center", fontsize=8,
                            color="white" if grid[i, j] > np.nanmean(grid) else "black")
        ax.set_xticks(range(len(blocks)), [str(n) for n in blocks])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("block (tokens per row)")
        ax.set_ylabel("batch")
        ax.set_title(f"{lay}, ctx {ctx}", fontsize=9)
        fig.colorbar(im, ax=ax, label="ms per token")
    fig.suptitle(f"{prof.model} — {prof.device}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the cost model the schedulers read -------------------------------------------------------
def kernel_ran(env: dict) -> str | None:
    """The skinny-GEMM path a run's compiled CPU steps took (run_environment's record), or None:
    eager steps, a GPU, or inductor's fallback GEMMs."""
    kernel = env.get("kernel") or ""
    return kernel if kernel.startswith("skinny-") and env.get("backend") == "compile" else None


def _matches(prof: "Profile", kernel: str | None, weights: str) -> bool:
    """An unqualified profile serves a run when what it records (meta["environment"]: kernel,
    weights) is what runs; one that records nothing was measured at fp32 weights."""
    env = prof.meta.get("environment") or {}
    if env.get("weights", "fp32") != weights:
        return False
    return kernel is None or "kernel" not in env or kernel_ran(env) == kernel


def _other_cpu(prof: "Profile") -> str:
    """A note when the profile was measured on a CPU of another ISA than this one: one CPU name
    covers Zen 3 (AVX2) and Zen 4 (AVX-512), so a native AVX2 "AMD EPYC" finds the skinny-avx2
    profile measured on a Zen 4 with the kernel forced narrower ("" when the ISAs agree or the
    profile does not record one; a GPU profile records none)."""
    from fastspec.graphs import kernels
    env = prof.meta.get("environment") or {}
    isas = kernels.cpu_isas()
    if not env.get("isa") or not isas or env["isa"] == isas[0]:
        return ""
    return (f"measured on a CPU with {env['isa']}, this one has {isas[0]}: the shape is close, "
            f"the ms are another machine's (`fastspec profile` measures this one)")


class ForwardCost:
    """T(rows, tokens): ms of one forward of `rows` rows × `tokens` new tokens at a typical
    context, as the planners of LibraSpec, BASTION and RecGuide read it.

    From the device's profile when one exists (`fastspec profile`; the repo's shipped profiles/
    are found from any cwd), else the roofline with nominal constants for this model's shape
    (source "default": the right shape of the curve, not this machine's numbers).
    `path`: the profile file read, if any (a run's environment names it)."""

    def __init__(self, cfg: ModelConfig, profile: "Profile | None" = None, ctx: int = 512,
                 path: str | None = None, bytes_per_param: int = 4):
        self.cfg, self.profile, self.ctx, self.path = cfg, profile, ctx, path
        self.source = "profile" if profile is not None and profile.roofline is not None else "default"
        self.bytes_per_param = bytes_per_param
        self.note = ""                  # set when the profile is another kernel's or precision's
        self._memo: dict[tuple[int, int], float] = {}

    @classmethod
    def for_model(cls, cfg: ModelConfig, device: str, model_name: str, kernel: str | None = None,
                  weights: str = "fp32") -> "ForwardCost":
        """The profile of this device, kernel path and weight precision: the file
        `fastspec profile` writes for them, else the device's unqualified profile when it does
        not record another kernel or precision (profiles written before names carried them were
        all fp32). Else, approximately, this device's profile of another kernel or precision (its
        shape is off: Zen 4's T(8)/T(1) is 1.18 at fp32 and 1.84 at int8; `describe` says so; the
        same kernel's fp32 profile first), else the nominal roofline.
        """
        from fastspec.weights import BYTES
        dev = device_name(device)
        own = os.path.basename(default_path(dev, model_name, kernel, weights))
        legacy = os.path.basename(default_path(dev, model_name))
        shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles")
        same_kernel = os.path.basename(default_path(dev, model_name, kernel))
        found: list[tuple[str, str, Profile]] = []
        for name in dict.fromkeys((own, legacy, same_kernel)):
            for path in (os.path.join("profiles", name), os.path.join(shipped, name)):
                if os.path.isfile(path):
                    try:
                        found.append((name, path, Profile.load(path)))
                    except FastspecError:
                        continue
        for name, path, prof in found:
            if name == own or (name == legacy and _matches(prof, kernel, weights)):
                cost = cls(cfg, prof, path=path)
                cost.note = _other_cpu(prof)
                return cost
        if found:
            name, path, prof = min(found, key=lambda f: f[0] != same_kernel)
            env = prof.meta.get("environment") or {}
            ran = kernel_ran(env) if "kernel" in env else None
            cost = cls(cfg, prof, path=path)
            cost.note = "; ".join(filter(None, (
                f"measured at {env.get('weights', 'fp32')} weights{f' with {ran}' if ran else ''}; "
                f"this run: {weights}{f' with {kernel}' if kernel else ''} "
                f"(`fastspec profile --weights {weights}` measures its own)", _other_cpu(prof))))
            return cost
        return cls(cfg, bytes_per_param=BYTES.get(weights, 4))

    def describe(self) -> str:
        """What the planners' T(rows, tokens) comes from, in a few words."""
        if not self.path:
            return "nominal roofline (no profile for this machine)"
        return f"profile {self.path}" + (f" ({self.note})" if self.note else "")

    def __call__(self, rows: int, tokens: int) -> float:
        key = (rows, tokens)
        if key not in self._memo:
            if self.source == "profile":
                ms = self.profile.predict_ms(rows, tokens, self.ctx)
            else:
                # Nominal 2-core CPU: 50 GFLOP/s, 20 GB/s, 1 ms fixed cost per forward.
                ms = 1e3 * max(forward_flops(self.cfg, rows, tokens, self.ctx) / 50e9,
                               forward_bytes(self.cfg, rows, tokens, self.ctx, self.bytes_per_param) / 20e9) + 1.0
            self._memo[key] = float(ms)
        return self._memo[key]
