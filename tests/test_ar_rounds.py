"""Plain AR rounds for drafting methods: a request drafts while its drafts pay on this device
and load, and takes one-forward AR rounds where they do not (fastspec/methods/ar_rounds.py)."""
from types import SimpleNamespace

from fastspec.methods.ar_rounds import EXPLORE, EXPLORE_MAX, HISTORY, ARSwitch, perfect_draft_pays


def request(block=8):
    return SimpleNamespace(block=block, state={})


def test_a_perfect_draft_pays_at_low_load_and_not_under_load():
    # The module's examples: the Zen 4 profile at C = 1 and C = 8.
    assert perfect_draft_pays([(4, 33.0), (8, 48.0)], 16.0)
    assert not perfect_draft_pays([(4, 139.0), (8, 261.0)], 30.0)
    assert not perfect_draft_pays([(4, 40.0)], 10.0)         # a tie is not a gain


def test_drafting_pays_is_judged_on_the_last_rounds_per_ms():
    """AR at 10 ms is .1 token a ms. Rounds of 2 tokens for 25 ms (.08) do not pay, rounds of 3
    (.12) do; fewer than HISTORY rounds are not judged (drafting goes on); only the last HISTORY
    rounds count."""
    seq, sw = request(), ARSwitch()
    for _ in range(HISTORY - 1):
        sw.record(seq, 2, 25.0)
        assert sw.drafting_pays(seq, 10.0)
    sw.record(seq, 2, 25.0)
    assert not sw.drafting_pays(seq, 10.0)
    for _ in range(HISTORY):
        sw.record(seq, 3, 25.0)
    assert sw.drafting_pays(seq, 10.0) and len(seq.state["draft_rates"]) == HISTORY


def test_looks_back_off_while_drafting_does_not_pay_and_reset_when_it_does():
    """The wait before a look doubles with each look that finds AR again (16, 32, 64, 128, 128),
    and it is the run's: a second request waits as long as the first one's last wait."""
    seq, sw = request(), ARSwitch()
    for _ in range(HISTORY):
        sw.record(seq, 2, 25.0)
    assert sw.next_is_ar(seq, 10.0, look_pays=True) and seq.state["draft_rates"] == []

    def wait(q):
        """AR rounds in a row before q looks (q has just gone AR)."""
        q.block, n = 1, 1
        while sw.next_is_ar(q, 10.0, look_pays=True):
            n += 1
        q.block = 8
        return n
    waits = []
    for _ in range(5):                 # each look commits 2 tokens again
        waits.append(wait(seq))
        sw.record(seq, 2, 25.0)
        assert sw.next_is_ar(seq, 10.0, look_pays=True)  # one look's round decides
    assert waits == [EXPLORE, 2 * EXPLORE, 4 * EXPLORE, EXPLORE_MAX, EXPLORE_MAX] and sw.looks == 5
    other = request()
    assert wait(other) == EXPLORE_MAX                    # the run's wait, not its own
    sw.record(other, 4, 25.0)                            # a look that pays: drafting again
    assert not sw.next_is_ar(other, 10.0, look_pays=True) and sw.explore == EXPLORE
    # Where not even a perfect draft pays, an AR run never ends.
    seq.block = 1
    assert all(sw.next_is_ar(seq, 10.0, look_pays=False) for _ in range(3 * EXPLORE_MAX))


def test_a_new_request_starts_ar_where_no_draft_pays_or_the_run_mostly_takes_ar():
    first = ARSwitch.first_is_ar
    assert first(look_pays=False, ar_rounds=0, rounds=0)
    assert not first(look_pays=True, ar_rounds=0, rounds=0)
    assert not first(look_pays=True, ar_rounds=EXPLORE - 1, rounds=EXPLORE - 1)   # too few
    assert first(look_pays=True, ar_rounds=EXPLORE, rounds=EXPLORE)
    assert not first(look_pays=True, ar_rounds=10, rounds=20)                    # half
