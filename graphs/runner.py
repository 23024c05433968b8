"""StepRunner: run one static-shaped step per GraphKey through eager, torch.compile or CUDA graphs.

    runner = StepRunner("auto", model=model)            # cuda-graph on CUDA, compile on CPU
    logits, = runner.run(GraphKey(4, 16, "chain"), step, ids, pos, k, v, cols, mask, slots,
                         static=(2, 3))                 # k, v: the KV cache, used in place

`fn(*inputs)` must return a tensor or a tuple of tensors; `run` always returns a tuple. One key is
one static shape: pass the same `fn` for a key every time (a bound method or a function made once).

Backends
  eager       fn(*inputs) under no_grad.
  compile     one `torch.compile(fn, dynamic=False, fullgraph=False)` per key, made on first use.
              The compiler is fastspec's (graphs/compile.py: packed skinny GEMMs at the model's
              weight precision when `model` is given and a kernel for this CPU builds —
              AVX-512, AVX2 or NEON, graphs/kernels.py —, in-place KV writes, inductor) unless
              `compiler` names another torch.compile backend ("inductor", "aot_eager", a callable),
              or "none": no compilation (fn as written; with cuda-graph, a graph of its eager
              kernels, built in about a second).
  cuda-graph  per key: compile fn (inductor, mode "max-autotune-no-cudagraphs"), warm it up on a side
              stream, capture one `torch.cuda.CUDAGraph` into static input/output buffers from one
              shared memory pool, lazily on first use; keep at most `max_graphs` (least recently
              used evicted) besides the pinned ones: the keys a warm-up built (`pinning`), which
              a run takes round after round, so evicting one would only capture it again. A
              replay copies the inputs into the static buffers, replays, and returns clones of
              the static outputs (copied out before any other replay, since the graphs share
              one pool).
  auto        cuda-graph when CUDA is available (keys whose inputs are on the CPU use compile),
              compile otherwise.

CUDA-graph rules (`static` positions): a captured graph reads and writes fixed addresses. Inputs
the step mutates in place (the KV cache) or that are large and persistent must be listed in
`static`: they are captured by address, never copied, and a later call with a different tensor
(another address or shape) recaptures the key. Every other input is copied into a private static
buffer, so in-place writes to it inside fn are not seen by the caller. The warm-up runs fn on the
real static inputs before capture, so fn's in-place effects must be idempotent (the model's K/V
writes are: the same values land in the same columns). Graphs share one pool, so replays must be
serialized on one stream (the runner does that; do not replay from several threads).

Padding (see graphs/keys.py): a batch of n requests runs in the bucket `batch_bucket(n)`. Padded
rows are inactive: the engine points them at its trash slot (the cache's last, which no request
uses) with `active = 0`, so nothing they write is ever committed or read. For a bare model
forward, `pad_step` pads the inputs by the same rules: ids zero, K/V in a slot no real row uses,
their committed length is 0 (>= 0) and their mask lets each padded token see its own column, so
no softmax row is all-masked and nothing turns NaN. `pad_rows` pads one tensor; `pad_step` pads
all the inputs of a model forward by those rules; real rows come back unchanged in rows [:n].
"""
from __future__ import annotations

import gc
import itertools
import os
import time
import types
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fastspec.config import FastspecError
from fastspec.graphs.keys import GraphKey
from fastspec.layout import cache_mask, causal_block
from fastspec.weights import weights_version

BACKENDS = ("auto", "cuda-graph", "compile", "eager")
# Inductor's mode under captured steps; FASTSPEC_INDUCTOR_MODE=default skips GEMM autotuning (a
# shorter warm-up for slower steps).
CUDA_GRAPH_MODE = os.environ.get("FASTSPEC_INDUCTOR_MODE", "max-autotune-no-cudagraphs")


