"""Who really hung: every rank's state and stacks, from every node, and the culprit named.

A collective hang is seen first where the waiting happens: the ranks that sit in `all_reduce`
stop making progress, so they are the ones whose heartbeats (or output) stop and that a naive
report blames, while the rank that never reached the collective is never shown. So when this
node finds a hung worker, it asks every node for a snapshot of all its workers before any of
them is killed:

    this node:   set <r>/dump/<n> (request n)      every other agent watches requests in order
    every node:  snapshot its workers -> <r>/stacks/<n>/<group_rank>
    this node:   wait for all of them (bounded by `HANG_REPORT_WAIT_SECONDS`), name the culprit

A snapshot is the process state from /proc (taken before anything is sent to the process), the
Python stacks of all its threads (faulthandler, installed by rally's bootstrap), and its
heartbeat count. The culprit, in this order:

1. a stopped process (state T: SIGSTOP, a debugger) or one in uninterruptible sleep (D);
2. a rank outside the collective the others wait in: its stacks show no torch.distributed
   frame while the others' do;
3. the rank with the lowest progress (fewest heartbeats);
4. else the rank this node found hung.

Its stacks are the root cause's; every other rank is summarised in one line (state, top frame).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rally.agent.base.collaborator import AgentContext, Collaborator
from rally.agent.base.event_loop import DumpStacks, News
from rally.agent.base.exit_codes import EXIT_INFRASTRUCTURE
from rally.agent.base.spec import STACK_SIGNAL
from rally.agent.display import console
from rally.agent.guard.processes import process_state
from rally.agent.observe.hang_watch import HangWatch, Reported, stuck_rank
from rally.agent.observe.health import Hang, HealthSource
from rally.rendezvous.c10d.store import StoreError
from rally.rendezvous.protocol import Assignment, EndKind, Round, RoundEnd


class StackSource(Protocol):
    """A worker as this module sees it (agent/rounds/workers.py's Worker is one): a process to
    signal and the stderr its stack dump lands in. A protocol, so that observe/ does not depend on
    the room above it that starts the workers."""

    @property
    def pid(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def output(self) -> StderrLog: ...


class StderrLog(Protocol):
    """A worker's output as this module reads it (agent/rounds/output.py's WorkerOutput is one)."""

    def stack_mark(self) -> int: ...

    def stack_since(self, mark: int) -> list[str]: ...

    def last_output_at(self) -> float: ...


class RoundWorkers(Protocol):
    """This round's workers on this node (agent/rounds/workers.py's WorkerGroup is one)."""

    @property
    def workers(self) -> Sequence[StackSource]: ...

    def running(self) -> Sequence[StackSource]: ...


class HangContext(AgentContext, Protocol):
    """What the hang report needs of its agent beyond every collaborator's context."""

    @property
    def group(self) -> RoundWorkers | None:
        """This round's workers on this node, None while none run."""


# How long the node that found a hang waits for the other nodes' snapshots.
HANG_REPORT_WAIT_SECONDS = 10.0
# A stack dump is complete when the worker's stderr has been quiet this long.
STACK_QUIET_SECONDS = 0.2

# Frames that mean "this rank is inside a collective": anything in torch.distributed, or a
# collective's name (a wrapper such as DDP's may call it from elsewhere).
COLLECTIVE_FUNCTIONS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv",
)  # fmt: skip
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<function>\S+)')


# Frames of rally's bootstrap and of runpy sit below every script's own (agent/worker_side/bootstrap.py):
# they say nothing about the hang, so the report leaves them out.
_OWN_FRAME = re.compile(r'^\s*File "[^"]*(/agent/worker_side/bootstrap\.py|/runpy\.py)", line \d+ in ')


def without_own_frames(stack: list[str]) -> list[str]:
    """A faulthandler dump without the frames of rally's bootstrap and of runpy."""
    return [line for line in stack if not _OWN_FRAME.match(line)]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process has used (/proc/PID/stat), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
    except (OSError, ValueError, IndexError):
        return None


def is_suspect_state(state: str) -> bool:
    return state.startswith("stopped") or state.startswith("uninterruptible")


def frames(stack: list[str]) -> list[tuple[str, str, str]]:
    """(file, line, function) of every frame in a faulthandler dump, in the order printed."""
    found = []
    for line in stack:
        m = _FRAME.match(line)
        if m:
            found.append((m["file"], m["line"], m["function"]))
    return found


