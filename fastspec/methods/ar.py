"""Plain autoregressive decoding: one token per forward. The reference every method must equal."""
from __future__ import annotations

import torch

from fastspec.layout import causal_block
from fastspec.methods.base import Method, RoundOutput
from fastspec.sampling import sample_tokens


class AR(Method):
    name = "ar"
    layout = "ar"

    def __init__(self, block: int = 1):
        super().__init__(block=1)

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        logits = step.forward(pending[:, None], causal_block(1, pending.device))
        token = sample_tokens(logits[:, 0], step.sampler)
        one = torch.ones_like(pending)
        return RoundOutput(token[:, None], one, torch.zeros_like(pending))
