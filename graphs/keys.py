"""GraphKey: what one captured (or compiled) step is specialised on.

A step's tensors have static shapes fixed by (batch bucket, block size, branch layout); the
runner keeps one graph per key. Batches are padded up to a bucket: padded rows are inactive slots
whose K/V land in their own unused slot (the "trash"), whose committed length stays >= 0 with the
row's own token always visible (no all-masked softmax, no NaN), and whose ids are zero.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastspec.config import FastspecError

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True, order=True)
class GraphKey:
    batch: int          # padded batch (a bucket)
    block: int          # new tokens per row in the step's widest forward
    layout: str         # "ar", "chain", "linear", "overlap(corr=2,cont=1)", "tree(0,0,1,1)", ...
    sampling: str = "greedy"    # greedy | sample | filtered: the code a round's sampler needs
    method: str = ""            # the method (and options) whose round this is: never shared

    def __str__(self) -> str:
        tail = "" if self.sampling == "greedy" else f" {self.sampling}"
        head = f"{self.method} " if self.method and self.method != self.layout else ""
        return f"{head}B{self.batch}×{self.block} {self.layout}{tail}"


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The smallest bucket holding n rows: 3 -> 4, 5 -> 8."""
    for b in buckets:
        if n <= b:
            return b
    raise FastspecError(f"concurrency {n} exceeds the largest batch bucket {buckets[-1]}")
