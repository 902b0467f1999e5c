"""Stragglers: ranks whose steps are persistently slower than the other ranks' steps.

Where the numbers come from: a worker that calls `rally.job.heartbeat(step=N)` writes the step
and the CLOCK_MONOTONIC time of the beat into its heartbeat file. Each read of the file is an
exact (step, time) pair, however rarely the agent reads, so a rank's step time over a window is
`(t_new - t_old) / (step_new - step_old)` across at least `window` steps.

Who is slow: a rank whose step time exceeds `factor` times the median step time of the *other*
ranks of the job (`--straggler-factor`, 1.5) is slow; it is named a straggler once it has stayed
slow for a further `window` steps (`--straggler-window`, 10), so one long step (a garbage
collection, a checkpoint) never names anyone. It is cleared as soon as it is no longer slow.

The job, not the node: every node publishes its ranks' step times in its status record (the
record `rally status` reads). Node 0's agent reads all records of the round every status interval,
and publishes the middle of the sorted step times (`CentralValues`, a handful of numbers
whatever the job's size) under `<round>/step_times`; every other node reads that one key.
From it each node computes, for each of its ranks, the exact median of all *other* ranks of the
job. Until node 0 has published (the first seconds of a round), a node compares its ranks with
its own other ranks only, and says so ("scope": "node").

A caveat worth knowing: in lock-step data parallel training every rank waits for the slowest
one inside each all-reduce, so all ranks advance at the same step rate. Stragglers by step
rate show where ranks advance independently (pipeline stages, asynchronous or loosely coupled
workers, data-loading ranks) or where the beat is placed before the step's collective.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from rally.agent.base.spec import DEFAULT_FACTOR, DEFAULT_WINDOW


class StepClock:
    """One rank's (step, monotonic ns) observations, as many as are needed to span the window."""

    def __init__(self, window: int):
        self.window = window
        self.samples: deque[tuple[int, int]] = deque()

    def add(self, step: int, ns: int) -> bool:
        """Record one observation; False if it is not new (same step as the last one)."""
        if self.samples and step == self.samples[-1][0]:
            return False
        if self.samples and (step < self.samples[-1][0] or ns <= self.samples[-1][1]):
            self.samples.clear()  # the script counts from a new start: the old times do not apply
        self.samples.append((step, ns))
        while len(self.samples) >= 2 and self.samples[1][0] <= step - self.window:
            self.samples.popleft()  # the next one still spans the window
        return True

    @property
    def step(self) -> int | None:
        return self.samples[-1][0] if self.samples else None

    def step_time(self) -> float | None:
        """Mean seconds per step over at least `window` steps; None until that many are seen."""
        if len(self.samples) < 2:
            return None
        (s0, t0), (s1, t1) = self.samples[0], self.samples[-1]
        if s1 - s0 < self.window:
            return None
        return (t1 - t0) / 1e9 / (s1 - s0)


