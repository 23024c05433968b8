"""D²SD: dual diffusion drafts on a prefix tree, verified in one forward.

A round with branches runs three forwards:
  1. draft: the usual draft block (LinearSS's), drafts d1..d(b-1) with their probabilities c_p;
  2. re-anchor: for the K most likely first-rejection points p (by Π_{i<p} c_i · (1 − c_p)) a
     second, batched draft fills a block that keeps `s d1 .. d(p-1)` and replaces d_p by its best
     alternative a_p: the drafter (trained with partially masked blocks) continues after a_p;
  3. verify: main chain and the K branches as one prefix tree (the shared prefix is computed
     once), accepted by the tree verifier; the accepted path's K/V is compacted into place.

Worked example, b = 5, K = 2, boundaries p = 2 and p = 4 (fastspec's d1 is exact: never a
boundary). Re-anchor forward (two draft blocks side by side, each seeing only itself):

    segment p=2:  s  d1 a2 M  M        -> drafts after a2:  e3 e4
    segment p=4:  s  d1 d2 d3 a4       -> nothing after a4 (a4 is the last judged position)

Tree verified in forward 3 (node: token, parent), N = b + K·(b−1) = 13 columns, padding invalid:

    0:s  1:d1(0) 2:d2(1) 3:d3(2) 4:d4(3) | 5:a2(1) 6:e3(5) 7:e4(6) 8:- | 9:a4(3) 10:- 11:- 12:-

Either drafter (`d2sd[drafter=dflash]`, fastspec/methods/drafter.py): with the model's DFlash
drafter both drafts are its forwards over the request's context ring (a re-anchored block holds
the real tokens `s d1 .. a_p` before its masks), the tree verify captures its target layers, and
the seed and the accepted path enter the ring.

Alternatives differ from the draft they replace, so siblings carry distinct tokens, and the tree
verifier's walk (sample or argmax at each node, descend into the child that matches) is exact.

The branch gate (`gate=1`, the default; `d2sd[gate=0]` always lays out all K). The branches cost
a re-anchor forward and k(b-1) more verified nodes; what they buy is read from the verifier.
Every round, laid out or not, books for each boundary whether its branch covered the outcome
(the first rejection at p, the verifier's token a_p: `covered_boundaries`), and a laid-out branch
that did adds its continuation's tokens. Between rounds the run lays out the k = 0..K with the
most expected tokens per ms of its step (the step times as measured, StepClock):

    E_k / T(k),   E_k = (mean chain tokens) + Σ_{j<k} hit_j · extra_j

k = 0 is the chain alone: the draft and a chain verify, two forwards (LinearSS's round: causal
verify, committed by length). On a 2-core CPU, where a round with two branches costs about twice
the chain's, the branches rarely pay; on a GPU at low load, where tokens are almost free, they do.

A narrower chain (`narrow=4`, the default; `narrow=0`: none). Branches are laid out at `block`
only, but the chain may also run at the narrower block, LinearSS's round at B = 4: under load a
CPU pays for every token of a forward (at 2 rows on 2 cores a chain round of 8 cost 86 ms, and AR
rounds won, results/round_mix_c2_bench_recguide_zen4_1207.json). What a chain of b would have
committed is read from the verifier: min(the chain's tokens, b), per round that ran at a block
>= b. E_b is the mean over the run (ar_rounds.BlockCommits: the last run's to start from); once
both are known (COMMIT_ROUNDS rounds each) a round runs the narrow chain where
E_narrow / T(narrow, k0) beats the gate's best at `block`. Every drafting request of a round
takes the round's block (D²SD's rows share one step).

    E_4 = 2.7, E_8 = 3.3 (no branch pays); 1 row: T 40 / 45 ms -> .068 < .073: 8
                                           2 rows: T 50 / 86 ms -> .054 > .038: 4

Plain AR rounds (`ar=1`, the default): as LibraSpec and BASTION, a request whose rounds commit
clearly fewer tokens per ms than AR would takes one-forward AR rounds, and looks at the drafts
again now and then (methods/ar_rounds.py); under load on a CPU nothing drafts.
"""
from __future__ import annotations

import torch

from fastspec.config import FastspecError
from fastspec.methods.ar_rounds import (AR_BLOCK, AR_VARIANT, ARSwitch, BlockCommits, ar_round,
                                        draft_could_pay)
