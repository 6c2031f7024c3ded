"""Which path a call takes: the codec's compressed ring, or the transport's
own uncompressed all-reduce ("native": NCCL's BF16 all-reduce for device
arrays, MPI's for host arrays), chosen from crossovers the collective
measures itself.

With ``path="auto"`` the first calls of each *class* (array backend, dtype,
size as floor(log2(length)), codec, topology, transport asked for, op) run
both paths in turn: untimed calls of each (workspace, communicators and
graphs are made there: ``warmup_calls``), then ``SAMPLES`` timed calls of
each, every one synchronised before and after; where graphs replay a
class's steady compressed calls (graphs.py), its compressed calls are timed
as replays.  The ranks then agree on the slowest rank's
median time of each path (one small MPI all-reduce, at the same call on
every rank since every rank makes the same calls), and the class keeps the
faster path from then on.  The compressed path must win by ``MARGIN``: on a
tie BF16 is the more accurate.  The report of every call says which path ran
and why.

The same chooser makes the ``hierarchy="auto"`` choice (flat or nodes),
seeded by the cost model (prediction.py): its predicted winner is measured
first, and a decisive prediction (``prediction.MARGIN``, on links the user
gave) decides the class without measuring the loser.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from ..settings import env_choice

PATH_CHOICES = ("auto", "compressed", "native")
WARMUP = 1          # untimed calls of each path per class
SAMPLES = 2         # timed calls of each path per class
MARGIN = 1.05       # compressed only when at least 5 % faster


def warmup_calls(replayed: bool) -> int:
    """Untimed calls of each path per class; one more where the class's
    compressed calls replay as CUDA graphs (the second is the capture), so
    that the timed ones are replays, as the class's calls run once decided."""
    return WARMUP + 1 if replayed else WARMUP


def measuring_calls(replayed: bool) -> int:
    """The calls a class spends measuring both paths before its choice."""
    return 2 * (warmup_calls(replayed) + SAMPLES)


def default_path(value=None) -> str:
    """``value``, else ``$DYNAMIQ_PATH``, else "auto"; a clear error otherwise."""
    return env_choice(value, "DYNAMIQ_PATH", PATH_CHOICES, "path")


def size_class(length: int) -> int:
    """floor(log2(length)): calls within a power of two share a choice."""
    return max(0, int(length).bit_length() - 1)


@dataclass
class _Class:
    times: dict
    choice: str | None = None
    why: str = ""
    order: tuple = ()           # the options in the order they are measured
    warmup: int = WARMUP        # untimed calls of each option
    predicted: str = ""         # the prediction that seeded the class, if any
    note: str = ""              # and what it decided


