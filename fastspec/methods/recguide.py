"""RecGuide: verification-overlapped drafting (low load) on LinearSS's draft/verify rounds.

The verify forward of round t also drafts round t+1 for its most likely outcomes, as extra rows
of the same forward. A branch attends to the verify row's own columns (no re-encoding of the
drafted prefix), so it costs only its own B tokens. Verify row + two branches, B = 4, fastspec's
convention (seed causal without the adapter, token shift):

    new tokens (columns)   s  d1 d2 d3 | a2 M  M  M  | M  M  M  M
    rel. positions         0  1  2  3  | 2  3  4  5  | 4  5  6  7
    a2 (correction at 2)   sees prefix + s d1          (verify columns 0..1) and itself
    its masks              see prefix + s d1 + a2 M M M
    continuation masks     see prefix + s d1 d2 d3 and the whole continuation block

Correction branch p: `[alt_p, M×(B−1)]` at positions L+p.., exactly the draft the next round
runs if the verifier rejects d_p and emits alt_p (the draft's best token other than d_p, MASK and
EOS). Continuation: the next block at L+B if every draft is accepted; its first token stands for
the bonus. A shifted drafter has a guess for it already (its last block position predicts L+B),
so the continuation is the seeded block `[d_B, M×(B−1)]` (in the drafter's training layout); an
unshifted one (NLD) drafts `[M×B]`, its first mask filled in place with the bonus guess. Risk of draft position p (never one whose draft
is exact, like fastspec's d1): 1 − (p_top1 − p_top2) of the draft distribution, MASK excluded.

Which branches, per row (the reference policy by c = number of risky positions, earliest
first): c = 0: continuation; 1: correction 1 + continuation; 2: corrections 1, 2 + continuation;
>= 3: corrections 1, 2. The layout has k branch slots; row r's j-th wanted branch takes slot j.
k is chosen between rounds by the cost gate: add slot j while (its observed hit rate) × (the draft
forward a hit saves) > (the extra verify cost of its B tokens), from measured step times (the
device profile's, scaled to the measured ones, for a layout not run yet). The warm-up builds the
layouts the gate reaches from the profile; the rest compile on first use.

Reuse: correction p hits iff the first rejection is at p and the verifier emitted alt_p; the
continuation iff every draft was accepted and its guess of the bonus equals the bonus. A hit carries the branch's drafts (and, when sampling,
their log-probs: acceptance stays lossless) into the next round, which then skips its draft
forward: that round is one forward.

Seedless corrections (`recguide[seed=mask]`, an extension beyond the paper, for an adapter trained
with `train-drafter --seedless`): correction branch p is `[M×B]` at L+p (adapter on, bidirectional,
TiDAR's pre-draft layout), drafting what follows the correction without guessing it. It hits
whenever the first rejection is at p, whatever the verifier emitted; the next round then verifies
`[emitted, d1' ..]`. Coverage no longer waits on the alternative token being right, at the price
of drafts that did not see the correction (shifted: d1' is a guess, not exact). The likelihood
policy scores such a branch by P(first rejection at p) ≈ Π_{i<p} q(d_i) · (1 − q(d_p)).

Not drafting at all (`recguide[blocks=1/4/8/16/32]`, the CLI's default set): block 1 is a plain
AR round, one forward of the seed (variant "ar", V_1 = 1 token). Where speculation does not pay on this device and
load (int8 weights on a 2-core CPU; C >= 4 there), the chooser's V_B / T(B) then picks it, as a
server turns speculation off by batch size, but per request and per round. AR rounds stay out
of the verifier's history (they say nothing about the drafts); after EXPLORE of them in a row a
request drafts once at its best block, so a stretch of easy text is found again.

Mixed corrections (`recguide[policy=likelihood;seed=mix]`, same adapter): the candidates are the
guessed correction and the seedless one at every position, and the continuation; a seedless
candidate at p is scored by the outcomes the guess misses, Π_{i<p} q(d_i) · (1 − q(d_p) − q(alt_p)),
times SEEDLESS_VALUE (its round's τ against a guessed one's). When both cover an outcome (the
verifier emitted alt_p), the guessed branch's drafts are the ones carried:

    d2 rejected, verifier emits alt_2:      slots [g2, m2, cont] -> g2 covers, m2 too -> carry g2
    d2 rejected, verifier emits another x:  slots [g2, m2, cont] -> m2 covers         -> carry m2

More alternatives (`recguide[policy=likelihood;alts=K]`, K ≤ 3): the guessed corrections at p
are the drafter's K best tokens other than d_p, each its own candidate, scored
Π_{i<p} q(d_i) · q(alt_p^(r)); a hit carries drafts that saw the correction, as with the first.
"""
from __future__ import annotations

import torch

from fastspec.config import FastspecError
from fastspec.convention import aligned_draft_logits, draft_block_mask, draft_adapter_flags
from fastspec.layout import causal_block
from fastspec.methods.ar_rounds import (AR_BLOCK, AR_VARIANT, EXPLORE, DraftMeans, ar_round,
                                        draft_could_pay, drafting_blocks)
from fastspec.methods.base import CarrySpec, Plan, RoundOutput, RunInfo, fresh_counts
from fastspec.methods.drafter import draft_stats_and_alternatives, exact_first_draft
from fastspec.methods.linear import BLOCK_SIZES, SELF_DRAFT, LinearSS
from fastspec.methods.step_clock import StepClock
from fastspec.sampling import filtered_logprobs, sample_from_logprobs
from fastspec.survival import SurvivalTables, choose_block, history_signal, stratum
from fastspec.verify import accept_chain
from fastspec.graphs.keys import batch_bucket

