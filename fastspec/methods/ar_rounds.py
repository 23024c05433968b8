"""Plain AR rounds for drafting methods: where drafting does not pay on this device and load.

A drafting round costs a draft forward and a verify forward; on a CPU under load (C >= 4 on
2 cores) the verify's extra tokens are no longer free, and one token per single-token forward
can beat what a round commits per millisecond. A method whose block set holds AR_BLOCK (1) then
plans a plain AR round (variant "ar": one forward of the seed, no draft), per request and per
round, as a server turns speculation off by batch size:

    after a drafting round   AR iff the request's drafting rounds commit clearly fewer tokens per
                             ms than an AR round does: r <= AR_MARGIN / T_AR, r the moving
                             average (weight 1/RATE_MEMORY) of k_i / T_i, k_i the tokens
                             round i committed, T_i its cost (a round that mixed drafting and
                             AR requests: what its drafting step added to everyone's round,
                             `mixed_round_ms`) and T_AR one AR round's at the run's batch, as
                             the run measures its steps (StepClock: the device
                             profile scaled to them); judged once HISTORY rounds
                             came in since its last AR round (verification-guided: what the
                             verifier accepted, not what the drafter believed; BASTION's tree
                             marginals, for one, under-state acceptance by half on this model)
    after an AR round        AR again; after EXPLORE AR rounds in a row the request drafts
                             HISTORY rounds (at its last drafting width) to look at its drafts
                             again, but only where a draft as good as the run's best
                             request's so far (before any: a perfect one) could beat AR
                             (`draft_could_pay`): a look that cannot pay would only add a
                             step to everyone's round. Each look that finds AR again doubles
                             the run's wait before the next (`ARSwitch`)

The moving average, the HISTORY rounds and the margin keep a request from chasing noise: at C=1
on a 2-core CPU drafting beats AR by ~1.25x on average, and a switch on 3 unlucky rounds (2 tokens
each) cost more than it saved (LibraSpec 1.21x -> 1.07x AR, results/libraspec_bastion_ar_c1_zen4_1207.json);
with the average and no margin BASTION still took AR rounds in 57% of its rounds at C=1 (1.39x ->
1.28x AR, results/libraspec_bastion_ar_c1_zen4_1207_ema.json), its profile-priced rate within 11%
of AR's.
    first round              AR where no draft could pay, drafting as well as the best request
                             known (this run's, else the method's last run's: `first_bound`),
                             or where the run has mostly taken AR rounds
                             (`ARSwitch.first_is_ar`); else the method's start block

An AR round is lossless as any: the seed's forward and the shared sampler. A drafter with a
context (DFlash's ring) still learns the committed seed.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Sequence

import torch

from fastspec.layout import causal_block
from fastspec.methods.base import RoundOutput
from fastspec.sampling import sample_tokens

AR_BLOCK = 1                    # the block that is a plain AR round (no draft, one forward)
AR_VARIANT = "ar"
EXPLORE = 16                    # after EXPLORE AR rounds in a row, a request may draft once again
EXPLORE_MAX = 128               # ... and after at most this many, however often looks found AR
HISTORY = 3                     # drafting rounds before a request's rate is judged
RATE_MEMORY = 6                 # the rate's moving average weighs a new round 1/6
AR_MARGIN = 0.9                 # drafting goes on unless its rate is below 0.9x AR's (set when
                                # rounds were priced by the profile alone: BASTION's round 48 ms and
                                # AR 15.8 at C=1, measured 43 and 18.5 in the same run,
                                # results/libraspec_bastion_ar_c1_zen4_1207_ema.json)


def ar_round(source, step, pending: torch.Tensor, carry: dict, host_columns: int) -> RoundOutput:
    """One forward of the seed, its token committed. source: the method's drafter (its verify
    forward; a drafter with a context commits the seed). Host values: zeros, as many columns as
    the method's drafting rounds report (one host read concatenates every group's). The carry
    comes back whole; a carried pre-draft (the `valid` flag of RecGuide's and TiDAR's) no longer
    lines up with the sequence and is dropped, so the request's next drafting round drafts anew."""
    S, dev = pending.shape[0], pending.device
    positions = step.lengths[:, None] if source.has_context else None
    logits, hidden = source.verify(step, pending[:, None], causal_block(1, dev))
    token = sample_tokens(logits[:, 0], step.sampler)
    new = dict(carry, **source.commit(carry, hidden, positions,
                                      torch.ones(S, 1, dtype=torch.bool, device=dev)))
    if "valid" in new:
        new["valid"] = torch.zeros_like(new["valid"])
    host = torch.zeros(S, host_columns, dtype=torch.long, device=dev)
    return RoundOutput(token[:, None], torch.ones_like(pending), torch.zeros_like(pending),
                       carry=new, host=host)