class PathChooser:
    """Per-class path decisions of one communicator (every rank holds one and
    feeds it the same calls, so the decisions agree)."""

    size_class = staticmethod(size_class)   # the size part of a class key

    def __init__(self, comm, warmup: int = WARMUP, samples: int = SAMPLES,
                 margin: float = MARGIN, options=("compressed", "native"), warmup_of=None):
        """``options``: (the candidate, the baseline it must beat by
        ``margin``): the paths, or the hierarchies ("nodes", "flat").
        ``warmup_of(key)``: a class's untimed calls of each option, if not
        ``warmup`` (from the key alone: alike on every rank)."""
        self.options = tuple(options)
        from ..control import as_plane
        self.plane = as_plane(comm)     # the ranks' control plane (agreeing on timings)
        self.warmup, self.samples, self.margin = int(warmup), int(samples), float(margin)
        self.warmup_of = warmup_of
        self._classes: dict = {}

    def choose(self, key, predict=None) -> tuple:
        """(path, why, timed): the path of the next call of ``key``; ``timed``
        asks the caller to time it and :meth:`record` the seconds.
        ``predict``: called once, at a class's first call, for a prediction
        (prediction.Prediction: ``winner``, ``decisive``, ``text()``,
        ``note()``) or None; the winner is measured first, and a decisive
        prediction decides the class at once."""
        first, second = self.options
        c = self._classes.get(key)
        if c is None:
            c = self._classes[key] = self._new_class(predict)
            c.warmup = self.warmup_of(key) if self.warmup_of else self.warmup
        if c.choice is not None:
            return c.choice, c.why, False
        a, b = c.order
        na, nb = len(c.times[a]), len(c.times[b])
        path = a if na <= nb else b
        total = 2 * (c.warmup + self.samples)
        seed = f"; {c.note}" if c.note else ""
        return path, f"auto: measuring both {first} and {second} (call {na + nb + 1} of " \
                     f"{total}){seed}", True

    def _new_class(self, predict) -> _Class:
        """A class at its first call: measured in the options' order, or the
        predicted winner first; decided at once on a decisive prediction."""
        c = _Class({p: [] for p in self.options}, order=self.options)
        pred = predict() if predict is not None else None
        if pred is None or pred.winner not in self.options:
            return c
        c.predicted, c.note = pred.text(), pred.note()
        c.order = (pred.winner, next(p for p in self.options if p != pred.winner))
        if pred.decisive:
            c.choice, c.why = pred.winner, f"auto: {c.note}"
        return c

    def record(self, key, path: str, seconds: float, ran: str, ran_why: str = "") -> None:
        """The time of a measuring call of ``key`` that asked for ``path`` and
        ran ``ran``.  When both paths have their samples, agree and decide."""
        c = self._classes.get(key)
        if c is None or c.choice is not None:
            return
        if ran != path:          # native asked, resolved to compressed on the routed transport
            c.choice, c.why = ran, ran_why or f"{path} unavailable"
            return
        c.times[path].append(float(seconds))
        need = c.warmup + self.samples
        if any(len(t) < need for t in c.times.values()):
            return
        first, second = self.options
        mine = np.array([statistics.median(c.times[p][c.warmup:]) for p in self.options],
                        dtype=np.float64)
        worst = np.empty_like(mine)
        self.plane.allreduce_max(mine, worst)
        tc, tn = float(worst[0]), float(worst[1])
        c.choice = first if tc * self.margin < tn else second
        c.why = (f"auto: measured {first} {tc * 1e3:.3f} ms, {second} {tn * 1e3:.3f} ms "
                 f"(slowest rank, median of {self.samples}) for 2^{key[2]}+ elements"
                 + (f"; {c.predicted}" if c.predicted else ""))

    def choice_of(self, key):
        """The option ``key``'s class decided, or None."""
        c = self._classes.get(key)
        return None if c is None else c.choice

    def decisions(self) -> dict:
        """{class key: (choice, why)} of the classes decided so far."""
        # a snapshot: the DDP hook's worker thread may add a class meanwhile
        return {k: (c.choice, c.why) for k, c in list(self._classes.items())
                if c.choice is not None}

    def forget(self) -> None:
        """Measure every class again (e.g. after the link changed)."""
        self._classes.clear()


# ----------------------------------------------------------------- whole steps
STEP_MARGIN = 1.03      # a less exact option must be at least 3 % faster


def typical_period(periods) -> float:
    """The mean of ``periods`` without the longest one (the one period
    itself when there is only one)."""
    ordered = sorted(periods)
    return float(np.mean(ordered[:-1] if len(ordered) > 1 else ordered))


