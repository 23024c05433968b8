from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class RoundOutput:
    """What one round produced for every row (tensors; the engine reads them once)."""
    emitted: torch.Tensor          # [S, n] new tokens; row s uses emitted[s, :n_emitted[s]]
    n_emitted: torch.Tensor        # [S] tokens emitted == tokens whose K/V the round commits
    n_drafted: torch.Tensor        # [S] how many of the emitted tokens were accepted drafts
    # Per draft position (speculative methods; schedulers such as RecGuide, LibraSpec and BASTION
    # read them): the drafter's probability of the token it proposed, its top-1 probability and
    # the top-1 minus top-2 margin. [S, n] each, or None.
    draft_prob: torch.Tensor | None = None
    draft_confidence: torch.Tensor | None = None
    draft_margin: torch.Tensor | None = None
    # The method's carried state after this round ({name: [S, ...]}, see Method.carry_spec).
    carry: dict[str, torch.Tensor] = field(default_factory=dict)
    # [S, k] small integers the method's host-side planner reads with the round's one host read
    # (e.g. "a pre-drafted block is ready", branch coverage); None when it reads nothing.
    host: torch.Tensor | None = None
    # Trees and branches: [S, D] columns (relative to the committed length L) whose K/V become
    # positions L+1 .. L+D, i.e. the accepted path after the seed (which stays at L). The engine
    # moves them inside the step before it commits n_emitted; None for chains (already in place).
    #   tree s a b c (columns 0..3), accepted path s -> b -> c: commit_cols [2 3] -> K/V of b
    #   moves to L+1, c to L+2. Entries past n_emitted - 1 move too and land past the new
    #   length, where nothing reads them.
    commit_cols: torch.Tensor | None = None


@dataclass(frozen=True)
class CarrySpec:
    """One per-slot tensor a method keeps from round to round: shape per slot, dtype, and the
    value a slot holds after admission or retirement (cleared)."""
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.long
    fill: float = 0


@dataclass(frozen=True)
class Plan:
    """What a request does in its next round, decided on the host between rounds: its block size
    and the step variant (e.g. RecGuide's "hit": the draft was pre-drafted, skip the draft
    forward). Requests with the same plan run together in one keyed step."""
    block: int
    variant: str = ""


@dataclass
class RunInfo:
    """What a method's planner may know about the run it plans for."""
    concurrency: int
    rows: int                                   # the batch bucket of a full batch
    eos_ids: set
    step_ms: dict                               # (rows, width, variant) -> measured ms
    # T(rows, tokens) in ms of one forward, from the device's profile (graphs/profile.ForwardCost)
    forward_ms: Callable[[int, int], float] = field(default=lambda rows, tokens: 1.0 + 0.05 * rows * tokens)
    model: Any = None                           # the target model (a method with its own drafter binds to it)
    # A later part of one measured run (`fastspec bench --interleave`: the methods take turns on
    # groups of prompts): the report's counts carry on from the earlier parts instead of restarting.
    keep_counts: bool = False


def fresh_counts(run: "RunInfo | None") -> bool:
    """Should begin() start the report's counts afresh? (No for a later part of a run.)"""
    return not getattr(run, "keep_counts", False)       # (planners also get duck-typed run infos)