# --- padding ----------------------------------------------------------------------------------
def pad_rows(t: torch.Tensor, batch: int, fill: Any = 0) -> torch.Tensor:
    """Pad dim 0 of `t` up to `batch` rows.

    fill: a scalar (every padded element), or a tensor broadcastable to one row `t.shape[1:]`
    (e.g. a mask row in which each padded token sees its own column). `t` itself when already full.
    """
    n = t.shape[0]
    if n > batch:
        raise ValueError(f"{n} rows do not fit a batch of {batch}")
    if n == batch:
        return t
    if isinstance(fill, torch.Tensor):
        pad = fill.to(device=t.device, dtype=t.dtype).expand(batch - n, *t.shape[1:])
    else:
        pad = t.new_full((batch - n, *t.shape[1:]), fill)
    return torch.cat([t, pad], dim=0)


def trash_slots(slots: torch.Tensor, count: int, num_slots: int) -> torch.Tensor:
    """`count` cache slots not in `slots` (lowest first), without a host sync."""
    used = torch.zeros(num_slots, dtype=torch.bool, device=slots.device)
    used[slots] = True
    order = torch.argsort(used.to(torch.int8), stable=True)     # free slots first, in order
    return order[:count]


def pad_step(batch: int, ids: torch.Tensor, positions: torch.Tensor, write_cols: torch.Tensor,
             mask: torch.Tensor, slots: torch.Tensor, adapter_on: torch.Tensor | None = None,
             *, num_slots: int) -> tuple[torch.Tensor, ...]:
    """Pad one model forward's inputs (LlamaModel.forward order) from n rows to `batch` rows.

    Padded rows: ids 0, positions and write columns 0..N-1 (committed length 0), a causal mask
    over those columns (each token sees its own column, never an empty row), a trash slot each
    (slots the real rows do not use; the cache needs `num_slots >= batch`), adapter off.
    Returns (ids, positions, write_cols, mask, slots, adapter_on); adapter_on stays None if None.
    """
    n, N = ids.shape
    if num_slots < batch:
        raise ValueError(f"a batch of {batch} rows needs a cache of >= {batch} slots, got {num_slots}")
    dev = ids.device
    cols = torch.arange(N, device=dev)
    pad_mask = cache_mask(torch.zeros(1, dtype=torch.long, device=dev), causal_block(N, dev),
                          mask.shape[-1])[0]
    out = (pad_rows(ids, batch, 0),
           pad_rows(positions, batch, cols.to(positions.dtype)),
           pad_rows(write_cols, batch, cols.to(write_cols.dtype)),
           pad_rows(mask, batch, pad_mask),
           torch.cat([slots, trash_slots(slots, batch - n, num_slots).to(slots.dtype)]),
           None if adapter_on is None else pad_rows(adapter_on, batch, False))
    return out


# --- the runner -------------------------------------------------------------------------------
def skip_weight_guards(entries) -> list[bool]:
    """Dynamo's guard filter for a step: keep every guard but those on the model's parameters and
    buffers. Those are the model's for the runner's life (the CPU kernel even packs them once, at
    the first compile), yet Dynamo checks each one (dtype, shape, strides, per-dimension marks) on
    every call: ~390 tensors in a SmolLM2 step, 0.36–0.42 ms of a bf16 or int8 AR step on Zen 4
    (graphs/guard_ab.py). The inputs' guards (shapes, dtypes, devices) and the modules' type
    guards stay.
    Replacing or rounding weights after a step compiled goes through
    `fastspec.weights.weights_changed`, which makes the runner build its steps again (no guard
    ever caught it: a re-fused adapter's new tensors have the old shapes). FASTSPEC_WEIGHT_GUARDS=1
    keeps them all."""
    return [not ("._parameters[" in e.name or "._buffers[" in e.name) for e in entries]


_STEP_IDS = itertools.count()


def _own_code(fn: Callable, name: str) -> Callable:
    """A plain function calling fn, with a code object no other function shares (named `name`)."""
    def step(*args):
        return fn(*args)
    return types.FunctionType(step.__code__.replace(co_name=name, co_qualname=name), step.__globals__,
                              name, step.__defaults__, step.__closure__)


