"""TiDAR-style one-forward self-speculation: every round is ONE forward that verifies this round's
draft and pre-drafts the next round for every outcome it can have.

The forward holds the verify row `[s d1 .. d(B-1)]` (causal, adapter off: the base model) plus one
pre-draft sub-block for every possible accepted count j = 0 .. B-1, each laid out exactly like the
draft forward the next round runs after that outcome, in the adapter's drafting convention, and
attending to the verify row's own columns `s d1 .. dj` (RecGuide's overlap layout with a branch
for every outcome: B + B·B tokens per row). B = 3, fastspec's convention (seed causal without the
adapter, token shift; the carried drafts d1 d2 d3 are aligned: d3 is the drafter's bonus guess):

    new tokens (columns)   s  d1 d2 | a1 M  M  | a2 M  M  | d3 M  M
    rel. positions         0  1  2  | 1  2  3  | 2  3  4  | 3  4  5
    adapter                .  .  .  | .  on on | .  on on | .  on on
    j = 0: d1 rejected     a1 = the draft's best token other than d1 (and EOS); sees s
    j = 1: d2 rejected     a2 = the same for d2; sees s d1
    j = 2: all accepted    d3 stands for the bonus; sees s d1 d2

Every sub-block is seeded by a guess of the next round's seed (the token the verifier emits after
j accepted drafts). NLD's unshifted drafter has no guess of the bonus (nothing in its block
predicts L+B), so its all-accepted sub-block is `[M×B]` at L+B (adapter on, the whole block
bidirectional), its first mask filling the bonus in place, as RecGuide's continuation does.

After acceptance the sub-block of the accepted count j is selected: its drafts (and, under
sampling, their filtered log-probs) are carried into the next round, whose one forward verifies
them after the TRUE seed. Unlike RecGuide, the sub-block is used even when its seed guess was
wrong, so no request ever runs a separate draft forward after its first round. That is lossless:
  - the next verify row is `[s' d1' ..]` with s' the token the verifier actually emitted, written
    at its true position; the drafts are just proposals, whatever they were conditioned on;
  - greedy: a draft is accepted only if it equals the base model's argmax after the true prefix;
  - sampling: d(i+1)' was drawn from the carried q_i with this round's own pre-draft stream,
    after the selection (which depends only on this round's acceptance draws), so given the
    committed prefix it is a draw from q_i, fixed before the next round's acceptance uniforms;
    min(1, p/q) acceptance plus residual resampling emits exactly p for ANY such q.
A wrong seed guess only makes the drafts less likely to be accepted (and in fastspec's convention
d1' is no longer exact); `report()` counts how often the selected sub-block had the right seed.
With the shipped SmolLM2 adapter (greedy, GSM8K, B = 4) a right seed was followed by 3.1 committed
tokens, a wrong one by 1.06: τ follows the seed-hit share (18%, mostly missed corrections).

Seedless pre-drafts (`tidar[seed=mask]`, the default; `seed=guess` keeps the guessed seeds
above; `train-drafter --seedless` trains an adapter for them): instead of a guessed correction,
sub-block j < B-1 is `[M×B]` at L+j+1 (adapter on, bidirectional), drafting the tokens AFTER the
correction without knowing it, as TiDAR's own pre-drafts do. Shifted, logit i predicts L+j+2+i, so the drafts
read off the sub-block as they would from a seeded one; unshifted, logit 0 is an in-place guess of
the correction (the seed-hit count reads it) and the drafts start at logit 1. The all-accepted
sub-block keeps the rule above (shifted: seeded by the bonus guess). Measured on the math suite
(B = 4, C = 1, the shipped adapter, results/tidar_layout_shipped.json): τ 1.29 with guessed seeds,
1.76 seedless; 1.79 with an adapter trained for it (results/tidar_layout_trained.json).

Cold start: a request's first round has no pre-draft and runs LinearSS's draft forward first
(two forwards, variant "cold"); every later round is one forward (variant "warm").

Cost: B + B² tokens per forward (B = 4: 20; B = 8: 72). The logits of the B·B pre-draft tokens are
all computed, though only one sub-block's are read (the head runs before the verifier decides).

Block size (`block=auto`, the default): a forward's tokens grow as B², so B is the device's
choice, made per run (each `generate`, each part of an interleaved bench) before its steps are
built: argmax over BLOCK_CHOICES of V(B) / T(C, B + B²), T from the device's profile at the run's
batch bucket and V(B) = (1 − a^B) / (1 − a) the expected commit of a round (1 + Σ_{k<B} a^k) when
each warm verify position is accepted with probability a given the ones before it. a is the
method's own: (accepted + 1) / (accepted + rejections + 2) over its warm rounds on this engine so
far (Laplace's rule: 0.5 before any round; cold rounds verify ordinary drafts, not pre-drafts,
and are left out). A run keeps the last run's B unless another is CHANGE_MARGIN faster, so an
interleaved bench does not rebuild steps for a 1% difference. With the shipped profiles: a 2-core
Zen 4 at fp32 (T(6) = 22.4 ms, T(12) = 34.1, T(20) = 49.8, T(72) = 152 at C=1) picks B = 2 for
every a up to 0.95, at C = 1, 4, 16; an H200 at C=1 picks B = 6 at a = 0.5 and 12 at a = 0.8
(3 and 6 at C=16). `block=N` fixes B.

AR rounds (`ar=1`, the default; `tidar[ar=0]` always drafts): as LibraSpec, D²SD and BASTION do
(methods/ar_rounds.py), a request takes plain AR rounds (one forward of its seed) where its warm
rounds commit clearly fewer tokens per ms than AR rounds would, judged on this run's measured step
times (`prices=profile`: the profile's alone) once 3 warm rounds came in; after EXPLORE AR rounds it
looks at its drafts again where a draft as good as the run's best could pay. A cold round is not
judged: it is what a look pays once to get its first pre-draft, not what drafting costs per round.
An AR round drops the carried pre-draft (it no longer lines up with the sequence), so a look starts
cold. Even B = 2's 6-token forward costs 2 AR steps at 4 rows on a 2-core CPU, so under load TiDAR
now runs AR rounds where it used to draft (C=4, math suite, Zen 4: 0.69x -> 0.93x AR,
results/tidar_ar_rounds_c124_zen4_1208.json); at C = 1 and 2 it keeps drafting.
"""
from __future__ import annotations