def draft_could_pay(rounds: Iterable[tuple[int, float]], ar_ms: float,
                    best: float | None = None) -> bool:
    """Could any drafting round beat AR if its request drafted as well as the best the run has
    seen? rounds: (tokens a perfect round commits, ms of that round) for each drafting plan;
    ar_ms: one AR round; best: the most tokens per drafting round any request of the run has
    averaged (`ARSwitch.best`; None before one was judged: every draft accepted).

        C=1 (CPU): [(4, 33), (8, 48)], AR 16   -> 4/33 = .12 > 1/16 = .063: a look may pay
        C=8 (CPU): [(4, 139), (8, 261)], AR 30 -> .029, .031 < .033: never
        C=4 (CPU): [(8, 133)], AR 17 (D2SD, results/round_mix_c4_zen4_1207.json): a perfect
                   draft, 8 / 133 = .060 > 1 / 17 = .059, may pay; were the run's best request
                   so far 4.9 tokens a round, .037, none can. (RecGuide's looks there: 33
                   drafting rounds of a run's 235 with a perfect draft's bound, 3 with the best's.)
    """
    return any(min(tokens, best if best is not None else tokens) / ms > 1.0 / ar_ms
               for tokens, ms in rounds)


def mixed_round_ms(blocks: Sequence[int], price_at: Callable[[int, int], float]) -> float | None:
    """The price a drafting request's round is judged at where the last round mixed drafting
    and AR requests (None where it did not: the caller's price of a round in which every
    request drafts). blocks: each request's last block (AR_BLOCK: an AR round); price_at(n,
    block): ms of a step of that block for n requests (the method's step rows for them).

    The drafters' step is one of its own that every request of the round waits for, so their
    drafting is worth it only if the tokens it adds beat AR's rate over the time it adds:
    Σ(k_i - 1) / (T - T_AR(n)) > n / T_AR(n), T the mixed round. Per drafter, with the added
    time shared, that is k_i / T_eff > 1 / T_AR(n) for

        T_eff = T_AR(n) + n / n_d · (T - T_AR(n))

    (all n drafting: T_eff = T, the all-drafting round's own price).

        For example, at C=4 with prices of the order a 2-core Zen 4 measures (AR 16-20 ms at
        4 rows, a B=8 drafting step ~40 ms at 1 row and 120-130 at 4 rows,
        results/round_mix_c4_zen4_1207.json): AR 20, a lone drafter's step 40, all four 120.
        One request drafting beside three AR requests makes a 60 ms round: T_eff = 20 + 4 · 40
        = 180 ms, and its 6 tokens (.033 a ms) lose to AR's 1 / 20 (.05); priced as a round in
        which all four draft (6 / 120 = .05 against .9 / 20 = .045) it kept drafting.
    """
    n = len(blocks)
    drafting = [b for b in blocks if b != AR_BLOCK]
    if not drafting or len(drafting) == n:
        return None
    ar_all = price_at(n, AR_BLOCK)
    steps = price_at(n - len(drafting), AR_BLOCK) + \
        sum(price_at(m, b) for b, m in Counter(drafting).items())
    return ar_all + n / len(drafting) * max(steps - ar_all, 0.0)


COMMIT_ROUNDS = 8               # rounds before a block's mean commit is believed; a new run's prior