from fastspec.methods.base import Plan, RoundOutput, RunInfo, fresh_counts
from fastspec.methods.drafter import (DrafterChoice, commit_path, draft_positions,
                                     draft_stats_and_alternatives, make_drafter, verify_chain)
from fastspec.methods.linear import BLOCK_SIZES, LinearSS
from fastspec.methods.step_clock import StepClock
from fastspec.sampling import point_mass_logp
from fastspec.tree import tree_mask
from fastspec.verify import accept_tree


def variant_for(k: int) -> str:
    """The step variant of a round with k branches ("k0": the chain alone, two forwards)."""
    return f"k{k}"


class D2SD(DrafterChoice, LinearSS):
    name = "d2sd"
    layout = "d2sd"
    forwards = 3

    def __init__(self, block: int = 8, branches: int = 2, drafter: str = "self", window: int = 1024,
                 gate: int = 1, prior_hits: float = 0.3, ar: int = 1, prices: str = "measured",
                 narrow: int | None = None):
        """branches: the most re-anchored branches a round lays out (K). gate: 1, the branch
        gate picks k = 0..K each round from what branches have added per ms (module doc); 0,
        always K (the paper's round). prior_hits: the hit rate assumed for a branch before
        rounds are seen. ar: 1, a request takes plain AR rounds where its rounds commit
        clearly fewer tokens per ms than AR would (methods/ar_rounds.py, as LibraSpec and
        BASTION); 0, it always drafts. prices: "measured" (this run's step times, StepClock) or
        "profile" (the device profile's alone: deterministic plans). drafter: "self" (the
        backbone's adapter) or "dflash" (the model's DFlash drafter, with a context ring of
        `window` committed tokens per request: both drafts are its forwards, the re-anchored
        blocks hold real tokens before their masks). narrow: a narrower chain-only block a
        round may take where it commits more per ms (module doc; 0: none; None: 4 where the
        branches fit its judged positions, branches <= 3)."""
        if block not in BLOCK_SIZES:
            raise FastspecError(f"--block must be one of {BLOCK_SIZES}, got {block}")
        if not 1 <= branches <= block - 2:
            raise FastspecError(f"d2sd: branches must be in 1..{block - 2}, got {branches}")
        if gate not in (0, 1):
            raise FastspecError(f"d2sd: gate must be 0 or 1, got {gate}")
        if not 0.0 <= prior_hits <= 1.0:
            raise FastspecError(f"d2sd: prior_hits must be in [0, 1], got {prior_hits}")
        if ar not in (0, 1):
            raise FastspecError(f"d2sd: ar must be 0 or 1, got {ar}")
        if prices not in ("measured", "profile"):
            raise FastspecError(f"d2sd: prices must be measured or profile, got {prices!r}")
        if narrow is None:
            narrow = 4 if block > 4 and branches <= 3 else 0
        if narrow and not (narrow in BLOCK_SIZES and branches < narrow < block):
            raise FastspecError(f"d2sd: narrow must be 0 or a block of {BLOCK_SIZES} below {block} "
                                f"and above the {branches} branches, got {narrow}")
        self.narrow = int(narrow)
        self.source = make_drafter(drafter, window, block)
        super().__init__(block)
        self.branches = branches
        self.gate, self.prior_hits, self.ar = bool(gate), float(prior_hits), bool(ar)
        # the gate and the AR switch read measured step times
        self.timed = (self.gate or self.ar) and prices == "measured"
        self.eos_ids: tuple[int, ...] = ()
        self.begin(None)

    def key_name(self) -> str:
        return (f"d2sd(k={self.branches},ar={int(self.ar)},narrow={self.narrow},"
                f"drafter={self.source.key_name()})")

    def begin(self, run) -> None:
        if run is not None:
            self.bind_drafter(run)
        fresh = fresh_counts(run)
        run = run or RunInfo(1, 1, set(), {})          # a nominal cost model until a run gives one
        self.eos_ids = tuple(sorted(run.eos_ids))
        self.rows, self.forward_ms = max(run.rows, 1), run.forward_ms
        self.draft_share = self.source.draft_share(getattr(run, "model", None))
        self.clock = StepClock(self.estimate_ms, getattr(run, "step_ms", {}) if self.timed else {})
        if fresh:
            self.commits = BlockCommits(self.chain_blocks(), getattr(self, "commits", None))   # E_b
            K = self.branches
            self.rounds = 0                         # drafting rounds at `block` (the gate's data)
            self.narrow_rounds = 0
            self.chain_tokens = 0                   # what the chain alone would have committed
            self.covered, self.extra, self.hits_laid = [0] * K, [0] * K, [0] * K
            self.chosen: dict[int, int] = {}        # branches laid out -> rounds
            self.switch = ARSwitch.after(getattr(self, "switch", None))   # who drafts, who takes AR rounds
            self.block_rounds: dict[int, int] = {}  # AR_BLOCK or the block -> rounds

    def chain_blocks(self) -> tuple[int, ...]:
        """The blocks a chain round may take: the narrow one (if any), then `block`."""
        return ((self.narrow,) if self.narrow else ()) + (self.block,)

    def nodes(self, k: int | None = None) -> int:
        return self.block + (self.branches if k is None else k) * (self.block - 1)

    def max_width(self) -> int:
        return max(self.nodes(), self.branches * self.block)

    def plans(self) -> list[Plan]:
        ks = range(self.branches + 1) if self.gate else [self.branches]
        return [Plan(self.block, variant_for(k)) for k in ks] + \
            ([Plan(self.narrow, variant_for(0))] if self.narrow and self.gate else []) + \
            ([Plan(AR_BLOCK, AR_VARIANT)] if self.ar else [])

    def forwards_for(self, variant: str) -> int:
        return 1 if variant == AR_VARIANT else 2 if variant == variant_for(0) else 3

    def estimate_ms(self, rows: int, width: int, variant: str) -> float:
        """The profile's ms of a round with k branches: the draft, the re-anchor forward of k
        blocks (none for k = 0) and the verify of the tree's n + k(n-1) nodes; or an AR
        round's forward."""
        if variant == AR_VARIANT:
            return self.forward_ms(rows, 1)
        k, n, t = int(variant[1:] or self.branches), width, self.forward_ms
        draft = self.draft_share * (t(rows, n) + (t(rows, k * n) if k else 0.0))
        return draft + t(rows, n + k * (n - 1))

    def step_cost(self, rows: int, plan: Plan, forward_ms) -> float:
        if plan.variant == AR_VARIANT:
            return forward_ms(rows, 1)
        k = int(plan.variant[1:] or self.branches)
        n = plan.block
        return forward_ms(rows, n) + (forward_ms(rows, k * n) if k else 0.0) + forward_ms(rows, n + k * (n - 1))

    # --- host side: the branch gate -----------------------------------------------------------
    def hit_rate(self, j: int) -> float:
        """Branch j's share of rounds whose outcome it covered (the first rejection at its
        boundary, the verifier's token its alternative): counted in every round, laid out or
        not; a Beta prior worth 4 rounds at prior_hits."""
        return (self.covered[j] + 4 * self.prior_hits) / (self.rounds + 4)

    def mean_chain(self) -> float:
        """Tokens a chain round commits on average (2 before any round: d1 is exact)."""
        return (self.chain_tokens + 2 * 2.0) / (self.rounds + 2)

    def mean_extra(self, j: int) -> float:
        """Tokens branch j adds when it hits and is laid out (its a_p is accepted, then its
        continuation and the verifier's token): before any, a fresh chain's mean minus one."""
        prior = max(self.mean_chain() - 1.0, 1.0)
        return (self.extra[j] + 2 * prior) / (self.hits_laid[j] + 2)

    def branch_value(self, k: int, chain: float | None = None) -> float:
        """Expected tokens of a round with k branches: the chain's (mean_chain unless given),
        plus Σ_{j<k} hit_j · extra_j."""
        value = self.mean_chain() if chain is None else chain
        return value + sum(self.hit_rate(j) * self.mean_extra(j) for j in range(k))

    def choose_block(self, k: int) -> int:
        """The round's block: the narrow chain where E_narrow / T(narrow, k0) beats the round
        at `block` with k branches (its chain's E_block, the branches' gains on top); `block`
        until both are known.

            E_4 = 2.7, E_8 = 3.3, k = 0; T(4) = 50, T(8) = 86 ms: .054 > .038 -> 4
        """
        if not (self.narrow and self.gate):
            return self.block
        e_narrow, e_wide = self.commits.mean(self.narrow), self.commits.mean(self.block)
        if e_narrow is None or e_wide is None:
            return self.block
        wide = self.branch_value(k, e_wide) / self.price(self.block, k)
        return self.narrow if e_narrow / self.price(self.narrow, 0) > wide else self.block

    def choose_branches(self) -> int:
        """k = argmax over 0..K of (mean chain tokens + Σ_{j<k} hit_j · extra_j) / T(k), T the
        round's step time as measured (the profile's, scaled, before it ran).

            chain 3.1 tokens; branch 0 hits 20% and adds 2.5; T(k0) = 45, T(k1) = 80 ms:
            k0: 3.1 / 45 = .069,  k1: 3.6 / 80 = .045  -> k = 0 (a CPU: tokens cost)
            T(k0) = 10, T(k1) = 11 ms (a GPU at low load): .31 vs .33 -> k = 1
        """
        if not self.gate:
            return self.branches
        best, best_rate = 0, 0.0
        for k in range(self.branches + 1):
            rate = self.branch_value(k) / self.clock.time(self.rows, self.block, variant_for(k))
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def price(self, block: int, k: int) -> float:
        """ms of a round at the run's batch: an AR round (block AR_BLOCK), else one with k
        branches, as this run measures its steps (the profile's where `prices=profile`)."""
        if block == AR_BLOCK:
            return self.clock.time(self.rows, 1, AR_VARIANT)
        return self.clock.time(self.rows, block, variant_for(k))

    def look_pays(self, first: bool = False) -> bool:
        """Would a chain round beat AR were it accepted as far as the run's best request's so far
        (before any: every draft, `block` tokens)? first: a new request's first round, judged at
        `ARSwitch.first_bound`."""
        bound = self.switch.bound(first, self.look_by_best)
        return draft_could_pay([(b, self.price(b, 0)) for b in self.chain_blocks()],
                               self.price(AR_BLOCK, 0), bound)

    def observe(self, seq) -> None:
        """Book the request's last round: which branches covered its outcome, and what a laid
        out one added (host columns: covered flags, then boundaries, K each; an AR round has
        none to book)."""
        h, K = seq.host, self.branches
        if not h or seq.block == AR_BLOCK:
            return
        tokens = seq.accept_lengths[-1] if seq.accept_lengths else 0
        laid = seq.state.get("branches", K)
        if seq.block != self.block:                 # a narrow chain round: E_narrow only
            self.narrow_rounds += 1
            self.commits.add(seq.block, tokens)
            return
        chain = tokens
        for j in range(K):
            if h[j]:
                self.covered[j] += 1
                if j < laid:                        # the tree took this branch
                    chain = h[K + j]                # the chain would have stopped at a_p
                    self.hits_laid[j] += 1
                    self.extra[j] += tokens - h[K + j]
        self.rounds += 1
        self.chain_tokens += chain
        for b in self.chain_blocks():               # what a chain of b would have committed
            self.commits.add(b, min(chain, b))

    def plan_round(self, seqs) -> list[Plan]:
        """One k for the round's drafting step (its rows run one step: D²SD does not bucket);
        with `ar`, each request drafts or takes an AR round (ARSwitch: its drafting rounds'
        tokens per ms against AR's, each priced at the k it ran)."""
        for q in seqs:
            self.observe(q)
        # A round that mixed drafting and AR rounds is judged at what it cost (D2SD's steps all
        # run at the batch's rows, its drafting step at the k it laid out).
        last_k = next((q.state.get("branches", 0) for q in seqs if q.host and q.block != AR_BLOCK), 0)
        self.switch.price_last_round(seqs, lambda n, b: self.price(b, last_k),
                                     self.ar and self.price_mixed_rounds)
        k, look_pays = self.choose_branches(), self.ar and self.look_pays()
        block = self.choose_block(k)
        k = k if block == self.block else 0
        first_pays = self.ar and self.look_pays(first=True)
        plans = []
        for q in seqs:
            drafts = True
            if self.ar:
                last_k = q.state.get("branches", k)
                drafts = self.switch.next_block(q, block, block,
                                                lambda b, lk=last_k: self.price(b, lk), look_pays,
                                                self.block_rounds, first_pays=first_pays) != AR_BLOCK
            taken = block if drafts else AR_BLOCK
            self.block_rounds[taken] = self.block_rounds.get(taken, 0) + 1
            if not drafts:
                plans.append(Plan(AR_BLOCK, AR_VARIANT))
            else:               # every drafting request takes the round's block (one step)
                q.state["branches"] = k
                self.chosen[k] = self.chosen.get(k, 0) + 1
                plans.append(Plan(block, variant_for(k)))
        return plans

    def plan(self, seq) -> Plan:
        return self.plan_round([seq])[0]

    def report(self) -> dict:
        n = max(sum(self.chosen.values()), 1)
        all_rounds = max(sum(self.block_rounds.values()), 1)
        return {"drafter": self.source.name, "gate": int(self.gate),
                "rounds": self.rounds + self.narrow_rounds, "narrow_rounds": self.narrow_rounds,
                "ar_share": self.block_rounds.get(AR_BLOCK, 0) / all_rounds, "looks": self.switch.looks,
                "branch_share": {k: c / n for k, c in sorted(self.chosen.items())},
                "hit_rates": [round(self.hit_rate(j), 4) for j in range(self.branches)],
                "mean_extra": [round(self.mean_extra(j), 3) for j in range(self.branches)],
                "mean_chain_tokens": round(self.mean_chain(), 3),
                "expected_chain": self.commits.report(),
                "block_share": {b: c / all_rounds for b, c in sorted(self.block_rounds.items())},
                "prices": "measured" if self.timed else "profile", "profile_check": self.clock.check()}

    # --- inside the step --------------------------------------------------------------------
    def boundaries(self, exact_d1: bool, prob: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[S, K] draft positions p (1-based: d_p) where the first rejection is most likely,
        P(first rejection at p) = Π_{i<p} c_i · (1 − c_p) over the judged drafts (exact_d1: d1 is
        the verifier's own token, never a boundary)."""
        S, n = prob.shape
        p = torch.arange(1, n + 1, device=prob.device)[None, :]            # aligned i -> d_(i+1)
        judged = (p >= (2 if exact_d1 else 1)) & (p <= blocks[:, None] - 1)
        c = torch.where(judged, prob, torch.ones_like(prob))
        before = torch.cumprod(torch.cat([torch.ones_like(c[:, :1]), c[:, :-1]], 1), 1)
        first_reject = torch.where(judged, before * (1 - c), torch.full_like(c, -1.0))
        return first_reject.topk(self.branches, dim=-1).indices + 1        # [S, K]

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        if variant == AR_VARIANT:
            return ar_round(self.source, step, pending, carry, 2 * self.branches)
        n, dev = step.width, pending.device
        K, M = int(variant[1:] or self.branches), self.source.mask_token_id(step)
        positions = draft_positions(self.source, step, n, dev)               # [S, n] or None

        # 1. the first draft: d1..d(n-1) at aligned indices 0..n-2.
        logits = self.source.logits(step, pending, blocks, n, carry, positions)
        drafts = logits.argmax(-1)          # tree candidates are deterministic (see verify.accept_tree)
        prob, conf, margin, alt, _ = draft_stats_and_alternatives(logits, drafts, self.eos_ids)
        alt = alt[..., 0]
        all_bounds = self.boundaries(self.source.exact_first(step), prob, blocks)   # [S, branches]
        bounds = all_bounds[:, :K]                                            # the laid-out ones

        if not K:
            # k0: LinearSS's verify (causal, committed by length: no tree mask, no K/V
            # compaction). The drafts are the argmax, as in a tree round, so under sampling q is
            # the point mass on each (accept d with p(d), else draw from p without d).
            q = point_mass_logp(drafts, logits) if step.sampler.any_sampled else None
            emitted, n_emitted, accepted, new = verify_chain(self.source, step, pending, drafts,
                                                             blocks, carry, positions, q)
            covered = covered_boundaries(emitted, n_emitted, drafts, alt, all_bounds)
            return RoundOutput(emitted, n_emitted, accepted, prob, conf, margin, carry=new,
                               host=torch.cat([covered.long(), all_bounds], 1))

        # 2. re-anchor: segment k keeps s d1..d(p-1), puts a_p at block position p, masks after.
        chain = torch.cat([pending[:, None], drafts[:, : n - 1]], 1)          # s d1 .. d(n-1)
        i = torch.arange(n, device=dev)
        segs = []
        for k in range(K):
            p = bounds[:, k: k + 1]                                           # [S, 1]
            a_p = alt.gather(1, p - 1)                                        # [S, 1]
            seg = torch.where(i[None, :] < p, chain, torch.full_like(chain, M))
            segs.append(torch.where(i[None, :] == p, a_p, seg))
        seg_logits = self.source.segment_logits(step, torch.cat(segs, 1), blocks, n, carry, positions)
        seg_drafts = seg_logits.argmax(-1)    # [S, K, n]: e_(j+1) at aligned j >= p, after a_p

        # 3. the tree, verified in one forward; the accepted path is compacted into place.
        tokens, parents, valid = assemble_tree(chain, alt, seg_drafts, bounds, blocks)
        tmask, depth = tree_mask(parents)
        target_logits, hidden = self.source.verify(step, tokens, tmask, rel_positions=depth)
        emitted, n_emitted, accepted, path = accept_tree(tokens, parents, valid, target_logits,
                                                         step.sampler, tmask, depth, n - 1)
        new = commit_path(self.source, carry, hidden, path, n_emitted, positions)
        covered = covered_boundaries(emitted, n_emitted, drafts, alt, all_bounds)
        return RoundOutput(emitted, n_emitted, accepted, prob, conf, margin, carry=new,
                           commit_cols=path, host=torch.cat([covered.long(), all_bounds], 1))


def covered_boundaries(emitted: torch.Tensor, n_emitted: torch.Tensor, drafts: torch.Tensor,
                       alt: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """[S, K] bool: did boundary k's branch cover the round's outcome — the committed tokens
    follow the drafts d1..d(p-1), then the verifier's token at depth p is a_p? (A branch laid
    out there was the accepted path; one not laid out would have been.) Same answer for a chain
    round and a tree round: emitted [S, n] holds the committed tokens by depth (emitted[:, i]
    at depth i + 1); drafts / alt [S, n] aligned (index i: d_(i+1) and its alternative).

        drafts d1..d4 = 11 12 13 14, alt a2 = 22, a4 = 24; bounds (2, 4)
        committed 11 22 35 (3 tokens): d1 matches, depth 2 is a2  -> covered (1, 0)
        committed 11 12 13 24 (4):     depth 4 is a4              -> covered (0, 1)
    """
    n = emitted.shape[1]
    matches = (emitted[:, : n - 1] == drafts[:, : n - 1]).long().cumprod(-1).sum(-1)   # [S]
    at_p = emitted.gather(1, (bounds - 1).clamp(max=n - 1))                           # [S, K]
    a_p = alt.gather(1, bounds - 1)
    return (matches[:, None] >= bounds - 1) & (at_p == a_p) & (n_emitted[:, None] >= bounds)


def assemble_tree(chain: torch.Tensor, alt: torch.Tensor, seg_drafts: torch.Tensor,
                  bounds: torch.Tensor, blocks: torch.Tensor):
    """(tokens, parents, valid) [S, n + K(n-1)] of the prefix tree: the main chain `s d1 ..
    d(n-1)` at nodes 0..n-1, then branch k at nodes n + k(n-1) ..: a_p (child of node p-1, the
    node that d_p hangs from), then e_(p+1), e_(p+2), ... each the child of the one before;
    a branch node is valid while its draft position is judged (<= b - 1).

    chain [S, n]; alt [S, n] (aligned: alt[:, p-1] replaces d_p); seg_drafts [S, K, n] (aligned
    drafts of re-anchored segment k: index j proposes e_(j+1)); bounds [S, K] (p, 1-based)."""
    S, n = chain.shape
    K = bounds.shape[1]
    dev = chain.device
    i = torch.arange(n, device=dev)
    j = torch.arange(n - 1, device=dev)[None, :]
    tokens, parents, valid = [chain], [(i - 1)[None, :].expand(S, n)], [i[None, :] < blocks[:, None]]
    for k in range(K):
        p = bounds[:, k: k + 1]
        start = n + k * (n - 1)
        src = (p + j - 1).clamp(max=n - 1)          # node j > 0 holds e_(p+j): aligned index p+j-1
        tokens.append(torch.where(j == 0, alt.gather(1, p - 1), seg_drafts[:, k].gather(1, src)))
        parents.append(torch.where(j == 0, p - 1, start + j - 1))
        valid.append(p + j <= blocks[:, None] - 1)
    tokens, parents, valid = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(valid, 1)
    # Padding nodes hang from the root (their own column only matters to themselves).
    parents = torch.where(valid, parents, torch.zeros_like(parents))
    parents[:, 0] = -1
    return tokens, parents, valid
