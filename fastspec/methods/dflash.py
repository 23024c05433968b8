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

Prompt context. The engine's prefill of a DFlash request runs eager and also captures the
drafter's target layers (`prefill_capture`); `prefill_context` writes the prompt's last W tokens
into the ring, so the first round already drafts from the prompt, as in DFlash. From then on
every committed token (the first round's seed included) enters the ring. Drafts only steer
speed: the output is AR's either way.

Counting: a round is 2 forwards (drafter + target verify); `report()` gives the drafter forwards
separately (one per request-round, a few layers against the target's whole stack).

The drafting itself (drafter forward, capturing verify, ring writes) lives in
`fastspec.methods.drafter.DFlashDraft`, which LibraSpec and BASTION use too (`drafter=dflash`).
"""
from __future__ import annotations

from fastspec.config import FastspecError
from fastspec.methods.base import Method, Plan, RoundOutput, fresh_counts
from fastspec.methods.drafter import NO_DRAFTER, DFlashDraft, DrafterChoice, chain_round
from fastspec.model.dflash import DFlashDrafter

__all__ = ["DFlash", "NO_DRAFTER"]


class DFlash(DrafterChoice, Method):
    name = "dflash"
    layout = "dflash"               # a drafter forward then a capturing chain verify, one step
    forwards = 2

    def __init__(self, block: int | None = None, window: int = 1024,
                 drafter: DFlashDrafter | None = None):
        """block: seed + masks per round (default: the drafter's trained block size); window: the
        committed tokens of context kept per request; drafter: a DFlashDrafter (default: the
        target model's `dflash`, bound when the run starts)."""
        self.source = DFlashDraft(window)
        super().__init__(block or 0)
        self.requested_block = block
        self.window = self.source.window
        self.drafter_forwards = 0
        if drafter is not None:
            self.bind(drafter)

    # --- host side --------------------------------------------------------------------------
    @property
    def drafter(self) -> DFlashDrafter | None:
        return self.source.drafter

    def bind(self, source) -> "DFlash":
        """Run with this drafter: a DFlashDrafter, or a target model carrying one (`.dflash`)."""
        drafter = self.source.bind(source).drafter
        block = self.requested_block or drafter.cfg.block_size
        if not 2 <= block <= self.window:
            raise FastspecError(f"dflash block must be in 2..window ({self.window}), got {block}")
        self.block = block
        return self

    def begin(self, run) -> None:
        model = getattr(run, "model", None)          # bound from the run's model when offered
        if self.drafter is None and model is not None:
            self.bind(model)
        self.source.bound()
        if fresh_counts(run):
            self.drafter_forwards = 0
            self.source.prefilled = 0

    def key_name(self) -> str:
        return self.source.key_name()

    def max_block(self) -> int:
        self.source.bound()
        return self.block

    def plan(self, seq) -> Plan:
        self.drafter_forwards += 1              # this request's round runs one drafter forward
        return Plan(seq.block)

    def report(self) -> dict:
        return {"drafter_forwards": self.drafter_forwards, **self.source.report()}

    # --- inside the step --------------------------------------------------------------------
    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        return chain_round(self.source, step, pending, blocks, carry)
