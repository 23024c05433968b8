"""The engine: requests in, tokens out, one batched forward per step.

    Engine.generate(prompts, sampling, method="ar", concurrency=C)

Up to C requests decode together in slots of a static KV cache (row b of the decode batch is slot
b). A finished request frees its slot and the next waiting request is prefilled into it
(continuous batching). The forward is the model's, through the chosen backend; everything on the
tensor side of a step is static-shaped and free of host syncs; the host reads the new tokens once
per step to stream them and to retire finished requests.
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch
import torch.nn.functional as F

from fastspec.config import FastspecError
from fastspec.convention import model_convention
from fastspec.draft import has_adapter
from fastspec.graphs.keys import BATCH_BUCKETS, GraphKey, batch_bucket
from fastspec.graphs.runner import StepRunner
from fastspec.kv_cache import KVCache
from fastspec.methods import Method, RoundOutput, get_method
from fastspec.methods.base import Plan, RunInfo
from fastspec.layout import block_placement, cache_mask, causal_block
from fastspec.sampling import SamplerState, SamplingParams, sample_tokens, sampling_mode

CTX_ALIGN = 256
CTX_STEP = 64         # a round's attention context is rounded up to this many columns


@dataclass
class Sequence:
    """One request: its prompt, what it has produced, and where it lives in the cache."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    rounds: int = 0                 # decode rounds (AR: one token each)
    accept_lengths: list[int] = field(default_factory=list)   # tokens committed per round
    forwards: int = 0               # forwards this request took part in (prefill included)
    block: int = 0                  # block size of its next round (the method's planner sets it)
    host: list[int] = field(default_factory=list)     # its last round's host values (planner input)
    state: dict = field(default_factory=dict)         # the method's host-side state for it
    t_submit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    rounds: int
    ttft_s: float
    latency_s: float
    accept_lengths: list[int] = field(default_factory=list)
    forwards: int = 0

    @property
    def tau(self) -> float:
        """Tokens committed per round (the first token comes from prefill, not a round)."""
        return (len(self.token_ids) - 1) / max(self.rounds, 1)


@dataclass
class RunStats:
    requests: int = 0
    new_tokens: int = 0
    forwards: int = 0
    rounds: int = 0
    steps: int = 0                  # keyed steps the rounds ran (one per group of joined plans)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall_s, 1e-9)

    request_forwards: int = 0       # summed over requests: forwards each request took part in
    warmup_s: float = 0.0           # compiling / capturing this run's step before timing started
    recompiles: int = 0             # compilations of steps already built (a replay must never compile)
    lazy_compiles: int = 0          # first builds of steps the warm-up did not cover (a new bucket
                                    # as requests split or drain): timed as warm-up, not decoding

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a request gains per forward it takes part in (AR: 1.0)."""
        return self.new_tokens / max(self.request_forwards, 1)


class Scheduler:
    """FIFO admission into free slots."""

    def __init__(self, seqs: Seq[Sequence], num_slots: int):
        self.waiting: deque[Sequence] = deque(seqs)
        self.free = list(range(num_slots - 1, -1, -1))    # pop() hands out slot 0 first
        self.running: dict[int, Sequence] = {}

    def admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = self.free.pop()
            self.running[seq.slot] = seq
            admitted.append(seq)
        return admitted

    def retire(self, seq: Sequence) -> None:
        del self.running[seq.slot]
        self.free.append(seq.slot)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)


class Step:
    """What a method's round sees inside one step: its rows' view of the KV cache, the sampler
    and the model forward. The whole round is traced as one function, so `forward` calls the
    model directly (no runner in between) and nothing here is committed: the engine's step
    returns the new lengths.

    Row r of the step is cache slot `slots[r]` with committed length `lengths[r]`. A forward of n
    new tokens writes them at columns `lengths + 0..n-1`; their RoPE positions are those columns
    unless `rel_positions` says otherwise (branch rows sit at columns after the verify row but
    take the positions of the point they branch from):

        verify s d1 d2 | branch a2 M M     columns L .. L+5, rel_positions [0 1 2 | 2 3 4]
    """

    def __init__(self, model, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                 slots: torch.Tensor, sampler: SamplerState, width: int, ctx: int | None = None):
        """ctx: cache columns the forwards attend over (default: the whole cache). Every column
        a row reads or writes this round lies below it; the compiled step takes it as a dynamic
        size, so attention reads the live prefix, not the cache's whole length."""
        self.model, self.k, self.v, self.lengths, self.slots = model, k, v, lengths, slots
        self.sampler, self.width = sampler, width
        self.ctx = k.shape[3] if ctx is None else ctx
        self.mask_token_id = model.mask_token_id
        self.convention = model_convention(model)
        self.max_position = model.rope_cos.shape[0] - 1

    def forward(self, ids: torch.Tensor, block_mask: torch.Tensor,
                adapter_on: torch.Tensor | None = None,
                rel_positions: torch.Tensor | None = None,
                capture: tuple[int, ...] | None = None):
        """Logits [S, n, V] for n new tokens per row, written after each row's committed length.
        block_mask [n, n] or [S, n, n] among the new tokens; adapter_on [S, n] or None;
        rel_positions [n] or [S, n]: RoPE positions relative to the committed length;
        capture: layers whose outputs come back too, (logits, hidden) (a DFlash drafter's)."""
        cols, mask, _ = block_placement(self.lengths, ids.shape[1], block_mask, self.ctx)
        pos = cols if rel_positions is None else self.lengths[:, None] + rel_positions
        # Tokens past the RoPE table are speculative garbage no request can commit (the budget
        # stops first); clamping keeps their lookup in range instead of a device assert.
        pos = pos.clamp(max=self.max_position)
        return self.model(ids, pos, self.k, self.v, cols, mask, self.slots, adapter_on,
                          capture=capture)


