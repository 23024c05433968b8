"""Drafting conventions: how an adapter was trained to fill a draft block, and so how every method
must lay out a draft forward and read its logits. The convention travels with the adapter
(`adapter_config.json`) and is the one place the layout of a draft block is written.

Draft block for a round whose committed prefix ends at L, seed s (not yet in the cache), B = 4:

    fastspec (token shift, seed causal, adapter off at the seed):
        tokens      s   M   M   M        adapter  . on on on
        attends     s | s M M M          (the seed sees the prefix and itself only)
        predicts    d1  d2  d3  d4       logit at block position i -> token at L+i+1

      The seed's logit is exactly the verifier's next token, so d1 is always right under greedy.

    nld (Nemotron-Labs-Diffusion: no shift, whole block bidirectional, adapter on everywhere):
        tokens      s   M   M   M        adapter on on on on
        attends     s M M M (all)        (every block token sees the prefix and the whole block)
        predicts    -   d1  d2  d3       logit at block position i -> token at L+i (filled in place)

Seedless block (TiDAR's pre-draft for a correction not emitted yet; `seedless` adapters are
trained on it): the seed slot is a MASK too, adapter on everywhere, the whole block bidirectional.
Shifted, its logit i still predicts L+i+1 (so d1 is a guess, not exact); unshifted, logit 0 is an
in-place guess of the seed itself.

Either way `aligned_draft_logits` returns logits whose index i proposes d(i+1), the token after
verify input i, so the verifier and every method read drafts the same way; the last index of an
unshifted block has nothing to propose and repeats the one before (never judged: a row of width
n verifies d1..d(n-1)). MASK is never a draft: its logit is -inf before argmax, sampling and
confidences.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from fastspec.config import FastspecError


@dataclass(frozen=True)
class DraftConvention:
    name: str = "fastspec"
    shift: bool = True               # logit at block position i predicts L+i+1 (else L+i)
    seed_attention: str = "causal"   # "causal": the seed sees prefix + itself; "block": the block
    seed_adapter: bool = False       # the adapter is on for the seed token
    lora_dtype: str = "model"        # "fp32": LoRA deltas computed in fp32 under a bf16 model
    # Also trained on TiDAR's seedless pre-draft: a block whose first token is a MASK standing
    # for a seed the verifier has not emitted yet (adapter on, whole block bidirectional), so it
    # drafts the tokens after an unknown correction (`train-drafter --seedless`; a record of
    # the training: `tidar` lays out seedless pre-drafts with any adapter).
    seedless: bool = False

    def __post_init__(self):
        if self.seed_attention not in ("causal", "block"):
            raise FastspecError(f"draft convention: seed_attention must be causal or block, "
                                f"got {self.seed_attention!r}")
        if self.lora_dtype not in ("model", "fp32"):
            raise FastspecError(f"draft convention: lora_dtype must be model or fp32, got {self.lora_dtype!r}")

    def to_dict(self) -> dict:
        return asdict(self)


FASTSPEC = DraftConvention()
NLD = DraftConvention("nld", shift=False, seed_attention="block", seed_adapter=True, lora_dtype="fp32")
CONVENTIONS = {"fastspec": FASTSPEC, "nld": NLD}


def convention_from_dict(raw: dict | str | None) -> DraftConvention:
    """An adapter's recorded convention: a name, a dict of fields, or None (fastspec's)."""
    if raw is None:
        return FASTSPEC
    if isinstance(raw, str):
        if raw not in CONVENTIONS:
            raise FastspecError(f"unknown draft convention {raw!r} (known: {', '.join(CONVENTIONS)})")
        return CONVENTIONS[raw]
    try:
        return DraftConvention(**raw)
    except TypeError as e:
        raise FastspecError(f"bad draft convention {raw}: {e}") from None


def model_convention(model) -> DraftConvention:
    return getattr(model, "draft_convention", None) or FASTSPEC


def draft_block_mask(conv: DraftConvention, blocks: torch.Tensor, n: int,
                     seedless: bool = False) -> torch.Tensor:
    """[S, n, n] attention among a draft block's n tokens; row s uses its first blocks[s].

    fastspec, blocks = [3], n = 4:     nld (or any seedless block), same:
          s M M .                            s M M .
       s  1 0 0 0                         s  1 1 1 0
       M  1 1 1 0                         M  1 1 1 0
       M  1 1 1 0                         M  1 1 1 0
       .  0 0 0 1  (padding: itself only, so no all-masked softmax)

    seedless: the seed slot is a MASK too, so it sees the whole block whatever the convention.
    """
    i = torch.arange(n, device=blocks.device)
    valid = i[None, :] < blocks[:, None]                               # [S, n]
    sees_block = valid[:, :, None] & valid[:, None, :]
    if conv.seed_attention == "causal" and not seedless:
        sees_block = sees_block & (i[None, :, None] > 0)
    eye = torch.eye(n, dtype=torch.bool, device=blocks.device)
    return sees_block | eye[None]


def draft_adapter_flags(conv: DraftConvention, rows: int, n: int, device=None,
                        seedless: bool = False) -> torch.Tensor:
    """[rows, n] adapter flags of a draft block: on for the masks, on at the seed iff the
    convention says so (always, when seedless: the seed slot is a MASK too)."""
    on = torch.ones(rows, n, dtype=torch.bool, device=device)
    if not conv.seed_adapter and not seedless:
        on[:, 0] = False
    return on


def exclude_mask_logit(logits: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """MASK is never drafted: its logit becomes -inf (a MASK outside the vocab has no logit)."""
    if mask_token_id is None or not 0 <= mask_token_id < logits.shape[-1]:
        return logits
    keep = torch.arange(logits.shape[-1], device=logits.device) != mask_token_id
    return logits.masked_fill(~keep, float("-inf"))


def aligned_draft_logits(conv: DraftConvention, logits: torch.Tensor,
                         mask_token_id: int | None) -> torch.Tensor:
    """[S, n, V] draft-forward logits -> [S, n, V] whose index i proposes d(i+1), MASK excluded.

    unshifted, n = 4:  block logits  [l0 l1 l2 l3]  ->  [l1 l2 l3 l3]   (d1 d2 d3, unused)
    """
    logits = exclude_mask_logit(logits, mask_token_id)
    if conv.shift:
        return logits
    return torch.cat([logits[:, 1:], logits[:, -1:]], dim=1)
