"""The step clock: step times read as profile × shape × level (fastspec/methods/step_clock.py)."""
import pytest

from fastspec.methods.step_clock import StepClock


def profile(rows, width, variant):
    return 10.0 + rows * width + (0 if variant == "ar" else 10.0)


def test_a_measured_step_reads_as_measured_and_the_others_scale_with_it():
    clock = StepClock(profile)
    assert clock.time(1, 8, "") == profile(1, 8, "")          # nothing timed: the profile
    assert clock.ms(1, 8, "") is None
    clock.timed(1, 8, "", 56.0)                                # 2x the profile's 28
    assert clock.time(1, 8, "") == pytest.approx(56.0)
    # Not run yet: the profile times the mean shape of what ran, at today's level.
    assert clock.time(1, 1, "ar") == pytest.approx(2 * profile(1, 1, "ar"))


def test_a_step_slower_than_its_profile_keeps_its_own_shape():
    """An AR step that runs 20% over its profile while drafting rounds run 10% under: after a
    few of each, each is priced as measured (the AR round's shape is not the drafting round's)."""
    clock = StepClock(profile)
    for _ in range(6):
        clock.timed(1, 1, "ar", 1.2 * profile(1, 1, "ar"))
        clock.timed(1, 8, "", 0.9 * profile(1, 8, ""))
    assert clock.time(1, 1, "ar") == pytest.approx(1.2 * profile(1, 1, "ar"), rel=0.03)
    assert clock.time(1, 8, "") == pytest.approx(0.9 * profile(1, 8, ""), rel=0.03)
    ratio = clock.time(1, 8, "") / clock.time(1, 1, "ar")
    assert ratio == pytest.approx(0.75 * profile(1, 8, "") / profile(1, 1, "ar"), rel=0.03)


def test_earlier_runs_measurements_seed_the_shapes_and_the_check_reports_the_error():
    measured = {(1, 8, ""): 56.0, (1, 1, "ar"): 22.0}          # profile 28 and 11: both 2x
    clock = StepClock(profile, measured)
    assert clock.level == pytest.approx(2.0)
    assert clock.time(1, 8, "") == pytest.approx(56.0)
    check = clock.check()
    assert check["steps"]["1x8:"] == {"measured": 56.0, "profile": 28.0, "error": -0.5, "at_level": 0.0}
    assert check["mean_abs_error"] == pytest.approx(0.5)
    assert check["mean_abs_error_at_level"] == pytest.approx(0.0)


def test_a_step_first_read_slow_is_priced_at_its_fast_readings():
    """Noise on a shared CPU only slows a step: of a step's first readings the least is its
    shape, so one slow reading does not price it high for the rest of the run."""
    clock = StepClock(profile)
    clock.timed(1, 8, "", 28.0)                                # profile 28: level 1
    clock.timed(1, 1, "ar", 25.0)                              # profile 11, read slow
    clock.timed(1, 1, "ar", 12.0)
    assert clock.time(1, 1, "ar") == pytest.approx(12.0, rel=0.05)


def test_a_round_costs_its_step_plus_the_host_time_per_round():
    """An AR step of 16 ms and a drafting step of 47 ms, 4 ms of host work a round: the rounds
    cost 20 and 51 ms, so a drafting round pays from 2.55 tokens on, not from 2.94 (steps alone)."""
    clock = StepClock(profile)
    clock.timed(1, 1, "ar", 16.0)
    clock.timed(1, 8, "", 47.0)
    assert clock.time(1, 8, "") / clock.time(1, 1, "ar") == pytest.approx(47 / 16)
    clock.round_overhead(4.0)
    assert clock.time(1, 1, "ar") == pytest.approx(20.0, rel=0.02)
    assert clock.ms(1, 8, "") == pytest.approx(51.0, rel=0.02)
    assert clock.time(1, 4, "") > clock.overhead                 # not run: profile-priced, plus it
    for _ in range(40):                                          # a moving average of the rounds
        clock.round_overhead(2.0)
    assert clock.overhead == pytest.approx(2.0, abs=0.05)
    clock.round_overhead(-1.0)                                   # timer noise never gives a credit
    assert clock.overhead >= 0.9 * 2.0
    assert clock.check()["round_overhead_ms"] == pytest.approx(clock.overhead, abs=1e-3)