def compact_path(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                 cols: torch.Tensor) -> None:
    """Move each row's accepted path into place: K/V at columns L + cols[:, j] go to L + 1 + j
    (every layer and head), in place. All sources are read before any write, so a path may
    move onto columns another path entry is read from.

        L = 10, cols [2 3]:  cache[..., 12] -> [..., 11], cache[..., 13] -> [..., 12]
    """
    D = cols.shape[1]
    ctx = k.shape[3]
    src = (lengths[:, None] + cols).clamp(max=ctx - 1)                          # [S, D]
    dst = (lengths[:, None] + 1 + torch.arange(D, device=cols.device)).clamp(max=ctx - 1)
    for cache in (k, v):
        moved = cache[:, slots[:, None], :, src]          # [layers, S, D, heads, hd]
        cache[:, slots[:, None], :, dst] = moved


def join_groups(groups: dict[Plan, list], cost: Callable[[int, Plan], float]) -> dict[Plan, list]:
    """Steps for a round's groups of equal plans: each group is a step of its own, and every step
    pays a read of the weights, so groups of one variant join a wider one's step (each row keeps
    its own block inside it) while the joined step costs less than the two apart. cost(rows, plan):
    ms of a step of `rows` rows at the plan's width. Widest first, each group joins the step
    before it or starts the next:

        {8: 3 rows, 4: 1 row, 2: 1 row}, weights-bound costs (CPU, small batch):
            T(4, 8) < T(3, 8) + T(1, 4) -> join; T(5, 8) < T(4, 8) + T(1, 2) -> join: one step
        same, token-bound costs (large batch x width): every group apart.
    """
    variants: dict[str, list[tuple[Plan, list]]] = {}
    for plan, members in groups.items():
        variants.setdefault(plan.variant, []).append((plan, members))
    joined: dict[Plan, list] = {}
    for items in variants.values():
        items.sort(key=lambda pm: -pm[0].block)
        plan, members = items[0][0], list(items[0][1])
        for nxt, rows in items[1:]:
            if cost(len(members) + len(rows), plan) < cost(len(members), plan) + cost(len(rows), nxt):
                members += rows
            else:
                joined[plan] = members
                plan, members = nxt, list(rows)
        joined[plan] = members
    return joined


# Where the prompt length is symbolic, shorter prompts pad up to this: so short a prefill costs
# about one decode step at any length, and the one compiled step never sees the small sizes
# that specialize a trace (fp32 CPU steps of up to CPU_ATTENTION_MAX_QUERIES = 8 queries take the
# attention kernel: a 5-token first compile was guarded 2 <= n <= 8 and recompiled at 17).
DYNAMIC_PREFILL_MIN = 16