@dataclass(frozen=True)
class CentralValues:
    """The middle of the job's sorted step times: enough for the median of all ranks but one.

    Removing one value x from a sorted list of n shifts the entries above x down by one, so the
    median of the remaining n - 1 values needs only the entries at positions (n-2)//2 to
    (n-1)//2 + 1 of the full list: at most three numbers, whatever n is.
    """

    count: int
    offset: int
    values: tuple[float, ...]

    @classmethod
    def of(cls, times: Iterable[float]) -> CentralValues:
        ordered = sorted(times)
        n = len(ordered)
        offset = max(0, (n - 2) // 2)
        return cls(n, offset, tuple(ordered[offset : (n - 1) // 2 + 2]))

    def median_without(self, value: float) -> float | None:
        """The median of every value but one equal (or nearest in order) to x; None if none is left."""
        n = self.count
        if n < 2:
            return None

        def remaining(position: int) -> float:
            # Position j of the list without x: entries below x keep their place, the rest move down.
            old = self.values[position - self.offset]
            return old if old < value else self.values[position + 1 - self.offset]

        low, high = (n - 2) // 2, (n - 1) // 2
        return (remaining(low) + remaining(high)) / 2

    def to_json(self) -> str:
        return json.dumps({"count": self.count, "offset": self.offset, "values": list(self.values)})

    @classmethod
    def from_json(cls, text: bytes | str) -> CentralValues | None:
        """Parse what node 0 published; None for anything malformed (store contents are not trusted)."""
        try:
            data = json.loads(text)
            count, offset = int(data["count"]), int(data["offset"])
            values = tuple(float(v) for v in data["values"])
        except (ValueError, TypeError, KeyError):
            return None
        expected = cls.of([0.0] * count)
        if count < 0 or (offset, len(values)) != (expected.offset, len(expected.values)):
            return None
        if any(not math.isfinite(v) or v < 0 for v in values) or list(values) != sorted(values):
            return None
        return cls(count, offset, values)


@dataclass(frozen=True)
class Straggler:
    """A rank named slow: its seconds per step, the others' median, and over which ranks."""

    rank: int
    step_time: float
    median: float
    scope: str  # "job": the median of every other rank of the job; "node": of this node's others

    @property
    def ratio(self) -> float:
        return self.step_time / self.median if self.median else math.inf


class StragglerWatch:
    """Step clocks for this node's ranks and the judgement of who is a straggler."""

    def __init__(self, factor: float = DEFAULT_FACTOR, window: int = DEFAULT_WINDOW):
        self.factor = factor
        self.window = window
        self.clocks: dict[int, StepClock] = {}
        self.job: CentralValues | None = None  # node 0's summary of the job, for this round
        self.step_times: dict[int, float] = {}  # replaced whole, so other threads may read it
        self.stragglers: dict[int, Straggler] = {}  # replaced whole as well
        self._slow_since: dict[int, int] = {}  # rank -> the step at which it was first seen slow

    def reset(self) -> None:
        """A new round: new ranks, new processes, nothing carries over."""
        self.clocks, self.job, self.step_times, self.stragglers, self._slow_since = {}, None, {}, {}, {}

    def observe(self, rank: int, step: int | None, ns: int) -> bool:
        """One read of a rank's heartbeat file; True when it brought a new step."""
        if step is None or ns <= 0:
            return False
        clock = self.clocks.setdefault(rank, StepClock(self.window))
        if not clock.add(step, ns):
            return False
        times = dict(self.step_times)
        value = clock.step_time()
        if value is None:
            times.pop(rank, None)
        else:
            times[rank] = value
        self.step_times = times
        return True

    def step(self, rank: int) -> int | None:
        clock = self.clocks.get(rank)
        return clock.step if clock else None

    def judge(self) -> tuple[list[Straggler], list[int]]:
        """Update who is a straggler; return the newly named ones and the ranks newly cleared."""
        job = self.job
        local = CentralValues.of(self.step_times.values())
        named, cleared = [], []
        current = dict(self.stragglers)
        for rank, value in self.step_times.items():
            scope, summary = ("job", job) if job is not None and job.count >= 2 else ("node", local)
            median = summary.median_without(value)
            slow = median is not None and median > 0 and value > self.factor * median
            step = self.step(rank) or 0
            if median is None or not slow:
                self._slow_since.pop(rank, None)
                if current.pop(rank, None) is not None:
                    cleared.append(rank)
                continue
            first = self._slow_since.setdefault(rank, step)
            if step - first < self.window:
                continue  # slow, but not yet for a whole window of its own
            found = Straggler(rank, value, median, scope)
            if rank not in current:
                named.append(found)
            current[rank] = found
        for rank in [r for r in current if r not in self.step_times]:
            del current[rank]
        self.stragglers = current
        return named, cleared


def job_step_times(records: Iterable[dict], round_number: int) -> list[float]:
    """Every running rank's step time in the status records of `round_number` (node 0 reads them)."""
    times = []
    for record in records:
        if not isinstance(record, dict) or record.get("round") != round_number:
            continue
        for worker in record.get("workers") or []:
            value = worker.get("step_time") if isinstance(worker, dict) else None
            if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
                times.append(float(value))
    return times