STREAM_BRANCH = 16              # + slot: the random stream of a branch's sampled drafts
CORR1, CORR2, CONT = 0, 1, 2    # branch kinds, in the reference policy's order
# Host values a round returns per row (RoundOutput.host columns): risky count, wanted branches,
# hit, branch slots laid out, then covered by candidate 0, 1, ... (one column per candidate).
H_RISKY, H_WANTED, H_HIT, H_SLOTS, H_COVERED = 0, 1, 2, 3, 4
MAX_SLOTS = 6                   # branch slots the likelihood policy may lay out (`slots=`)
# A seedless hit's worth against a guessed one's: the round it feeds starts from a guessed first
# draft. (Whole runs with seedless branches: τ 2.65 vs 3.35, results/recguide_seedless_gsm8k.json;
# the fed rounds alone are lower, ≈ 1.7 vs 3.3 in results/recguide_mix_gsm8k20.json, so with
# scarce slots a guessed candidate should usually come first.)
SEEDLESS_VALUE = 0.8
MAX_ALTS = 3                    # guessed alternatives per draft position (`alts=`)


def slots_of(variant: str) -> int:
    """Branch slots a step variant lays out: "draft2" / "hit2" -> 2 ("" or "ar" -> 0)."""
    return int(variant[-1]) if variant[-1:].isdigit() else 0


def variant_for(block: int, slots: int) -> str:
    """The variant of a drafting round with `slots` branch slots; block 1 is the AR round."""
    return AR_VARIANT if block == AR_BLOCK else f"draft{slots}"


def overlap_layout(step, verify_ids, blocks, anchors, firsts, seeded):
    """Tokens [S, N], mask among them [S, N, N], adapter flags [S, N] and RoPE positions
    relative to the committed length [S, N] for the verify row plus one branch per slot
    (N = n · (1 + slots)); see the module docstring for a worked example."""
    S, n = verify_ids.shape
    dev = verify_ids.device
    conv = step.convention
    full = torch.full((S,), n, dtype=torch.long, device=dev)
    seed_mask = draft_block_mask(conv, full, n)                     # [S, n, n] seeded block
    all_see = draft_block_mask(conv, full, n, seedless=True)        # all masks (seedless)
    seed_flags = draft_adapter_flags(conv, S, n, dev)
    all_flags = draft_adapter_flags(conv, S, n, dev, seedless=True)
    i = torch.arange(n, device=dev)
    ids, rel, adapter = [verify_ids], [i.expand(S, n)], [torch.zeros(S, n, dtype=torch.bool, device=dev)]
    blocks_rows = [torch.cat([causal_block(n, dev).expand(S, n, n),
                              torch.zeros(S, n, n * len(anchors), dtype=torch.bool, device=dev)], 2)]
    for j, (anchor, first, is_seeded) in enumerate(zip(anchors, firsts, seeded)):
        tok = torch.full((S, n), step.mask_token_id, dtype=torch.long, device=dev)
        tok[:, 0] = first
        ids.append(tok)
        rel.append(anchor[:, None] + i[None, :])
        adapter.append(torch.where(is_seeded[:, None], seed_flags, all_flags))
        sees_verify = (i[None, :] < anchor[:, None])[:, None, :].expand(S, n, n)
        own = torch.where(is_seeded[:, None, None], seed_mask, all_see)
        parts = [sees_verify]
        for jj in range(len(anchors)):
            parts.append(own if jj == j else torch.zeros(S, n, n, dtype=torch.bool, device=dev))
        blocks_rows.append(torch.cat(parts, 2))
    return (torch.cat(ids, 1), torch.cat(blocks_rows, 1), torch.cat(adapter, 1),
            torch.cat(rel, 1))


