from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoundOutput:
    """What one round produced for every slot (tensors; the engine reads them once)."""
    emitted: torch.Tensor          # [S, n] new tokens; row s uses emitted[s, :n_emitted[s]]
    n_emitted: torch.Tensor        # [S] tokens emitted == tokens whose K/V the round commits
    n_drafted: torch.Tensor        # [S] how many of the emitted tokens were accepted drafts
    forwards: int                  # model forwards the round ran


class Method:
    name = "?"
    needs_adapter = False

    def __init__(self, block: int = 16):
        self.block = block

    def block_for(self, seq) -> int:
        """The block size a request starts with (schedulers may change it per round)."""
        return self.block

    def max_block(self) -> int:
        """Tokens one round can emit per row at most: the KV cache keeps this much headroom."""
        return self.block

    def round(self, engine, pending: torch.Tensor, blocks: torch.Tensor) -> RoundOutput:
        """One round for every slot. pending [S]: each slot's seed (sampled, not yet in cache);
        blocks [S]: each slot's block size."""
        raise NotImplementedError
