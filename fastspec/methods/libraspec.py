"""LibraSpec: a training-free dynamic speculative length from the draft's own confidences and the
device's forward cost, on LinearSS's draft/verify rounds (or DFlash's: `libraspec[drafter=dflash]`
drafts with the model's DFlash drafter, fastspec/methods/drafter.py; c_1 is then its confidence).

Length. γ is the number of drafts a verify forward judges: a chain verify of width b is
`[s d1 .. d(b-1)]` and judges d1..d(b-1) (verify.accept_chain), so γ = b − 1 and its cost is
T(γ) := forward_ms(rows, γ + 1), one forward of the seed plus γ drafts at the current batch:
rows = the run's batch bucket (C in flight; `cost_rows="step"`: the rows of the step itself).

Stop rule, per row. c_i is the drafter's confidence at draft d_i (its top-1 probability, which
is the probability of its own draft under greedy; d1 is exact under fastspec's convention, so
c_1 = 1 there). P_k = Π_{i≤k} c_i is the chance that d1..dk are all accepted and
E(γ) = Σ_{k≤γ} P_k the expected accepted drafts when γ are judged. Starting at γ = 0, extend to
γ + 1 while

    P_{γ+1} · T(γ)  >  E(γ) · (T(γ+1) − T(γ))      i.e.  E(γ+1) / T(γ+1)  >  E(γ) / T(γ),

so γ is the first local maximum of accepted drafts per verify millisecond (the global one when
T is convex: E is concave because c_i <= 1). Worked example, c = 1 .9 .8 .7 .6 .5 .5 .4 and
the shipped CPU profile of SmolLM2-135M:

    γ                0      1      2      3      4      5      6      7      8
    P_{γ+1}          1      .9     .72    .504   .302   .151   .0756  .0302
    E(γ)             0      1      1.9    2.62   3.12   3.43   3.58   3.65   3.68
    T(γ) rows = 1    19.69  19.70  19.71  19.72  19.73  19.73  19.90  20.73  21.56
    T(γ) rows = 8    48.37  48.44  48.50  48.56  48.63  53.83  60.44  67.06  73.68

    rows = 1: ... 5 -> 6: .151·19.73 = 2.98 > 3.43·0.17 = 0.58 yes; 6 -> 7: .0756·19.90 = 1.50
              > 3.58·0.83 = 2.97 no: γ = 6 (a verify of 7 tokens, width 8)
    rows = 8: ... 4 -> 5: .302·48.63 = 14.7 > 3.12·5.20 = 16.2 no: γ = 4 (5 tokens, width 8)

At a larger batch each extra token costs more relative to the forward (the step turns
compute-bound sooner), so the chosen lengths shrink as concurrency grows.

Rounds. A round is one traced step of one static width W (a draft forward `[s M×(W−1)]`, which
proposes d1..dW, then the verify `[s d1..d(W−1)]`), so the length chosen from a round's
confidences sets the width of the request's next round, on the host: W' = the smallest block of
`blocks` holding γ + 1 tokens. A row whose rule was still extending at its last known confidence
(`capped`: γ = W under fastspec's shift, W − 1 unshifted) asks for one token more, so it grows a
bucket:

    W = 8, c1..c8 -> γ = 3   : next width 4  (judges d1..d3)
    W = 8, c1..c8 -> γ = 8   : capped, next width 16
    W = 4, c1..c4 -> γ = 2   : next width 4

Within a round the verify judges every draft its width holds (W − 1 ≥ the previous round's γ):
the forward has computed those logits anyway, so judging them is free and only adds accepted
tokens. Requests with equal widths run together (bucketing); the draft width equals the verify
width, so the round costs 2·T(W − 1) and the rule (homogeneous in T) is the same for it.

Not drafting at all (block 1 in `blocks`, the default set; `libraspec[blocks=4/8/16/32]` is the
rule alone): a request whose last drafting rounds committed fewer tokens per ms than plain AR
rounds would takes AR rounds (methods/ar_rounds.py; γ = 0 in the report). A round of width W
costs a draft and a verify forward, (1 + share) · T(W − 1) (share: the draft forward's cost over
the target's, 1 for the backbone); an AR round T(0). With the shipped Zen 4 profile a width-4
round must commit more than 2.07 tokens at rows 1 (32.7 ms against 15.8), 3.60 at rows 4 and
4.69 at rows 8 (139.3 against 29.7 ms; more than it can) to beat AR. Those are the profile's
prices; the choice reads them scaled to this run's measured steps (StepClock, `prices=measured`,
the default): the profile is 10-20% off a measured step on a 2-core CPU, both ways.

Sampling stays lossless: a round's width is fixed by earlier rounds, and the confidences are
top-1 probabilities of the drafter's distributions, not of its sampled tokens.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

import torch

from fastspec.config import FastspecError
from fastspec.graphs.keys import BATCH_BUCKETS, batch_bucket
from fastspec.methods.ar_rounds import (AR_BLOCK, AR_VARIANT, ARSwitch, ar_round, drafting_blocks,
                                        draft_could_pay)
from fastspec.methods.base import Plan, RoundOutput, RunInfo, fresh_counts
from fastspec.methods.drafter import DrafterChoice, chain_round, make_drafter
from fastspec.methods.linear import BLOCK_SIZES, LinearSS
from fastspec.methods.step_clock import StepClock

# RoundOutput.host columns: the chosen length, "still extending at the last known draft", the
# rows whose forward cost chose it.
H_GAMMA, H_CAPPED, H_ROWS = 0, 1, 2
HOST_COLUMNS = 3
DEFAULT_BLOCKS = (AR_BLOCK,) + BLOCK_SIZES


def stop_length(conf: Sequence[float], cost: Sequence[float]) -> int:
    """The stop rule on the host, in plain Python: γ for confidences conf[k-1] = c_k (k = 1..n)
    and costs cost[g] = T(g) (g = 0..n). The tensor version is `choose_lengths`."""
    p, expected, g = 1.0, 0.0, 0
    while g < len(conf):
        p_next = p * conf[g]
        if not p_next * cost[g] > expected * (cost[g + 1] - cost[g]):
            break
        p, expected, g = p_next, expected + p_next, g + 1
    return g


def choose_lengths(conf: torch.Tensor, cost: Sequence[float]) -> torch.Tensor:
    """γ [S] for confidences conf [S, n] (column k-1 is c_k; 0 past a row's known drafts) and
    costs cost[g] = T(g), g = 0..n: the number of leading γ = 0..n-1 at which the rule extends.
    The costs are Python floats baked into the step (a tensor built inside it would be a host
    copy in every replay of a CUDA graph).

        c = [1 .9 .5], T = [10 10 12 16]:  P = [1 .9 .45], E(γ) = [0 1 1.9]
        extend?  γ=0: 1·10 > 0·0 yes   γ=1: .9·10 > 1·2 yes   γ=2: .45·12 = 5.4 > 1.9·4 no -> 2
    """
    p = conf.float().cumprod(-1)                                      # P_{γ+1}, γ = 0..n-1
    e_before = torch.cat([torch.zeros_like(p[:, :1]), p.cumsum(-1)[:, :-1]], 1)     # E(γ)
    n = conf.shape[1]
    extend = torch.stack([p[:, g] * float(cost[g]) > e_before[:, g] * float(cost[g + 1] - cost[g])
                          for g in range(n)], 1)                      # [S, n]
    return extend.long().cumprod(-1).sum(-1)


class LibraSpec(DrafterChoice, LinearSS):
    name = "libraspec"
    layout = "linear"               # LinearSS's two forwards; the GraphKey names the method
    bucketing = True                # each width its own step over its own rows
    # ... unless one step is cheaper than several (engine.join_groups): then each row verifies
    # the joined step's width, the stop rule's own answer when the extra tokens cost nothing.
    widen_joined = True
    forwards = 2

    def __init__(self, block: int = 8, blocks: tuple[int, ...] | int = DEFAULT_BLOCKS,
                 cost_rows: str = "batch", drafter: str = "self", window: int = 1024,
                 prices: str = "measured"):
        """block: the width of a request's first round. blocks: the verify widths the chosen
        lengths are rounded up to (each a step of its own, warmed before timing); 1 adds the
        plain AR round, taken where no width pays (module doc).
        cost_rows: the rows T is read at: "batch", the run's batch bucket (the load C; requests
        split into widths still pay for the whole round), or "step", the rows of the step that
        ran the round (a group of few rows sees cheap tokens and keeps its long widths).
        drafter: "self" (the backbone's adapter, LinearSS's draft) or "dflash" (the model's DFlash
        drafter, with a context ring of `window` committed tokens per request).
        prices: what the choice between drafting and AR rounds reads, "measured" (this run's
        step times, StepClock: the profile scaled to them) or "profile" (the device profile)."""
        self.source = make_drafter(drafter, window, blocks if isinstance(blocks, int) else max(blocks, default=0))
        super().__init__(block)
        if cost_rows not in ("batch", "step"):
            raise FastspecError(f"libraspec cost_rows must be batch or step, got {cost_rows!r}")
        self.cost_rows = cost_rows
        if prices not in ("measured", "profile"):
            raise FastspecError(f"libraspec prices must be measured or profile, got {prices!r}")
        self.timed = prices == "measured"
        blocks = (blocks,) if isinstance(blocks, int) else blocks
        self.blocks = tuple(sorted(set(blocks)))
        bad = [b for b in self.blocks if b not in DEFAULT_BLOCKS]
        self.draft_blocks = drafting_blocks(self.blocks)
        if bad or not self.draft_blocks:
            raise FastspecError(f"libraspec blocks must be among {DEFAULT_BLOCKS} (one of them "
                                f"above 1), got {blocks}")
        if block not in self.draft_blocks:
            raise FastspecError(f"libraspec start block {block} must be one of {self.draft_blocks}")
        self.ar = AR_BLOCK in self.blocks
        self.costs: dict[int, tuple[float, ...]] = {}
        self.draft_share = 1.0
        self.begin(None)

    # --- host side --------------------------------------------------------------------------
    def key_name(self) -> str:
        # "batch" bakes T at the run's rows into every step: a run at another C gets its own.
        rows = self.run.rows if self.cost_rows == "batch" else "step"
        return self.timing_name().replace(",drafter=", f",T@{rows},drafter=")

    def timing_name(self) -> str:
        # A step's time is its shape's (rows, width), whichever T it baked in.
        return (f"libraspec(blocks={'/'.join(map(str, self.blocks))},start={self.block},"
                f"drafter={self.source.key_name()})")

    def begin(self, run: RunInfo | None) -> None:
        if run is not None:
            self.bind_drafter(run)
        fresh = fresh_counts(run)
        run = run or RunInfo(1, 1, set(), {})          # a nominal cost model until a run gives one
        self.run = run
        self.cost_source = getattr(run.forward_ms, "source", "given")
        costs = self.cost_table(run.forward_ms)
        # Same numbers, same object: a compiled step that baked the old table stays valid.
        if costs != self.costs:
            self.costs = costs
        self.draft_share = self.source.draft_share(getattr(run, "model", None))
        self.clock = StepClock(self.estimate_ms, run.step_ms if self.timed else {})
        if fresh:
            self.gammas: Counter = Counter()        # chosen length -> rounds
            self.widths: Counter = Counter()        # verify width -> rounds
            self.capped = 0
            self.switch = ARSwitch.after(getattr(self, "switch", None))   # who drafts, who takes AR rounds
            self.by_rows: dict[int, list[int]] = {} # rows T was read at -> [Σγ, rounds]

    def cost_table(self, forward_ms: Callable[[int, int], float]) -> dict[int, tuple[float, ...]]:
        """{rows: (T(0) .. T(max block))} for every batch bucket: T(γ) = forward_ms(rows, γ + 1).
        A step reads its row's table as constants (its rows are static)."""
        n = self.max_block()
        return {rows: tuple(float(forward_ms(rows, g + 1)) for g in range(n + 1))
                for rows in BATCH_BUCKETS}

    def costs_for(self, rows: int) -> tuple[float, ...]:
        table = self.costs.get(rows)
        if table is None:                           # not a bucket (hand-built steps in tests)
            table = tuple(float(self.run.forward_ms(rows, g + 1)) for g in range(self.max_block() + 1))
        return table

    def round_ms(self, width: int, rows: int) -> float:
        """ms of a drafting round of `width` at `rows`: a draft and a verify forward."""
        return (1.0 + self.draft_share) * self.costs_for(rows)[width - 1]

    def estimate_ms(self, rows: int, width: int, variant: str) -> float:
        """The profile's ms of a round's step: an AR round's forward, or round_ms."""
        return self.costs_for(rows)[0] if variant == AR_VARIANT else self.round_ms(width, rows)

    def price(self, rows: int, width: int) -> float:
        """ms of a round of `width` (1: an AR round) at `rows`, as this run measures its steps
        (the profile's where `prices=profile`)."""
        return self.clock.time(rows, width, AR_VARIANT if width == AR_BLOCK else "")

    def look_pays(self, rows: int | None = None, first: bool = False) -> bool:
        """Could a look at the drafts after AR rounds pay: would a draft beat AR were it accepted
        as far as the run's best request's so far (before any: all of it)? first: a new
        request's first round, judged at `ARSwitch.first_bound`."""
        rows = rows or self.run.rows
        bound = self.switch.bound(first, self.look_by_best)
        return draft_could_pay(((w, self.price(rows, w)) for w in self.draft_blocks),
                               self.price(rows, AR_BLOCK), bound)

    def plans(self) -> list[Plan]:
        return [Plan(b, AR_VARIANT if b == AR_BLOCK else "") for b in self.blocks]

    def forwards_for(self, variant: str) -> int:
        return 1 if variant == AR_VARIANT else self.forwards

    def max_block(self) -> int:
        return max(self.blocks)

    def width_for(self, gamma: int, capped: bool) -> int:
        """The next verify width: the smallest block holding γ + 1 tokens (one more when the rule
        was still extending at the last draft it could see), else the widest."""
        need = gamma + 1 + int(capped)
        return next((b for b in self.draft_blocks if b >= need), self.draft_blocks[-1])

    def plan_round(self, seqs) -> list[Plan]:
        # A round that mixed drafting and AR rounds is judged at what it cost.
        self.switch.price_last_round(seqs, lambda n, w: self.price(batch_bucket(n), w),
                                     self.ar and self.price_mixed_rounds)
        return [self.plan(seq) for seq in seqs]

    def plan(self, seq) -> Plan:
        h = seq.host
        rows = (h[H_ROWS] if h else 0) or self.run.rows
        drafted = bool(h) and seq.block != AR_BLOCK
        wanted = self.width_for(h[H_GAMMA], bool(h[H_CAPPED])) if drafted else None   # the rule's
        if self.ar:
            # AR or drafting is priced at the batch's rows, as BASTION and D²SD price it: a
            # request drafting alone beside the run's AR rows costs the round a step of its own,
            # not a 1-row round against a 1-row AR round (C=4: 90% AR rounds and 0.86x AR priced
            # at the step's rows, results/round_overhead_c14_zen4_1207.json).
            full = self.run.rows
            width = self.switch.next_block(seq, self.block, wanted,
                                           lambda w: self.price(full, w), self.look_pays(full), self.widths,
                                           first_pays=None if h else self.look_pays(full, first=True))
        else:
            width = wanted or seq.block or self.block
        if drafted or (h and width == AR_BLOCK):    # the rule's γ, or γ = 0 before an AR round
            gamma, capped = (0, 0) if width == AR_BLOCK else (h[H_GAMMA], h[H_CAPPED])
            self.gammas[gamma] += 1
            self.capped += capped
            acc = self.by_rows.setdefault(rows, [0, 0])
            acc[0] += gamma
            acc[1] += 1
        self.widths[width] += 1
        return Plan(width, AR_VARIANT if width == AR_BLOCK else "")

    def report(self) -> dict:
        """The last run, at its concurrency: the share of rounds per verify width (every planned
        round; width 1: AR rounds) and per chosen length γ (every round a next round was planned
        from: a request's last round is not; γ = 0: an AR round), mean γ overall and per rows T
        was read at, and T(γ) at the run's rows."""
        n_g = max(sum(self.gammas.values()), 1)
        n_w = max(sum(self.widths.values()), 1)
        return {"drafter": self.source.name, "concurrency": self.run.concurrency, "rows": self.run.rows,
                "cost_source": self.cost_source,
                "rounds": sum(self.gammas.values()),
                "mean_gamma": sum(g * c for g, c in self.gammas.items()) / n_g,
                "gamma_share": {g: c / n_g for g, c in sorted(self.gammas.items())},
                "width_share": {w: c / n_w for w, c in sorted(self.widths.items())},
                "mean_width": sum(w * c for w, c in self.widths.items()) / n_w,
                "capped_share": self.capped / n_g,
                "ar_share": self.widths.get(AR_BLOCK, 0) / n_w, "looks": self.switch.looks,
                "prices": "measured" if self.timed else "profile", "profile_check": self.clock.check(),
                "mean_gamma_by_rows": {r: s / max(k, 1) for r, (s, k) in sorted(self.by_rows.items())},
                "cost_ms": {g: round(t, 3) for g, t in
                            enumerate(self.costs_for(self.run.rows)[:9])}}

    # --- inside the step --------------------------------------------------------------------
    def lengths(self, step, conf: torch.Tensor, blocks: torch.Tensor):
        """(γ [S], capped [S], rows T was read at) from the round's top-1 confidences conf
        [S, n] (aligned: index i is d(i+1))."""
        S, n = conf.shape
        i = torch.arange(n, device=conf.device)
        # A row knows drafts d1..d(b) when shifted (d(b) guesses the bonus), d1..d(b-1) when not
        # (the last aligned index repeats the one before: no proposal of its own).
        known = self.source.known(step, blocks)
        c = torch.where(i[None, :] < known[:, None], conf.float(), torch.zeros_like(conf, dtype=torch.float))
        if self.source.exact_first(step):           # d1 is the verifier's own next token
            c = torch.cat([torch.ones_like(c[:, :1]), c[:, 1:]], 1)
        rows = self.run.rows if self.cost_rows == "batch" else S     # static: baked in the step
        gamma = choose_lengths(c, self.costs_for(rows)[: n + 1])
        return gamma, gamma >= known, rows

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        if variant == AR_VARIANT:
            return ar_round(self.source, step, pending, carry, HOST_COLUMNS)
        out = chain_round(self.source, step, pending, blocks, carry)   # draft + verify
        gamma, capped, rows = self.lengths(step, out.draft_confidence, blocks)
        out.host = torch.stack([gamma, capped.long(), torch.full_like(gamma, rows)], 1)
        return out