class RecGuide(LinearSS):
    name = "recguide"
    layout = "overlap"
    bucketing = True
    # plan_round already weighs one common step (every row at one block) against the split, on
    # measured step times; a joined step of ragged blocks is never better than its common block
    # at the widest (a longer block only adds drafts), so the engine does not join its groups.
    join_steps = False
    timed = True                    # the gate and the block chooser read measured step times

    def __init__(self, block: int = 8, threshold: float = 0.5, max_corrections: int = 2,
                 continuation: bool = True, branches: str | int = "gate", prior_hits: float = 0.3,
                 policy: str = "reference", blocks: tuple[int, ...] | None = None,
                 tables: SurvivalTables | str | None = None, objective: str = "ratio", rho: float = 0.0,
                 use_signal: bool = True, use_stratum: bool = True, bucketing: bool = True,
                 seed: str = "guess", slots: int = 3, alts: int = 1):
        """block: the (starting) block size. blocks: the set each request chooses from per round
        (None: `block` only, fixed). tables: survival tables (None: a geometric cold start from
        the history signal). branches: "gate" (the cost gate picks the slot count each round) or
        a fixed count. prior_hits: the hit rate assumed for a slot before any round is observed.
        use_signal / use_stratum / bucketing: the ablation steps of the adaptive block size.
        seed: how a correction branch starts: "guess" (the alternative token, the paper's),
        "mask" (seedless: hit by any correction at its position) or "mix" (either, per candidate,
        with the likelihood policy; see the module doc).
        slots: under the likelihood policy, how many candidates (and so branch slots at most) a
        row gets, 1..6; the reference policy always has its three (corr1, corr2, cont).
        alts: guessed corrections per position, the drafter's alts best alternatives (likelihood
        policy, 1..3)."""
        super().__init__(block)
        blocks = (blocks,) if isinstance(blocks, int) else blocks
        self.blocks = tuple(sorted(set(blocks or (block,))))
        if branches != "gate" and not isinstance(branches, int):
            raise FastspecError(f"--branches must be gate or a count, got {branches!r}")
        bad = [b for b in self.blocks if b not in (AR_BLOCK,) + BLOCK_SIZES]
        if bad:
            raise FastspecError(f"--blocks must be among {(AR_BLOCK,) + BLOCK_SIZES}, got {bad}")
        if block not in self.blocks:
            raise FastspecError(f"--block {block} must be one of --blocks {self.blocks}")
        if not 0 <= max_corrections <= 2:
            raise FastspecError(f"--max-corrections must be 0, 1 or 2, got {max_corrections}")
        if not 0 <= threshold <= 1:
            raise FastspecError(f"--risk-threshold must be in [0, 1], got {threshold}")
        if policy not in ("reference", "likelihood"):
            raise FastspecError(f"--branch-policy must be reference or likelihood, got {policy!r}")
        if objective not in ("ratio", "penalty"):
            raise FastspecError(f"--block-objective must be ratio or penalty, got {objective!r}")
        if seed not in ("guess", "mask", "mix"):
            raise FastspecError(f"recguide: seed must be guess, mask or mix, got {seed!r}")
        if seed == "mix" and policy != "likelihood":
            raise FastspecError("recguide: seed=mix ranks guessed and seedless corrections by "
                                "likelihood; it needs policy=likelihood")
        self.seed = seed
        if not 1 <= alts <= MAX_ALTS or (alts > 1 and policy != "likelihood"):
            raise FastspecError(f"recguide: alts must be 1..{MAX_ALTS}, and above 1 needs "
                                f"policy=likelihood, got {alts}")
        self.n_alts = alts
        self.policy = policy
        self.threshold = threshold
        self.max_corrections = max_corrections
        self.continuation = bool(continuation)
        if not 1 <= slots <= MAX_SLOTS or (slots != 3 and policy != "likelihood"):
            raise FastspecError(f"recguide: slots must be 1..{MAX_SLOTS} with policy=likelihood "
                                f"(the reference policy has 3), got {slots}")
        # Candidates per row (host columns); branch slots a layout may have.
        self.n_cand = slots if policy == "likelihood" else 3
        self.max_slots = slots if policy == "likelihood" else max_corrections + int(continuation)
        if branches != "gate" and not 0 <= int(branches) <= self.max_slots:
            raise FastspecError(f"--branches must be gate or 0..{self.max_slots}, got {branches}")
        self.branches = branches
        self.prior_hits = prior_hits
        if isinstance(tables, str):
            tables = SurvivalTables.load(tables)
        self.tables, self.objective, self.rho = tables, objective, rho
        self.use_signal, self.use_stratum = bool(use_signal), bool(use_stratum)
        self.bucketing = bool(bucketing)
        self.eos_ids: tuple[int, ...] = ()
        self.step_ms: dict = {}
        self.rows = 1
        self.forward_ms = RunInfo(1, 1, set(), {}).forward_ms
        self.begin(None)

    # --- host side --------------------------------------------------------------------------
    def key_name(self) -> str:
        return (f"recguide({self.policy},t={self.threshold},corr={self.max_corrections},"
                f"cont={int(self.continuation)},blocks={'/'.join(map(str, self.blocks))},"
                f"bucketing={int(self.bucketing)}"
                f"{({'mask': ',seedless', 'mix': ',mixed'}).get(self.seed, '')}"
                f"{f',slots={self.n_cand}' if self.n_cand != 3 else ''}"
                f"{f',alts={self.n_alts}' if self.n_alts != 1 else ''})")

    def begin(self, run) -> None:
        if run is not None:
            self.eos_ids = tuple(sorted(run.eos_ids))
            self.step_ms = run.step_ms
            self.rows = run.rows
            self.forward_ms = run.forward_ms
        if fresh_counts(run):
            self._reset_counts()
        self.clock = StepClock(self.estimate_ms, self.step_ms)      # measured step times

    def _reset_counts(self) -> None:
        """The report's counts (Tables 3 and 4, the gate's decisions), zero."""
        # Counterfactual hit counts per slot: slot j's wanted branch matched the outcome.
        self.slot_covered = [0] * self.n_cand
        self.slot_trials = [0] * self.n_cand
        # prefix_covered[k]: rounds whose outcome one of the first k wanted candidates covered
        self.prefix_covered = [0] * (self.n_cand + 1)
        # dropped: carried drafts not verified because a step of their own cost more (keep_hits)
        self.table3 = {"rounds": 0, "proposed": 0, "laid_out": 0, "covered": 0, "reused": 0,
                       "dropped": 0}
        self.decisions: dict[int, int] = {}          # branch slots laid out -> rounds
        self.block_choices: dict[int, int] = {}      # block size -> rounds (Table 4)
        self.drafts = DraftMeans()                   # the requests' tokens per drafting round

    def slot_counts(self) -> list[int]:
        return list(range(self.max_slots + 1)) if self.branches == "gate" else [int(self.branches)]

    def plans(self) -> list[Plan]:
        """The steps warmed before timing: the branch layouts the cost gate reaches from this
        device's profile at the prior hit rate (all of them on a GPU at low load; on a CPU,
        where a branch's tokens cost about what a hit saves, often the plain round alone), and
        every other block's plain round. A layout the gate picks later, as hit rates are
        observed, compiles on first use, outside the timed decode (counted as warm-up)."""
        if self.branches == "gate":
            k_draft = self.gate(self.rows, self.block, hit=False)
            k_hit = self.gate(self.rows, self.block, hit=True)
            plans = [Plan(self.block, f"draft{k}") for k in range(k_draft + 1)]
            # A hit needs a branch laid out the round before.
            if k_draft > 0:
                plans += [Plan(self.block, f"hit{k}") for k in range(k_hit + 1)]
        else:
            plans = [Plan(self.block, f"{v}{k}") for k in self.slot_counts() for v in ("draft", "hit")]
        k0 = self.slot_counts()[0]
        return plans + [Plan(b, variant_for(b, k0)) for b in self.blocks if b != self.block]

    def forwards_for(self, variant: str) -> int:
        return 1 if variant.startswith("hit") or variant == AR_VARIANT else 2

    def max_block(self) -> int:
        return max(self.blocks)

    def max_width(self) -> int:
        return self.max_block() * (1 + self.max_slots)

    def step_width(self, plan: Plan) -> int:
        return plan.block * (1 + slots_of(plan.variant))

    def carry_spec(self, vocab_size: int, sampled: bool = False) -> dict[str, CarrySpec]:
        n = self.max_block()
        spec = {"valid": CarrySpec(()), "drafts": CarrySpec((n,)),
                "prob": CarrySpec((n,), torch.float32), "conf": CarrySpec((n,), torch.float32),
                "margin": CarrySpec((n,), torch.float32), "alt": CarrySpec((n, self.n_alts)),
                "alt_prob": CarrySpec((n, self.n_alts), torch.float32)}
        if sampled:
            spec["logp"] = CarrySpec((n, vocab_size), torch.float32)
        return spec

    def hit_rate(self, j: int) -> float:
        """Slot j's observed hit rate (Beta prior worth 4 rounds at `prior_hits`)."""
        return (self.slot_covered[j] + 4 * self.prior_hits) / (self.slot_trials[j] + 4)

    def step_cost(self, rows: int, plan: Plan, forward_ms) -> float:
        """A round's time from forward_ms alone: the overlap forward of the verify row plus k
        branch blocks, and the draft forward unless the drafts were carried (a hit)."""
        t = forward_ms(rows, self.step_width(plan))
        return t if self.forwards_for(plan.variant) == 1 else t + forward_ms(rows, plan.block)

    def estimate_ms(self, rows: int, block: int, variant: str) -> float:
        """step_cost on the run's device profile."""
        return self.step_cost(rows, Plan(block, variant), self.forward_ms)

    def profile_check(self) -> dict:
        """Profile estimate vs measured time of every step this run timed (StepClock.check)."""
        return self.clock.check()

    def step_time_ms(self, rows: int, block: int, variant: str) -> float:
        """A round's time, as measured or the profile's scaled (StepClock.time)."""
        return self.clock.time(rows, block, variant)

    def gate(self, rows: int, block: int, hit: bool, together: int = 1) -> int:
        """Branch slots for the next round: add slot j while its hit rate × the draft forward a
        hit saves exceeds the extra verify cost of its B tokens (step times as measured, the
        profile's for steps not run yet). together: the requests sharing the step; the draft
        forward is saved only if every one of them hits (hit rate ** together)."""
        if self.branches != "gate":
            return int(self.branches)
        v = "hit" if hit else "draft"
        t = lambda variant: self.step_time_ms(rows, block, variant)   # noqa: E731
        k = 0
        while k < self.max_slots:
            saved = t(f"draft{k + 1}") - t(f"hit{k + 1}")          # the draft forward a hit skips
            extra = t(f"{v}{k + 1}") - t(f"{v}{k}")                # slot k+1's branch tokens
            if saved <= 0 or self.hit_rate(k) ** together * saved <= extra:
                break
            k += 1
        return k

    def gate_bound(self, rows: int) -> list[dict]:
        """The most k branch slots laid out every round could give on this device, at this run's
        outcomes: a round is a hit (verify with k slots only) with probability H_k, the share of
        rounds whose outcome one of the row's first k candidates covered (counted whether or not
        they were laid out; before any round, the prior hit rates summed), else a drafting round
        with k slots. Against the plain round, at the same τ:

            bound_k = T(draft0) / (H_k · T(hit k) + (1 − H_k) · T(draft k))

        e.g. forwards of T(B·n) = 34, 41, 55 ms for n = 1, 2, 4 rows' worth of tokens (a drafting
        round adds a 34 ms draft): one slot covering 34% of the outcomes gives 68 / (0.34·41 +
        0.66·75) = 1.07; three slots covering 51% give 68 / (0.51·55 + 0.49·89) = 0.95.
        `measured`: step times as this run measured them (the profile's, scaled, where a layout
        never ran); `profile`: the device profile alone. An upper bound on RecGuide's tok/s over
        LinearSS's at block `self.block`, one row's view: a hit's round commits at most what a
        drafted one would, a branch costs its tokens whatever the outcome, and with R rows in a
        step the draft forward is saved only when all R hit (the gate prices H ** R)."""
        rounds = self.table3["rounds"]
        out, prior = [], 0.0
        for k in range(self.max_slots + 1):
            if k:
                prior = min(1.0, prior + self.prior_hits)
            hits = self.prefix_covered[min(k, self.n_cand)] / rounds if rounds else prior
            row = {"slots": k, "hit_rate": round(hits, 4)}
            for name, t in (("measured", self.step_time_ms), ("profile", self.estimate_ms)):
                plain = t(rows, self.block, "draft0")
                mean = (hits * t(rows, self.block, f"hit{k}")
                        + (1 - hits) * t(rows, self.block, f"draft{k}"))
                row[name] = round(plain / mean, 4)
            out.append(row)
        return out

    def block_values(self, seq) -> dict[int, float]:
        """V_B(s, z) for every B of the set, from the request's recent rounds (the survival
        tables, or a geometric run at s for a block they lack: the cold start)."""
        hist_b, hist_c = seq.state.setdefault("blocks", []), seq.state.setdefault("commits", [])
        s = history_signal(hist_b, hist_c) if self.use_signal else 0.5
        z = stratum(hist_b[-1] if hist_b else None, hist_c[-1] if hist_c else None) \
            if self.use_stratum else "*"
        values = {}
        for b in self.blocks:
            if self.tables is not None and b in self.tables.blocks:
                values[b] = self.tables.value(b, s, z)
            else:
                p = min(max(s, 0.05), 0.95)
                values[b] = float(sum(p ** k for k in range(b)))
        return values

    def choose_block(self, seq) -> int:
        """Verification-guided block size: argmax_B V_B(s, z) / T(B) from the request's recent
        rounds and the measured round time of each B at the current batch bucket."""
        if len(self.blocks) == 1:
            return self.blocks[0]
        ar_run = seq.state.get("ar_run", 0)
        if not seq.state.get("blocks") and not ar_run and self.block_choices and self.bucketing:
            # No history yet: join the block the run's rounds have mostly taken, so a newly
            # admitted request does not split the batch into a bucket of its own.
            return max(self.block_choices, key=self.block_choices.get)
        costs = {}
        for b in self.blocks:
            t = self.clock.ms(self.rows, b, variant_for(b, self.slot_counts()[0]))
            if t is None:                                  # not measured yet: keep the start
                return seq.block or self.block
            costs[b] = t
        values = self.block_values(seq)
        blocks = self.blocks
        if ar_run and ar_run % EXPLORE == 0:
            # Look at the drafts again, once, where drafting could pay at all: a block accepted
            # as far as the run's best request's drafts so far (before any: every draft, B
            # tokens) beats AR's one token per round. Under load on a CPU none does (C=8: a
            # drafting round costs more than B AR rounds; C=4: more than 5 of them, and the best
            # request drafts 4-5 tokens a round), and a look would only add a step to
            # everyone's round.
            drafting = drafting_blocks(blocks)
            best = self.drafts.best if self.look_by_best else None
            if draft_could_pay(((b, costs[b]) for b in drafting), costs[AR_BLOCK], best):
                blocks = drafting
        return choose_block({b: values[b] for b in blocks}, costs, self.objective, self.rho)

    def step_rows(self, n: int) -> int:
        """The rows a step for n requests runs: its own bucket, or the whole batch's unbucketed."""
        return batch_bucket(n) if self.bucketing else self.rows

    def rate(self, value: float, ms: float) -> float:
        return value / ms if self.objective == "ratio" else value - self.rho * ms

    def join_or_split(self, seqs, blocks: list[int]) -> list[int]:
        """The requests' own blocks split the batch into one step per block (each padded to its
        bucket); one common block runs them as one step. Take whichever commits more per ms.
        C=2, a round of T(rows, B) = 2 · (10 + rows · B) ms; a drafts well (V_a = 11.2, 6.73,
        3.71 at B = 16, 8, 4) and wants 16, b badly (V_b = 1.05) and wants 4: split,
        (11.2 + 1.05) / (52 + 28) = 0.153 a ms; common B=8, 7.78 / 52 = 0.150: the split stays.
        Were tokens almost free, one step at B=16 would double the rate."""
        k0 = self.slot_counts()[0]
        t = lambda n, b: self.step_time_ms(self.step_rows(n), b, variant_for(b, k0))  # noqa: E731
        values = [self.block_values(q) for q in seqs]
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b] = counts.get(b, 0) + 1
        best = blocks
        best_rate = self.rate(sum(v[b] for v, b in zip(values, blocks)),
                              sum(t(n, b) for b, n in counts.items()))
        for b in self.blocks:
            if b == AR_BLOCK:           # all AR would undo a request's look at its drafts
                continue
            r = self.rate(sum(v[b] for v in values), t(len(seqs), b))
            if r > best_rate:
                best, best_rate = [b] * len(seqs), r
        return best

    def keep_hits(self, block: int, n_draft: int, n_hit: int) -> bool:
        """Rows whose drafts were carried skip the draft forward only as a step of their own:
        beside rows of the same block that draft, that is a second step. Keep it only when the
        two steps cost less than one draft step for all (the carried drafts are then dropped and
        those rows draft afresh, the same drafts: lossless either way)."""
        if n_draft == 0:
            return True
        k0 = self.slot_counts()[0]
        t = lambda n, v: self.step_time_ms(self.step_rows(n), block, f"{v}{k0}")  # noqa: E731
        return t(n_draft, "draft") + t(n_hit, "hit") < t(n_draft + n_hit, "draft")

    def observe(self, seq) -> bool:
        """Book the previous round's outcome and counterfactual coverage; True if its drafts
        for the next round were carried (a hit)."""
        h = seq.host
        if not h:
            return False
        if seq.block == AR_BLOCK:           # no drafts: nothing to learn about them
            seq.state["ar_run"] = seq.state.get("ar_run", 0) + 1
            return False
        seq.state["ar_run"] = 0
        seq.state.setdefault("blocks", []).append(seq.block)
        seq.state.setdefault("commits", []).append(seq.accept_lengths[-1])
        self.drafts.add(seq.state, seq.accept_lengths[-1])
        wanted = h[H_WANTED]
        covered = [h[H_COVERED + j] for j in range(min(wanted, self.n_cand))]
        for j, c in enumerate(covered):
            self.slot_trials[j] += 1
            self.slot_covered[j] += c
        for k in range(1, self.n_cand + 1):
            self.prefix_covered[k] += int(any(covered[:k]))
        t = self.table3
        t["rounds"] += 1
        t["proposed"] += wanted
        t["laid_out"] += min(wanted, h[H_SLOTS])
        t["covered"] += int(any(h[H_COVERED + j] for j in range(min(wanted, self.n_cand))))
        return h[H_HIT] == 1

    def plan_round(self, seqs) -> list[Plan]:
        """Every running request's next round, planned together: what one request does changes
        the cost of its batch, because rows with different plans run as separate steps.
        - Block sizes (verification-guided): each request's argmax_B V_B / T(B), then
          `join_or_split` against one common block.
        - Hits: carried drafts are verified in a one-forward step of their own when that step
          and the others' round cost less than one round for all (`keep_hits`).
        - Branch slots: the cost gate per step; at R rows a slot saves the draft forward of the
          next round only if all R rows hit (hit rate ** R), so on a busy batch it stays closed."""
        hits = [self.observe(q) for q in seqs]
        # A carried block keeps its size; otherwise the verifier's history picks the next one.
        blocks = [q.block if hit else self.choose_block(q) for q, hit in zip(seqs, hits)]
        drafting = [i for i, hit in enumerate(hits) if not hit]
        if self.bucketing and len(self.blocks) > 1 and len({blocks[i] for i in drafting}) > 1:
            joined = self.join_or_split([seqs[i] for i in drafting], [blocks[i] for i in drafting])
            for i, b in zip(drafting, joined):
                blocks[i] = b
        step_block = (lambda b: b) if self.bucketing else (lambda b: max(blocks))   # noqa: E731
        for b in set(map(step_block, blocks)):
            rows = [i for i in range(len(seqs)) if step_block(blocks[i]) == b]
            n_hit = sum(hits[i] for i in rows)
            if n_hit and not self.keep_hits(b, len(rows) - n_hit, n_hit):
                for i in rows:
                    hits[i] = False
                self.table3["dropped"] += n_hit
        groups: dict[tuple[int, bool], int] = {}
        for b, hit in zip(blocks, hits):
            groups[step_block(b), hit] = groups.get((step_block(b), hit), 0) + 1
        slots = {g: 0 if g[0] == AR_BLOCK else self.gate(self.step_rows(n), g[0], g[1], together=n)
                 for g, n in groups.items()}
        plans = []
        for b, hit in zip(blocks, hits):
            k = slots[step_block(b), hit]
            self.table3["reused"] += hit
            self.decisions[k] = self.decisions.get(k, 0) + 1
            self.block_choices[b] = self.block_choices.get(b, 0) + 1
            plans.append(Plan(b, f"hit{k}" if hit else variant_for(b, k)))
        return plans

    def plan(self, seq) -> Plan:
        """One request planned alone (a batch of one)."""
        return self.plan_round([seq])[0]

    def report(self) -> dict:
        """Table 3 (branch coverage and reuse), Table 4 (block choices) and the gate's decisions
        for the last run."""
        t = dict(self.table3)
        r = max(t["rounds"], 1)
        n = max(sum(self.block_choices.values()), 1)
        t.update(coverage=t["covered"] / r, reuse=t["reused"] / r, no_hit=1 - t["reused"] / r,
                 slot_hit_rates=[round(self.hit_rate(j), 4) for j in range(self.max_slots)],
                 slots_chosen=dict(sorted(self.decisions.items())),
                 block_share={b: c / n for b, c in sorted(self.block_choices.items())},
                 step_ms={f"{rows}x{w}:{v}": round(ms, 3)
                          for (rows, w, v), ms in sorted(self.step_ms.items())},
                 profile_check=self.profile_check(), gate_bound=self.gate_bound(self.rows))
        return t

    # --- inside the step --------------------------------------------------------------------
    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        if variant == AR_VARIANT:
            # Block 1: the AR round (its host values zeros, as wide as a drafting round's).
            return ar_round(SELF_DRAFT, step, pending, carry, H_COVERED + self.n_cand)
        n, S, dev = step.width, pending.shape[0], pending.device
        k_slots = slots_of(variant)
        s = step.sampler
        # Carried blocks are stored at the widest block; this step's rows use the first n.
        widths = {k: v.shape[1] for k, v in carry.items() if v.dim() > 1}
        carry = {k: v[:, :n] if v.dim() > 1 else v for k, v in carry.items()}
        if variant.startswith("hit"):
            drafts, draft_logp = carry["drafts"], carry.get("logp")
            prob, conf, margin = carry["prob"], carry["conf"], carry["margin"]
            alt, alt_prob = carry["alt"], carry["alt_prob"]
        else:
            drafts, draft_logp, logits = self.draft(step, pending, blocks)
            prob, conf, margin, alt, alt_prob = self.stats(logits, drafts)

        # Candidate branches, up to n_cand per row, in slot order: (aligned index of the corrected
        # draft, or the continuation) and whether the row wants it at all.
        rows = torch.arange(S, device=dev)
        # The continuation's first token stands for the bonus. A shifted drafter already guessed
        # it (its last draft, aligned index b-1, predicts position L+b): the branch is then an
        # ordinary seeded draft. An unshifted one starts from a MASK whose in-place draft is the
        # guess.
        bonus_guess = drafts.gather(1, (blocks - 1)[:, None])[:, 0]
        slot_idx, slot_rank, slot_cont, slot_seedless, wanted, c = self.candidates(
            step, blocks, margin, prob, alt_prob, bonus_guess)
        slot_alt = alt[rows[:, None], slot_idx, slot_rank]          # [S, K] a guess's first token
        mask_tok = torch.full_like(bonus_guess, step.mask_token_id)
        cont_first = bonus_guess if step.convention.shift else mask_tok
        anchors, firsts, seeded = [], [], []
        for j in range(k_slots):
            idx, cont, seedless = slot_idx[:, j], slot_cont[:, j], slot_seedless[:, j]
            anchors.append(torch.where(cont, blocks, idx + 1))
            firsts.append(torch.where(cont, cont_first,
                                      torch.where(seedless, mask_tok, slot_alt[:, j])))
            seeded.append(torch.where(cont, torch.full_like(cont, step.convention.shift),
                                      ~seedless))
        verify_ids = torch.cat([pending[:, None], drafts[:, : n - 1]], dim=1)
        if k_slots == 0:
            target_logits = step.forward(verify_ids, causal_block(n, dev))
        else:
            ids, mask, adapter, rel = self.overlap_layout(step, verify_ids, blocks, anchors, firsts,
                                                          seeded)
            logits_all = step.forward(ids, mask, adapter_on=adapter, rel_positions=rel)
            target_logits = logits_all[:, :n]
        emitted, n_emitted, accepted = accept_chain(drafts, target_logits, blocks, s, draft_logp)
        out_tok = emitted[rows, accepted]                           # the correction or the bonus

        # Which outcome each candidate covers (counterfactually, laid out or not): a correction
        # at index i iff the first rejection is d(i+1) and the verifier emitted its alternative
        # (any token, when seedless); the continuation iff every draft was accepted and the bonus
        # was guessed.
        full = accepted >= blocks - 1
        cont_ok = full & (out_tok == bonus_guess) if step.convention.shift else full
        corr_ok = (accepted[:, None] == slot_idx) & ~full[:, None]
        corr_ok = corr_ok & (slot_seedless | (out_tok[:, None] == slot_alt))
        covers = torch.where(slot_cont, cont_ok[:, None], corr_ok) & wanted      # [S, K]
        # A guessed branch (or the continuation) that covers the outcome wins over a seedless one:
        # counterfactually over all candidates (the host's hit rates), and among the laid-out slots
        # for what is carried.
        exact = covers & ~slot_seedless
        laid = torch.arange(covers.shape[1], device=dev)[None, :] < k_slots
        carried = covers & (~slot_seedless | ~(exact & laid).any(-1, keepdim=True))
        covers = covers & (~slot_seedless | ~exact.any(-1, keepdim=True))

        new = {"valid": torch.zeros_like(pending), "drafts": drafts, "prob": prob, "conf": conf,
               "margin": margin, "alt": alt, "alt_prob": alt_prob}
        if draft_logp is not None:
            new["logp"] = draft_logp
        for j in range(k_slots):
            blk = logits_all[:, n * (j + 1): n * (j + 2)]
            b_al = aligned_draft_logits(step.convention, blk, step.mask_token_id)
            cover = carried[:, j]
            if not step.convention.shift:    # unshifted: the continuation guessed the bonus
                guess = aligned_bonus_guess(blk, step.mask_token_id)
                cover = cover & (~slot_cont[:, j] | (guess == out_tok))
            if not s.any_sampled:
                b_drafts, b_logp = b_al.argmax(-1), None
            else:
                b_logp = filtered_logprobs(b_al, s.temperature, s.top_k, s.top_p, s.any_filtered)
                b_drafts = sample_from_logprobs(b_logp, s.uniform(STREAM_BRANCH + j, (n,), rows=S))
            b_prob, b_conf, b_margin, b_alt, b_alt_prob = self.stats(b_al, b_drafts)
            take = cover[:, None]
            new["valid"] = torch.where(cover, torch.ones_like(new["valid"]), new["valid"])
            new["drafts"] = torch.where(take, b_drafts, new["drafts"])
            new["prob"] = torch.where(take, b_prob, new["prob"])
            new["conf"] = torch.where(take, b_conf, new["conf"])
            new["margin"] = torch.where(take, b_margin, new["margin"])
            new["alt"] = torch.where(take[..., None], b_alt, new["alt"])
            new["alt_prob"] = torch.where(take[..., None], b_alt_prob, new["alt_prob"])
            if b_logp is not None:
                new["logp"] = torch.where(take[..., None], b_logp, new["logp"])
        host = torch.cat([c[:, None], wanted.long().sum(-1, keepdim=True), new["valid"][:, None],
                          torch.full_like(c, k_slots)[:, None], covers.long()], 1)
        for k, w in widths.items():
            if w > n:
                pad = (0, 0, 0, w - n) if new[k].dim() == 3 else (0, w - n)
                new[k] = torch.nn.functional.pad(new[k], pad)
        return RoundOutput(emitted, n_emitted, accepted, prob, conf, margin, carry=new, host=host)

    def stats(self, logits: torch.Tensor, drafts: torch.Tensor):
        """Per position: the draft's probability, top-1, margin, and [S, n, alts] the best tokens
        other than the draft with their probabilities (one pass over the vocabulary)."""
        return draft_stats_and_alternatives(logits, drafts, self.eos_ids, k=self.n_alts)

    def candidates(self, step, blocks, margin, prob, alt_prob, bonus_guess):
        """Up to K = n_cand branches per row in slot order: (aligned index [S, K] of the draft a
        correction replaces, which alternative it starts from [S, K], is-continuation [S, K],
        is-seedless [S, K], wanted [S, K]) and the risky count c [S].

        reference: risky = 1 − margin > threshold; by c: 0 -> [cont], 1 -> [corr1, cont],
        2 -> [corr1, corr2, cont], >= 3 -> [corr1, corr2] (earliest risky first).
        likelihood: the K candidates most likely to be hit, by the drafter's own probabilities:
        a correction of d_p is hit with P ≈ Π_{i<p} q(d_i) · q(alt_p) (seedless: · (1 − q(d_p))),
        the continuation with Π_{i<b} q(d_i) · q(bonus guess); alts > 1 adds the next-best
        alternatives at every position, seed=mix the seedless corrections (module doc)."""
        S, n = margin.shape
        dev = margin.device
        conv = step.convention
        i = torch.arange(n, device=dev)
        # Aligned index i judges draft p = i + 1; fastspec's d1 is exact: never a branch point.
        p_min = 2 if exact_first_draft(conv) else 1
        judged = ((i + 1)[None, :] >= p_min) & ((i + 1)[None, :] <= blocks[:, None] - 1)
        risky = ((1 - margin) > self.threshold) & judged
        c = risky.long().sum(-1)
        if self.policy == "likelihood":
            q = torch.where(judged, prob, torch.ones_like(prob))
            before = torch.cumprod(torch.cat([torch.ones_like(q[:, :1]), q[:, :-1]], 1), 1)
            unwanted = torch.full_like(prob, -1.0)
            corr_ok = judged if self.max_corrections > 0 else torch.zeros_like(judged)
            score_of = lambda hit_given_reject: torch.where(corr_ok, before * hit_given_reject,  # noqa: E731
                                                            unwanted)
            seedless = self.seed == "mask"       # every correction seedless (a Python flag)
            if seedless:
                parts = [score_of(1 - prob)]
            else:
                parts = [score_of(alt_prob[..., r]) for r in range(self.n_alts)]
            n_guessed = 0 if seedless else self.n_alts * n   # guessed columns
            if self.seed == "mix":      # seedless at p: the outcomes the guesses at p miss
                parts.append(score_of((1 - prob - alt_prob.sum(-1)).clamp_min(0) * SEEDLESS_VALUE))
            all_acc = before.gather(1, (blocks - 1)[:, None])               # every draft accepted
            g = prob.gather(1, (blocks - 1)[:, None]) if conv.shift else torch.ones_like(all_acc)
            # A Python flag, not a tensor: nothing is copied from the host inside a captured step.
            cont_score = all_acc * g if self.continuation else torch.full_like(all_acc, -1.0)
            score = torch.cat(parts + [cont_score], 1)              # [S, (alts + mix) · n + 1]
            width = score.shape[1]
            if self.n_cand > width:                  # fewer positions than candidates: unwanted
                score = torch.cat([score, score.new_full((S, self.n_cand - width), -1.0)], 1)
            top = score.topk(self.n_cand, dim=-1)
            col = top.indices
            # Worked example, n = 4, alts = 2, mix: columns
            #   [g0 g1 g2 g3 | g0' g1' g2' g3' | m0 m1 m2 m3 | cont]   (' = second alternative)
            # column 5 -> draft 1's second alternative; column 10 -> draft 2's seedless branch.
            # (The continuation and padding columns index no draft: they point at draft 0.)
            corr = col < width - 1
            idx = torch.where(corr, col % n, torch.zeros_like(col))
            rank = torch.where(col < n_guessed, col // n, torch.zeros_like(col))
            return idx, rank, col == width - 1, corr & (col >= n_guessed), top.values >= 0, c
        rank = risky.long().cumsum(-1)
        idx1 = ((rank == 1) & risky).long().argmax(-1)              # aligned index of 1st risky
        idx2 = ((rank == 2) & risky).long().argmax(-1)
        by_kind = torch.stack([(c >= 1) & (self.max_corrections >= 1),
                               (c >= 2) & (self.max_corrections >= 2),
                               (c <= 2) & self.continuation], 1)   # [S, 3]: corr1, corr2, cont
        order = by_kind.long().cumsum(-1)                           # kind's place in the row's list
        kinds = torch.stack([((order == j + 1) & by_kind).long().argmax(-1) for j in range(3)], 1)
        idx = torch.where(kinds == CORR1, idx1[:, None], idx2[:, None])
        wanted = by_kind.long().sum(-1, keepdim=True) > torch.arange(3, device=dev)[None, :]
        cont = kinds == CONT
        return (idx, torch.zeros_like(idx), cont,
                torch.full_like(cont, self.seed == "mask") & ~cont, wanted, c)

    overlap_layout = staticmethod(overlap_layout)     # shared with TiDAR (fastspec/methods/tidar.py)


def aligned_bonus_guess(block_logits: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """An unshifted continuation's in-place draft of its first position (the bonus token)."""
    x = block_logits[:, 0]
    if mask_token_id is not None and 0 <= mask_token_id < x.shape[-1]:
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) == mask_token_id, float("-inf"))
    return x.argmax(-1)
