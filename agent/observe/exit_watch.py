"""Workers that do not end: caught with no flag, with their stacks and one line.

A worker can be done and still never exit: torch's process-group destructors hang at interpreter
exit (a gloo or NCCL group destroyed after its peers left), an atexit handler waits for ever, a
data loader leaves a non-daemon thread. The job then never ends and its allocation burns, and the
default hang watch (agent/observe/hang_watch.py) sees nothing: nobody waits for the rank in a
collective. Two cases, timed from the moment the rank is done, bounded by half of
--hang-report-after (`SHARE_OF_HANG_BOUND`: 30 s by default; 0 turns this off with the hang watch):

* **its training function returned for good** (`rally.job.run` says "returned" over its socket,
  agent/base/reentry_wire.py): once every worker of the job has exited 0 or returned, a worker
  still alive `bound` seconds after its return is stuck on its way out. Its stacks are taken (as
  the hang report takes them, silently), one line says where it is stuck, and it is stopped
  (SIGTERM, SIGKILL after --shutdown-timeout): its function succeeded, so the job does
  (`stuck_after_return` on the worker makes its exit a success, agent/rounds/workers.py);
* **a plain script's rank alive `bound` seconds after every other rank of the job exited 0**:
  the same line, once, and nothing stopped: a script may work on alone after the others (rank 0
  uploading the model), and torchrun waits for it too.

A rank that used more than IDLE_SHARE of a core over the bound is working, not stuck: its clock
starts again (a stuck exit waits on a lock or a socket and uses nothing). "Every other rank" is
job-wide, from signed records beside the success records nodes leave for the round's end
(rendezvous/round_channel.py): a node whose workers are all done (exited 0 or returned) writes its
`done` mark. A node with a rank timed here waits for every other node's `done` marks (a returned
rank) or success records (a plain script's) in a thread of its own: a store wait, no polling.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rally.agent.base.collaborator import AgentContext, Collaborator
from rally.agent.base.event_loop import News, PeersDone, WorkerSaid
from rally.agent.display import console
from rally.agent.guard import processes
from rally.agent.observe.hang_report import StackSource, cpu_seconds, top_frame
from rally.agent.observe.hang_watch import IDLE_SHARE
from rally.rendezvous.base.membership import WAIT_SLICE_SECONDS
from rally.rendezvous.c10d.store import StoreError
from rally.rendezvous.protocol import Round

# The bound, as a share of --hang-report-after (60 s: 30 s). Shorter than the hang watch's: a done
# rank has no reason to wait at all, while a rank in a job may work alone for a while; long enough
# for a slow but healthy exit (a checkpoint's last write, a process group's orderly teardown).
SHARE_OF_HANG_BOUND = 0.5


class DoneWorker(StackSource, Protocol):
    """A worker as this watch sees it (agent/rounds/workers.py's Worker is one)."""

    stopped: bool
    stuck_after_return: bool  # set here: its function returned and it was stopped for not exiting

    @property
    def returncode(self) -> int | None: ...


class DoneWorkers(Protocol):
    @property
    def workers(self) -> Sequence[DoneWorker]: ...


class Stacks(Protocol):
    """Who takes a worker's stacks silently (agent/observe/hang_report.py's HangReporter)."""

    def collect_stacks(self, workers: Sequence[StackSource]) -> dict[int, list[str]]: ...


class ExitWatchContext(AgentContext, Protocol):
    @property
    def group(self) -> DoneWorkers | None: ...


@dataclass
class Clock:
    """A rank being timed: since when (time.monotonic()), and the CPU seconds it had used then."""

    since: float
    cpu: float | None

    def __post_init__(self) -> None:
        self.started = self.since  # `since` starts again after a busy stretch; this does not

    def due(self, bound: float, now: float, cpu: float | None) -> bool:
        """`bound` seconds passed and the rank sat idle meanwhile (`cpu`: its CPU seconds now, None
        when unknown); a busy one starts a new clock."""
        if now - self.since < bound:
            return False
        if self.cpu is None or cpu is None or cpu - self.cpu <= IDLE_SHARE * (now - self.since):
            return True
        self.since, self.cpu = now, cpu
        return False


class ExitWatch(Collaborator):
    """The agent's side: time the ranks that are done, report (and, for rally.job.run, stop) those
    that do not end. See the module docstring."""

    wants = (WorkerSaid, PeersDone)

    def __init__(self, ctx: ExitWatchContext, stacks: Stacks) -> None:
        self.ctx = ctx
        self.stacks = stacks
        self.bound = ctx.spec.hang_report_after * SHARE_OF_HANG_BOUND
        self.returned: dict[int, float] = {}  # pid -> when its function returned for good
        self.clocks: dict[int, Clock] = {}
        self.done: set[int] = set()  # pids reported (a plain script's) or stopped (returned)
        self.kill_at: dict[int, float] = {}  # pid -> when SIGKILL follows its SIGTERM
        self.heard: set[str] = set()  # "done", "succeeded": every other node's records are there
        self.waiting: set[str] = set()  # the kinds of records a thread of ours waits for
        self.over = threading.Event()  # the round's watch is over: our waits end
        self.told = False  # this node's `done` mark is written
        self.timed: list[int] = []  # pids whose clock runs: the job is done but for them

    # ------------------------------------------------------------ hooks (agent/base/collaborator.py)
    def round_formed(self, rnd: Round) -> None:
        self.returned, self.clocks, self.done, self.kill_at = {}, {}, set(), {}
        self.heard, self.waiting, self.over, self.told, self.timed = set(), set(), threading.Event(), False, []

    def watch_over(self, rnd: Round) -> None:
        self.over.set()

    def on_news(self, rnd: Round, news: News) -> None:
        if isinstance(news, PeersDone):
            self.heard.add(news.kind)
        elif isinstance(news, WorkerSaid) and news.message.get("op") == "returned":
            self.returned[news.pid] = now = time.monotonic()
            self.clocks[news.pid] = Clock(now, cpu_seconds(news.pid))

    def next_due(self, now: float) -> float | None:
        times = [t - now for t in self.kill_at.values()]
        times += [self.clocks[pid].since + self.bound - now for pid in self.timed]
        return max(0.0, min(times)) if times else None

    def watch(self, rnd: Round) -> None:
        group = self.ctx.group
        if self.bound <= 0 or group is None:
            return None
        now = time.monotonic()
        a, workers = rnd.assignment, list(group.workers)
        for worker in workers:
            if worker.pid in self.kill_at and now >= self.kill_at[worker.pid]:  # the SIGTERM's grace is over
                del self.kill_at[worker.pid]
                if worker.returncode is None:  # not reaped: its pid is still its own
                    processes.send_to_group(worker.pid, signal.SIGKILL)
        alive = [w for w in workers if w.returncode is None and not w.stuck_after_return]
        returned = [w for w in alive if w.pid in self.returned]
        ended_well = [w for w in workers if w.returncode == 0 or w.stuck_after_return]
        plain = [w for w in alive if w.pid not in self.returned]
        # this node's part: its ranks all done (some alive after their return), or one plain rank left
        done = len(ended_well) + len(returned) == len(workers)
        here = bool(returned) and done
        alone = len(plain) == 1 and len(ended_well) == len(workers) - 1 and a.world_size > 1
        several = a.group_world_size > 1
        if several and done and not self.told:
            self.ctx.store_call(rnd.channel.report_done)
            self.told = True
        if several and here:
            self.hear_from_others(rnd, "done")
        if several and alone:
            self.hear_from_others(rnd, "succeeded")
        finished, exited = ("done" in self.heard, "succeeded" in self.heard) if several else (True, True)
        self.timed = []
        if here and finished:
            for worker in returned:
                if worker.pid in self.done:
                    continue
                if self.clocks[worker.pid].due(self.bound, now, cpu_seconds(worker.pid)):
                    self.stop(rnd, worker, now)
                else:
                    self.timed.append(worker.pid)
        elif alone and exited and plain[0].pid not in self.done:
            worker = plain[0]
            clock = self.clocks.setdefault(worker.pid, Clock(now, cpu_seconds(worker.pid)))
            if clock.due(self.bound, now, cpu_seconds(worker.pid)):
                self.report_alone(rnd, worker, now - clock.started)
            else:
                self.timed.append(worker.pid)
        return None

    def hear_from_others(self, rnd: Round, kind: str) -> None:
        """Wait (once per round and kind, in a thread on a connection of its own) for every other
        node's `kind` records; `PeersDone` tells the main loop. A store lost ends the wait: the
        round's own threads report that."""
        if kind in self.waiting:
            return
        self.waiting.add(kind)
        over, post, number = self.over, self.ctx.loop.inbox.post, rnd.assignment.round

        def wait() -> None:
            try:
                channel = rnd.connect_again().channel
                while not over.is_set():
                    # wait: background: WAIT_SLICE_SECONDS slices until the others' records are there or the round ends
                    if channel.wait_others(kind, WAIT_SLICE_SECONDS):
                        post(PeersDone(number, kind))
                        return
            except StoreError:
                pass

        threading.Thread(target=wait, name=f"rally-exit-watch-{kind}", daemon=True).start()

    # ------------------------------------------------------------ what is said and done
    def stop(self, rnd: Round, worker: DoneWorker, now: float) -> None:
        """Its function returned long ago and every other rank is done: stacks, one line, SIGTERM."""
        grace = self.ctx.spec.shutdown_timeout
        seconds = now - self.returned[worker.pid]
        stack, where = self.where(worker)
        detail = (
            f"rank {worker.global_rank} (local rank {worker.local_rank}, pid {worker.pid}) on {self.ctx.host} is "
            f"still alive {seconds:.0f} s after its training function returned (rally.job.run), every other rank "
            f"done: it is stuck {where}"
        )
        action = (
            f"stopping it (SIGTERM, SIGKILL after {grace:g} s, --shutdown-timeout): its function succeeded, and "
            f"so does the job (the bound: {self.bound:g} s, half of --hang-report-after)"
        )
        self.say(rnd, "stuck_after_return", worker, detail, action, stack, seconds)
        self.done.add(worker.pid)
        worker.stuck_after_return = worker.stopped = True  # its exit is a success, not a failure
        processes.stop_group(worker.pid, signal.SIGTERM)
        self.kill_at[worker.pid] = now + grace

    def report_alone(self, rnd: Round, worker: DoneWorker, seconds: float) -> None:
        """A plain script's rank alive long after every other rank exited 0: said once, nothing stopped."""
        stack, where = self.where(worker)
        detail = (
            f"rank {worker.global_rank} (local rank {worker.local_rank}, pid {worker.pid}) on {self.ctx.host} is "
            f"still running {seconds:.0f} s after every other rank exited 0: it is {where}"
        )
        action = (
            "said once; the job waits for it, as torchrun's would: --silence-timeout S stops a rank S s "
            "without output (a failure); a rank stuck after its rally.job.run function returned is stopped "
            f"as a success (the bound: {self.bound:g} s, half of --hang-report-after)"
        )
        self.say(rnd, "alive_after_peers", worker, detail, action, stack, seconds)
        self.done.add(worker.pid)

    def where(self, worker: DoneWorker) -> tuple[list[str], str]:
        """Its stacks (taken as the hang report takes them: into the agent's capture, not its output)
        and where its main thread is ("in fn (file:line)")."""
        stack = self.stacks.collect_stacks([worker]).get(worker.local_rank, [])
        return (
            stack,
            f"in {top_frame(stack)}" if stack else "with no Python stack (in C code, or past the interpreter's end)",
        )

    def say(
        self, rnd: Round, event: str, worker: DoneWorker, detail: str, action: str, stack: list[str], seconds: float
    ) -> None:
        """The line and its stacks on the console, the event, and report.json's `stuck_at_exit`."""
        console.warn("\n".join([f"{detail}; {action}", "its Python stacks:", *("  " + line for line in stack)]))
        record = {
            "round": rnd.assignment.round,
            "rank": worker.global_rank,
            "local_rank": worker.local_rank,
            "host": self.ctx.host,
            "pid": worker.pid,
            "seconds": round(seconds, 1),
            "where": top_frame(stack),
            "detail": detail,
            "stacks": stack,
            "time": time.time(),
        }
        self.ctx.events.emit(event, **record)
        stuck = self.ctx.report.notes.setdefault("stuck_at_exit", [])
        if isinstance(stuck, list):
            stuck.append({"kind": event, **record})
        self.ctx.report.write()
