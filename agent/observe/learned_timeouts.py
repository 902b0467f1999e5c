"""`--heartbeat-timeout auto`: hang timeouts learned from the job itself, not guessed by the user.

Too short a `--heartbeat-timeout` kills a healthy job at its first slow step; too long wastes a
node-hour per hang. NVIDIA's ft_launcher (fault_tolerance/timeouts_calc.py) measures instead: the
longest gap between heartbeats times a safety factor. rally does the same:

* the worker measures (agent/worker_side/heartbeat_file.py): each beat records the longest interval so far,
  counted from the later of the previous beat and the last section change (the clock the agent
  judges a hang by); each top-level `job.section(name)` without a timeout of its own records, on
  exit, how often that name completed and its longest duration;
* this module turns them into deadlines: after `samples` intervals the heartbeat timeout is
  `factor` x the longest, at least `floor`; a section's after its first completion (a checkpoint
  may run once an hour: waiting for several would leave it unguarded for hours). Inside such a
  section only its own deadline counts (none before it is learned), so a long checkpoint never
  trips the step timeout. A longer interval seen later raises a timeout, never lowers it;
* the values go to the store (`rendezvous/status/job_notes.py`): a restarted round, or a node that
  joins later, starts with them instead of learning again. Every node merges by maximum.

The values are printed once when first learned and again whenever they change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeGuard

from rally.agent.base.spec import LearningSettings
from rally.agent.worker_side.heartbeat_file import HeartbeatRecord

# A learned timeout is raised (and printed) only when the new value is this much above it, so a
# job whose longest step creeps up by milliseconds does not print a line per step.
CHANGE_FRACTION = 0.1
# Sections are learned from their first completion (see the module docstring).
SECTION_SAMPLES = 1


class LearnedTimeouts:
    """What this node learned (and took from the store) for one job; lives as long as the agent.

    `observe` runs on the agent's main thread, `to_json`/`merge` also on the keep-alive thread
    (which persists the values): a lock keeps the two apart."""

    def __init__(self, settings: LearningSettings, say: Callable[[str], None], emit: Callable[..., None]):
        self.settings = settings
        self.say = say
        self.emit = emit
        self.heartbeat: float | None = None
        self.sections: dict[str, float] = {}
        self.longest_beat = 0.0  # seconds, over every worker and round seen here
        self.longest_section: dict[str, float] = {}
        self.changed = False  # not yet in the store
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the deadlines
    def section_timeout(self, section: str) -> float | None:
        """The learned deadline of the top-level section `section` (or its nested `a/b`) is in."""
        return self.sections.get(section.split("/", 1)[0])

    # ------------------------------------------------------------------ learning
    def observe(self, record: HeartbeatRecord) -> None:
        """One read of a worker's heartbeat file."""
        s = self.settings
        seconds = record.longest_interval_ns / 1e9
        if record.intervals and seconds > self.longest_beat:
            self.longest_beat = seconds
        if self.heartbeat is not None or record.intervals >= s.samples:
            self._raise("heartbeat", None, self.longest_beat, f"{record.intervals} intervals")
        name = record.done_section
        if name and record.done_count >= SECTION_SAMPLES:
            longest = max(self.longest_section.get(name, 0.0), record.done_longest_ns / 1e9)
            self.longest_section[name] = longest
            self._raise(
                "section", name, longest, f"{record.done_count} completion{'s' if record.done_count != 1 else ''}"
            )

    def _raise(self, kind: str, name: str | None, longest: float, seen: str) -> None:
        s = self.settings
        value = max(s.floor, s.factor * longest)
        current = self.heartbeat if name is None else self.sections.get(name)
        if current is not None and value <= current * (1 + CHANGE_FRACTION):
            return
        with self._lock:
            if name is None:
                self.heartbeat = value
            else:
                self.sections[name] = value
            self.changed = True
        what = "heartbeat timeout" if name is None else f"timeout of section '{name}'"
        verb = "learned" if current is None else f"raised from {current:.2f} s to"
        self.say(
            f"{what} {verb} {value:.2f} s: {s.factor:g} x the longest of {seen} ({longest:.2f} s), "
            f"at least {s.floor:g} s (--heartbeat-timeout auto)"
        )
        self.emit(
            "timeout_learned",
            kind=kind,
            section=name,
            timeout=round(value, 3),
            longest=round(longest, 6),
            previous=current,
        )

    # ------------------------------------------------------------------ the store (rendezvous/status/job_notes.py)
    def to_json(self) -> dict[str, Any]:
        with self._lock:
            self.changed = False
            return {"heartbeat": self.heartbeat, "sections": dict(self.sections)}

    def merge(self, stored: dict[str, Any] | None, source: str) -> None:
        """Take the larger of each value from the store (written by this job's agents earlier)."""
        if not isinstance(stored, dict):
            return
        taken = []
        beat = stored.get("heartbeat")
        with self._lock:
            if _seconds(beat) and (self.heartbeat is None or beat > self.heartbeat):
                self.heartbeat = float(beat)
                taken.append(f"heartbeat {beat:.1f} s")
            sections = stored.get("sections")
            for name, value in sections.items() if isinstance(sections, dict) else []:
                if isinstance(name, str) and _seconds(value) and value > self.sections.get(name, 0.0):
                    self.sections[name] = float(value)
                    taken.append(f"section '{name}' {value:.1f} s")
        if taken:
            self.say(f"learned timeouts from {source}, not learning them again: {', '.join(taken)}")
            self.emit("timeouts_loaded", heartbeat=self.heartbeat, sections=dict(self.sections))


def _seconds(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e9
