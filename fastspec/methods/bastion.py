"""BASTION: budget-aware tree drafting from one draft's position-wise marginals.

One round, node budget N from the planner, draft block W = min(B, N) (B = 8: max depth 7; a
tree of N nodes is never deeper than N − 1, so a budget of 4 drafts 4 wide, not 8):

    1. draft forward  [seed, M×(W−1)], LinearSS's layout (the adapter's convention): aligned index d
       gives the marginal of the token at depth d+1; its K best tokens are the candidates there.
    2. tree           best first by path probability (fastspec/tree.best_first_tree): pop the best
                      candidate, push its best child and its next sibling; stop once a node no
                      longer pays for its share of the round's cost T(n) (profile roofline).
    3. verify forward the N nodes as one tree (each sees its ancestors and the prefix; positions
                      L + depth; adapter off: the base model), accept_tree, and the accepted
                      path's K/V is compacted to L+1.. (RoundOutput.commit_cols).

    marginals (K = 2)      tree (N = 6), nodes in the order best-first adds them
      depth 1: a .7  b .2        s            node     s  a  c  e  d  b
      depth 2: c .6  d .3       / \\          parent   -  0  1  2  1  0
      depth 3: e .9  ...       a   b          depth    0  1  2  3  2  1
                              / \\            path p   1 .7 .42 .378 .21 .2
                             c   d
                             |
                             e

Probabilities the rule reads: the drafter's softmax for greedy rows (its estimate that a token is
the verifier's argmax), the filtered law at the row's temperature for sampled rows. Under
fastspec's convention the seed's logit is the verifier's own, so depth 1 uses the exact target
law (greedy: one node, the argmax). EOS may be a node: the engine ends the request there.

Either drafter (`bastion[drafter=dflash]`, fastspec/methods/drafter.py): with the model's DFlash
drafter, step 1 is the drafter's forward over its context ring (d1 is then its guess, not the
verifier's token), step 3 also captures the drafter's target layers, and the seed and the
accepted path's nodes enter the ring at positions L, L+1, ...

Node budget per request per round (host side, `plan`): the smallest bucket holding the size the
rule wanted last round (one bucket up when it wanted more than the budget), cut to a smaller
budget where that one commits more tokens per ms (`choose=measured`, the default; `choose=rule`:
the rule alone). The rule prices nodes inside one step; it cannot see that a budget of 4 also
drafts 4 wide instead of 8, and at 2 rows on a 2-core CPU a budget-8 round cost 86 ms and AR
rounds won (results/round_mix_c2_bench_recguide_zen4_1207.json). What a smaller budget would
have committed is read from the verifier: best first adds a node after its parent, so the first
b nodes of a tree are the b-node tree, and a round's accepted path tells what each b <= N would
have committed (the path's nodes with index < b, plus the verifier's token; host columns
H_PREFIX..). Per run, E_b = the mean of those over every tree round of budget >= b; the budget is
argmax E_b / price(b) over the budgets up to the rule's (each E_b once COMMIT_ROUNDS rounds
saw it; the rule's own budget until then). A new run starts from the last run's E_b
(ar_rounds.BlockCommits), so a run at C = 2 after one at C = 1 starts at the budget its prices
favour. Inside a step of width N every node is computed anyway, so the tree fills the
budget with the next most likely candidates (`fill`), and steps are keyed by (rows, N) with
bounded padding.

    E_4 = 2.7, E_8 = 3.4 tokens; 1 row: price(4) 40, price(8) 45 ms -> .068 < .076: 8
                                 2 rows: price(4) 50, price(8) 86 ms -> .054 > .040: 4

Not drafting at all (budget 1 in `budgets`, the default set; `bastion[budgets=8/16/32]` is the
rule alone): a request whose last tree rounds committed fewer tokens per ms than plain AR rounds
would (a round of budget N priced at its step's time as this run measures it, StepClock: the
profile's T[N] = draft + an N-node forward and T(rows, 1) for an AR round, scaled to the
measured steps; `prices=profile`: the profile's alone) takes AR rounds (methods/ar_rounds.py). What the verifier accepted decides, not
the tree's path probabilities: on the shipped adapter those are about half the acceptance rate.
"""
from __future__ import annotations

