"""The default hang watch: with no flag, a rank stuck while its peers wait for it in a collective
is found and reported (never stopped).

The hang timeouts (--heartbeat-timeout, --silence-timeout, --startup-timeout) stop a job, so
they cannot be on by default: a long data-loading phase, a torch.compile or a checkpoint is
silence too. What tells a hang from a long phase is who waits for whom. A hang as users meet it
is one rank that stopped (a deadlock, a sleep, a stuck read, SIGSTOP) while the others sit in a
collective for it; a long phase is every rank busy at once, outside any collective. So the watch
reports only when both hold:

* the culprit made no progress for `after` seconds (--hang-report-after, default 60): no new
  `job.heartbeat()`, no output line, no `job.section` entered or left, and it is not inside a
  section (a section is the script saying "this takes long");
* and at that moment at least one other rank waits in a collective (a torch.distributed frame in
  its stack) and has been quiet for at least half of `after`, while the culprit is outside one, or
  its process is stopped or in uninterruptible sleep.

* and it still holds CONFIRM_SECONDS later: the same rank, stuck at the same frames, the others
  still waiting, and the rank used almost no CPU meanwhile (under IDLE_SHARE of a core). One
  snapshot can catch a healthy job at an unlucky instant (a rank that never prints computing its
  forward while rank 0 sits in an all_reduce); a hung rank stays put and idle.

Evidence comes from the stacks the hang report already gathers (agent/observe/hang_report.py),
taken silently (into a file of the agent's, not the worker's stderr): at most once per `after`
seconds per node (twice when the first look found a suspect), and only while some worker on the
node has been quiet that long. A rank stuck in a busy loop is not reported by this watch (it is
not idle); --heartbeat-timeout or --silence-timeout catch it.

Why 60 s: it is 10x shorter than NCCL's default collective timeout (10 min) and 30x shorter than
gloo's (30 min), so the report comes long before the job dies of the timeout or a user gives up
and cancels it; and it is longer than what one rank legitimately does alone while the others wait
at a barrier in common scripts (rank 0 writing a checkpoint of a few GB with `torch.save`, a
short evaluation or log upload on rank 0), which takes seconds to tens of seconds. Phases on every
rank at once (data loading, a compile, a job.save) are never reported, whatever their length. A
longer rank-0-only phase can be wrapped in `job.section(...)` or the bound raised; a false report
costs a warning, never the job, and is taken back when the rank makes progress again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

# The second look, this long after a first one found a suspect.
CONFIRM_SECONDS = 5.0
# A suspect that used more than this share of a core between the two looks is working, not hung.
IDLE_SHARE = 0.25


class Seen(Protocol):
    """A rank as the watch judges it (agent/observe/hang_report.py's Snapshot is one)."""

    rank: int
    host: str
    state: str
    stack: list[str]
    beats: int | None
    quiet: float | None
    section: str
    cpu: float | None

    @property
    def in_collective(self) -> bool: ...


S = TypeVar("S", bound=Seen)


def _suspect_state(state: str) -> bool:
    return state.startswith("stopped") or state.startswith("uninterruptible")


def stuck_rank(snapshots: Sequence[S], after: float) -> tuple[S, list[S]] | None:
    """The rank the others wait for, and the ranks waiting in a collective; None without that evidence.

    A candidate was quiet for `after` seconds, is in no section, and is outside any collective or
    stopped; a waiter is in a collective and was quiet for at least `after / 2`. Several candidates:
    the one with the fewest heartbeats (then the lowest rank)."""
    candidates = [
        s
        for s in snapshots
        if (s.quiet or 0.0) >= after
        and not s.section
        and (_suspect_state(s.state) or (bool(s.stack) and not s.in_collective))
    ]
    waiting = [
        s for s in snapshots if s not in candidates and s.stack and s.in_collective and (s.quiet or 0.0) >= after / 2
    ]
    if not candidates or not waiting:
        return None
    culprit = min(candidates, key=lambda s: (s.beats if s.beats is not None else -1, s.rank))
    return culprit, sorted(waiting, key=lambda s: s.rank)


@dataclass(frozen=True)
class Suspect:
    """What the first look saw of the rank it suspects, for the second to compare with."""

    rank: int
    host: str
    stack: tuple[str, ...]
    waiting: tuple[int, ...]
    cpu: float | None
    at: float  # monotonic time of the first look

    @classmethod
    def of(cls, culprit: Seen, waiting: Sequence[Seen], now: float) -> Suspect:
        return cls(culprit.rank, culprit.host, tuple(culprit.stack), tuple(s.rank for s in waiting), culprit.cpu, now)

    def confirmed_by(self, culprit: Seen, waiting: Sequence[Seen], now: float) -> bool:
        """The second look saw the same: same rank at the same frames, the same ranks waiting, and idle."""
        if (culprit.rank, culprit.host, tuple(culprit.stack)) != (self.rank, self.host, self.stack):
            return False
        if not set(self.waiting) <= {s.rank for s in waiting}:
            return False
        if self.cpu is None or culprit.cpu is None:
            return True  # no CPU reading (the process went away meanwhile): the frames decide
        return culprit.cpu - self.cpu <= IDLE_SHARE * max(now - self.at, CONFIRM_SECONDS)


@dataclass
class Reported:
    """A hang this node reported and nobody has taken back yet."""

    rank: int
    host: str
    detail: str
    at: float  # monotonic time of the report
    wall: float  # time.time() of the report, for records


class HangWatch:
    """When to look (at most once per `after` seconds, only while a local worker is quiet that
    long) and what is reported; the looking itself is the hang report's (agent/observe/hang_report.py)."""

    def __init__(self, after: float):
        self.after = after
        self.next_look_at = 0.0
        self.reported: Reported | None = None
        self.suspect: Suspect | None = None  # found by a first look, to be confirmed by a second

    @property
    def on(self) -> bool:
        return self.after > 0

    def due(self, quiet: dict[int, float], now: float) -> bool:
        """Whether to look now: some local worker quiet for `after`, no report standing, not looked lately
        (or a suspect to confirm, CONFIRM_SECONDS after the first look)."""
        if not self.on or self.reported is not None:
            return False
        if self.suspect is not None:
            return now >= self.suspect.at + CONFIRM_SECONDS
        return now >= self.next_look_at and max(quiet.values(), default=0.0) >= self.after

    def judge(self, found: tuple[Seen, Sequence[Seen]] | None, now: float) -> bool:
        """After a look: True when it confirms the suspect of the look before (report it now)."""
        suspect, self.suspect = self.suspect, None
        if found is None:
            self.looked(now)
            return False
        culprit, waiting = found
        if suspect is not None and suspect.confirmed_by(culprit, waiting, now):
            return True
        if suspect is not None:  # it moved, or worked: not hung; the next look after a whole bound
            self.looked(now)
            return False
        self.suspect = Suspect.of(culprit, waiting, now)
        return False

    def looked(self, now: float) -> None:
        self.next_look_at = now + self.after

    def progressed(self, quiet: dict[int, float], now: float) -> Reported | None:
        """The standing report, taken back, if some local worker made progress since it was made."""
        report = self.reported
        if report is None or not quiet or min(quiet.values()) >= now - report.at:
            return None
        self.reported = None
        self.looked(now)
        return report