class BlockCommits:
    """What a drafting round of each block commits, per run, as the verifier says (E_b): BASTION
    reads what a b-node prefix of its trees would have committed, D²SD what a chain of b would
    have. Each block's mean is believed once COMMIT_ROUNDS rounds saw it; a new run starts from
    the last run's sums, weighed as COMMIT_ROUNDS rounds at most, so a run at C = 2 after one at
    C = 1 starts from what the drafter commits and only its prices are new.

        last run: 40 rounds, E_4 = 2.9  ->  this run starts at 8 rounds, E_4 = 2.9
    """

    def __init__(self, blocks: Iterable[int], last: "BlockCommits | None" = None):
        old = last.sums if last is not None else {}
        self.sums: dict[int, tuple[float, int]] = {}
        for b in blocks:
            tokens, rounds = old.get(b, (0.0, 0))
            kept = min(rounds, COMMIT_ROUNDS)
            self.sums[b] = (tokens * kept / rounds if rounds else 0.0, kept)

    def add(self, block: int, tokens: float) -> None:
        t, n = self.sums[block]
        self.sums[block] = (t + tokens, n + 1)

    def mean(self, block: int) -> float | None:
        """E_b (None before COMMIT_ROUNDS rounds saw it)."""
        tokens, rounds = self.sums[block]
        return tokens / rounds if rounds >= COMMIT_ROUNDS else None

    def report(self) -> dict[int, float]:
        return {b: round(t / n, 3) for b, (t, n) in self.sums.items() if n}


class DraftMeans:
    """The best drafting a run has seen: per request, its mean tokens per drafting round."""

    def __init__(self):
        self.means: dict[int, float] = {}

    def add(self, state: dict, tokens: int) -> None:
        """A drafting round of the request (state: its seq.state) committed `tokens`."""
        n = state["drafted_rounds"] = state.get("drafted_rounds", 0) + 1
        total = state["drafted_tokens"] = state.get("drafted_tokens", 0) + tokens
        if n >= HISTORY:
            self.means[state.setdefault("drafts_id", len(self.means))] = total / n

    @property
    def best(self) -> float | None:
        """The most tokens per drafting round any request has averaged over its drafting rounds
        (HISTORY at least; None before one has drafted that many): what a look can hope for
        (`draft_could_pay`). The highest of the requests' current means, not of each mean's
        history: a request's first rounds (8, 8, 5 at B=8: 7.0) say less than its eight (4.9)."""
        return max(self.means.values()) if self.means else None


