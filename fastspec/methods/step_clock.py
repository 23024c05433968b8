"""Measured step times for a planner: what a step costs on this machine now, not on the profile.

A planner prices its choices (a block size, a branch slot, a tree budget, an AR round) by the
time of the step each one runs. The device profile gives every step shape a price before it has
run; on a 2-core CPU it is 10-20% off the measured step, in both directions (BASTION's round
priced 48 ms and measured 43, an AR step 15.8 and 18.5 in one run,
results/libraspec_bastion_ar_c1_zen4_1207_ema.json), enough to flip a close choice. A timed
method (`Method.timed`) gets every compiled step's wall time from the engine and reads its steps
through a `StepClock`:

    time(step) = profile(step) · shape(step) · level

The shape (this step's cost against the profile's) is a property of the step and is learned
slowly; the level (how fast the machine runs now) is shared by every step and follows the
machine's load within a few steps. Comparing two steps then compares them at today's level, not
at the moments each was last measured:

    B=4 round measured at 70 ms (profile 67, level 1.0 -> shape 1.04); the machine then slows
    to half speed while B=8 rounds run (profile 71, 142 ms -> level ~2): B=4 now reads
    ~67 · 1.04 · 2 = 139 ms, not its stale 70 ms, and B=8 is not priced 2x it.

(Were only one step ever timed, a slowdown could not be told from its shape; the level moves fast
and the shape slowly, so most of it goes to the level.) A step that has not run yet is priced at
the profile times the mean shape of the steps of its (rows, width) that did run, else of all:
a profile taken at another thread count is off by about one common factor.

A round costs more than its step: the engine plans it, reads its results once and commits them
on the host (`round_overhead`, measured by the engine for timed methods, a moving average).
Pricing steps alone undercharges the cheapest round, AR's, the most. `time` and `ms` price a
round: the step plus that overhead. It is small with the compiled CPU steps: 0.5-1.0 ms a round
at C = 1 and 4 on Zen 4 (2-5% of an AR round; results/round_overhead_c14_zen4_1207.json).
"""
from __future__ import annotations

from typing import Callable

LEVEL_RATE, SHAPE_RATE = 0.3, 0.05
OVERHEAD_RATE = 0.1     # the host time per round's moving average weighs a new round 1/10
FIRST_SAMPLES = 3       # a step's shape is the least of its first samples, then a slow average

StepKey = tuple[int, int, str]          # (rows, width, variant)


class StepClock:
    def __init__(self, estimate: Callable[[int, int, str], float], measured: dict | None = None):
        """estimate(rows, width, variant): the profile's ms for a step. measured: the engine's
        record of this method's step times (earlier runs' seed the shapes, as of one moment)."""
        self.estimate = estimate
        self.measured = measured if measured is not None else {}
        ratios = {key: ms / estimate(*key) for key, ms in self.measured.items()}
        self.level = sorted(ratios.values())[len(ratios) // 2] if ratios else None
        self.shape = {key: f / self.level for key, f in ratios.items()}
        self.shape_n = {key: 1 for key in self.shape}
        self.overhead: float = 0.0               # ms of host work per round (round_overhead)
        self.overhead_n = 0

    def round_overhead(self, ms: float) -> None:
        """One round's host time outside its steps (planning, the host read, commits): a moving
        average, the first rounds' readings taken as they come."""
        ms = max(ms, 0.0)
        self.overhead_n += 1
        self.overhead = ms if self.overhead_n == 1 else (1 - OVERHEAD_RATE) * self.overhead + OVERHEAD_RATE * ms

    def timed(self, rows: int, width: int, variant: str, ms: float) -> None:
        """One measured step. A step's first measurement gives its shape at the current level
        (it says nothing of the level: its shape was unknown); later ones move the level at
        LEVEL_RATE. The shape is the least of its first FIRST_SAMPLES readings (at their
        levels), then a slow average (SHAPE_RATE): on a shared CPU the noise only ever slows
        a step, and a first reading taken slow would otherwise price that step high for as long
        as the planner, believing it, never runs it again (an AR step read at 50 ms, 20 in
        truth, kept LibraSpec drafting at C=4, results/libraspec_bastion_prices_c48_zen4_1207.json).

            profile: tree round 160 ms, AR 10; measured 24 and 10
            tree first: level .15, shape 1; AR first: shape 1 / .15 = 6.7, level .15 still
            (were the AR step's ratio 1 read as the level, the tree round would read 65 ms)
        """
        key = (rows, width, variant)
        ratio = ms / self.estimate(*key)
        known = self.shape.get(key)
        if known is None:
            self.level = self.level or ratio
            self.shape[key], self.shape_n[key] = ratio / self.level, 1
            return
        self.level = (1 - LEVEL_RATE) * self.level + LEVEL_RATE * ratio / known
        n = self.shape_n[key] = self.shape_n[key] + 1
        reading = ratio / self.level
        self.shape[key] = min(known, reading) if n <= FIRST_SAMPLES else \
            (1 - SHAPE_RATE) * known + SHAPE_RATE * reading

    def mean_shape(self, rows: int, width: int) -> float:
        """The mean shape of the measured steps of this (rows, width), else of all; 1 if none."""
        same = [f for (r, w, _), f in self.shape.items() if (r, w) == (rows, width)] or \
            list(self.shape.values())
        return sum(same) / len(same) if same else 1.0

    def ms(self, rows: int, width: int, variant: str) -> float | None:
        """A round of a measured step: the step's time at the machine's current level plus the
        host time per round (None: never measured)."""
        f = self.shape.get((rows, width, variant))
        return None if f is None else self.estimate(rows, width, variant) * f * self.level + self.overhead

    def time(self, rows: int, width: int, variant: str) -> float:
        """A round's time: its step as measured once it has run, else the profile's estimate
        times the mean shape of the steps run (`mean_shape`), at the machine's current level;
        plus the host time per round."""
        ms = self.ms(rows, width, variant)
        if ms is not None:
            return ms
        step = self.estimate(rows, width, variant) * self.mean_shape(rows, width) * (self.level or 1.0)
        return step + self.overhead

    def check(self) -> dict:
        """Profile estimate vs measured time of every step timed, and the mean absolute relative
        error: `error`, the profile as it is (what a cold start and a new machine plan with);
        `at_level`, the profile times the machine's level at the end (what a step not run yet
        is priced at)."""
        rows = {}
        level = self.level or 1.0
        for (r, w, v), ms in sorted(self.measured.items()):
            est = self.estimate(r, w, v)
            rows[f"{r}x{w}:{v}"] = {"measured": round(ms, 3), "profile": round(est, 3),
                                    "error": round(est / ms - 1, 4),
                                    "at_level": round(est * level / ms - 1, 4)}

        def mean(col: str) -> float | None:
            return round(sum(abs(x[col]) for x in rows.values()) / len(rows), 4) if rows else None
        return {"steps": rows, "mean_abs_error": mean("error"), "level": round(level, 4),
                "mean_abs_error_at_level": mean("at_level"), "round_overhead_ms": round(self.overhead, 3)}
