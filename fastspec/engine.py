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
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from fastspec.config import FastspecError
from fastspec.draft import has_adapter
from fastspec.graphs.keys import GraphKey, batch_bucket
from fastspec.graphs.runner import StepRunner
from fastspec.kv_cache import KVCache
from fastspec.methods import Method, RoundOutput, get_method
from fastspec.layout import block_placement, cache_mask, causal_block
from fastspec.sampling import SamplerState, SamplingParams, sample_tokens, sampling_mode

CTX_ALIGN = 256


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
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall_s, 1e-9)

    request_forwards: int = 0       # summed over requests: forwards each request took part in
    warmup_s: float = 0.0           # compiling / capturing this run's step before timing started
    recompiles: int = 0             # compilations after the warm-up (a replay must never compile)

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
    """What a method's round sees inside one step: the batch's view of the KV cache, the sampler
    and the model forward. The whole round is traced as one function, so `forward` calls the
    model directly (no runner in between) and nothing here is committed: the engine's step
    returns the new lengths."""

    def __init__(self, model, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                 sampler: SamplerState, width: int):
        self.model, self.k, self.v, self.lengths = model, k, v, lengths
        self.sampler, self.width = sampler, width
        self.mask_token_id = model.mask_token_id

    def forward(self, ids: torch.Tensor, block_mask: torch.Tensor,
                adapter_on: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, n, V] for n new tokens per slot, written after each slot's committed length.
        block_mask [n, n] or [S, n, n] among the new tokens; adapter_on [S, n] or None."""
        cols, mask, slots = block_placement(self.lengths, ids.shape[1], block_mask, self.k.shape[3])
        return self.model(ids, cols, self.k, self.v, cols, mask, slots, adapter_on)


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
        self.last_stats = self.stats = RunStats()
        self.sampler: SamplerState | None = None
        self.round_width = 1
        self.name = getattr(loaded, "name", "this model")
        self.last_round: RoundOutput | None = None      # the latest round (draft statistics)
        self._methods: dict[tuple, Method] = {}
        self._round_fns: dict[tuple, Callable] = {}

    @property
    def mask_token_id(self) -> int | None:
        return self.model.mask_token_id

    # --- set-up -----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise FastspecError("this model has no tokenizer: pass token ids")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
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

    def prepare(self, num_slots: int, need_len: int, method: Method | None = None) -> None:
        """Allocate the KV cache and (re)build the decode forward for these static shapes."""
        if need_len > self.max_context:
            raise FastspecError(
                f"prompt plus --max-new-tokens needs {need_len} positions but the context is "
                f"{self.max_context}: shorten the prompt or lower --max-new-tokens")
        max_len = min(-(-need_len // CTX_ALIGN) * CTX_ALIGN, self.max_context)
        c = self.cache
        if c is None or c.num_slots != num_slots or c.max_len < max_len:
            self.cache = KVCache(self.cfg, num_slots, max_len, self.dtype, self.device)
        method = method or get_method("ar")
        # Shapes the step depends on: warm each combination once, before any timing starts.
        mode = self.sampler.mode if self.sampler is not None else "greedy"
        key = (num_slots, self.cache.max_len, method.name, method.max_block(), mode)
        self.warmup_s = 0.0 if key in self._warm else self.warm_up(method)
        self._warm.add(key)

    def warm_up(self, method: Method) -> float:
        """Run one round on dummy slots so compilation happens before timing starts."""
        t0 = time.perf_counter()
        S = self.cache.num_slots
        run_sampler = self.sampler
        # The same code path (GraphKey.sampling) as the run.
        self.sampler = SamplerState(S, self.device, mode=run_sampler.mode if run_sampler else "greedy")
        self.stats = RunStats()
        self.cache.lengths.fill_(1)
        blocks = torch.full((S,), method.max_block(), dtype=torch.long, device=self.device)
        # Distinct tensors: dynamo guards on aliasing, and the run never aliases seeds and flags.
        seeds = torch.zeros(S, dtype=torch.long, device=self.device)
        self.run_round(method, seeds, blocks, torch.zeros_like(seeds))
        self.cache.lengths.zero_()
        self.sampler = run_sampler
        return time.perf_counter() - t0

    @torch.no_grad()
    def model_forward(self, *args):
        """The step every GraphKey runs: one model forward (kept as one function object, so
        the runner recognises it across calls)."""
        return self.model(*args)

    # --- the two forwards -------------------------------------------------------------------
    @torch.no_grad()
    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Prompts of admitted requests in one ragged batch (right-padded); last-token logits."""
        c = self.cache
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        lens = torch.tensor([len(s.prompt_ids) for s in seqs], device=self.device)
        n = int(lens.max())
        ids = torch.zeros(len(seqs), n, dtype=torch.long, device=self.device)
        for row, s in enumerate(seqs):
            ids[row, : len(s.prompt_ids)] = torch.tensor(s.prompt_ids)
        pos = torch.arange(n, device=self.device).expand(len(seqs), n)
        zero = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        mask = cache_mask(zero, causal_block(n, self.device), n)
        logits = self.model(ids, pos, c.k, c.v, pos, mask, slots, logits_index=(lens - 1)[:, None])
        c.lengths[slots] = lens
        return logits[:, 0]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, block_mask: torch.Tensor,
                adapter_on: torch.Tensor | None = None, layout: str = "chain") -> torch.Tensor:
        """One forward of n new tokens for every slot, written after each slot's committed length.

        ids [S, n]; block_mask [n, n] or [S, n, n] among the new tokens (the committed prefix is
        always visible); adapter_on [S, n]; layout names the branch shape for the GraphKey.
        Returns logits [S, n, V]. Nothing is committed.
        """
        c = self.cache
        cols, mask, slots = block_placement(c.lengths, ids.shape[1], block_mask, c.max_len)
        self.stats.forwards += 1
        key = GraphKey(c.num_slots, ids.shape[1], layout)
        # The K/V caches (inputs 2, 3) are written in place: the runner uses them by address.
        return self.runner.run(key, self.model_forward, ids, cols, c.k, c.v, cols, mask, slots,
                               adapter_on, static=(2, 3))[0]

    # --- one round: the step every speculative method runs ----------------------------------
    def method(self, name: str | Method, block: int | None = None) -> Method:
        """The method instance for (name, block), kept so its compiled steps are reused."""
        if isinstance(name, Method):
            return name
        key = (name, block)
        if key not in self._methods:
            self._methods[key] = get_method(name, **({} if block is None else {"block": block}))
        return self._methods[key]

    def _round_fn(self, meth: Method, mode: str) -> Callable:
        """The step of GraphKey(batch, width, meth.layout, mode): draft / verify forwards,
        acceptance and the new committed lengths, as one function of tensors."""
        key = (id(meth), mode)
        fn = self._round_fns.get(key)
        if fn is None:
            model, width = self.model, meth.max_block()

            def round_step(pending, blocks, active, lengths, k, v, *sampler_tensors):
                sampler = SamplerState.view(sampler_tensors, mode)
                out = meth.round(Step(model, k, v, lengths, sampler, width), pending, blocks)
                # Commit by length: the seed and the accepted drafts (whose K/V the verify
                # forward wrote) join the prefix; the last emitted token seeds the next round,
                # and active rows move their random streams on.
                new_lengths = lengths + out.n_emitted * active
                new_counter = sampler.counter + active
                next_pending = out.emitted.gather(1, (out.n_emitted - 1)[:, None])[:, 0]
                extra = tuple(t for t in (out.draft_prob, out.draft_confidence, out.draft_margin)
                              if t is not None)
                return (out.emitted, out.n_emitted, out.n_drafted, new_lengths, new_counter,
                        next_pending) + extra

            fn = self._round_fns[key] = torch.no_grad()(round_step)
        return fn

    def run_round(self, meth: Method, pending: torch.Tensor, blocks: torch.Tensor,
                  active: torch.Tensor) -> tuple[RoundOutput, torch.Tensor]:
        """One round for every slot through the runner (one compiled step / CUDA graph per key).
        Commits the new lengths; returns the round's output and the next seeds."""
        c, s = self.cache, self.sampler
        key = GraphKey(c.num_slots, meth.max_block(), meth.layout, s.mode)
        # K/V (inputs 4, 5) are written in place: the runner uses them by address.
        outs = self.runner.run(key, self._round_fn(meth, s.mode), pending, blocks, active,
                               c.lengths, c.k, c.v, *s.tensors(), static=(4, 5))
        emitted, n_emitted, n_drafted, lengths, counter, next_pending, *draft_stats = outs
        c.lengths.copy_(lengths)
        s.counter.copy_(counter)
        self.stats.forwards += meth.forwards
        out = RoundOutput(emitted, n_emitted, n_drafted, *draft_stats)
        self.last_round = out
        return out, next_pending

    # --- the loop ---------------------------------------------------------------------------
    def generate(self, prompts: Seq[str | list[int]],
                 sampling: SamplingParams | Seq[SamplingParams] | None = None,
                 method: str | Method = "ar", concurrency: int = 1, block: int | None = None,
                 on_commit: Callable[[int, list[int], int], None] | None = None) -> list[Completion]:
        """Decode every prompt with `method` ("ar", "linear", ... or a Method instance).

        `sampling` is one SamplingParams for all prompts or one per prompt. `on_commit(index,
        new_token_ids, n_drafted)` streams tokens as rounds commit them; the first `n_drafted`
        of them were accepted drafts.
        """
        meth = self.method(method, block)
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
        num_slots = batch_bucket(min(concurrency, len(seqs)))
        self.round_width = meth.max_block()
        # The run's sampling code path is known up front: the warm-up compiles that step.
        self.sampler = SamplerState(num_slots, self.device, mode=sampling_mode(per_request))
        # Headroom: a round writes up to round_width speculative K/V after the committed length.
        self.prepare(num_slots, max(len(s.prompt_ids) + s.params.max_new_tokens for s in seqs)
                     + self.round_width, meth)
        c = self.cache
        c.lengths.zero_()
        compiles_after_warmup = self.runner.total_compiles()
        stats = self.stats = RunStats(requests=len(seqs))
        sched = Scheduler(seqs, num_slots)
        pending = torch.zeros(num_slots, dtype=torch.long, device=self.device)   # seeds
        active = torch.zeros(num_slots, dtype=torch.long, device=self.device)    # 1 = slot decoding
        blocks = torch.full((num_slots,), meth.max_block(), dtype=torch.long, device=self.device)

        def commit(seq: Sequence, tokens: list[int], n_drafted: int, now: float) -> None:
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
                seq.t_done = now
                sched.retire(seq)
                active[seq.slot] = 0

        t_start = time.perf_counter()
        for s in seqs:
            s.t_submit = t_start
        while sched.busy:
            admitted = sched.admit()
            if admitted:
                t0 = time.perf_counter()
                slots = torch.tensor([s.slot for s in admitted], device=self.device)
                for s in admitted:
                    self.sampler.set(s.slot, s.params, s.index)
                    blocks[s.slot] = meth.block_for(s)
                first = sample_tokens(self._prefill(admitted), self.sampler, slots)
                self.sampler.counter[slots] += 1       # rounds draw fresh numbers
                pending[slots] = first
                active[slots] = 1
                stats.forwards += 1
                now = time.perf_counter()
                stats.prefill_s += now - t0
                for s, tok in zip(admitted, first.tolist()):
                    s.t_first = now
                    s.forwards += 1
                    commit(s, [tok], 0, now)
            if not sched.running:
                continue
            t0 = time.perf_counter()
            out, pending = self.run_round(meth, pending, blocks, active)
            stats.rounds += 1
            # One host read per round: every row's tokens, counts and accepted drafts.
            w = out.emitted.shape[1]
            host = torch.cat([out.emitted, out.n_emitted[:, None], out.n_drafted[:, None]], 1).tolist()
            emitted = [r[:w] for r in host]
            n_emitted, n_drafted = [r[w] for r in host], [r[w + 1] for r in host]
            now = time.perf_counter()
            stats.decode_s += now - t0
            for slot, seq in list(sched.running.items()):
                seq.rounds += 1
                seq.forwards += meth.forwards
                seq.accept_lengths.append(n_emitted[slot])
                commit(seq, emitted[slot][: n_emitted[slot]], n_drafted[slot], now)
        stats.wall_s = time.perf_counter() - t_start
        stats.warmup_s = self.warmup_s
        stats.recompiles = self.runner.total_compiles() - compiles_after_warmup
        stats.new_tokens = sum(len(s.output_ids) for s in seqs)
        stats.request_forwards = sum(s.forwards for s in seqs)
        self.last_stats = stats
        return [Completion(s.index, s.prompt_ids, s.output_ids, self.decode(s.output_ids),
                           s.finish_reason or "length", s.rounds, s.t_first - s.t_submit,
                           s.t_done - s.t_submit, s.accept_lengths, s.forwards) for s in seqs]
