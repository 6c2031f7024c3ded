"""The whole-step path choice (call/paths.StepChooser) on a fake control
plane: its schedule is a function of the step alone, every option is timed
in every round, periods are taken between the two steps of one option, and
the most exact option within the margin of the fastest is kept."""
import numpy as np
import pytest

from dynamiq_mpi.call.paths import StepChooser, typical_period

OPTIONS = ("plain", "native", "compressed")


class MaxPlane:
    """A control plane whose other ranks report ``others`` (per option)."""

    def __init__(self, others=None):
        self.others, self.calls = others, 0

    def allreduce_max(self, mine, out):
        self.calls += 1
        out[...] = mine if self.others is None else np.maximum(mine, self.others)


def run(chooser, cost, start=0):
    """Feed steps whose end marks advance by ``cost[option]`` seconds."""
    clock, step, seen = 0.0, start, []
    while chooser.choice is None:
        option, measuring = chooser.option(step)
        assert measuring
        seen.append(option)
        clock += cost[option] + 1e-3 * (step % 3)       # a little noise
        chooser.step_ended(step, clock)
        step += 1
    return seen, step


def test_schedule_times_every_option_each_round_then_keeps_the_fastest():
    plane = MaxPlane()
    chooser = StepChooser(plane, OPTIONS, lambda a, b: b - a, rounds=3, first="native")
    seen, end = run(chooser, {"plain": 0.30, "native": 0.20, "compressed": 0.10}, start=7)
    assert len(seen) == 1 + 2 * 3 * (1 + 3) == end - 7
    assert seen[0] == "native"
    rounds = [seen[1 + 6 * r:1 + 6 * (r + 1)] for r in range(4)]     # the warm-up round first
    for r, got in enumerate(rounds):
        k = r % 3
        order = OPTIONS[k:] + OPTIONS[:k]
        assert got == [o for o in order for _ in range(2)]
    assert chooser.choice == "compressed" and plane.calls == 1
    assert chooser.typical["compressed"] == pytest.approx(0.1005, abs=1e-6)
    assert [len(v) for v in chooser.periods.values()] == [3, 3, 3]
    assert chooser.option(end + 100) == ("compressed", False)
    (key, (choice, why)), = chooser.decisions().items()
    assert key == "step" and choice == "compressed" and "whole steps" in why


@pytest.mark.parametrize("cost,want", [
    ({"plain": 0.100, "native": 0.099, "compressed": 0.098}, "plain"),    # within 3 %: exact
    ({"plain": 0.120, "native": 0.100, "compressed": 0.099}, "native"),
    ({"plain": 0.120, "native": 0.110, "compressed": 0.100}, "compressed"),
])
def test_the_most_exact_option_within_the_margin_wins(cost, want):
    chooser = StepChooser(MaxPlane(), OPTIONS, lambda a, b: b - a, rounds=2)
    run(chooser, cost)
    assert chooser.choice == want


def test_a_slow_round_does_not_decide():
    """Steps only ever get slower than they can be (allocator, host, link):
    the longest period of each option is left out, so a slow first timed
    round of the fastest option does not hand the choice to another."""
    chooser = StepChooser(MaxPlane(), OPTIONS, lambda a, b: b - a, rounds=3)
    clock, step = 0.0, 0
    while chooser.choice is None:
        option, _ = chooser.option(step)
        slow = 0.04 if step < 13 else 0.0       # the warm-up and first timed rounds
        clock += {"plain": 0.100, "native": 0.110, "compressed": 0.105}[option] + slow
        chooser.step_ended(step, clock)
        step += 1
    assert chooser.choice == "plain"


def test_the_slowest_rank_decides():
    """Another rank measured compressed steps far slower: every rank keeps
    what the slowest rank's times say."""
    plane = MaxPlane(others=np.array([0.3, 0.2, 0.5]))
    chooser = StepChooser(plane, OPTIONS, lambda a, b: b - a, rounds=1)
    run(chooser, {"plain": 0.30, "native": 0.20, "compressed": 0.10})
    assert chooser.choice == "native"
    assert chooser.typical == pytest.approx({"plain": 0.3, "native": 0.2, "compressed": 0.5},
                                            abs=3e-3)


def test_steps_outside_the_schedule_and_bad_rounds():
    chooser = StepChooser(MaxPlane(), OPTIONS, lambda a, b: b - a, rounds=1)
    chooser.option(5)
    with pytest.raises(RuntimeError, match="outside the schedule"):
        chooser.option(4)
    with pytest.raises(ValueError, match="rounds"):
        StepChooser(MaxPlane(), OPTIONS, lambda a, b: b - a, rounds=0)


@pytest.mark.parametrize("periods_ms,steady", [
    # sockets, 4x H200, DDP's default buckets: one lucky BF16 step (163 ms; 501 ms
    # steady) made the shortest period pick BF16 over compressed (212 ms steady)
    ({"plain": [627, 645, 678], "native": [297, 614, 163], "compressed": [196, 189, 207]},
     "compressed"),
    # NVLink, 2x H200, DDP's default buckets: plain DDP 105 ms steady, BF16 117,
    # compressed 118; the shortest picked compressed from one 119 ms step
    ({"plain": [136, 127, 125], "native": [124, 133, 141], "compressed": [119, 132, 169]},
     "plain"),
])
def test_measured_periods_give_the_path_that_was_fastest_steady(periods_ms, steady):
    """Periods recorded by the real-model benchmark (docs/results/lm_bench)
    and the path whose steady steps were fastest in the same job."""
    chooser = StepChooser(MaxPlane(), OPTIONS, lambda a, b: b - a, rounds=3)
    clock, step, seen = 0.0, 0, {o: 0 for o in OPTIONS}
    while chooser.choice is None:
        option, _ = chooser.option(step)
        i = step - 1 - 6                    # timed steps: after step 0 and the warm-up round
        timed = i >= 0 and i % 2 == 1
        if timed:
            clock += periods_ms[option][seen[option]] / 1e3
            seen[option] += 1
        else:
            clock += 0.5
        chooser.step_ended(step, clock)
        step += 1
    assert [len(v) for v in chooser.periods.values()] == [3, 3, 3]
    assert chooser.choice == steady


def test_typical_period():
    assert typical_period([0.3]) == 0.3
    assert typical_period([0.2, 0.5]) == 0.2
    assert typical_period([0.297, 0.614, 0.163]) == pytest.approx(0.230)
