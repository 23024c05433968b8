"""Who drafts a chain: the backbone with its draft adapter, or a separate DFlash drafter.

A chain method's round is always the same three steps (`chain_round`):

    draft    aligned logits [S, n, V] from the drafter: index i proposes d(i+1)
    verify   the target's forward of `s d1 .. d(n-1)` (causal; a tree method passes its tree mask)
    commit   the drafter's carried state learns what the round committed (DFlash: the context
             ring gets the committed inputs' hidden states; the adapter keeps nothing)

so LinearSS, DFlash and LibraSpec differ only in the drafter and in what the planner reads, and
BASTION builds its tree from either drafter's marginals. Two drafters:

  * `AdapterDraft`: LinearSS's draft forward on the backbone (the adapter's convention decides
    whether d1 is the verifier's own token: `exact_first`).
  * `DFlashDraft`: a DFlash drafter (fastspec/model/dflash.py) over a per-slot context ring of the
    target's hidden states (see `fastspec.methods.dflash` for the ring). Its verify forward also
    captures the drafter's target layers, and `commit` writes the committed inputs into the ring.

Both are lossless: the verifier is the target's plain forward and the shared acceptance rules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastspec.config import FastspecError
from fastspec.convention import (aligned_draft_logits, draft_adapter_flags, draft_block_mask,
                                 exclude_mask_logit)
from fastspec.layout import causal_block
from fastspec.methods.base import CarrySpec, RoundOutput
from fastspec.model.dflash import DFlashDrafter
from fastspec.sampling import STREAM_DRAFT, filtered_logprobs, sample_from_logprobs
from fastspec.verify import accept_chain

DRAFTERS = ("self", "dflash")
NO_DRAFTER = ("this method needs a DFlash drafter: load one with fastspec.model.dflash."
              "load_dflash(PATH, model) (or train one: fastspec train-drafter --kind dflash)")


def exact_first_draft(conv) -> bool:
    """The seed's draft logit is the verifier's own (causal seed without the adapter, shifted)."""
    return conv.shift and conv.seed_attention == "causal" and not conv.seed_adapter


def draft_stats(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per position: the drafter's probability of its draft, top-1 probability, top-1 − top-2."""
    logits = logits.float()
    lse = logits.logsumexp(-1)
    # Top-2 from vectorized reductions a compiled step fuses (max, then max of the rest; a tied
    # maximum gives p1 = p2, as topk does): aten's topk is a fallback call and an arg-max
    # reduction runs scalar on the CPU (~0.5 and ~0.3 ms a round at 9 x 49,152 logits).
    top1 = logits.amax(-1)
    is_top = logits == top1[..., None]
    top2 = torch.where(is_top.sum(-1) > 1, top1, logits.masked_fill(is_top, float("-inf")).amax(-1))
    p1, p2 = (top1 - lse).exp(), (top2 - lse).exp()
    p_draft = (logits.gather(-1, drafts[..., None])[..., 0] - lse).exp()
    return p_draft, p1, p1 - p2


def draft_stats_and_alternatives(logits: torch.Tensor, drafts: torch.Tensor, eos_ids=(),
                                 k: int = 1) -> tuple[torch.Tensor, ...]:
    """`draft_stats` and the k best tokens other than the draft, MASK (already -inf) and EOS,
    with their probabilities ([S, n, k], best first), from one log-sum-exp and one top-m pass
    over the vocabulary: of the top m = k + 1 + #EOS at most 1 + #EOS are banned.

        top 4 (k = 2, one EOS):  [d  e  x  y]  banned [1 1 0 0]  rank among allowed [0 0 1 2]
                                 -> alternatives x, y
    """
    logits = logits.float()
    lse = logits.logsumexp(-1, keepdim=True)
    top = logits.topk(min(k + 1 + len(eos_ids), logits.shape[-1]), dim=-1)
    logp = top.values - lse
    p1, p2 = logp[..., 0].exp(), logp[..., 1].exp()
    p_draft = (logits.gather(-1, drafts[..., None]) - lse)[..., 0].exp()
    banned = top.indices == drafts[..., None]
    for e in eos_ids:
        banned = banned | (top.indices == e)
    rank = (~banned).long().cumsum(-1)
    picks = torch.stack([((rank == r + 1) & ~banned).long().argmax(-1) for r in range(k)], -1)
    return p_draft, p1, p1 - p2, top.indices.gather(-1, picks), logp.gather(-1, picks).exp()