from collections import Counter

import torch

from fastspec.config import FastspecError
from fastspec.convention import aligned_draft_logits
from fastspec.methods.ar_rounds import AR_BLOCK, AR_VARIANT, ARSwitch, ar_round, draft_could_pay
from fastspec.methods.base import CarrySpec, Method, Plan, RoundOutput, RunInfo, fresh_counts
from fastspec.methods.drafter import draft_stats_and_alternatives
from fastspec.methods.linear import SELF_DRAFT, LinearSS
from fastspec.methods.recguide import aligned_bonus_guess, overlap_layout
from fastspec.methods.step_clock import StepClock
from fastspec.sampling import filtered_logprobs, sample_from_logprobs
from fastspec.verify import accept_chain

STREAM_PREDRAFT = 24            # the random stream of the selected sub-block's sampled drafts
# Host values a round returns per row: the selected sub-block's seed guess was the emitted token,
# the accepted count (= the selected sub-block), a pre-draft is carried.
H_SEED_HIT, H_ACCEPTED, H_VALID = 0, 1, 2
HOST_COLUMNS = 3
MIN_BLOCK, MAX_BLOCK = 2, 16
BLOCK_CHOICES = (2, 3, 4, 6, 8, 12, 16)     # what `block=auto` chooses from
CHANGE_MARGIN = 1.05                        # ... and how much faster another B must look