class ARSwitch:
    """Which requests of a run draft and which take AR rounds (host side, one per method and
    run). Per request (seq.state): its drafting rate and the rounds it has seen since its last
    AR round, the AR rounds in a row, and whether it is looking. Per run: the AR rounds before a
    look, which doubles (up to EXPLORE_MAX) each time a look finds drafting still does not pay,
    and is EXPLORE again once one finds it does: whether drafting pays is mostly the load's doing, which
    every request of the run shares, so one request's failed look spares the others theirs.

        AR x16, look: AR again -> AR x32, look: AR again -> AR x64, look: drafts pay -> drafting
    """

    def __init__(self, prior: float | None = None):
        """prior: the best mean tokens per drafting round of an earlier run of the same method
        (`first_bound`), or None."""
        self.explore = EXPLORE
        self.looks = 0
        self.drafts = DraftMeans()
        self.prior = prior
        # The price of the last round for its drafting requests where it mixed them with AR
        # requests (mixed_round_ms; set by the planner before it plans a round), else None.
        self.round_ms: float | None = None

    @classmethod
    def after(cls, last: "ARSwitch | None") -> "ARSwitch":
        """A new run's switch; the method's last run's best request (`first_bound`) its prior."""
        return cls(last.first_bound if last is not None else None)

    @property
    def best(self) -> float | None:
        return self.drafts.best

    def bound(self, first: bool, by_best: bool = True) -> float | None:
        """`draft_could_pay`'s bound: a new request's first round is judged at `first_bound`, a
        look at the run's own `best`; by_best False (a method's `look_by_best`): a perfect draft."""
        if not by_best:
            return None
        return self.first_bound if first else self.best

    def price_last_round(self, seqs, price_at: Callable[[int, int], float], mixed: bool = True) -> None:
        """Before a round's plans: the price its drafting requests' last round is judged at where
        it mixed them with AR requests (`mixed_round_ms` over the requests that ran it, seq.block
        their last block); mixed False (a method's `price_mixed_rounds`): the caller's own price."""
        self.round_ms = mixed_round_ms([q.block for q in seqs if q.host], price_at) if mixed else None

    @property
    def first_bound(self) -> float | None:
        """What a new request's first round is judged by (`draft_could_pay`): the run's best
        request so far, else the best of the method's earlier run (a new run at C=4 then starts
        with AR rounds where the last run's best request could not pay: each of BASTION's first
        four requests built 6-9 trees of 130 ms, 8 AR rounds each, before one was judged,
        results/planners_c24_zen4_1207_evening.json), else a perfect draft. Looks keep the
        run's own bound (`best`: a perfect draft until one of its requests is judged), so a run
        whose text drafts better than the last run's still finds it after EXPLORE AR rounds."""
        own = self.drafts.best
        return own if own is not None else self.prior

    def record(self, seq, tokens: int, ms: float) -> None:
        """A drafting round of the request committed `tokens` in a round priced `ms`."""
        st, rate = seq.state, tokens / ms
        old = st.get("rate")
        st["rate"] = rate if old is None else old + (rate - old) / RATE_MEMORY
        st["judged"] = st.get("judged", 0) + 1
        self.drafts.add(st, tokens)

    @staticmethod
    def drafting_pays(seq, ar_ms: float) -> bool | None:
        """Do the request's drafting rounds commit more per ms than AR rounds would? None until
        HISTORY rounds came in (one round is noise: a drafter right 60% of the time commits 2
        tokens, the fewest, in 40% of its rounds)."""
        if seq.state.get("judged", 0) < HISTORY:
            return None
        return seq.state["rate"] > AR_MARGIN / ar_ms

    def next_is_ar(self, seq, ar_ms: float, look_pays: bool) -> bool:
        """The request's next round (after `record` booked its last one if it drafted).
        seq.block: its last round's block (AR_BLOCK: an AR round); ar_ms: one AR round at the
        run's batch; look_pays: a look could beat AR (draft_could_pay). Going AR
        forgets the drafting rate: a look is judged on its own HISTORY rounds."""
        st = seq.state
        if seq.block != AR_BLOCK:
            pays = self.drafting_pays(seq, ar_ms)
            if pays is None:
                return False
            if st.get("looked"):
                self.explore = EXPLORE if pays else min(2 * self.explore, EXPLORE_MAX)
            st["ar_run"], st["looked"] = 0, False
            if not pays:
                st["rate"], st["judged"] = None, 0
            return not pays
        run = st["ar_run"] = st.get("ar_run", 0) + 1
        if look_pays and run >= self.explore:
            st["looked"] = True
            self.looks += 1
            return False
        return True

    def next_block(self, seq, start: int, wanted: int | None, price, look_pays: bool,
                   taken: dict[int, int], first_pays: bool | None = None, judged: bool = True) -> int:
        """The block of the request's next round, AR_BLOCK or a drafting one, for a method with
        AR rounds in its set. start: the method's start block (a first round's, and a look's by
        a request that has not drafted yet); wanted: what the method's rule
        wants after the drafting round just run (None after an AR round or before the first);
        price(block): ms of a round of that block at the run's batch (block 1: an AR round);
        look_pays: a look could beat AR (draft_could_pay); taken: rounds per block so far in the run;
        first_pays: a first round could beat AR (draft_could_pay at `first_bound`; None: look_pays);
        judged: the drafting round just run counts toward the request's rate (TiDAR's cold
        rounds do not: a look pays its draft forward once, not every round).

            first round                -> start, or AR (first_is_ar)
            after a drafting round     -> wanted (kept for a later look), or AR (next_is_ar)
            after an AR round          -> AR, or a look at the last wanted block
        """
        if not seq.host:
            pays = look_pays if first_pays is None else first_pays
            ar = self.first_is_ar(pays, taken.get(AR_BLOCK, 0), sum(taken.values()))
            return AR_BLOCK if ar else start
        if seq.block != AR_BLOCK:
            seq.state["wanted"] = wanted
            if judged:
                self.record(seq, seq.accept_lengths[-1] if seq.accept_lengths else 0,
                            self.round_ms or price(seq.block))
        if self.next_is_ar(seq, price(AR_BLOCK), look_pays):
            return AR_BLOCK
        return seq.state.get("wanted") or start

    @staticmethod
    def first_is_ar(look_pays: bool, ar_rounds: int, rounds: int) -> bool:
        """A new request's first round (no drafts seen yet): AR where not even a draft as good as
        the best known (`first_bound`) could pay at this load, or where the run's rounds so far
        were mostly AR rounds (at least EXPLORE of them): it joins them rather than add a
        drafting step of its own to everyone's round, and looks at its drafts when the run's
        wait is over."""
        return not look_pays or (rounds >= EXPLORE and 2 * ar_rounds > rounds)


def drafting_blocks(blocks: Sequence[int]) -> tuple[int, ...]:
    """The blocks of a set that draft (all but the AR round)."""
    return tuple(b for b in blocks if b != AR_BLOCK)