import torch

from fastspec.config import FastspecError
from fastspec.graphs.keys import BATCH_BUCKETS, batch_bucket
from fastspec.methods.ar_rounds import (AR_BLOCK, AR_VARIANT, ARSwitch, BlockCommits, ar_round,
                                        draft_could_pay, drafting_blocks)
from fastspec.methods.base import Method, Plan, RoundOutput, RunInfo, fresh_counts
from fastspec.methods.drafter import (DrafterChoice, commit_path, draft_positions, draft_stats,
                                     make_drafter)
from fastspec.methods.step_clock import StepClock
from fastspec.sampling import filtered_logprobs
from fastspec.tree import best_first_tree, tree_mask
from fastspec.verify import accept_tree

BUDGETS = (4, 8, 16, 32)
DEFAULT_BUDGETS = (AR_BLOCK,) + BUDGETS
H_WANTED, H_NODES = 0, 1        # host columns: nodes the rule wanted, nodes laid out (valid),
H_PREFIX = 2                    # then per tree budget b: tokens its b-node prefix would have
                                # committed (0: b > the round's budget)


class BASTION(DrafterChoice, Method):
    name = "bastion"
    layout = "tree"
    forwards = 2
    bucketing = True
    widen_joined = True             # (its round builds every tree to the step's width anyway)

    def __init__(self, block: int = 16, draft_block: int = 8, top_k: int = 8,
                 budgets: tuple[int, ...] = DEFAULT_BUDGETS, fill: bool = True, drafter: str = "self",
                 window: int = 1024, prices: str = "measured", choose: str = "measured"):
        """block: the starting node budget (one of `budgets`; 1 in them adds the plain AR round,
        taken where no tree pays: module doc). draft_block: the draft forward's
        width (max tree depth draft_block − 1). top_k: candidates per depth. fill: fill the
        budget after the stopping rule (nodes cost nothing extra in a step of that width).
        drafter: "self" (the backbone's adapter) or "dflash" (the model's DFlash drafter, with a
        context ring of `window` committed tokens per request). prices: what the choice between
        trees and AR rounds reads, "measured" (this run's step times, StepClock) or "profile".
        choose: "measured" (the budget up to the rule's with the most tokens per ms, as the
        verifier says smaller trees would have done: module doc) or "rule" (the rule alone)."""
        self.source = make_drafter(drafter, window, draft_block)
        budgets = (budgets,) if isinstance(budgets, int) else tuple(sorted(set(budgets)))
        self.tree_budgets = drafting_blocks(budgets)
        if block not in self.tree_budgets:
            raise FastspecError(f"bastion: starting budget {block} must be one of {self.tree_budgets}")
        if min(budgets) < 1 or not self.tree_budgets or min(self.tree_budgets) < 2:
            raise FastspecError(f"bastion: node budgets must be 1 (the AR round) or >= 2, got {budgets}")
        if not 2 <= draft_block <= 64:
            raise FastspecError(f"bastion: draft block must be in 2..64, got {draft_block}")
        if top_k < 1:
            raise FastspecError(f"bastion: top_k must be >= 1, got {top_k}")
        if prices not in ("measured", "profile"):
            raise FastspecError(f"bastion: prices must be measured or profile, got {prices!r}")
        if choose not in ("measured", "rule"):
            raise FastspecError(f"bastion: choose must be measured or rule, got {choose!r}")
        super().__init__(block)
        self.measured_choice = choose == "measured"
        self.host_columns = H_PREFIX + len(self.tree_budgets)
        self.timed = prices == "measured"
        self.budgets, self.draft_block, self.top_k, self.fill = budgets, draft_block, top_k, bool(fill)
        self.ar = AR_BLOCK in budgets
        self.max_depth = draft_block - 1
        # (rows, budget) -> T[n], the ms of a round with an n-node tree: read inside the traced
        # step (a constant there); one dict updated in place so compiled steps stay valid.
        self.cost_tables: dict[tuple[int, int], tuple[float, ...]] = {}
        self.begin(None)

    # --- host side --------------------------------------------------------------------------
    def key_name(self) -> str:
        return (f"bastion(draft={self.draft_block},k={self.top_k},"
                f"budgets={'/'.join(map(str, self.budgets))},fill={int(self.fill)},"
                f"choose={'measured' if self.measured_choice else 'rule'},"
                f"drafter={self.source.key_name()})")

    def begin(self, run) -> None:
        if run is not None:
            self.bind_drafter(run)
        fresh = fresh_counts(run)
        run = run or RunInfo(1, 1, set(), {})          # a nominal cost model until a run gives one
        self.forward_ms = run.forward_ms
        self.draft_share = self.source.draft_share(getattr(run, "model", None))
        for rows in (b for b in BATCH_BUCKETS if b <= max(run.rows, 1)):
            for budget in self.tree_budgets:
                self.cost_tables[(rows, budget)] = self._costs(rows, budget)
        self.rows = max(run.rows, 1)
        self.clock = StepClock(self.estimate_ms, getattr(run, "step_ms", {}) if self.timed else {})
        if fresh:
            self.commits = BlockCommits(self.tree_budgets, getattr(self, "commits", None))   # E_b
            self.stats = {"rounds": 0, "wanted": 0, "nodes": 0, "budget": 0, "tokens": 0}
            self.switch = ARSwitch.after(getattr(self, "switch", None))     # who builds trees, who AR
            self.budget_rounds: dict[int, int] = {}

    def draft_width(self, budget: int) -> int:
        """The draft forward's width for a tree of `budget` nodes (never deeper than budget − 1)."""
        return min(self.draft_block, budget)

    def _costs(self, rows: int, budget: int) -> tuple[float, ...]:
        draft = self.draft_share * self.forward_ms(rows, self.draft_width(budget))
        return tuple(draft + self.forward_ms(rows, max(n, 1)) for n in range(budget + 2))

    def cost_table(self, rows: int, budget: int) -> tuple[float, ...]:
        """T[n], n = 0 .. budget + 1: ms of a round (the budget's draft forward + an n-node tree
        forward) at `rows` batch rows."""
        if (rows, budget) not in self.cost_tables:      # a bucket the run did not announce
            self.cost_tables[(rows, budget)] = self._costs(rows, budget)
        return self.cost_tables[(rows, budget)]

    def estimate_ms(self, rows: int, budget: int, variant: str) -> float:
        """The profile's ms of a round's step: an AR round's forward, or a draft and a tree of
        `budget` nodes."""
        return self.forward_ms(rows, 1) if variant == AR_VARIANT else self.cost_table(rows, budget)[budget]

    def price(self, budget: int) -> float:
        """ms of a round of `budget` (1: an AR round) at the run's batch, as this run measures
        its steps (the profile's where `prices=profile`)."""
        return self.clock.time(self.rows, budget, AR_VARIANT if budget == AR_BLOCK else "")

    def look_pays(self, first: bool = False) -> bool:
        """Could a look at the drafts after AR rounds pay: would a tree beat AR were it accepted
        as far as the run's best request's so far (before any: all of it)? first: a new
        request's first round, judged at `ARSwitch.first_bound`. (A tree of n nodes emits at
        most min(n, draft block) tokens.)"""
        bound = self.switch.bound(first, self.look_by_best)
        return draft_could_pay(((self.draft_width(n), self.price(n)) for n in self.tree_budgets),
                               self.price(AR_BLOCK), bound)

    def plan_round(self, seqs) -> list[Plan]:
        # A round that mixed trees and AR rounds is judged at what it cost.
        self.switch.price_last_round(
            seqs, lambda n, b: self.clock.time(batch_bucket(n), b, AR_VARIANT if b == AR_BLOCK else ""),
            self.ar and self.price_mixed_rounds)
        return [self.plan(seq) for seq in seqs]

    def measured_budget(self, cap: int) -> int:
        """The budget up to `cap` (the rule's) with the most expected tokens per ms; `cap` itself
        until its E_b is known.

            E_4 = 2.7, E_8 = 3.4; price(4) = 50, price(8) = 86 ms: .054 > .040 -> 4
        """
        E = self.commits.mean
        if not self.measured_choice or E(cap) is None:
            return cap
        return max((E(b) / self.price(b), -b, b) for b in self.tree_budgets
                   if b <= cap and E(b) is not None)[2]

    def plan(self, seq) -> Plan:
        h = seq.host
        drafted = bool(h) and seq.block != AR_BLOCK
        wanted = None
        start = self.measured_budget(self.block)
        if drafted:
            for b, tokens in zip(self.tree_budgets, h[H_PREFIX:]):   # what each b <= budget would have
                if tokens > 0:
                    self.commits.add(b, tokens)
            st, tb, budget = self.stats, self.tree_budgets, seq.block
            st["rounds"] += 1
            st["wanted"] += h[H_WANTED]
            st["nodes"] += h[H_NODES]
            st["budget"] += budget
            st["tokens"] += seq.accept_lengths[-1] if seq.accept_lengths else 0
            # The rule's next budget; one bucket up when it wanted more than the budget.
            wanted = next((b for b in tb if b > budget), tb[-1]) if h[H_WANTED] > budget else \
                next(b for b in tb if b >= h[H_WANTED])
            wanted = self.measured_budget(wanted)
        if self.ar:
            budget = self.switch.next_block(seq, start, wanted, self.price,
                                            self.look_pays(), self.budget_rounds,
                                            first_pays=None if h else self.look_pays(first=True))
        else:
            budget = wanted or (seq.block if h else start)
        self.budget_rounds[budget] = self.budget_rounds.get(budget, 0) + 1
        return Plan(budget, AR_VARIANT if budget == AR_BLOCK else "")

    def plans(self) -> list[Plan]:
        return [Plan(b, AR_VARIANT if b == AR_BLOCK else "") for b in self.budgets]

    def forwards_for(self, variant: str) -> int:
        return 1 if variant == AR_VARIANT else self.forwards

    def max_block(self) -> int:
        return self.max_depth + 1            # the path after the seed plus the verifier's token

    def max_width(self) -> int:
        return max(max(self.budgets), self.draft_block)

    def step_width(self, plan: Plan) -> int:
        if plan.variant == AR_VARIANT:
            return 1
        return plan.block           # the draft block (min(draft_block, nodes) wide), then the tree

    def step_cost(self, rows: int, plan: Plan, forward_ms) -> float:
        if plan.variant == AR_VARIANT:
            return forward_ms(rows, 1)
        return forward_ms(rows, self.draft_width(plan.block)) + forward_ms(rows, plan.block)

    def report(self) -> dict:
        """Average tree sizes (nodes the rule wanted, nodes laid out, budget) and tokens per round."""
        st = self.stats
        r = max(st["rounds"], 1)
        n = max(sum(self.budget_rounds.values()), 1)
        return {"drafter": self.source.name, "rounds": st["rounds"], "mean_wanted_nodes": st["wanted"] / r,
                "ar_share": self.budget_rounds.get(AR_BLOCK, 0) / n, "looks": self.switch.looks,
                "prices": "measured" if self.timed else "profile", "profile_check": self.clock.check(),
                "mean_nodes": st["nodes"] / r, "mean_budget": st["budget"] / r,
                "tau": st["tokens"] / r,
                "choose": "measured" if self.measured_choice else "rule",
                "expected_tokens": self.commits.report(),
                "budget_share": {b: c / n for b, c in sorted(self.budget_rounds.items())}}

    # --- inside the step --------------------------------------------------------------------
    def marginals(self, step, logits: torch.Tensor) -> torch.Tensor:
        """[S, D, V] per-depth probabilities the tree is built from (see the module docstring)."""
        s = step.sampler
        S = logits.shape[0]
        probs = logits.float().softmax(-1)
        law = None
        if s.any_sampled:     # sampled rows: the filtered law they are verified against
            law = filtered_logprobs(logits, s.temperature[:S], s.top_k[:S], s.top_p[:S],
                                    s.any_filtered).exp()
            probs = torch.where((s.temperature[:S] > 0)[:, None, None], law, probs)
        if self.source.exact_first(step):
            # Depth 1 is the verifier's own law (greedy rows: a point mass at the argmax).
            vocab = torch.arange(logits.shape[-1], device=logits.device)
            first = law[:, :1] if law is not None else \
                (vocab == logits[:, :1].argmax(-1, keepdim=True)).float()
            probs = torch.cat([first, probs[:, 1:]], 1)
        return probs

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        if variant == AR_VARIANT:
            return ar_round(self.source, step, pending, carry, self.host_columns)
        N, S = step.width, pending.shape[0]
        W = self.draft_width(N)
        D = W - 1
        dev = pending.device
        chain = draft_positions(self.source, step, W, dev)                 # [S, W] or None
        logits = self.source.logits(step, pending, torch.full_like(pending, W), W, carry,
                                    chain)[:, :D]                              # [S, D, V]
        top_probs, top_tokens = self.marginals(step, logits).topk(self.top_k, dim=-1)
        tree = best_first_tree(top_tokens, top_probs, N, self.cost_table(S, N), root=pending,
                               fill=self.fill)
        mask, depth = tree_mask(tree.parents)
        target_logits, hidden = self.source.verify(step, tree.tokens, mask, rel_positions=depth)
        emitted, n_emitted, accepted, path = accept_tree(tree.tokens, tree.parents, tree.valid,
                                                         target_logits, step.sampler, mask, depth, D)
        new = commit_path(self.source, carry, hidden, path, n_emitted, chain)
        # Draft statistics of the accepted chain (the path's tokens at depths 1..D).
        prob, conf, margin = draft_stats(logits, tree.tokens.gather(1, path))
        host = torch.cat([torch.stack([tree.wanted, tree.valid.long().sum(-1)], 1),
                          prefix_commits(path, accepted, self.tree_budgets, N)], 1)
        return RoundOutput(emitted, n_emitted, accepted, prob, conf, margin, carry=new, host=host,
                           commit_cols=path)


def prefix_commits(path: torch.Tensor, accepted: torch.Tensor, budgets: tuple[int, ...],
                   nodes: int) -> torch.Tensor:
    """[S, len(budgets)]: the tokens a tree of only its first b nodes would have committed, per
    budget b <= nodes (0 for b > nodes: not seen). Best first adds a node after its parent, so
    the first b nodes are the b-node tree, and its accepted path is the part of this round's
    path (node indices, increasing with depth) below index b; then the verifier's token.
    path [S, D]: node indices at depths 1..D; accepted [S]: the path's length.

        path 1 2 5 7, accepted 4: b = 4 -> 1 2 (+1) = 3 tokens, b = 8 -> 5 tokens
    """
    D = path.shape[1]
    on_path = torch.arange(D, device=path.device)[None, :] < accepted[:, None]          # [S, D]
    zeros = torch.zeros_like(accepted)
    return torch.stack([((path < b) & on_path).long().sum(-1) + 1 if b <= nodes else zeros
                        for b in budgets], 1)