class StepChooser:
    """Chooses among ``options`` by timing whole training steps, the way a
    DDP job runs them (the DDP hook's ``path="auto"``): a measured option
    runs two consecutive steps and the period between their ends counts, so
    the period holds one step of that option alone (its communication
    overlapped with the backward pass, its exposed tail, the compute between).

    The schedule is a pure function of the step index, so every rank runs the
    same option at every step: step 0 (before DDP's bucket rebuild), then
    ``warmup`` untimed rounds and ``rounds`` timed ones; a round runs two
    steps of every option, the order rotated round by round (a drifting link
    touches every option alike).  After the last timed step the ranks agree
    on the slowest rank's typical period of each option (one small
    all-reduce on the control plane), and the choice is kept: the most exact
    option (``options`` is ordered most exact first) within ``margin`` of
    the fastest.  Typical: the mean of the periods without the longest one.
    Not the median: what slows a step when options switch (the caching
    allocator meeting the other options' buffers, a busy host) lasts a round
    or two (NVLink, 2x H200: plain 138, 138, 118 ms against 115 ms steady).
    Not the shortest: a link whose rate comes in bursts gives one option a
    lucky step (sockets, 4x H200: BF16 297, 614, 163 ms against 501 ms
    steady, compressed 196, 189, 207 ms against 212 ms).

    ``elapsed(mark_a, mark_b)`` gives the seconds between two marks the caller
    made at the end of steps (CUDA events or host clocks); it is called only
    when deciding, so timing adds no host synchronisation to a step.
    """

    def __init__(self, plane, options, elapsed, rounds: int, margin: float = STEP_MARGIN,
                 first: str | None = None, warmup: int = 1):
        self.plane, self.options, self.elapsed = plane, tuple(options), elapsed
        self.margin = float(margin)
        if rounds < 1:
            raise ValueError(f"StepChooser: rounds must be >= 1, got {rounds}")
        first = first or self.options[0]
        schedule = [(first, False)]
        for r in range(int(warmup) + int(rounds)):
            k = r % len(self.options)
            for o in self.options[k:] + self.options[:k]:
                schedule += [(o, False), (o, r >= warmup)]
        self.schedule = schedule
        self.start = None           # the step index of the schedule's first step
        self.choice = None
        self.why = ""
        self.typical = {}           # option -> the slowest rank's typical period (s)
        self.periods = {}           # option -> this rank's periods (s), in schedule order
        self._marks = {}            # schedule index -> the mark at the end of that step

    def option(self, step: int) -> tuple:
        """(option, measuring) of step ``step`` (a counter every rank shares)."""
        if self.choice is not None:
            return self.choice, False
        if self.start is None:
            self.start = int(step)
        i = int(step) - self.start
        if not 0 <= i < len(self.schedule):
            raise RuntimeError(f"StepChooser: step {step} outside the schedule started at "
                               f"{self.start} ({len(self.schedule)} steps)")
        return self.schedule[i][0], True

    def step_ended(self, step: int, mark) -> None:
        """The end of step ``step`` (the same steps on every rank); after the
        schedule's last step, agree and decide."""
        if self.choice is not None or self.start is None:
            return
        i = int(step) - self.start
        if not 0 <= i < len(self.schedule):
            return
        if self.schedule[i][1] or (i + 1 < len(self.schedule) and self.schedule[i + 1][1]):
            self._marks[i] = mark
        if i == len(self.schedule) - 1:
            self._decide()

    def _decide(self):
        periods = {o: [] for o in self.options}
        for i, (o, timed) in enumerate(self.schedule):
            if timed:
                periods[o].append(self.elapsed(self._marks[i - 1], self._marks[i]))
        self.periods = periods
        mine = np.array([typical_period(periods[o]) for o in self.options], dtype=np.float64)
        worst = np.empty_like(mine)
        self.plane.allreduce_max(mine, worst)
        self.typical = {o: float(t) for o, t in zip(self.options, worst)}
        fastest = min(self.typical.values())
        self.choice = next(o for o in self.options if self.typical[o] <= fastest * self.margin)
        rounds = len(periods[self.options[0]])
        times = ", ".join(f"{o} {self.typical[o] * 1e3:.1f} ms" for o in self.options)
        self.why = (f"auto: whole steps, {times} (slowest rank, mean of {rounds} without the "
                    f"longest); the most exact within {(self.margin - 1) * 100:.0f} % of the "
                    f"fastest")
        self._marks.clear()

    def decisions(self) -> dict:
        return {} if self.choice is None else {"step": (self.choice, self.why)}
