"""DFlash: a separate block-diffusion drafter that reads the target's hidden states.

A round for a row with committed length L and seed s (sampled, not yet in the cache), B = 4:

    draft   (the drafter, fastspec/model/dflash.py)
        tokens    s  M  M  M      at L .. L+3, the target's embeddings, bidirectional in the block
        keys      the row's carried context K/V (committed tokens) + the block's own
        predicts  -  d1 d2 d3     block position i -> the token at L+i (target LM head, MASK -inf)
    verify  (the target, causal, no adapter): [s d1 d2 d3], also returning the outputs of the
            drafter's `target_layer_ids` for these 4 tokens; accept_chain emits a+1 tokens
    context the committed inputs s d1 .. da (positions L .. L+a) -> fc, hidden_norm -> every
            drafter layer's K/V, written into the row's carried ring

The context is a ring of W entries per slot (`window`, carried: `ctx_k`, `ctx_v` [layers,
kv_heads, W, head_dim] and `ctx_pos` [W], -1 = empty): position p lives at index p % W, so a
request longer than W keeps its last W committed tokens (a sliding window over the context, as
DFlash's optional draft window; drafts only steer speed, verification keeps the output exact).

    W = 8, L = 10, 3 committed this round: positions 10 11 12 -> indices 2 3 4 (over 2 .. 4 of
    the previous lap); the uncommitted verify inputs at 13 .. write nothing

Cold start. The engine's prefill does not capture hidden states, so by default a request's
context starts empty: its first round drafts from `[s, M ...]` alone and every committed token
from then on (first round's seed included) enters the context; the prompt never does. With the
prefill hook (`prefill_capture` / `prefill_context`, an engine change the lead may apply: the
prefill forward captures the drafter's target layers and hands them here), the context holds
the prompt's last W tokens from the first round on, as in DFlash. Either way the output is AR's.

Counting: a round is 2 forwards (drafter + target verify); `report()` gives the drafter forwards
separately (one per request-round, a few layers against the target's whole stack).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastspec.config import FastspecError
from fastspec.convention import exclude_mask_logit
from fastspec.layout import block_placement, causal_block
from fastspec.methods.base import CarrySpec, Method, Plan, RoundOutput
from fastspec.methods.linear import draft_stats
from fastspec.model.dflash import DFlashDrafter
from fastspec.sampling import STREAM_DRAFT, filtered_logprobs, sample_from_logprobs
from fastspec.verify import accept_chain

NO_DRAFTER = ("method 'dflash' needs a DFlash drafter: load one with fastspec.model.dflash."
              "load_dflash(PATH, model) (or train one: fastspec train-drafter --kind dflash)")


class DFlash(Method):
    name = "dflash"
    layout = "dflash"               # a drafter forward then a capturing chain verify, one step
    forwards = 2

    def __init__(self, block: int | None = None, window: int = 1024,
                 drafter: DFlashDrafter | None = None):
        """block: seed + masks per round (default: the drafter's trained block size); window: the
        committed tokens of context kept per request; drafter: a DFlashDrafter (default: the
        target model's `dflash`, bound when the run starts)."""
        if window < 2:
            raise FastspecError(f"dflash window must be >= 2, got {window}")
        super().__init__(block or 0)
        self.requested_block = block
        self.window = int(window)
        self.drafter: DFlashDrafter | None = None
        self.drafter_forwards = 0
        self.prefilled = 0
        if drafter is not None:
            self.bind(drafter)

    # --- host side --------------------------------------------------------------------------
    def bind(self, source) -> "DFlash":
        """Run with this drafter: a DFlashDrafter, or a target model carrying one (`.dflash`)."""
        drafter = source if isinstance(source, DFlashDrafter) else getattr(source, "dflash", None)
        if drafter is None:
            raise FastspecError(NO_DRAFTER)
        block = self.requested_block or drafter.cfg.block_size
        if not 2 <= block <= self.window:
            raise FastspecError(f"dflash block must be in 2..window ({self.window}), got {block}")
        self.drafter, self.block = drafter, block
        return self

    def _bound(self) -> DFlashDrafter:
        if self.drafter is None:
            raise FastspecError(NO_DRAFTER)
        return self.drafter

    def begin(self, run) -> None:
        model = getattr(run, "model", None)          # bound from the run's model when offered
        if self.drafter is None and model is not None:
            self.bind(model)
        self._bound()
        self.drafter_forwards = 0
        self.prefilled = 0

    def key_name(self) -> str:
        return f"dflash(window={self.window})"

    def max_block(self) -> int:
        self._bound()
        return self.block

    def plan(self, seq) -> Plan:
        self.drafter_forwards += 1              # this request's round runs one drafter forward
        return Plan(seq.block)

    def carry_spec(self, vocab_size: int, sampled: bool = False) -> dict[str, CarrySpec]:
        layers, kv_heads, head_dim = self._bound().kv_shape
        shape, dtype = (layers, kv_heads, self.window, head_dim), self.drafter.fc.dtype
        return {"ctx_k": CarrySpec(shape, dtype), "ctx_v": CarrySpec(shape, dtype),
                "ctx_pos": CarrySpec((self.window,), torch.long, -1)}

    def report(self) -> dict:
        return {"drafter_forwards": self.drafter_forwards, "window": self.window,
                "drafter_layers": self._bound().cfg.layers.num_layers,
                "prompt_context": self.prefilled > 0}

    # --- the prefill hook (host side, eager) ---------------------------------------------------
    @property
    def prefill_capture(self) -> tuple[int, ...]:
        """Target layers the engine's prefill forward should capture for `prefill_context`."""
        return self._bound().cfg.target_layer_ids

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
        k, v = self._bound().context_kv(feats, pos.clamp(min=0))
        ring = pos % W
        rows = slots[:, None]
        carry["ctx_k"][rows, :, :, ring] = k.permute(0, 3, 1, 2, 4).to(carry["ctx_k"].dtype)
        carry["ctx_v"][rows, :, :, ring] = v.permute(0, 3, 1, 2, 4).to(carry["ctx_v"].dtype)
        carry["ctx_pos"][rows, ring] = torch.where(present, pos, torch.full_like(pos, -1))
        self.prefilled += len(slots)

    # --- inside the step --------------------------------------------------------------------
    def draft(self, step, pending: torch.Tensor, blocks: torch.Tensor, carry, positions):
        """Drafter forward: drafts [S, n] (index i proposes d(i+1)), their filtered log-probs
        (None under greedy) and the aligned logits."""
        drafter, target = self.drafter, step.model
        S, n, dev = pending.shape[0], step.width, pending.device
        mask_id = drafter.cfg.mask_token_id
        ids = torch.full((S, n), mask_id, dtype=torch.long, device=dev)
        ids[:, 0] = pending
        x = F.embedding(ids, target.embed).to(drafter.fc.dtype)       # the target's embeddings
        i = torch.arange(n, device=dev)
        valid = i[None, :] < blocks[:, None]                             # [S, n]
        # The whole valid block sees itself (seed included); padding sees only itself.
        block_mask = (valid[:, :, None] & valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=dev)
        ctx_pos = carry["ctx_pos"]
        ctx_mask = (ctx_pos >= 0)[:, None, :].expand(S, n, ctx_pos.shape[1])
        h = drafter(x, positions, carry["ctx_k"], carry["ctx_v"], ctx_pos, ctx_mask, block_mask)
        logits = exclude_mask_logit(F.linear(h.to(target.head_weight.dtype), target.head_weight).float(),
                                    mask_id)
        # In place: block position i proposes L+i, so index i (the token after verify input i)
        # reads position i+1; the last index has nothing to propose and is never judged.
        aligned = torch.cat([logits[:, 1:], logits[:, -1:]], dim=1)
        s = step.sampler
        if not s.any_sampled:
            return aligned.argmax(-1), None, aligned
        logp = filtered_logprobs(aligned, s.temperature[:S], s.top_k[:S], s.top_p[:S], s.any_filtered)
        return sample_from_logprobs(logp, s.uniform(STREAM_DRAFT, (n,), rows=S)), logp, aligned

    def verify(self, step, ids: torch.Tensor):
        """The target's causal verify forward of `ids` [S, n] (written after each row's committed
        length, as Step.forward does), also returning the drafter's target layers' outputs."""
        n = ids.shape[1]
        cols, mask, _ = block_placement(step.lengths, n, causal_block(n, ids.device), step.ctx)
        return step.model(ids, cols.clamp(max=step.max_position), step.k, step.v, cols, mask,
                          step.slots, None, capture=self.drafter.cfg.target_layer_ids)

    def write_context(self, carry, hidden: torch.Tensor, positions: torch.Tensor,
                      committed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows' rings with the committed tokens' context K/V written at position % W.
        hidden [S, n, K·hidden], positions [S, n], committed [S, n] bool (a prefix of each row)."""
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

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        n, dev = step.width, pending.device
        positions = step.lengths[:, None] + torch.arange(n, device=dev)        # [S, n]
        drafts, draft_logp, aligned = self.draft(step, pending, blocks, carry, positions)
        verify_ids = torch.cat([pending[:, None], drafts[:, : n - 1]], dim=1)
        target_logits, hidden = self.verify(step, verify_ids)
        emitted, n_emitted, accepted = accept_chain(drafts, target_logits, blocks, step.sampler,
                                                    draft_logp)
        # The committed inputs this round: the seed and the accepted drafts (n_emitted of them).
        committed = torch.arange(n, device=dev)[None, :] < n_emitted[:, None]
        new = self.write_context(carry, hidden, positions, committed)
        return RoundOutput(emitted, n_emitted, accepted, *draft_stats(aligned, drafts), carry=new)
