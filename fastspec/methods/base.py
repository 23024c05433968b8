from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoundOutput:
    """What one round produced for every slot (tensors; the engine reads them once)."""
    emitted: torch.Tensor          # [S, n] new tokens; row s uses emitted[s, :n_emitted[s]]
    n_emitted: torch.Tensor        # [S] tokens emitted == tokens whose K/V the round commits
    n_drafted: torch.Tensor        # [S] how many of the emitted tokens were accepted drafts
    # Per draft position (speculative methods; schedulers such as RecGuide, LibraSpec and BASTION
    # read them): the drafter's probability of the token it proposed, its top-1 probability and
    # the top-1 minus top-2 margin. [S, n] each, or None.
    draft_prob: torch.Tensor | None = None
    draft_confidence: torch.Tensor | None = None
    draft_margin: torch.Tensor | None = None


class Method:
    """A decoding method: lays out the tokens of one round, asks for forwards, accepts.

    `round` runs inside the engine's step for a GraphKey(batch, block, layout): traced and
    compiled (or captured) as one function, so it must be tensor code only: no `.item()`, no
    boolean indexing, no data-dependent Python branches, no Python state written.
    """
    name = "?"
    needs_adapter = False
    layout = "?"                    # the GraphKey layout of a round
    forwards = 1                    # model forwards per round

    def __init__(self, block: int = 16):
        self.block = block

    def block_for(self, seq) -> int:
        """The block size a request starts with (schedulers may change it per round)."""
        return self.block

    def max_block(self) -> int:
        """Tokens one round can emit per row at most: the KV cache keeps this much headroom."""
        return self.block

    def round(self, step, pending: torch.Tensor, blocks: torch.Tensor) -> RoundOutput:
        """One round for every slot. step: the engine's `Step` (forward, sampler, width);
        pending [S]: each slot's seed (sampled, not yet in cache); blocks [S]: block sizes."""
        raise NotImplementedError
