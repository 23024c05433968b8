"""Traces for the survival tables of verification-guided block sizes (`fastspec calibrate`).

From the same state, how far would blocks of 8, 16 and 32 each have been accepted? A probe round
answers that for every block size in the set (a draft and a verify forward each, greedy: the
acceptance of a block is deterministic given the committed prefix) and then runs the trajectory's
own round last, so the K/V it leaves behind is that round's. Fixed-block trajectories of every
B give states of every stratum z = (previous block, fully accepted?).
"""
from __future__ import annotations

import copy

import torch

from fastspec.config import FastspecError
from fastspec.methods.base import Plan, RoundOutput
from fastspec.methods.linear import LinearSS
from fastspec.sampling import SamplingParams
from fastspec.survival import Observation, SurvivalTables, history_signal, stratum
from fastspec.verify import accept_chain


class SurvivalProbe(LinearSS):
    """LinearSS at a fixed block whose every round also measures every block size's commit."""
    name = "survival-probe"
    layout = "probe"

    def __init__(self, block: int, blocks: tuple[int, ...]):
        super().__init__(block)
        self.blocks = tuple(sorted(blocks))
        self.observations: list[Observation] = []
        self.pending_state: dict[int, tuple[float, str]] = {}

    def key_name(self) -> str:
        return f"probe(B={self.block},{'/'.join(map(str, self.blocks))})"

    def max_block(self) -> int:
        return max(self.blocks + (self.block,))

    def plans(self) -> list[Plan]:
        return [Plan(self.block)]

    def plan(self, seq) -> Plan:
        hist_b = seq.state.setdefault("blocks", [])
        if seq.host:                                  # the probe of the round that just ran
            s, z = seq.state["sz"]
            for b, commit in zip(self.blocks, seq.host):
                self.observations.append(Observation(s, z, b, commit))
            hist_b.append(self.block)
        c = seq.accept_lengths
        seq.state["sz"] = (history_signal(hist_b, c),
                           stratum(hist_b[-1] if hist_b else None, c[-1] if c else None))
        return Plan(self.block)

    def round(self, step, pending, blocks, carry, variant="") -> RoundOutput:
        if step.sampler.any_sampled:
            raise FastspecError("calibration traces are greedy (acceptance must be deterministic)")
        commits = []
        for b in self.blocks:
            probe = copy.copy(step)
            probe.width = b
            bb = torch.full_like(blocks, b)
            drafts, _, _ = self.draft(probe, pending, bb)
            target = probe.forward(torch.cat([pending[:, None], drafts[:, : b - 1]], 1),
                                   torch.ones(b, b, dtype=torch.bool, device=pending.device).tril())
            commits.append(accept_chain(drafts, target, bb, step.sampler)[1])
        out = super().round(step, pending, blocks, carry, variant)     # last: its K/V stays
        return RoundOutput(out.emitted, out.n_emitted, out.n_drafted, out.draft_prob,
                           out.draft_confidence, out.draft_margin, host=torch.stack(commits, 1))

    def forwards_for(self, variant: str) -> int:
        return 2 + 2 * len(self.blocks)


def collect(engine, prompts, blocks=(8, 16, 32), max_new_tokens: int = 256, concurrency: int = 1,
            progress=None) -> list[Observation]:
    """Same-state counterfactual observations from fixed-block trajectories of every B."""
    obs: list[Observation] = []
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for b in blocks:
        probe = SurvivalProbe(b, tuple(blocks))
        engine.generate(prompts, params, method=probe, concurrency=concurrency)
        obs += probe.observations
        if progress is not None:
            progress(b, len(probe.observations))
    return obs


def fit_tables(obs: list[Observation], blocks, meta: dict | None = None, bins: int = 4,
               min_count: int = 30) -> SurvivalTables:
    return SurvivalTables.fit(obs, blocks=tuple(blocks), bins=bins, min_count=min_count, meta=meta)