def draft_logits(step, pending: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The draft forward `[seed, MASK×(n−1)]` in the adapter's convention: aligned logits
    [S, n, V] whose index i proposes d(i+1), MASK excluded (row s drafts its first blocks[s])."""
    S, conv = pending.shape[0], step.convention
    ids = torch.full((S, n), step.mask_token_id, dtype=torch.long, device=pending.device)
    ids[:, 0] = pending
    logits = step.forward(ids, draft_block_mask(conv, blocks, n),
                          adapter_on=draft_adapter_flags(conv, S, n, pending.device))
    return aligned_draft_logits(conv, logits, step.mask_token_id)


def sample_drafts(step, logits: torch.Tensor):
    """Drafts [S, n] from aligned logits: argmax under greedy (log-probs None: q is never
    needed), else sampled from the filtered law, whose log-probs [S, n, V] come back too."""
    s, S, n = step.sampler, logits.shape[0], logits.shape[1]
    if not s.any_sampled:
        return logits.argmax(-1), None
    logp = filtered_logprobs(logits, s.temperature[:S], s.top_k[:S], s.top_p[:S], s.any_filtered)
    return sample_from_logprobs(logp, s.uniform(STREAM_DRAFT, (n,), rows=S)), logp


class AdapterDraft:
    """The backbone drafts in diffusion mode with its adapter (LinearSS's draft forward)."""
    name = "self"
    needs_adapter = True
    has_context = False              # no carried state: positions are not needed
    convention_exact = True          # d1 is exact where the model's convention says so
    prefill_capture = None

    missing_drafter = False

    def key_name(self) -> str:
        return "self"

    def draft_share(self, model) -> float:
        """A draft forward's cost as a share of the target's forward of the same width."""
        return 1.0                   # the backbone itself drafts

    def bind_run(self, run) -> None:
        pass

    def mask_token_id(self, step) -> int:
        return step.mask_token_id

    def carry_spec(self) -> dict:
        return {}

    def exact_first(self, step) -> bool:
        return exact_first_draft(step.convention)

    def known(self, step, blocks: torch.Tensor) -> torch.Tensor:
        """Drafts a row proposes: d1..d(b) when shifted (d(b) guesses the bonus), else d1..d(b-1)."""
        return blocks - (0 if step.convention.shift else 1)

    def logits(self, step, pending, blocks, n, carry, positions) -> torch.Tensor:
        return draft_logits(step, pending, blocks, n)

    def segment_logits(self, step, ids, blocks, n, carry, positions) -> torch.Tensor:
        """K draft blocks side by side, ids [S, K·n] (each `s t1 .. M ..`, its own block in the
        adapter's convention, at positions L .. L+n-1): aligned logits [S, K, n, V]."""
        S, conv, dev = ids.shape[0], step.convention, ids.device
        K = ids.shape[1] // n
        own = draft_block_mask(conv, blocks, n)                               # [S, n, n]
        mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool, device=dev)] * K)
        mask = mask[None] & own.repeat(1, K, K)
        flags = draft_adapter_flags(conv, S, n, dev).repeat(1, K)
        rel = torch.arange(n, device=dev).repeat(K).expand(S, K * n)
        logits = step.forward(ids, mask, adapter_on=flags, rel_positions=rel)
        return torch.stack([aligned_draft_logits(conv, logits[:, k * n:(k + 1) * n], step.mask_token_id)
                            for k in range(K)], 1)

    def verify(self, step, ids, block_mask, rel_positions=None):
        return step.forward(ids, block_mask, rel_positions=rel_positions), None

    def commit(self, carry, hidden, positions, committed) -> dict:
        return {}