class TiDAR(LinearSS):
    name = "tidar"
    layout = "tidar"
    # One block size for every request, one step per variant (cold rows and warm rows).
    bucketing = False
    # `fastspec bench` without --block: TiDAR's own choice from the device's profile, not the
    # suite's B = 8 (a B = 8 round is one 72-token forward; on a CPU 3x a B = 4 round's 20 tokens).
    bench_block = "auto"

    def __init__(self, block: int | str = "auto", seed: str = "mask", ar: int = 1,
                 prices: str = "measured"):
        """seed: how the correction sub-blocks start: "mask" (seedless, TiDAR's layout) or
        "guess" (the draft's alternative token).
        block: B, the verify width; a round's forward has B + B² tokens per row. "auto": chosen
        per run from the device's profile and the acceptance seen so far (module docstring).
        ar: 1, a request takes plain AR rounds where its warm rounds commit clearly fewer tokens
        per ms than AR would (module docstring, methods/ar_rounds.py); 0, it always drafts.
        prices: "measured" (this run's step times, StepClock) or "profile" (the profile's alone)."""
        auto = block == "auto"
        if not auto and (not isinstance(block, int) or not MIN_BLOCK <= block <= MAX_BLOCK):
            raise FastspecError(f"--block for tidar must be auto or an integer in {MIN_BLOCK}..{MAX_BLOCK}, "
                                f"got {block!r}")
        if seed not in ("guess", "mask"):
            raise FastspecError(f"tidar: seed must be mask or guess, got {seed!r}")
        if ar not in (0, 1):
            raise FastspecError(f"tidar: ar must be 0 or 1, got {ar!r}")
        if prices not in ("measured", "profile"):
            raise FastspecError(f"tidar: prices must be measured or profile, got {prices!r}")
        Method.__init__(self, 4 if auto else block)     # (auto: until the first run chooses)
        self.auto, self.seed, self.ar = auto, seed, bool(ar)
        self.timed = self.ar and prices == "measured"   # the AR switch reads measured step times
        self.eos_ids: tuple[int, ...] = ()
        # Warm verify positions seen on this engine (every run, every B): drafts accepted, and
        # rejections (a round that stopped before its last draft). Not reset by begin().
        self.accepted_drafts = 0
        self.rejections = 0
        self.block_choice: dict = {}
        self.begin(None)

    # --- host side --------------------------------------------------------------------------
    def key_name(self) -> str:
        return f"tidar(B={self.block},seed={self.seed},ar={int(self.ar)})"

    def timing_name(self) -> str:
        # Read before begin() chooses B; step times are kept per (rows, width, variant) anyway.
        return f"tidar(B=auto,seed={self.seed},ar={int(self.ar)})" if self.auto else self.key_name()

    @property
    def seedless(self) -> bool:
        """Correction sub-blocks are `[M×B]` (a Python flag: fixed at trace time)."""
        return self.seed == "mask"

    def accept_rate(self) -> float:
        """a: P(a warm verify position is accepted | the ones before it were), Laplace's rule."""
        return (self.accepted_drafts + 1) / (self.accepted_drafts + self.rejections + 2)

    @staticmethod
    def expected_commit(block: int, a: float) -> float:
        """V(B) = 1 + a + ... + a^(B-1): tokens a round commits (accepted drafts + the verifier's
        own token) when each of its B-1 drafts is accepted with probability a after the last."""
        return float(block) if a >= 1.0 else (1.0 - a ** block) / (1.0 - a)

    def choose_block(self, rows: int, forward_ms) -> int:
        """argmax_B V(B) / T(rows, B + B²) over BLOCK_CHOICES; the current B unless another is
        CHANGE_MARGIN faster. Records what it weighed in `block_choice` (the report's)."""
        a = self.accept_rate()
        rate = {b: self.expected_commit(b, a) / max(forward_ms(rows, b + b * b), 1e-9)
                for b in BLOCK_CHOICES}
        best = max(rate, key=rate.get)
        if self.block_choice and rate[best] < CHANGE_MARGIN * rate[self.block]:
            best = self.block
        self.block_choice = {"accept_rate": round(a, 4), "rows": rows, "block": best,
                             "tokens_per_ms": {str(b): round(r, 5) for b, r in rate.items()}}
        return best

    def begin(self, run) -> None:
        if run is not None:
            self.eos_ids = tuple(sorted(run.eos_ids))
            if self.auto:
                self.block = self.choose_block(run.rows, run.forward_ms)
        fresh = fresh_counts(run)
        run = run or RunInfo(1, 1, set(), {})          # a nominal cost model until a run gives one
        self.rows, self.forward_ms = max(run.rows, 1), run.forward_ms
        self.clock = StepClock(self.estimate_ms, getattr(run, "step_ms", {}) if self.timed else {})
        if fresh:
            self.seqs: dict = {}            # this run's requests (report() reads their counts)
            self.seed_trials = 0            # rounds whose pre-draft a next round verified
            self.seed_hits = 0              # ... whose seed guess was the emitted token
            self.variant_rounds: Counter = Counter()        # cold / warm / ar -> rounds
            self.switch = ARSwitch.after(getattr(self, "switch", None))   # who drafts, who takes AR rounds

    def block_for(self, seq) -> int:
        self.seqs[id(seq)] = seq            # (indices restart in each part of an interleaved run)
        return self.block

    def plans(self) -> list[Plan]:
        return [Plan(self.block, "cold"), Plan(self.block, "warm")] + \
            ([Plan(AR_BLOCK, AR_VARIANT)] if self.ar else [])

    # --- host side: AR rounds -----------------------------------------------------------------
    def estimate_ms(self, rows: int, width: int, variant: str) -> float:
        """The profile's ms of a step: an AR round's forward, a warm round's B + B² tokens, or a
        cold round's draft forward (B) before them."""
        if variant == AR_VARIANT:
            return self.forward_ms(rows, 1)
        warm = self.forward_ms(rows, width + width * width)
        return warm + (self.forward_ms(rows, width) if variant == "cold" else 0.0)

    def price(self, block: int, variant: str = "warm") -> float:
        """ms of a round at the run's batch (TiDAR's steps all run at the batch's rows): an AR
        round (block AR_BLOCK), else a round of `variant`, as this run measures its steps."""
        if block == AR_BLOCK:
            return self.clock.time(self.rows, 1, AR_VARIANT)
        return self.clock.time(self.rows, block, variant)

    def look_pays(self, first: bool = False) -> bool:
        """Could a warm round beat AR were it accepted as far as the run's best request's so far
        (before any: every draft, B tokens)? A look's cold round is paid once per look, not per
        round, and is left out. first: a new request's first round (`ARSwitch.first_bound`)."""
        return draft_could_pay([(self.block, self.price(self.block))], self.price(AR_BLOCK),
                               self.switch.bound(first, self.look_by_best))

    def observe(self, seq) -> None:
        """Book the request's last round: a warm round's verify positions are a's data."""
        h = seq.host
        if h and seq.state.get("variant") == "warm":
            self.accepted_drafts += h[H_ACCEPTED]
            self.rejections += h[H_ACCEPTED] < self.block - 1

    def plan_round(self, seqs) -> list[Plan]:
        """Each request's next round: warm where its last round left a pre-draft, cold where it
        did not (its first round, or after an AR round); with `ar`, AR where its warm rounds
        commit clearly fewer tokens per ms than AR rounds would (ARSwitch, judged on warm rounds
        only: a look's one cold round is its entry fee, not its rate).

            cold, warm, warm, warm -> judged (3 warm rounds): AR x16 -> look: cold, warm, ...
        """
        for q in seqs:
            self.observe(q)
        if self.ar:
            # A round that mixed drafting and AR requests is judged at what it cost.
            self.switch.price_last_round(seqs, lambda n, b: self.price(b), self.price_mixed_rounds)
            look_pays, first_pays = self.look_pays(), self.look_pays(first=True)
        plans = []
        for q in seqs:
            h, v = q.host, self.variant_rounds
            block = self.block
            if self.ar:             # (only warm rounds are judged, so they are what `price` prices)
                taken = {AR_BLOCK: v[AR_VARIANT], self.block: v["cold"] + v["warm"]}
                block = self.switch.next_block(q, self.block, self.block, self.price, look_pays,
                                               taken, first_pays=first_pays,
                                               judged=q.state.get("variant") == "warm")
            if block == AR_BLOCK:
                variant = AR_VARIANT
            elif h and h[H_VALID]:
                variant = "warm"
                self.seed_trials += 1
                self.seed_hits += h[H_SEED_HIT]
            else:
                variant = "cold"
            q.state["variant"] = variant
            v[variant] += 1
            plans.append(Plan(block, variant))
        return plans

    def plan(self, seq) -> Plan:
        return self.plan_round([seq])[0]

    def forwards_for(self, variant: str) -> int:
        return 2 if variant == "cold" else 1

    def exact_drafts(self, variant: str) -> bool:
        # A warm round verifies a pre-draft made before its seed was known: d1 is a guess.
        return variant != "warm"

    def step_width(self, plan: Plan) -> int:
        return 1 if plan.variant == AR_VARIANT else self.max_width()

    def max_width(self) -> int:
        # Before a run has chosen (`bench` reserves the cache for every method first): the
        # widest B it may choose, so the cache always has the headroom.
        b = max(BLOCK_CHOICES) if self.auto and not self.block_choice else self.block
        return b * (1 + b)

    def carry_spec(self, vocab_size: int, sampled: bool = False) -> dict[str, CarrySpec]:
        n = self.block
        spec = {"valid": CarrySpec(()), "drafts": CarrySpec((n,)), "alt": CarrySpec((n,)),
                "prob": CarrySpec((n,), torch.float32), "conf": CarrySpec((n,), torch.float32),
                "margin": CarrySpec((n,), torch.float32)}
        if sampled:
            spec["logp"] = CarrySpec((n, vocab_size), torch.float32)
        return spec

    def report(self) -> dict:
        """The last run's rounds (cold, warm and AR), the share of verified pre-drafts whose seed
        guess was right, τ (tokens committed per round, AR rounds included) and tokens per
        forward (prefill included, as the engine's RunStats counts it;
        `decode_tokens_per_forward` leaves the prefill out)."""
        seqs = list(self.seqs.values())
        rounds = sum(s.rounds for s in seqs)
        committed = sum(sum(s.accept_lengths) for s in seqs)
        forwards = sum(s.forwards for s in seqs)
        prefills = sum(1 for s in seqs if s.forwards)
        v = self.variant_rounds
        return {"rounds": rounds, "cold_rounds": v["cold"], "warm_rounds": v["warm"],
                "ar_rounds": v[AR_VARIANT], "ar_share": v[AR_VARIANT] / max(sum(v.values()), 1),
                "looks": self.switch.looks, "ar": int(self.ar),
                "seed_trials": self.seed_trials, "seed_hits": self.seed_hits,
                "seed_hit_share": self.seed_hits / max(self.seed_trials, 1),
                "tau": committed / max(rounds, 1), "block": self.block,
                **({"block_choice": dict(self.block_choice)} if self.block_choice else {}),
                "tokens_per_forward": sum(len(s.output_ids) for s in seqs) / max(forwards, 1),
                "decode_tokens_per_forward": committed / max(forwards - prefills, 1),
                "prices": "measured" if self.timed else "profile", "profile_check": self.clock.check()}

    # --- inside the step --------------------------------------------------------------------
    def layout_tokens(self, step, verify_ids: torch.Tensor, alt: torch.Tensor,
                      bonus_guess: torch.Tensor):
        """(tokens [S, N], mask [S, N, N], adapter flags [S, N], RoPE positions relative to the
        committed length [S, N]), N = B + B·B: the verify row, then sub-block j = 0 .. B-1 at
        positions L+j+1 .., seeded by alt[:, j] (j < B-1; `[M×B]` when seedless) or the bonus
        guess (j = B-1; an unshifted drafter's is `[M×B]`), seeing the verify columns s d1 .. dj."""
        S, n = verify_ids.shape
        dev = verify_ids.device
        shifted, seedless = step.convention.shift, self.seedless
        mask_id = torch.full_like(bonus_guess, step.mask_token_id)
        anchors = [torch.full((S,), j + 1, dtype=torch.long, device=dev) for j in range(n)]
        firsts = [mask_id if seedless else alt[:, j] for j in range(n - 1)] \
            + [bonus_guess if shifted else mask_id]
        seeded = [torch.full((S,), not seedless, dtype=torch.bool, device=dev)] * (n - 1) \
            + [torch.full((S,), shifted, dtype=torch.bool, device=dev)]
        return overlap_layout(step, verify_ids, None, anchors, firsts, seeded)

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        if variant == AR_VARIANT:               # (it drops the pre-draft: the next round is cold)
            return ar_round(SELF_DRAFT, step, pending, carry, HOST_COLUMNS)
        n, S, dev = step.width, pending.shape[0], pending.device
        conv, s = step.convention, step.sampler
        rows = torch.arange(S, device=dev)
        if variant == "warm":
            drafts, draft_logp = carry["drafts"], carry.get("logp")
            prob, conf, margin, alt = carry["prob"], carry["conf"], carry["margin"], carry["alt"]
        else:                                    # cold: no pre-draft yet, draft forward first
            drafts, draft_logp, logits = self.draft(step, pending, blocks)
            prob, conf, margin, alt, _ = draft_stats_and_alternatives(logits, drafts, self.eos_ids)
            alt = alt[..., 0]

        verify_ids = torch.cat([pending[:, None], drafts[:, : n - 1]], dim=1)
        bonus_guess = drafts[:, n - 1]           # shifted: the last aligned draft predicts L+B
        ids, mask, adapter, rel = self.layout_tokens(step, verify_ids, alt, bonus_guess)
        logits_all = step.forward(ids, mask, adapter_on=adapter, rel_positions=rel)
        emitted, n_emitted, accepted = accept_chain(drafts, logits_all[:, :n], blocks, s, draft_logp)
        out_tok = emitted[rows, accepted]                    # the correction or the bonus

        # Select sub-block j = accepted: columns n + j·n .. n + j·n + n-1 of the forward.
        #   n = 3, accepted [0 2] -> columns [[3 4 5] [9 10 11]]
        cols = n + accepted[:, None] * n + torch.arange(n, device=dev)[None, :]
        chosen = logits_all.gather(1, cols[..., None].expand(S, n, logits_all.shape[-1]))
        chosen_al = aligned_draft_logits(conv, chosen, step.mask_token_id)
        # Its seed guess: alt_j after a rejection at j+1; after a full run the bonus guess. An
        # unshifted drafter's `[M×B]` guesses in place (its first logit); a shifted seedless
        # sub-block has no guess (-1: never a hit).
        full = accepted >= n - 1
        in_place = aligned_bonus_guess(chosen, step.mask_token_id)
        cont_guess = bonus_guess if conv.shift else in_place
        if not self.seedless:
            corr_guess = alt.gather(1, accepted[:, None])[:, 0]
        else:
            corr_guess = in_place if not conv.shift else torch.full_like(in_place, -1)
        guess = torch.where(full, cont_guess, corr_guess)
        seed_hit = guess == out_tok

        if not s.any_sampled:
            nxt, nxt_logp = chosen_al.argmax(-1), None
        else:   # drawn after the selection, from a stream the acceptance never reads
            nxt_logp = filtered_logprobs(chosen_al, s.temperature, s.top_k, s.top_p, s.any_filtered)
            nxt = sample_from_logprobs(nxt_logp, s.uniform(STREAM_PREDRAFT, (n,), rows=S))
        nxt_prob, nxt_conf, nxt_margin, nxt_alt, _ = draft_stats_and_alternatives(
            chosen_al, nxt, self.eos_ids)
        new = {"valid": torch.ones_like(pending), "drafts": nxt, "alt": nxt_alt[..., 0],
               "prob": nxt_prob, "conf": nxt_conf, "margin": nxt_margin}
        if nxt_logp is not None:
            new["logp"] = nxt_logp
        host = torch.stack([seed_hit.long(), accepted, new["valid"]], 1)
        return RoundOutput(emitted, n_emitted, accepted, prob, conf, margin, carry=new, host=host)