class Method:
    """A decoding method: lays out the tokens of one round, asks for forwards, accepts.

    `round` runs inside the engine's step for a GraphKey(batch, block, layout, sampling, method):
    traced and compiled (or captured) as one function, so it must be tensor code only: no
    `.item()`, no boolean indexing, no data-dependent Python branches, no Python state written.
    Between rounds, `plan` (host side) gives each request its block size and variant.
    """
    name = "?"
    needs_adapter = False
    needs_dflash = False            # drafts with a DFlash drafter the run's model must carry
    layout = "?"                    # the GraphKey layout of a round
    forwards = 1                    # model forwards per round (see forwards_for)
    # True: rows with different blocks run in separate steps, each padded to its own bucket.
    # False: one step for every row, at the widest block any of them drafts this round, padded
    # to the bucket of the whole batch (one key per block size, however requests drain).
    bucketing = False
    # With bucketing: groups of one variant still join one step when the device profile says
    # that is cheaper than separate steps (engine.join_groups). False: every plan its own step.
    join_steps = True
    # In a joined step, every row drafts/verifies the step's whole width (it costs nothing more
    # there) instead of its own plan's block.
    widen_joined = False
    timed = False                   # True: the planner reads measured step times (costs a sync on GPU)
    # Planners with AR rounds: a look at the drafts pays only where the run's best request's
    # drafts could beat AR (methods/ar_rounds.py draft_could_pay); False: a perfect draft's.
    look_by_best = True
    # ... and a drafting round that ran beside AR requests is judged at what its step added to
    # everyone's round (ar_rounds.mixed_round_ms); False: as if every request had drafted.
    price_mixed_rounds = True
    clock = None                    # ... through this StepClock (methods/step_clock.py), set in begin()
    # The block `fastspec bench` gives it when --block is not set (None: the suite's 8).
    bench_block: int | str | None = None     # ("auto": the method chooses per run, TiDAR)

    def __init__(self, block: int = 16):
        self.block = block

    # --- host side --------------------------------------------------------------------------
    def block_for(self, seq) -> int:
        """The block size a request starts with."""
        return self.block

    def plan(self, seq) -> Plan:
        """The request's next round (seq: the engine's Sequence, with its history so far and the
        last round's host values in `seq.host`)."""
        return Plan(seq.block)

    def plan_round(self, seqs: list) -> list[Plan]:
        """Every running request's next round (rows with equal plans run as one step). A
        planner that weighs what one request's plan does to its batch's steps overrides this."""
        return [self.plan(seq) for seq in seqs]

    def plans(self) -> list[Plan]:
        """The plans whose steps the warm-up builds before timing starts: every plan `plan` can
        return, or the ones it is expected to (a plan outside them compiles on first use, and the
        engine counts that compile as warm-up, not decoding)."""
        return [Plan(self.block)]

    def forwards_for(self, variant: str) -> int:
        """Model forwards one round of this variant runs."""
        return self.forwards

    def max_block(self) -> int:
        """Tokens one round can emit per row at most."""
        return self.block

    def max_width(self) -> int:
        """New tokens one forward writes per row at most: the KV cache keeps this much headroom."""
        return self.max_block()

    def step_width(self, plan: Plan) -> int:
        """New tokens per row the step of `plan` writes (its attention context reaches that far
        past the rows' committed lengths, and no further: attention is paid per column). A
        bucketing method's step is its plan's block wide (Engine.run_group); a step of the
        whole batch may write up to max_width."""
        return plan.block if self.bucketing else self.max_width()

    def step_cost(self, rows: int, plan: Plan, forward_ms: Callable[[int, int], float]) -> float:
        """ms of one round's step of `plan` over `rows` batch rows, from forward_ms(rows, tokens)
        of one forward: what the engine weighs when it joins groups (engine.join_groups)."""
        return self.forwards_for(plan.variant) * forward_ms(rows, self.step_width(plan))

    def timed_step(self, rows: int, width: int, variant: str, ms: float) -> None:
        """A step of this method just ran in `ms` (timed methods only; compiles excluded)."""
        if self.timed and self.clock is not None:
            self.clock.timed(rows, width, variant, ms)

    def timed_round(self, overhead_ms: float) -> None:
        """A round of this method just ran with `overhead_ms` of host time outside its steps
        (timed methods only; rounds that compiled a step excluded)."""
        if self.timed and self.clock is not None:
            self.clock.round_overhead(overhead_ms)

    def begin(self, run: "RunInfo") -> None:
        """Called once before a run's first round (host side)."""

    def carry_spec(self, vocab_size: int, sampled: bool = False) -> dict[str, CarrySpec]:
        """Per-slot tensors kept from one round to the next (static buffers the engine owns)."""
        return {}

    def exact_drafts(self, variant: str) -> bool:
        """Is a round of `variant`'s first draft exact where the model's convention makes it so
        (a draft forward of the backbone after its seed: fastspec's d1 is the verifier's own
        token)? False where it is a guess whatever the convention: a DFlash drafter's, TiDAR's
        pre-drafts. The calibration report leaves exact drafts out (evals/calibration.py)."""
        return getattr(getattr(self, "source", None), "convention_exact", True)

    def layout_name(self, variant: str) -> str:
        return self.layout if not variant else f"{self.layout}:{variant}"

    def key_name(self) -> str:
        """Names this method's steps in GraphKeys: two method instances with different options
        never share (or evict) each other's compiled steps."""
        return self.name

    def timing_name(self) -> str:
        """Names this method's measured step times (Engine.step_ms): key_name unless some of
        its options change what its steps compute but not what they cost. Fixed before begin()."""
        return self.key_name()

    # Set by the engine when another live instance has the same key_name (options that only
    # steer the host side, e.g. RecGuide's survival tables): "#2", "#3", ...
    key_tag: str = ""

    def step_name(self) -> str:
        """key_name, made unique among one engine's live instances: each instance traces its
        own step functions, so two that shared a GraphKey would recompile it at every switch."""
        return self.key_name() + self.key_tag

    # --- inside the step --------------------------------------------------------------------
    def round(self, step, pending: torch.Tensor, blocks: torch.Tensor,
              carry: dict[str, torch.Tensor], variant: str = "") -> RoundOutput:
        """One round for every row. step: the engine's `Step` (forward, sampler, width);
        pending [S]: each row's seed (sampled, not yet in cache); blocks [S]: block sizes;
        carry: this method's carried state for the rows."""
        raise NotImplementedError