@dataclass
class _Stats:
    compiles: int = 0            # backend compilations (graph breaks and recompiles included)
    calls: int = 0
    compile_s: float = 0.0       # wall time of the calls that compiled (or captured)
    captures: int = 0            # CUDA graph captures (cuda-graph keys only)

    def as_dict(self) -> dict:
        d = {"compiles": self.compiles, "calls": self.calls, "compile_s": self.compile_s}
        if self.captures:
            d["captures"] = self.captures
        return d


@dataclass
class _Entry:
    kind: str                    # "eager" | "compile" | "cuda-graph"
    fn: Callable
    compiled: Callable | None = None
    # cuda-graph only
    graph: Any = None
    signature: tuple = ()
    static_in: list = field(default_factory=list)
    static_out: tuple = ()


def _same_fn(a: Callable, b: Callable) -> bool:
    return a is b or a == b          # bound methods of one object compare equal


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class StepRunner:
    def __init__(self, backend: str = "auto", max_graphs: int = 32, *, model: torch.nn.Module | None = None,
                 compiler: str | Callable | None = None, warmup: int = 2):
        """backend: auto | cuda-graph | compile | eager. max_graphs: CUDA graphs kept (LRU).

        model: the model fn runs, if any; fastspec's compile backend packs its base weights and
        fused draft LoRA for the skinny GEMM, a snapshot: when the model's weights are replaced
        or rounded (`fastspec.weights.weights_changed`: a re-fused adapter, a new precision) the
        runner drops its steps and packs again on the next call. compiler: the
        torch.compile backend for compile/cuda-graph keys (default: fastspec's on the CPU,
        inductor "max-autotune-no-cudagraphs" for CUDA graphs). warmup: runs before a capture.
        """
        if backend not in BACKENDS:
            raise FastspecError(f"unknown runner backend {backend!r} (choose {', '.join(BACKENDS)})")
        cuda = torch.cuda.is_available()
        if backend == "cuda-graph" and not cuda:
            raise FastspecError("the cuda-graph backend needs CUDA; use compile or eager on the CPU")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.backend = backend
        self.resolved = ("cuda-graph" if cuda else "compile") if backend == "auto" else backend
        self.max_graphs = max_graphs
        self.model = model
        self.compiler = compiler
        self.warmup = max(1, warmup)
        self._entries: OrderedDict[GraphKey, _Entry] = OrderedDict()
        self._pinned: set[GraphKey] = set()        # never evicted (see `pinning`)
        self._pinning = False
        self._stats: dict[GraphKey, _Stats] = {}
        self._packed: dict | None = None
        self._kernel = None
        self._pool = None
        self._weights_version = weights_version(model)

    # --- public -----------------------------------------------------------------------------
    def run(self, key: GraphKey, fn: Callable[..., Any], *inputs: torch.Tensor | None,
            static: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:
        """fn(*inputs) for this key, through the runner's backend. Always a tuple of tensors.

        static: positions of inputs used in place by address (CUDA graphs; see the module doc).
        """
        if (version := weights_version(self.model)) != self._weights_version:
            # The packed panels and captured graphs read the old tensors: build every step again.
            self.clear()
            self._packed, self._weights_version = None, version
        st = self._stats.setdefault(key, _Stats())
        st.calls += 1
        if self._pinning:
            self._pinned.add(key)
        entry = self._entries.get(key)
        if entry is not None and not _same_fn(entry.fn, fn):
            self._drop(key)                       # a new step for this key: build it again
            entry = None
        if entry is None:
            entry = self._entries[key] = _Entry(self._kind_for(inputs), fn)
        self._entries.move_to_end(key)
        if entry.kind == "eager":
            with torch.no_grad():
                return _as_tuple(fn(*inputs))
        if entry.kind == "compile":
            return self._run_compiled(key, entry, st, inputs)
        return self._run_graph(key, entry, st, inputs, tuple(static))

    def stats(self) -> dict[GraphKey, dict]:
        """{key: {"compiles": n, "calls": n, "compile_s": s[, "captures": n]}}."""
        return {k: s.as_dict() for k, s in self._stats.items()}

    def total_compiles(self) -> int:
        """Compilations (and captures) so far, every key together."""
        return sum(s.compiles + s.captures for s in self._stats.values())

    def total_compile_s(self) -> float:
        """Seconds spent compiling (and capturing) so far, every key together."""
        return sum(s.compile_s for s in self._stats.values())

    def keys(self) -> list[GraphKey]:
        """Keys with a live compiled step or graph, least recently used first."""
        return list(self._entries)

    @contextmanager
    def pinning(self):
        """Every key run inside is pinned, in place of the keys an earlier warm-up pinned: its
        CUDA graph is never evicted. A warm-up builds all the steps a run can take (RecGuide at
        C=8: each block size in each batch bucket up to 8, with its branch layouts), possibly
        more than `max_graphs`, and an evicted one would be captured again mid-run, round after
        round. `max_graphs` bounds the other keys (built later, or by earlier runs: a bench
        sweep's pins do not pile up over its methods and concurrencies)."""
        self._pinned = set()
        self._pinning = True
        try:
            yield
        finally:
            self._pinning = False

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    # --- internals --------------------------------------------------------------------------
    def _kind_for(self, inputs) -> str:
        if self.resolved != "cuda-graph":
            return self.resolved
        on_cuda = [t.is_cuda for t in inputs if isinstance(t, torch.Tensor)]
        if on_cuda and all(on_cuda):
            return "cuda-graph"
        if self.backend == "cuda-graph":
            raise FastspecError("the cuda-graph backend needs every input tensor on a CUDA device")
        return "compile"                           # auto with CPU inputs

    def _drop(self, key: GraphKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.graph is not None:
            entry.graph.reset()                   # frees its share of the pool
            if not any(e.graph is not None for e in self._entries.values()):
                # The pool died with its last graph: capturing into its handle again trips
                # CUDACachingAllocator's use_count assert (seen on torch 2.11, H200).
                self._pool = None
        if entry is not None:
            entry.graph, entry.static_in, entry.static_out = None, [], ()

    def _base_compiler(self, kind: str) -> Callable:
        """The torch.compile backend callable (gm, example_inputs) -> compiled."""
        if self.compiler is not None:
            if callable(self.compiler):
                return self.compiler
            from torch._dynamo import lookup_backend
            return lookup_backend(self.compiler)
        from torch._inductor.compile_fx import compile_fx
        if kind == "cuda-graph":
            import torch._inductor
            patches = torch._inductor.list_mode_options(CUDA_GRAPH_MODE)

            def inductor(gm, example_inputs):
                return compile_fx(gm, example_inputs, config_patches=patches)
            return inductor
        from fastspec.graphs.compile import _pack_model, _skinny_backend, setup_inductor_cache
        from fastspec.graphs import kernels
        setup_inductor_cache()
        if self._packed is None:
            # The kernel for this CPU (built on first use; None: one warning line, inductor's
            # GEMMs) and the weights packed for it once per runner, at the model's weight
            # precision (fastspec/weights.py).
            self._kernel = kernels.active()
            self._packed = (_pack_model(self.model, self._kernel)
                            if self.model is not None and self._kernel is not None else {})
            if self._kernel is not None:
                # Prefetch on or off per this CPU's measurement (cached on disk; kernels.py).
                kernels.tune_prefetch(self._kernel, *kernels.model_gemms(self.model))
                # Compiled CPU steps trace attention as one op the backend swaps for the kernel's
                # (FASTSPEC_ATTENTION=sdpa keeps inductor's gather + SDPA, for A/B runs; the
                # choice is the process's, made by the runner that compiles next).
                from fastspec.model.llama import set_cpu_attention
                sdpa = os.environ.get("FASTSPEC_ATTENTION", "kernel") == "sdpa"
                set_cpu_attention(None if sdpa else kernels.attention_op())
        return _skinny_backend(self._packed, self._kernel)

    def _compile(self, key: GraphKey, kind: str, fn: Callable) -> Callable:
        # Dynamo keeps compiled entries per code object, and torch.compile of a bound method or
        # closure traces one shared wrapper: every key of every runner in the process then
        # piled its entries on one code object, each call walked the others' guards, and past
        # recompile_limit Dynamo silently ran eager (the test suite reached 128). Each key gets a
        # code object of its own, so its entries are its own (a step and its rare recompiles).
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * self.max_graphs, 256)
        if self.compiler == "none":
            return fn
        fn = _own_code(fn, f"fastspec_step_{next(_STEP_IDS)}")
        base = self._base_compiler(kind)
        st = self._stats[key]

        def counting(gm, example_inputs):
            st.compiles += 1
            return base(gm, example_inputs)

        options = None if os.environ.get("FASTSPEC_WEIGHT_GUARDS") == "1" else \
            {"guard_filter_fn": skip_weight_guards}
        return torch.compile(fn, backend=counting, dynamic=False, fullgraph=False, options=options)

    def _run_compiled(self, key, entry: _Entry, st: _Stats, inputs) -> tuple[torch.Tensor, ...]:
        before, t0 = st.compiles, time.perf_counter()
        if entry.compiled is None:
            entry.compiled = self._compile(key, "compile", entry.fn)
        with torch.no_grad():
            out = _as_tuple(entry.compiled(*inputs))
        if st.compiles != before:
            st.compile_s += time.perf_counter() - t0
        return out

    @staticmethod
    def _signature(inputs, static: tuple) -> tuple:
        sig = []
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                sig.append((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device),
                            t.data_ptr() if i in static else None))
            else:
                sig.append(("const", t if t is None or isinstance(t, (bool, int, float, str)) else id(t)))
        return tuple(sig) + (static,)

    def _run_graph(self, key, entry: _Entry, st: _Stats, inputs, static: tuple) -> tuple[torch.Tensor, ...]:
        sig = self._signature(inputs, static)
        if entry.graph is not None and entry.signature != sig:
            # New shapes or a moved static buffer: capture again. The compiled fn is kept (its
            # guards are shapes and dtypes, not addresses; new shapes recompile through them).
            fn, compiled = entry.fn, entry.compiled
            self._drop(key)
            entry = self._entries[key] = _Entry("cuda-graph", fn)
            entry.compiled = compiled
        if entry.graph is None:
            t0 = time.perf_counter()
            self._capture(key, entry, inputs, static, sig)
            st.captures += 1
            st.compile_s += time.perf_counter() - t0
            unpinned = [k for k in self._entries if k not in self._pinned]     # oldest first
            for old in unpinned[: max(len(unpinned) - self.max_graphs, 0)]:
                self._drop(old)
        else:
            for i, (dst, src) in enumerate(zip(entry.static_in, inputs)):
                if isinstance(src, torch.Tensor) and i not in static:
                    dst.copy_(src, non_blocking=True)
        entry.graph.replay()
        return tuple(o.clone() for o in entry.static_out)

    def _capture(self, key, entry: _Entry, inputs, static: tuple, sig: tuple) -> None:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        device = tensors[0].device
        if entry.compiled is None:
            entry.compiled = self._compile(key, "cuda-graph", entry.fn)
        with torch.no_grad():
            static_in = [t if (i in static or not isinstance(t, torch.Tensor)) else t.clone()
                         for i, t in enumerate(inputs)]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(self.warmup):           # compiles (autotunes) and initialises libraries
                entry.compiled(*static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # A dead graph freed mid-capture (its owner in a reference cycle, found by a GC pass the
        # capture's Python work triggers) resets itself on the capturing stream, which invalidates
        # the capture (seen on an H200: a profile captured after a check's engines were deleted).
        # Collect before, and let no collection run during the capture.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool):
                static_out = _as_tuple(entry.compiled(*static_in))
        finally:
            if was_enabled:
                gc.enable()
        entry.graph, entry.static_in, entry.static_out, entry.signature = graph, static_in, static_out, sig