class DFlashDraft:
    """A separate DFlash drafter over each slot's ring of the target's hidden states."""
    name = "dflash"
    needs_adapter = False
    has_context = True               # the ring: drafts and commits need the rows' positions
    convention_exact = False         # d1 is the drafter's guess, whatever the convention

    def __init__(self, window: int = 1024, drafter: DFlashDrafter | None = None):
        if window < 2:
            raise FastspecError(f"dflash window must be >= 2, got {window}")
        self.window = int(window)
        self.drafter: DFlashDrafter | None = None
        self.prefilled = 0
        if drafter is not None:
            self.bind(drafter)

    # --- host side --------------------------------------------------------------------------
    def bind(self, source) -> "DFlashDraft":
        """Draft with this drafter: a DFlashDrafter, or a target model carrying one (`.dflash`)."""
        drafter = source if isinstance(source, DFlashDrafter) else getattr(source, "dflash", None)
        if drafter is None:
            raise FastspecError(NO_DRAFTER)
        self.drafter = drafter
        return self

    def bind_run(self, run) -> None:
        """At a run's start: without a drafter of its own, take the run model's."""
        if self.drafter is None:
            self.bind(getattr(run, "model", None))

    @property
    def missing_drafter(self) -> bool:
        return self.drafter is None

    def mask_token_id(self, step) -> int:
        return self.bound().cfg.mask_token_id

    def bound(self) -> DFlashDrafter:
        if self.drafter is None:
            raise FastspecError(NO_DRAFTER)
        return self.drafter

    def key_name(self) -> str:
        return f"dflash(window={self.window})"

    def draft_share(self, model) -> float:
        """The drafter's layers over the target's (the head, which both run, left out: a low
        estimate, so a planner that weighs drafting against AR leans to drafting)."""
        cfg = getattr(model, "cfg", None)
        if self.drafter is None or cfg is None:
            return 1.0
        return self.drafter.cfg.layers.num_layers / cfg.num_layers

    def carry_spec(self) -> dict:
        layers, kv_heads, head_dim = self.bound().kv_shape
        shape, dtype = (layers, kv_heads, self.window, head_dim), self.drafter.fc.dtype
        return {"ctx_k": CarrySpec(shape, dtype), "ctx_v": CarrySpec(shape, dtype),
                "ctx_pos": CarrySpec((self.window,), torch.long, -1)}

    def report(self) -> dict:
        return {"drafter": "dflash", "window": self.window,
                "drafter_layers": self.bound().cfg.layers.num_layers,
                "prompt_context": self.prefilled > 0}

    def exact_first(self, step) -> bool:
        return False                 # d1 is the drafter's guess, not the verifier's token

    def known(self, step, blocks: torch.Tensor) -> torch.Tensor:
        return blocks - 1            # block position i proposes L+i: d1..d(b-1)

    # --- the prefill hook (host side, eager) ---------------------------------------------------
    @property
    def prefill_capture(self) -> tuple[int, ...]:
        """Target layers the engine's prefill forward should capture for `prefill_context`."""
        return self.bound().cfg.target_layer_ids

    @torch.no_grad()
    def prefill_context(self, carry: dict[str, torch.Tensor], slots: torch.Tensor,
                        hidden: torch.Tensor, lengths: torch.Tensor) -> None:
        """Fill freshly prefilled slots' context rings with their prompts' last W tokens.

        carry: the engine's carried buffers (all slots); slots [B]; hidden [B, N, K·hidden]: the
        prefill forward's captured layers (right-padded prompts); lengths [B] prompt lengths.
        Index j of the ring gets position L − W + j' with j' chosen so every index is written
        once (positions below 0 mark the entry empty):

            W = 4, L = 6: positions 2 3 4 5 -> indices 2 3 0 1;  L = 2: -2 -1 0 1 -> 2 3 0 1
        """
        W, dev = self.window, hidden.device
        pos = lengths[:, None] - W + torch.arange(W, device=dev)              # [B, W]
        present = pos >= 0
        feats = hidden.gather(1, pos.clamp(min=0)[..., None].expand(-1, -1, hidden.shape[-1]))
        k, v = self.bound().context_kv(feats, pos.clamp(min=0))
        ring = pos % W
        rows = slots[:, None]
        carry["ctx_k"][rows, :, :, ring] = k.permute(0, 3, 1, 2, 4).to(carry["ctx_k"].dtype)
        carry["ctx_v"][rows, :, :, ring] = v.permute(0, 3, 1, 2, 4).to(carry["ctx_v"].dtype)
        carry["ctx_pos"][rows, ring] = torch.where(present, pos, torch.full_like(pos, -1))
        self.prefilled += len(slots)

    # --- inside the step --------------------------------------------------------------------
    def block_logits(self, step, ids, positions, block_mask, carry, n: int) -> torch.Tensor:
        """The drafter forward of K blocks of n, `ids` [S, K·n] at `positions` [S, K·n],
        attending to the rows' rings and within a block by `block_mask` [S, K·n, K·n]: logits
        [S, K, n−1, V] of block positions 1 .. n−1 in place (position i's logits guess the token
        at its own position), MASK excluded. A seed's own logits guess nothing the round needs,
        so the LM head (the drafter's largest GEMM) skips them: n = 4, K = 2,
        `s M M M | s t M M` -> head rows 1 2 3 5 6 7."""
        drafter, target = self.drafter, step.model
        S, K = ids.shape[0], ids.shape[1] // n
        x = F.embedding(ids, target.embed).to(drafter.fc.dtype)       # the target's embeddings
        ctx_pos = carry["ctx_pos"]
        ctx_mask = (ctx_pos >= 0)[:, None, :].expand(S, ids.shape[1], ctx_pos.shape[1])
        h = drafter(x, positions, carry["ctx_k"], carry["ctx_v"], ctx_pos, ctx_mask, block_mask)
        h = h.view(S, K, n, -1)[:, :, 1:]
        return exclude_mask_logit(F.linear(h.to(target.head_weight.dtype), target.head_weight).float(),
                                  drafter.cfg.mask_token_id)

    @staticmethod
    def own_block(blocks: torch.Tensor, n: int) -> torch.Tensor:
        """[S, n, n]: the whole valid block sees itself (seed included); padding only itself."""
        i = torch.arange(n, device=blocks.device)
        valid = i[None, :] < blocks[:, None]
        return (valid[:, :, None] & valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=blocks.device)

    def logits(self, step, pending, blocks, n, carry, positions) -> torch.Tensor:
        """The drafter forward of `[seed, MASK × (n−1)]` at `positions` [S, n]: aligned logits
        [S, n, V] (index i proposes d(i+1); the last index repeats, it proposes nothing)."""
        ids = torch.full((pending.shape[0], n), self.drafter.cfg.mask_token_id, dtype=torch.long,
                         device=pending.device)
        ids[:, 0] = pending
        logits = self.block_logits(step, ids, positions, self.own_block(blocks, n), carry, n)[:, 0]
        # In place: block position i proposes L+i, so index i (the token after verify input i)
        # reads position i+1, which is row i of the head's rows 1 .. n−1.
        return torch.cat([logits, logits[:, -1:]], dim=1)

    def segment_logits(self, step, ids, blocks, n, carry, positions) -> torch.Tensor:
        """K blocks side by side, ids [S, K·n] (each `s t1 .. M ..` at positions L .. L+n-1,
        its filled tokens embedded as tokens), each seeing the ring and its own valid block:
        aligned logits [S, K, n, V]."""
        S = ids.shape[0]
        K = ids.shape[1] // n
        mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool, device=ids.device)] * K)
        mask = mask[None] & self.own_block(blocks, n).repeat(1, K, K)
        logits = self.block_logits(step, ids, positions.repeat(1, K), mask, carry, n)
        return torch.cat([logits, logits[:, :, -1:]], dim=2)

    def verify(self, step, ids, block_mask, rel_positions=None):
        """The target's forward (Step.forward), also returning the drafter's target layers'
        outputs for these tokens [S, n, K·hidden]."""
        return step.forward(ids, block_mask, rel_positions=rel_positions,
                            capture=self.drafter.cfg.target_layer_ids)

    def commit(self, carry, hidden: torch.Tensor, positions: torch.Tensor,
               committed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows' rings with the committed inputs' context K/V written at position % W.
        hidden [S, n, K·hidden], positions [S, n], committed [S, n] bool (a prefix of each row).

            W = 8, L = 10, 3 committed: positions 10 11 12 -> indices 2 3 4; the uncommitted
            inputs at 13 .. write nothing
        """
        W = self.window
        k, v = self.drafter.context_kv(hidden, positions)                   # [S, layers, kv, n, hd]
        ring = positions % W                                                # n <= W: distinct
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        keep = committed[..., None, None, None]
        new = {}
        # carry holds this step's gathered copies of the rows' rings: writing them is local.
        for name, t in (("ctx_k", k), ("ctx_v", v)):
            ctx = carry[name]
            old = ctx[rows, :, :, ring]                                       # [S, n, layers, kv, hd]
            ctx[rows, :, :, ring] = torch.where(keep, t.permute(0, 3, 1, 2, 4).to(ctx.dtype), old)
            new[name] = ctx
        ctx_pos = carry["ctx_pos"]
        ctx_pos[rows, ring] = torch.where(committed, positions, ctx_pos[rows, ring])
        new["ctx_pos"] = ctx_pos
        return new


def commit_path(source, carry, hidden, path, n_emitted, positions) -> dict:
    """After a tree round: the drafter's context learns the committed inputs, the seed (node 0)
    and the accepted path's nodes, at positions L, L+1, ... (positions [S, >= D+1]):

        path [3 5] (depth 1 at node 3, depth 2 at node 5) -> nodes [0 3 5] at L, L+1, L+2
    """
    if hidden is None:
        return {}
    D = path.shape[1]
    nodes = torch.cat([torch.zeros_like(path[:, :1]), path], 1)                # [S, D+1]
    h = hidden.gather(1, nodes[..., None].expand(-1, -1, hidden.shape[-1]))
    committed = torch.arange(D + 1, device=path.device)[None, :] < n_emitted[:, None]
    return source.commit(carry, h, positions[:, : D + 1], committed)


def make_drafter(drafter: str, window: int = 1024, widest: int = 0):
    """The drafter of a method's `drafter=` option; `widest`: the most positions one round
    commits or drafts (a DFlash ring must hold them all at distinct indices)."""
    if drafter not in DRAFTERS:
        raise FastspecError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    if drafter == "self":
        return AdapterDraft()
    if widest > window:
        raise FastspecError(f"dflash window {window} is narrower than a round ({widest} positions)")
    return DFlashDraft(window)


def draft_positions(source, step, n: int, device) -> torch.Tensor | None:
    """[S, n] positions L .. L+n-1 of a round's chain for a drafter with a context, else None."""
    return step.lengths[:, None] + torch.arange(n, device=device) if source.has_context else None


def chain_round(source, step, pending: torch.Tensor, blocks: torch.Tensor, carry):
    """One chain round with drafter `source` (see the module doc): a RoundOutput."""
    n, dev = step.width, pending.device
    positions = draft_positions(source, step, n, dev)
    logits = source.logits(step, pending, blocks, n, carry, positions)
    drafts, draft_logp = sample_drafts(step, logits)
    emitted, n_emitted, accepted, new = verify_chain(source, step, pending, drafts, blocks, carry,
                                                     positions, draft_logp)
    return RoundOutput(emitted, n_emitted, accepted, *draft_stats(logits, drafts), carry=new)


def verify_chain(source, step, pending, drafts, blocks, carry, positions, draft_logp):
    """The chain `[seed, d1 .. d(n-1)]` verified causally, accepted, and committed by length:
    (emitted, n_emitted, accepted, the drafter's new carried state). drafts [S, n] aligned;
    draft_logp: the drafts' law q (None under greedy)."""
    n, dev = drafts.shape[1], drafts.device
    verify_ids = torch.cat([pending[:, None], drafts[:, : n - 1]], dim=1)
    target_logits, hidden = source.verify(step, verify_ids, causal_block(n, dev))
    emitted, n_emitted, accepted = accept_chain(drafts, target_logits, blocks, step.sampler, draft_logp)
    # The committed inputs this round: the seed and the accepted drafts (n_emitted of them).
    committed = torch.arange(n, device=dev)[None, :] < n_emitted[:, None]
    return emitted, n_emitted, accepted, source.commit(carry, hidden, positions, committed)


class DrafterChoice:
    """Mixin for methods that draft with either drafter (`drafter="self"|"dflash"`): the
    engine's hooks (adapter check, carried state, prefill capture) follow the chosen one.
    The method sets `self.source` (make_drafter) in its __init__."""
    source: AdapterDraft | DFlashDraft

    @property
    def needs_adapter(self) -> bool:
        return self.source.needs_adapter

    @property
    def needs_dflash(self) -> bool:
        """Drafts with a DFlash drafter it was not given: the run's model must carry one."""
        return self.source.missing_drafter

    @property
    def prefill_capture(self):
        return self.source.prefill_capture

    def prefill_context(self, carry, slots, hidden, lengths) -> None:
        self.source.prefill_context(carry, slots, hidden, lengths)

    def carry_spec(self, vocab_size: int, sampled: bool = False) -> dict:
        return self.source.carry_spec()

    def bind_drafter(self, run) -> None:
        """At a run's start: a DFlash source without a drafter takes the run model's."""
        self.source.bind_run(run)