def prompt_bucket(n: int, cap: int) -> int:
    """The padded length of a prompt of n tokens where every length needs its own graph (CUDA
    graphs): n rounded up to a sixteenth of its next power of two, at least 8 (5 -> 8, 17 -> 24,
    69 -> 72, 129 -> 144, 300 -> 320), at most `cap`. Fewer than 8 padded rows below 64 tokens,
    less than an eighth above, for 8 buckets an octave (16 up to 128)."""
    top = 1 << max(4, (n - 1).bit_length())
    step = max(8, top // 16)
    return min(-(-n // step) * step, cap)


class Engine:
    def __init__(self, loaded, backend: str = "auto", max_context: int | None = None,
                 compiler: str | None = None):
        """loaded: a `fastspec.model.loader.LoadedModel`.
        backend: auto (CUDA graphs on GPU, torch.compile on CPU) | cuda-graph | compile | eager.
        compiler: the torch.compile backend under compile/cuda-graph (default: fastspec's; tests
        use "aot_eager" to trace the same steps without inductor's build time)."""
        self.loaded = loaded
        self.model = loaded.model
        self.cfg = loaded.cfg
        self.tokenizer = loaded.tokenizer
        self.backend = backend
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.max_context = min(max_context or self.cfg.max_position_embeddings,
                               self.model.rope_cos.shape[0])
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos
        self.cache: KVCache | None = None
        # One compiled step (or captured graph) per GraphKey(batch, block, layout).
        self.runner = StepRunner(backend, model=self.model, compiler=compiler)
        self.warmup_s = 0.0
        self._warm: set = set()
        self._warm_prefill: set = set()     # (length bucket, cache shape) compiled
        self.last_stats = self.stats = RunStats()
        self.sampler: SamplerState | None = None
        self.name = getattr(loaded, "name", "this model")
        self.last_round: RoundOutput | None = None      # the latest round (draft statistics)
        self._methods: dict[tuple, Method] = {}
        self._step_names: weakref.WeakValueDictionary[str, Method] = weakref.WeakValueDictionary()
        self.carry: dict[str, torch.Tensor] = {}
        self._carry_specs: dict = {}
        self.last_rounds: list = []
        self.last_method: Method | None = None
        # Measured ms of each method's steps: {method key: {(rows, width, variant): EMA ms}}.
        self.step_ms: dict[str, dict[tuple[int, int, str], float]] = {}
        self.round_steps_ms = 0.0           # the current round's timed steps (Method.timed_round)
        self._round_fns: dict[tuple, Callable] = {}
        self._forward_cost = None

    @property
    def forward_cost(self):
        """T(rows, tokens) ms of one forward: the device profile's, or a nominal roofline."""
        if self._forward_cost is None:
            from fastspec.graphs.profile import ForwardCost
            from fastspec.weights import weight_precision
            kernel = None                 # the skinny-GEMM path compiled CPU steps take, if any
            if self.device.type == "cpu" and self.runner.resolved == "compile" and self.dtype == torch.float32:
                from fastspec.graphs import kernels
                kernel = kernels.kernel_path() if kernels.active() is not None else None
            self._forward_cost = ForwardCost.for_model(self.cfg, str(self.device), self.name, kernel,
                                                       weight_precision(self.model))
        return self._forward_cost

    @property
    def mask_token_id(self) -> int | None:
        return self.model.mask_token_id

    # --- set-up -----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FastspecError("this model has no tokenizer: pass token ids")
            # verbose=False: no transformers warning about the tokenizer's max length; a prompt
            # too long for the context is one FastspecError line (prepare), not two.
            ids = self.tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"]
        else:
            ids = list(prompt)
        if not ids:
            raise FastspecError("empty prompt: give at least one token of input")
        return ids

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise FastspecError("this model has no tokenizer: pass token ids")
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "\n".join(m["content"] for m in messages) + "\n"

    def prepare(self, concurrency: int, need_len: int, method: Method | None = None) -> None:
        """Allocate the KV cache for `concurrency` requests in flight (plus one trash slot that
        padded rows write into), the method's carried state, and warm its steps.
        need_len: the longest prompt plus its token budget (speculative headroom is added here)."""
        if need_len > self.max_context:
            raise FastspecError(
                f"prompt plus --max-new-tokens needs {need_len} positions but the context is "
                f"{self.max_context}: shorten the prompt or lower --max-new-tokens")
        method = method or get_method("ar")
        self.reserve(concurrency, need_len, [method])
        num_slots = self.cache.num_slots
        self.trash = num_slots - 1
        # Every per-slot buffer has the cache's slots (more than concurrency + 1 in a cache
        # reserved for a larger run).
        if self.sampler is not None and self.sampler.counter.shape[0] != num_slots:
            self.sampler = SamplerState(num_slots, self.device, mode=self.sampler.mode)
        sampled = self.sampler is not None and self.sampler.mode != "greedy"
        self._carry_specs = method.carry_spec(self.cfg.vocab_size, sampled)
        self.carry = {name: torch.full((num_slots, *spec.shape), spec.fill, dtype=spec.dtype,
                                       device=self.device)
                      for name, spec in self._carry_specs.items()}
        # Shapes the step depends on: warm each combination once, before any timing starts.
        mode = self.sampler.mode if self.sampler is not None else "greedy"
        key = (num_slots, self.cache.max_len, method.key_name(), id(method), mode,
               batch_bucket(concurrency))
        self.warmup_s = 0.0 if key in self._warm else self.warm_up(method, concurrency)
        self._warm.add(key)

    def reserve(self, concurrency: int, need_len: int, methods: Seq[Method]) -> None:
        """A KV cache with room for `concurrency` requests (plus the trash slot padded rows
        write into) of `need_len` positions each, under any of `methods`. A cache that is
        already big enough is kept: a new one has new K/V shapes, and every compiled step then
        builds again. `bench --interleave` reserves a run's largest need before its first part,
        so a later part with a longer prompt or fewer requests reuses the steps it built."""
        need_len = min(need_len, self.max_context)
        # Headroom: a round writes up to max_width speculative K/V after the committed length.
        # One column more than a round can reach: a round's context then always stays below
        # the cache's length, so the compiled step never specializes on ctx == max_len.
        width = max(m.max_width() for m in methods)
        max_len = -(-(need_len + width + 1) // CTX_ALIGN) * CTX_ALIGN
        c = self.cache
        if c is None or c.num_slots < concurrency + 1 or c.max_len < max_len:
            num_slots = max(concurrency + 1, c.num_slots if c is not None else 0)
            max_len = max(max_len, c.max_len if c is not None else 0)
            self.cache = KVCache(self.cfg, num_slots, max_len, self.dtype, self.device)
            self.ctx_cols = torch.arange(max_len, device=self.device)

    def clear_slot(self, slot: int) -> None:
        """A slot between requests: nothing committed, no carried state."""
        self.cache.lengths[slot] = 0
        for name, spec in self._carry_specs.items():
            self.carry[name][slot] = spec.fill

    def warm_up(self, method: Method, concurrency: int) -> float:
        """Run one round of every plan the method can make, on dummy rows, so that compilation
        happens before timing starts. Every plan's step is built first; then the plans take
        turns, twice: the step times a timed planner (RecGuide) starts from are not taken right
        after each step's own compilation, when a step ran 25-40% slow on a 2-core CPU (one such
        B=4 round at 56 ms against B=8's 45 kept RecGuide at B=8 for a whole run)."""
        t0 = time.perf_counter()
        run_sampler = self.sampler
        # The same code path (GraphKey.sampling) as the run.
        self.sampler = SamplerState(self.cache.num_slots, self.device,
                                    mode=run_sampler.mode if run_sampler else "greedy")
        self.stats = RunStats()
        self.cache.lengths.fill_(1)
        self.pending = torch.zeros(self.cache.num_slots, dtype=torch.long, device=self.device)
        # A bucketing method runs each round's groups (requests that chose the same plan) in
        # their own batch bucket, so a group of any size up to `concurrency` can come: warm
        # every bucket, as a server captures a graph per batch size, and none compiles mid-run.
        # C=4: groups of 1, 2 and 4 rows; a method without bucketing always runs all 4.
        sizes = ([b for b in BATCH_BUCKETS if b < concurrency] if method.bucketing else []) + [concurrency]
        groups = [(plan, list(range(n))) for n in sizes for plan in method.plans()]
        with self.runner.pinning():                     # the run needs every one of them
            for _ in range(1 + (2 if method.timed else 1)):  # round 1 builds, the later ones are timed
                for plan, real in groups:
                    self.run_group(method, plan, real, [plan.block] * len(real), concurrency, 1)
                    self.cache.lengths.fill_(1)
        self.cache.lengths.zero_()
        for name, spec in self._carry_specs.items():
            self.carry[name].fill_(spec.fill)
        self.sampler = run_sampler
        return time.perf_counter() - t0

    @torch.no_grad()
    def model_forward(self, *args):
        """The step every GraphKey runs: one model forward (kept as one function object, so
        the runner recognises it across calls)."""
        return self.model(*args)

    # --- the two forwards -------------------------------------------------------------------
    @torch.no_grad()
    def _prefill(self, seqs: list[Sequence], meth: Method | None = None) -> torch.Tensor:
        """Prompts of admitted requests in one ragged batch (right-padded); last-token logits.
        A method with a `prefill_capture` (DFlash) also gets the prompts' hidden states of those
        layers, through its `prefill_context(carry, slots, hidden, lengths)`."""
        c = self.cache
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        lens = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)
        capture = getattr(meth, "prefill_capture", None)
        if not capture and self.runner.resolved != "eager":
            logits = torch.cat([self._prefill_compiled(s.prompt_ids, s.slot) for s in seqs])
            c.lengths[slots] = lens
            return logits
        n = int(lens.max())
        ids = torch.zeros(len(seqs), n, dtype=torch.long, device=self.device)
        for row, s in enumerate(seqs):
            ids[row, : len(s.prompt_ids)] = torch.tensor(s.prompt_ids)
        pos = torch.arange(n, device=self.device).expand(len(seqs), n)
        zero = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        mask = cache_mask(zero, causal_block(n, self.device), n)
        out = self.model(ids, pos, c.k, c.v, pos, mask, slots, logits_index=(lens - 1)[:, None],
                         **({"capture": capture} if capture else {}))
        logits = out
        if capture:
            logits, hidden = out
            meth.prefill_context(self.carry, slots, hidden, lens)
        c.lengths[slots] = lens
        return logits[:, 0]

    def prefill_bucket(self, n: int) -> int:
        """The padded length a compiled prefill of n prompt tokens runs at. Where the compiled
        step keeps sizes symbolic (compile, not CUDA graphs: `dynamic_ctx`) the prompt runs at
        its own length, at least DYNAMIC_PREFILL_MIN (1 -> 16, 17 -> 17); under CUDA graphs,
        one capture per length bucket (`prompt_bucket`). A prefill is compute-bound, so a padded row costs
        as much as a prompt row: padding 69 tokens to 128 took 181 ms at bf16 on Zen 4."""
        if self.dynamic_ctx:
            return min(max(n, DYNAMIC_PREFILL_MIN), self.cache.max_len)
        return prompt_bucket(n, self.cache.max_len)

    def _prefill_key(self, P: int) -> GraphKey:
        """One key for every prompt length where the length stays symbolic (block 0: any)."""
        return GraphKey(1, 0 if self.dynamic_ctx and P > 1 else P, "prefill", method="prefill")

    def _prefill_compiled(self, prompt_ids: list[int], slot: int) -> torch.Tensor:
        """One prompt through the compiled model forward at its `prefill_bucket` length P:
        [t1 .. tn 0 .. 0] at positions 0 .. P-1, causal. Under CUDA graphs the padding writes
        K/V past the prompt (columns n .. P-1), beyond the committed length, where nothing reads
        it before a later step overwrites it; elsewhere P = n and the length is a symbolic size
        of the compiled step (one compile serves every prompt). Last-token logits [1, V]."""
        c, dev = self.cache, self.device
        n = len(prompt_ids)
        P = self.prefill_bucket(n)
        ids = torch.zeros(1, P, dtype=torch.long, device=dev)
        ids[0, :n] = torch.tensor(prompt_ids)
        pos = torch.arange(P, device=dev)[None]
        mask = cache_mask(torch.zeros(1, dtype=torch.long, device=dev), causal_block(P, dev), P)
        slots = torch.tensor([slot], device=dev)
        last = torch.tensor([[n - 1]], device=dev)
        if P > 1 and self.dynamic_ctx:
            for t, dims in ((ids, (1,)), (pos, (1,)), (mask, (1, 2))):
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        return self.runner.run(self._prefill_key(P), self.prefill_forward, ids, pos, c.k, c.v, pos,
                               mask, slots, last, static=(2, 3))[0][:, 0]

    @torch.no_grad()
    def prefill_forward(self, ids, pos, k, v, cols, mask, slots, last):
        """The compiled prefill step: a model forward with logits at `last` only."""
        return self.model(ids, pos, k, v, cols, mask, slots, logits_index=last)

    def warm_prefill(self, prompt_lengths, meth: Method | None = None) -> float:
        """Compile the prefill steps these prompts need (on the trash slot) before timing: one
        per length bucket, or one for every length where it stays symbolic."""
        if self.runner.resolved == "eager" or getattr(meth, "prefill_capture", None):
            return 0.0
        t0 = time.perf_counter()
        lengths = {}                 # key -> one length it serves
        for P in sorted({self.prefill_bucket(n) for n in prompt_lengths}):
            lengths.setdefault((self._prefill_key(P), tuple(self.cache.k.shape)), P)
        for key, P in lengths.items():
            if key not in self._warm_prefill:
                self._prefill_compiled([0] * P, self.trash)
                self._warm_prefill.add(key)
        return time.perf_counter() - t0

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, block_mask: torch.Tensor,
                adapter_on: torch.Tensor | None = None, layout: str = "chain") -> torch.Tensor:
        """One forward of n new tokens for slots 0..S-1 (S = ids.shape[0]), written after each
        slot's committed length.

        ids [S, n]; block_mask [n, n] or [S, n, n] among the new tokens (the committed prefix is
        always visible); adapter_on [S, n]; layout names the branch shape for the GraphKey.
        Returns logits [S, n, V]. Nothing is committed.
        """
        c = self.cache
        S = ids.shape[0]
        cols, mask, slots = block_placement(c.lengths[:S], ids.shape[1], block_mask, c.max_len)
        self.stats.forwards += 1
        key = GraphKey(S, ids.shape[1], layout, method="forward")
        # The K/V caches (inputs 2, 3) are written in place: the runner uses them by address.
        return self.runner.run(key, self.model_forward, ids, cols, c.k, c.v, cols, mask, slots,
                               adapter_on, static=(2, 3))[0]

    # --- one round: the step every speculative method runs ----------------------------------
    def method(self, name: str | Method, block: int | None = None) -> Method:
        """The method instance for (name, block), kept so its compiled steps are reused."""
        if isinstance(name, Method):
            return self._name_steps(name)
        key = (name, block)           # name may carry options: recguide[corr=1;cont=0]
        if key not in self._methods:
            self._methods[key] = get_method(name, **({} if block is None else {"block": block}))
        return self._name_steps(self._methods[key])

    def _name_steps(self, meth: Method) -> Method:
        """Give `meth` a step name no other live instance of this engine has: recguide[tables=A]
        and recguide[tables=B] share a key_name, so the second becomes `recguide(...)#2`."""
        owner = self._step_names.get(meth.step_name())
        if owner is meth:
            return meth
        n = 1
        while owner is not None:
            n += 1
            meth.key_tag = f"#{n}"
            owner = self._step_names.get(meth.step_name())
            if owner is meth:
                return meth
        self._step_names[meth.step_name()] = meth
        return meth

    def _round_fn(self, meth: Method, variant: str, mode: str, width: int) -> Callable:
        """The step of one GraphKey: a round of `meth` (draft / verify forwards, acceptance, the
        new committed lengths and carried state) for the rows `slots`, as one function of tensors.
        Per-slot engine state comes in whole and is gathered here; the engine scatters the rows'
        results back, so a step touches only its own slots."""
        key = (id(meth), variant, mode, width)
        fn = self._round_fns.get(key)
        if fn is None:
            model, names = self.model, list(self.carry)

            def round_step(slots, active, blocks, pending, lengths, k, v, ctx_cols, *state):
                sampler = SamplerState.view(tuple(t[slots] for t in state[:5]), mode)
                carry = {n: t[slots] for n, t in zip(names, state[5:])}
                L = lengths[slots]
                step = Step(model, k, v, L, slots, sampler, width, ctx=ctx_cols.shape[0])
                out = meth.round(step, pending[slots], blocks, carry, variant)
                if out.commit_cols is not None:
                    compact_path(k, v, slots, L, out.commit_cols)
                # Commit by length: the seed and the accepted drafts (whose K/V the verify
                # forward wrote) join the prefix; the last emitted token seeds the next round,
                # and active rows move their random streams on (padded rows: active 0).
                new_lengths = L + out.n_emitted * active
                new_counter = sampler.counter + active
                next_pending = out.emitted.gather(1, (out.n_emitted - 1)[:, None])[:, 0]
                host = out.host if out.host is not None else out.n_emitted[:, None] * 0
                stats = tuple(t for t in (out.draft_prob, out.draft_confidence, out.draft_margin)
                              if t is not None)
                return (out.emitted, out.n_emitted, out.n_drafted, new_lengths, new_counter,
                        next_pending, host, *(out.carry[n] for n in names)) + stats

            fn = self._round_fns[key] = torch.no_grad()(round_step)
        return fn

    @property
    def dynamic_ctx(self) -> bool:
        """Whether rounds attend over a context sized to their rows (not under CUDA graphs)."""
        return not (self.device.type == "cuda" and self.runner.resolved == "cuda-graph")

    def attention_ctx(self, meth: Method, longest: int | None, plan: Plan | None = None) -> int:
        """Cache columns a round attends over: the rows' longest committed length plus the
        columns this plan's step writes (the method's widest without a plan), rounded up to
        CTX_STEP (below the cache's length, which `prepare` sizes one column past any round's
        reach). A step on the whole cache would copy every slot's K/V for all max_len columns
        per layer (the slot gather); CUDA graphs keep the whole cache, so one capture serves a
        key. longest None: the whole cache."""
        c = self.cache
        if longest is None or not self.dynamic_ctx:
            return c.max_len
        need = longest + (meth.max_width() if plan is None else meth.step_width(plan)) + 1
        return min(-(-need // CTX_STEP) * CTX_STEP, c.max_len - 1)

    def run_group(self, meth: Method, plan: Plan, slots: list[int], blocks: list[int],
                  concurrency: int, longest: int | None = None) -> RoundOutput:
        """One round for the requests in `slots` that share `plan`, as one keyed step (padded to
        a batch bucket with trash rows). Commits their lengths, seeds, streams and carry.
        longest: an upper bound on the rows' committed lengths (None: the whole cache)."""
        c, s = self.cache, self.sampler
        n = len(slots)
        if meth.bucketing:
            rows, width = batch_bucket(n), plan.block
        else:    # one step for everyone, at the widest block any of them drafts this round
            rows, width = batch_bucket(concurrency), max(blocks)     # (the whole batch's bucket)
        pad = rows - n
        dev = self.device
        slot_t = torch.tensor(slots + [self.trash] * pad, device=dev)
        active = torch.tensor([1] * n + [0] * pad, device=dev)
        block_t = torch.tensor(blocks + [width] * pad, device=dev)
        key = GraphKey(rows, width, meth.layout_name(plan.variant), s.mode, meth.step_name())
        fn = self._round_fn(meth, plan.variant, s.mode, width)
        # The attention context enters as the length of a column range, a size the compiled
        # step keeps symbolic: one compile serves every context.
        ctx_cols = self.ctx_cols[:self.attention_ctx(meth, longest, Plan(width, plan.variant))]
        if self.dynamic_ctx:
            torch._dynamo.maybe_mark_dynamic(ctx_cols, 0)
        compiles, t0 = self.runner.total_compiles(), time.perf_counter()
        # K/V (inputs 5, 6) are written in place: the runner uses them by address.
        outs = self.runner.run(key, fn, slot_t, active, block_t, self.pending, c.lengths, c.k, c.v,
                               ctx_cols, *s.tensors(), *self.carry.values(), static=(5, 6))
        # Measured step times feed planners that ask for them (a sync per step on a GPU).
        if meth.timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if meth.timed and self.runner.total_compiles() == compiles:
            ms = (time.perf_counter() - t0) * 1e3
            self.round_steps_ms += ms
            times = self.step_ms.setdefault(meth.timing_name(), {})
            old = times.get((rows, width, plan.variant))
            times[(rows, width, plan.variant)] = ms if old is None else 0.8 * old + 0.2 * ms
            meth.timed_step(rows, width, plan.variant, ms)
        emitted, n_emitted, n_drafted, lengths, counter, next_pending, host = outs[:7]
        ncarry = len(self.carry)
        c.lengths.index_copy_(0, slot_t, lengths)
        s.counter.index_copy_(0, slot_t, counter)
        self.pending.index_copy_(0, slot_t, next_pending)
        for t, new in zip(self.carry.values(), outs[7: 7 + ncarry]):
            t.index_copy_(0, slot_t, new)
        f = meth.forwards_for(plan.variant)
        self.stats.forwards += f
        return RoundOutput(emitted[:n], n_emitted[:n], n_drafted[:n],
                           *(t[:n] for t in outs[7 + ncarry:]), host=host[:n])

    # --- the loop ---------------------------------------------------------------------------
    def generate(self, prompts: Seq[str | list[int]],
                 sampling: SamplingParams | Seq[SamplingParams] | None = None,
                 method: str | Method = "ar", concurrency: int = 1, block: int | None = None,
                 on_commit: Callable[[int, list[int], int], None] | None = None,
                 keep_counts: bool = False) -> list[Completion]:
        """Decode every prompt with `method` ("ar", "linear", ... or a Method instance).

        At most `concurrency` requests are in flight. `sampling` is one SamplingParams for all
        prompts or one per prompt. `on_commit(index, new_token_ids, n_drafted)` streams tokens as
        rounds commit them; the first `n_drafted` of them were accepted drafts. keep_counts: this
        call continues the method's last run (its report counts on; `bench --interleave`).
        """
        meth = self.method(method, block)
        self.last_method = meth                 # (DraftStats reads what its rounds' drafts were)
        if meth.needs_adapter and not has_adapter(self.model):
            raise FastspecError(
                f"method {meth.name!r} needs a draft adapter and {self.name} has none: train one with "
                f"`fastspec train-drafter --model {self.name}` or use --method ar")
        if concurrency < 1:
            raise FastspecError(f"--concurrency must be >= 1, got {concurrency}")
        sampling = sampling or SamplingParams()
        per_request = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(per_request) != len(prompts):
            raise FastspecError("give one SamplingParams, or one per prompt")
        seqs = [Sequence(i, self.encode(p), sp) for i, (p, sp) in enumerate(zip(prompts, per_request))]
        if not seqs:
            return []
        C = min(concurrency, len(seqs))
        batch_bucket(C)                                  # a clear error past the largest bucket
        # The run's sampling code path is known up front: the warm-up compiles that step.
        self.sampler = SamplerState(C + 1, self.device, mode=sampling_mode(per_request))
        meth.begin(RunInfo(C, batch_bucket(C), set(self.eos_ids),
                           self.step_ms.setdefault(meth.timing_name(), {}), self.forward_cost,
                           model=self.model, keep_counts=keep_counts))
        self.prepare(C, max(len(s.prompt_ids) + s.params.max_new_tokens for s in seqs), meth)
        self.warmup_s += self.warm_prefill([len(s.prompt_ids) for s in seqs], meth)
        c = self.cache
        c.lengths.zero_()
        compiled_before = {k: v["compiles"] + v.get("captures", 0)
                           for k, v in self.runner.stats().items()}
        compile_s_before = self.runner.total_compile_s()

        def clock() -> float:
            """Request timestamps leave out steps compiled mid-run (warm-up, not decoding), as
            the run's own decode time does below."""
            return time.perf_counter() - (self.runner.total_compile_s() - compile_s_before)
        stats = self.stats = RunStats(requests=len(seqs))
        sched = Scheduler(seqs, C)
        self.pending = torch.zeros(self.cache.num_slots, dtype=torch.long, device=self.device)   # seeds

        def commit(seq: Sequence, tokens: list[int], n_drafted: int, tick: float) -> int:
            """Append what the request keeps (EOS and the token budget cut a round short);
            returns how many tokens it kept."""
            for j, token in enumerate(tokens):
                seq.output_ids.append(token)
                if token in self.eos_ids and not seq.params.ignore_eos:
                    seq.finish_reason = "eos"
                elif len(seq.output_ids) >= seq.params.max_new_tokens:
                    seq.finish_reason = "length"
                if seq.finished:
                    tokens = tokens[: j + 1]
                    break
            if on_commit is not None:
                on_commit(seq.index, tokens, min(n_drafted, len(tokens)))
            if seq.finished:
                seq.t_done = tick
                sched.retire(seq)
                self.clear_slot(seq.slot)
            return len(tokens)

        prefill_lazy_s = 0.0        # of the steps compiled mid-run, those built while prefilling
        t_start, t_submit = time.perf_counter(), clock()
        for s in seqs:
            s.t_submit = t_submit
        while sched.busy:
            admitted = sched.admit()
            if admitted:
                t0, compile_s0 = time.perf_counter(), self.runner.total_compile_s()
                slots = torch.tensor([s.slot for s in admitted], device=self.device)
                for s in admitted:
                    self.clear_slot(s.slot)
                    self.sampler.set(s.slot, s.params, s.index)
                    s.block = meth.block_for(s)
                first = sample_tokens(self._prefill(admitted, meth), self.sampler, slots)
                self.sampler.counter[slots] += 1       # rounds draw fresh numbers
                self.pending[slots] = first
                stats.forwards += 1
                now = time.perf_counter()
                prefill_compile_s = self.runner.total_compile_s() - compile_s0
                prefill_lazy_s += prefill_compile_s
                stats.prefill_s += now - t0 - prefill_compile_s
                tick = clock()
                for s, tok in zip(admitted, first.tolist()):
                    s.t_first = tick
                    s.forwards += 1
                    commit(s, [tok], 0, tick)
            if not sched.running:
                continue
            t0, compiles0 = time.perf_counter(), self.runner.total_compiles()
            self.round_steps_ms = 0.0
            # The method's planner gives each request its next round; equal plans run together.
            groups: dict[Plan, list[Sequence]] = {}
            running = list(sched.running.values())
            for seq, plan in zip(running, meth.plan_round(running)):
                seq.block = plan.block
                groups.setdefault(plan if meth.bucketing else Plan(0, plan.variant), []).append(seq)
            if meth.bucketing and meth.join_steps and len(groups) > 1:
                groups = join_groups(groups, lambda rows, plan: meth.step_cost(batch_bucket(rows), plan,
                                                                               self.forward_cost))
                if meth.widen_joined:       # the step's width is paid anyway: every row uses it
                    for plan, members in groups.items():
                        for seq in members:
                            seq.block = plan.block
            results = []
            for plan, members in groups.items():
                # Committed length <= prompt + outputs (the last output is the pending seed).
                longest = max(len(q.prompt_ids) + len(q.output_ids) for q in members)
                out = self.run_group(meth, plan, [q.slot for q in members],
                                     [q.block for q in members], C, longest)
                results.append((plan, members, out))
            stats.steps += len(results)
            self.last_round = results[0][2]
            self.last_rounds = results
            # One host read per round: every row's tokens, counts, accepted drafts, host values.
            w = max(o.emitted.shape[1] for _, _, o in results)
            rows = torch.cat([torch.cat([F.pad(o.emitted, (0, w - o.emitted.shape[1])),
                                         o.n_emitted[:, None], o.n_drafted[:, None], o.host], 1)
                              for _, _, o in results]).tolist()
            stats.rounds += 1
            now = time.perf_counter()
            stats.decode_s += now - t0
            tick = clock()
            i = 0
            for plan, members, out in results:
                f = meth.forwards_for(plan.variant)
                for seq in members:
                    r = rows[i]
                    i += 1
                    n_emitted, n_drafted, seq.host = r[w], r[w + 1], r[w + 2:]
                    seq.rounds += 1
                    seq.forwards += f
                    kept = commit(seq, r[:n_emitted], n_drafted, tick)
                    seq.accept_lengths.append(kept)
            if meth.timed and self.runner.total_compiles() == compiles0:
                # What the round cost beyond its steps: planning, the host read, commits.
                meth.timed_round((time.perf_counter() - t0) * 1e3 - self.round_steps_ms)
        stats.wall_s = time.perf_counter() - t_start
        # Steps compiled mid-run (a new bucket as requests drain) are warm-up, not decoding.
        lazy_s = self.runner.total_compile_s() - compile_s_before
        stats.wall_s -= lazy_s
        stats.decode_s -= lazy_s - prefill_lazy_s
        stats.warmup_s = self.warmup_s + lazy_s
        for k, v in self.runner.stats().items():
            n = v["compiles"] + v.get("captures", 0)
            if k in compiled_before and compiled_before[k] > 0:
                stats.recompiles += n - compiled_before[k]
            else:
                stats.lazy_compiles += n
        stats.new_tokens = sum(len(s.output_ids) for s in seqs)
        stats.request_forwards = sum(s.forwards for s in seqs)
        self.last_stats = stats
        return [Completion(s.index, s.prompt_ids, s.output_ids, self.decode(s.output_ids),
                           s.finish_reason or "length", s.rounds, s.t_first - s.t_submit,
                           s.t_done - s.t_submit, s.accept_lengths, s.forwards) for s in seqs]