def in_collective(stack: list[str]) -> bool:
    return any("torch/distributed/" in f or fn in COLLECTIVE_FUNCTIONS for f, _, fn in frames(stack))


def top_frame(stack: list[str]) -> str:
    """The innermost frame of the thread that took the dump (the main thread), as 'fn (file:line)'."""
    current = stack
    for i, line in enumerate(stack):
        if line.startswith("Current thread"):
            current = stack[i:]
            break
    found = frames(current)
    if not found:
        return "no Python stack"
    file, line, function = found[0]
    return f"{function} ({os.path.basename(file)}:{line})"


@dataclass
class Snapshot:
    """One rank as its agent saw it when the hang was reported."""

    rank: int
    local_rank: int
    host: str
    pid: int
    state: str
    stack: list[str]
    beats: int | None
    node: int = -1  # the agent's group rank
    quiet: float | None = None  # seconds since its last sign of progress (agent/observe/health.py quiet_for)
    section: str = ""  # the job.section it is in
    cpu: float | None = None  # CPU seconds (user + system) the process had used when the snapshot was taken

    @classmethod
    def from_dict(cls, data: dict) -> Snapshot | None:
        try:
            return cls(
                int(data["rank"]),
                int(data["local_rank"]),
                str(data["host"]),
                int(data["pid"]),
                str(data["state"]),
                [str(line) for line in data.get("stack") or []],
                None if data.get("beats") is None else int(data["beats"]),
                int(data.get("node", -1)),
                None if data.get("quiet") is None else float(data["quiet"]),
                str(data.get("section") or ""),
                None if data.get("cpu") is None else float(data["cpu"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def in_collective(self) -> bool:
        return in_collective(self.stack)

    def summary(self) -> str:
        where = ("in a collective: " if self.in_collective else "") + top_frame(self.stack)
        beats = "" if self.beats is None else f", {self.beats} heartbeats"
        return f"rank {self.rank} (node {self.node} {self.host}, pid {self.pid}): {self.state}, {where}{beats}"


def name_culprit(snapshots: list[Snapshot], found_hung: Snapshot | None) -> tuple[Snapshot, str] | None:
    """The rank most likely to have caused the hang, and why (see the module docstring)."""
    if not snapshots:
        return None
    ordered = sorted(snapshots, key=lambda s: s.rank)
    suspect = [s for s in ordered if is_suspect_state(s.state)]
    if suspect:
        return suspect[0], f"its process is {suspect[0].state}"
    waiting = [s for s in ordered if s.stack and s.in_collective]
    outside = [s for s in ordered if s.stack and not s.in_collective]
    if waiting and outside:
        culprit = min(outside, key=lambda s: (s.beats if s.beats is not None else -1, s.rank))
        ranks = ", ".join(str(s.rank) for s in waiting)
        return culprit, (
            f"it is outside the collective that rank{'s' if len(waiting) > 1 else ''} {ranks} "
            f"wait{'' if len(waiting) > 1 else 's'} in ({top_frame(waiting[0].stack)}); it is in "
            f"{top_frame(culprit.stack)}"
        )
    beating = [(s.beats, s) for s in ordered if s.beats is not None]
    most = max((beats for beats, _ in beating), default=0)
    if len(beating) > 1 and min(beats for beats, _ in beating) < most:
        beats, culprit = min(beating, key=lambda pair: (pair[0], pair[1].rank))
        return culprit, f"it made the least progress ({beats} heartbeats; the others up to {most})"
    if found_hung is not None:
        return found_hung, ""
    return ordered[0], ""


class HangReporter(Collaborator):
    """The agent's side: find a hung worker, snapshot this node's workers, ask the others, write the
    root cause; and answer the other nodes' requests (the agent's main loop calls `answer`)."""

    wants = (DumpStacks,)

    def __init__(self, ctx: HangContext, health: HealthSource, wait: float = HANG_REPORT_WAIT_SECONDS):
        """`health`: who keeps this round's health monitor (heartbeats, output, hang timeouts: the
        observer); `wait`: how long the node that found a hang waits for the other nodes' snapshots."""
        self.ctx = ctx
        self.health = health
        self.host = ctx.host
        self.wait = wait
        self.answered: set[tuple[int, int]] = set()  # (round, request) answered
        self.hang_watch = HangWatch(ctx.spec.hang_report_after)  # the default watch (agent/observe/hang_watch.py)

    # ------------------------------------------------------------ hooks (agent/base/collaborator.py)
    def round_formed(self, rnd: Round) -> None:
        self.start_watching(rnd)

    def watch(self, rnd: Round) -> RoundEnd | None:
        """A worker hung (no heartbeat, no output): the round ends with the culprit named."""
        group = self.ctx.group
        assert group is not None  # the watch loop runs while the round's workers do
        last_output = {w.local_rank: w.output.last_output_at() for w in group.running()}
        hangs = self.health.health.check(last_output)
        if not hangs:
            self.watch_quietly(rnd, last_output)
            return None
        end = self.report(rnd, hangs[0])
        return self.ctx.store_call(lambda: rnd.channel.end(end))

    def watch_over(self, rnd: Round) -> None:
        self.round_over(rnd)
        self.hang_watch.reported = None  # the next round's workers are new

    def status_fields(self) -> dict[str, object]:
        """The standing default hang report, for `rally status`, the live view and /metrics."""
        found = self.hang_watch.reported
        if found is None:
            return {}
        return {"hang": {"rank": found.rank, "host": found.host, "detail": found.detail, "time": found.wall}}

    # ------------------------------------------------------------ every node
    def cross_node(self, assignment: Assignment) -> bool:
        return assignment.group_world_size > 1

    def start_watching(self, rnd: Round) -> None:
        """Watch the round's stack requests in a thread (own store connection); the main loop answers."""
        if self.cross_node(rnd.assignment):
            threading.Thread(target=self._watch_requests, args=(rnd,), daemon=True).start()

    def _watch_requests(self, rnd: Round) -> None:
        try:
            stacks, n = rnd.connect_again().stacks, 0
            # wait: background: a thread answering stack requests in slices; every request of the round, in order,
            # until its end
            while stacks.wait_request(n):
                self.ctx.loop.inbox.post(DumpStacks(rnd.assignment.round, n))
                n += 1
        except StoreError:
            pass  # the store is gone: the keep-alive and round-end threads report that

    def round_over(self, rnd: Round) -> None:
        """Release this round's watchers (ours and, if nobody asked yet, everyone's).

        In a thread of its own, on a connection of its own: the round may be over because the
        store froze or this node was cut off, and a store call would then never return."""
        if self.cross_node(rnd.assignment):

            def release() -> None:
                try:
                    rnd.connect_again().stacks.end_requests()
                except StoreError:
                    pass

            threading.Thread(target=release, daemon=True).start()

    def on_news(self, rnd: Round, news: News) -> None:
        if isinstance(news, DumpStacks) and news.round == rnd.assignment.round:
            self.answer(rnd, news.request)

    def answer(self, rnd: Round, request: int = 0) -> None:
        """Another node found a hang (or a rank that looks stuck): publish this node's snapshots (once per request)."""
        if (rnd.assignment.round, request) in self.answered:
            return
        self.answered.add((rnd.assignment.round, request))
        snapshots = [s.__dict__ for s in self.snapshot_workers(rnd.assignment)]
        self.ctx.store_call(lambda: rnd.stacks.publish(request, snapshots))

    def snapshot_workers(self, assignment: Assignment) -> list[Snapshot]:
        """State first (before SIGCONT or the dump signal touch it), then stacks and heartbeats."""
        group = self.ctx.group
        workers = group.running() if group is not None else []
        states = {w.local_rank: process_state(w.pid) for w in workers}
        now = time.monotonic()
        health = self.health.health
        quiet = {w.local_rank: health.quiet_for(w.local_rank, w.output.last_output_at(), now) for w in workers}
        cpu = {w.local_rank: cpu_seconds(w.pid) for w in workers}
        stacks = self.collect_stacks(workers)
        return [
            Snapshot(
                w.global_rank,
                w.local_rank,
                self.host,
                w.pid,
                states[w.local_rank],
                stacks.get(w.local_rank, []),
                self.health.health.heartbeat_count(w.local_rank),
                assignment.group_rank,
                round(quiet[w.local_rank], 1),
                self.health.health.section(w.local_rank),
                cpu[w.local_rank],
            )
            for w in workers
        ]

    def collect_stacks(self, workers: Sequence[StackSource]) -> dict[int, list[str]]:
        """Ask each worker's faulthandler for all its threads' stacks, all at once; bounded wait."""
        if not self.ctx.spec.is_python or not workers:
            return {}
        marks = {}
        for w in workers:
            try:
                stopped = process_state(w.pid).startswith("stopped")
                marks[w.local_rank] = w.output.stack_mark()
                os.kill(w.pid, STACK_SIGNAL)
                if stopped:  # a stopped process runs its dump handler only once continued; the signal
                    os.kill(w.pid, signal.SIGCONT)  # sent first is pending, so it dumps where it stopped
            except ProcessLookupError:
                continue
        asked = [w for w in workers if w.local_rank in marks]
        deadline = time.monotonic() + self.health.health.settings.stack_dump_wait
        seen: dict[int, int] = {}
        quiet_since = time.monotonic()
        while asked and time.monotonic() < deadline:
            self.ctx.loop.pump(0.05)
            counts = {w.local_rank: len(w.output.stack_since(marks[w.local_rank])) for w in asked}
            if counts != seen:
                seen, quiet_since = counts, time.monotonic()
            elif all(counts.values()) and time.monotonic() - quiet_since > STACK_QUIET_SECONDS:
                break
        return {w.local_rank: without_own_frames(w.output.stack_since(marks[w.local_rank])) for w in asked}

    # ------------------------------------------------------------ the node that found the hang
    def report(self, rnd: Round, hang: Hang) -> RoundEnd:
        """Snapshot every rank on every node, name the culprit, and describe it as the round's end."""
        a, group = rnd.assignment, self.ctx.group
        assert group is not None
        found = next(w for w in group.workers if w.local_rank == hang.local_rank)
        reason = f"rank {found.global_rank} on {self.host} {hang.reason}"
        self.ctx.events.emit("worker_hung", round=a.round, rank=found.global_rank, pid=found.pid, reason=hang.reason)
        mine, snapshots, missing = self.every_node(rnd, reason, ask=self.cross_node(a))
        found_snapshot = next((s for s in mine if s.local_rank == hang.local_rank), None)
        named = name_culprit(snapshots, found_snapshot)
        return self._describe(a, hang, found, snapshots, named, missing)

    def every_node(
        self, rnd: Round, reason: str, ask: bool, mine: list[Snapshot] | None = None
    ) -> tuple[list[Snapshot], list[Snapshot], list[int]]:
        """This node's snapshots (`mine`, else taken now), everyone's (asked for through the store when
        `ask`), and the nodes that sent none."""
        a, store_call = rnd.assignment, self.ctx.store_call
        request = store_call(lambda: rnd.stacks.request(reason)) if ask else None
        mine = self.snapshot_workers(a) if mine is None else mine
        snapshots = list(mine)
        missing: list[int] = []
        if request is not None:
            n = request
            self.answered.add((a.round, n))
            store_call(lambda: rnd.stacks.publish(n, [s.__dict__ for s in mine]))
            gathered = store_call(lambda: rnd.stacks.gather(n, self.wait), waiting=True)
            for g in range(a.group_world_size):
                if g == a.group_rank:
                    continue
                if g not in gathered:
                    missing.append(g)
                snapshots += [s for s in (Snapshot.from_dict(d) for d in gathered.get(g, [])) if s is not None]
        return mine, snapshots, missing

    # ------------------------------------------------------------ the default watch (agent/observe/hang_watch.py)
    def watch_quietly(self, rnd: Round, last_output: dict[int, float]) -> None:
        """No hang timeout fired: look for a rank stuck while others wait for it in a collective,
        at most once per --hang-report-after seconds, and report it without ending the round."""
        watch = self.hang_watch
        if not watch.on or not last_output:
            return
        now = time.monotonic()
        quiet = {rank: self.health.health.quiet_for(rank, at, now) for rank, at in last_output.items()}
        over = watch.progressed(quiet, now)
        if over is not None:
            ago = now - over.at
            console.say(
                f"rank {over.rank} on {over.host} is making progress again: the hang reported {ago:.0f} s ago is over"
            )
            self.ctx.events.emit("hang_over", round=rnd.assignment.round, rank=over.rank, host=over.host)
            return
        if not watch.due(quiet, now):
            return
        watch.looked(now)
        a = rnd.assignment
        mine = self.snapshot_workers(a)
        # Another node is asked only by a node whose own workers wait in a collective: the waiting
        # side sees the hang first, and a node of ranks that all work alone (data loading) asks nobody.
        waiting_here = any(s.in_collective and (s.quiet or 0.0) >= watch.after / 2 for s in mine)
        snapshots, missing = mine, list[int]()
        if self.cross_node(a) and waiting_here:
            reason = f"a rank on {self.host} waits in a collective with no progress for {watch.after:g} s"
            _, snapshots, missing = self.every_node(rnd, reason, ask=True, mine=mine)
        found = stuck_rank(snapshots, watch.after)
        if not watch.judge(found, time.monotonic()) or found is None:
            return  # nothing, or a suspect that the next look (CONFIRM_SECONDS on) must see again
        culprit, waiting = found
        self.report_quietly(rnd, culprit, waiting, snapshots, missing)

    def report_quietly(
        self, rnd: Round, culprit: Snapshot, waiting: list[Snapshot], snapshots: list[Snapshot], missing: list[int]
    ) -> None:
        """Say it (console, events, status record, report.json); the workers go on."""
        after = self.hang_watch.after
        ranks = ", ".join(str(s.rank) for s in waiting)
        state = f"its process is {culprit.state}, " if is_suspect_state(culprit.state) else ""
        detail = (
            f"rank {culprit.rank} (local rank {culprit.local_rank}, pid {culprit.pid}) on {culprit.host} looks hung: "
            f"{state}no progress for {culprit.quiet or 0:.0f} s, outside the collective that "
            f"rank{'s' if len(waiting) > 1 else ''} {ranks} wait{'' if len(waiting) > 1 else 's'} in "
            f"({top_frame(waiting[0].stack)}); it is in {top_frame(culprit.stack)}"
        )
        others = [s.summary() for s in sorted(snapshots, key=lambda s: s.rank) if s is not culprit]
        others += [f"node {g}: sent no snapshot within {self.wait:g} s" for g in missing]
        lines = [
            f"{detail} (reported after {after:g} s without progress, --hang-report-after; the job goes on: "
            "--heartbeat-timeout or --silence-timeout stops a hung job)",
            "its Python stacks:",
            *("  " + line for line in culprit.stack),
            "the other ranks:",
            *("  " + line for line in others),
        ]
        console.warn("\n".join(lines))
        now = time.time()
        record = {
            "round": rnd.assignment.round,
            "rank": culprit.rank,
            "local_rank": culprit.local_rank,
            "host": culprit.host,
            "pid": culprit.pid,
            "state": culprit.state,
            "where": top_frame(culprit.stack),
            "quiet": culprit.quiet,
            "detail": detail,
            "stacks": culprit.stack,
            "others": others,
            "time": now,
        }
        self.ctx.events.emit("hang_reported", **record)
        hangs = self.ctx.report.notes.setdefault("hangs", [])  # report.json's `hangs`
        if isinstance(hangs, list):
            hangs.append(record)
        self.ctx.report.write()
        self.hang_watch.reported = Reported(culprit.rank, culprit.host, detail, time.monotonic(), now)

    def _describe(
        self,
        assignment: Assignment,
        hang: Hang,
        found: StackSource,
        snapshots: list[Snapshot],
        named: tuple[Snapshot, str] | None,
        missing: list[int],
    ) -> RoundEnd:
        host = self.host
        if named is None:  # the hung worker exited while it was being looked at
            culprit = Snapshot(
                found.global_rank, found.local_rank, host, found.pid, "exited", [], None, assignment.group_rank
            )
            why = ""
        else:
            culprit, why = named
        is_found = culprit.node == assignment.group_rank and culprit.local_rank == found.local_rank
        detail = f"rank {culprit.rank} (local rank {culprit.local_rank}, pid {culprit.pid}) on {culprit.host} is hung: "
        if is_found and not why:
            detail += f"it {hang.reason}"
        else:
            detail += why or f"it {hang.reason}"
            if not is_found:
                detail += f"; found when rank {found.global_rank} on {host} {hang.reason}"
        others = [s.summary() for s in sorted(snapshots, key=lambda s: s.rank) if s is not culprit]
        others += [f"node {g}: sent no snapshot within {self.wait:g} s" for g in missing]
        info: dict[str, Any] = {
            "host": culprit.host,
            "group_rank": culprit.node,
            "rank": culprit.rank,
            "local_rank": culprit.local_rank,
            "pid": culprit.pid,
            "state": culprit.state,
            "stacks": culprit.stack,
            "hang": hang.reason,
            "others": others,
            "found_by": {"host": host, "rank": found.global_rank, "reason": hang.reason},
            "exit_status": EXIT_INFRASTRUCTURE,
            "time": time.time(),
        }
        return RoundEnd(EndKind.WORKER_HUNG, detail, culprit.host, info)
