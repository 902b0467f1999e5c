"""One way to wire a feature into the agent: a `Collaborator` with hooks at the moments of a job,
handed one `AgentContext` when it is built.

A feature of the agent (quarantine and pre-flight, stragglers and GPUs, the hang report, the
judge of worker exits, the checkpoint tier...) is one class: it subclasses `Collaborator`,
overrides the hooks it needs (the others do nothing) and is registered in one list,
`Agent.collaborators` (agent/agent.py). The agent calls every registered collaborator's hook at
each moment, in the list's order (at `exit`, in reverse: the last registered stops first):

    start()                        once, before the store is opened
    joined(store)                  once, the store open, before this node registers
    before_round()                 before this node joins each round
    round_formed(rnd)              the round formed and its threads run; workers' store not known yet
    workers_starting(rnd, master)  the workers' store is known, no worker started yet
    watch(rnd)                     each turn of the watch loop while the workers run
    watch_over(rnd)                the watch loop is over, however it ended (also on an exit)
    round_ending(rnd)              the round ended; its workers are about to be stopped
    round_ended(rnd, end)          its workers stopped and the end acknowledged
    restarting(rnd, end)           another round follows (a restart or a membership change)
    exit()                         the agent exits, its workers stopped
    status_fields()                any time: this feature's fields of the node's status record

and, where the agent still needs something of its features, a hook each (none names a feature):

    worker_env()                   the workers' environment: this feature's variables
    workers_started(rnd, workers)  this round's workers run (their pids, heartbeat files)
    worker_exited(worker)          a worker's pidfd turned readable
    next_due(now)                  seconds until this feature wants a turn of the watch loop
    on_news(rnd, news)             news of a type in `wants` (agent/base/event_loop.py), this round's
    on_preemption(rnd, signum)     a preemption signal: the round's end (rnd None: the agent exits)
    in_status_thread(rnd)          the round's status thread published this node's record
    round_holdings()               what this node tells each round about its checkpoints
    helper_pids()                  this feature's processes: never the job's, gone when the agent is
    worker_reentry()               parks and re-enters the workers inside `rally.job.run`, if this feature does

A hook that may end the round returns the round's end (`workers_starting`, `watch`): the first
collaborator to return one ends it and the later ones are not asked. A hook that makes this node
leave the job raises `AgentExit` (agent/base/exit_codes.py) with the exit code and its one line.

What a collaborator needs of its agent it reads from the context it was given, instead of taking
a dozen parameters and callbacks: the `AgentContext` protocol below, which the agent itself
satisfies (mypy checks that where the agent builds the collaborator). A collaborator that needs
more of the agent (this round's workers, their health) declares a protocol of its own extending
`AgentContext`, in its own room, with the types its room can import (agent/observe/hang_report.py's
`HangContext`); so a feature in a lower room never imports the agent above it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

from rally.agent.base.event_log import EventLog
from rally.agent.base.event_loop import EventLoop, News
from rally.agent.base.spec import JobSpec
from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.plan import RendezvousPlan
from rally.rendezvous.protocol import NodeInfo, Round, RoundEnd

T = TypeVar("T")


class JobRecord(Protocol):
    """The agent's report.json as a collaborator may change it (agent/report.py's JobReport is one)."""

    outcome: str  # "running" until something decides it: "quarantined", "left out by pre-flight", ...
    notes: dict[str, object]  # a feature's own keys of report.json (the quarantine's `quarantined`, the hangs reported)

    def write(self) -> None:
        """Write report.json now (a feature that notes something while the job runs)."""


class Holdings(Protocol):
    """What this node tells each round about its checkpoints (agent/checkpoint/holdings.py)."""

    def progress(self) -> int | None:
        """The newest step saved, in memory or on disk (the crash-loop guard)."""

    def holdings(self) -> tuple[list[int], int | None]:
        """(steps in this node's memory, the newest intact step on disk that can matter)."""


class WorkerReentry(Protocol):
    """An in-process restart as the agent asks for it (agent/rounds/parking.py's WorkerParking is one):
    this node's workers parked in `rally.job.run` as a round ends, re-entered in the next round."""

    def park(self, rnd: Round, culprit: object = None) -> bool:
        """Park this round's workers (`culprit`: the global rank that ended the round, if one did);
        False, with one line when the script uses `rally.job.run`, when they must be restarted whole."""

    def reenter(self, rnd: Round, master: tuple[str, int]) -> None:
        """The parked workers enter their training function again in round `rnd` (the dead ones
        replaced); the agent's worker group is this round's after it."""


class StartedWorker(Protocol):
    """One of this round's workers as a feature may watch it (agent/rounds/workers.py's Worker is one)."""

    @property
    def local_rank(self) -> int: ...

    @property
    def pid(self) -> int: ...

    @property
    def heartbeat_file(self) -> str | None: ...

    @property
    def started_at(self) -> float:
        """When its process started (time.monotonic())."""


class AgentContext(Protocol):
    """What a collaborator sees of its agent (agent/agent.py's Agent is one).

    Read-only properties, so that the agent's own attributes, of its own (narrower) types, satisfy
    them; `store` is None until the store is opened."""

    @property
    def spec(self) -> JobSpec: ...

    @property
    def plan(self) -> RendezvousPlan: ...

    @property
    def node(self) -> NodeInfo:
        """This node in the rendezvous (its id, host, address, preferred rank)."""

    @property
    def host(self) -> str: ...

    @property
    def base_env(self) -> dict[str, str]:
        """The environment every worker of this agent starts from."""

    @property
    def run_dir(self) -> Path:
        """This run's log directory (events.jsonl, report.json, the workers' logs), as the agent opened
        it: `/proc/<agent pid>/fd/<n>` (agent/rounds/workers.py LogLayout); `.resolve()` for people."""

    @property
    def events(self) -> EventLog: ...

    @property
    def loop(self) -> EventLoop:
        """The main thread's selector: signals, pidfds, worker output, the threads' inbox."""

    @property
    def report(self) -> JobRecord: ...

    @property
    def store(self) -> KeyValueStore | None:
        """The rendezvous store of the main thread, None until it is opened."""

    @property
    def hosts_store(self) -> bool:
        """This agent hosts the rendezvous store (its exit ends the store for every node)."""

    def store_call(self, fn: Callable[[], T], waiting: bool = False) -> T:
        """Every store call of the main thread goes through here: a lost, silent or untrusted store
        ends the agent with one line. `waiting`: a long call, run while signals are handled."""
        ...

    def announce(self, line: str) -> None:
        """Say what a long wait waits for: the console, and this node's status record."""

    def status_now(self) -> dict | None:
        """This node's status record in the round it is in (None before the first)."""


class Collaborator:
    """A feature of the agent: override the hooks you need (see the module docstring for when each
    runs). Every hook runs in the agent's main thread, but `in_status_thread`."""

    # The kinds of news (agent/base/event_loop.py) this feature asked for: `on_news` hears those
    # of the running round.
    wants: ClassVar[tuple[type, ...]] = ()

    def start(self) -> None:
        """The agent starts: its signal handlers, guard and template are up; the store is not open."""

    def joined(self, store: KeyValueStore) -> None:
        """The store is open and the rendezvous made; this node is not registered yet."""

    def before_round(self) -> None:
        """Before this node joins a round (the first one too); the last round's workers are gone."""

    def round_formed(self, rnd: Round) -> None:
        """A round formed with this node in it; its store threads run, its workers' store is not known."""

    def workers_starting(self, rnd: Round, master: tuple[str, int]) -> RoundEnd | None:
        """The workers' store (MASTER_ADDR, MASTER_PORT) is known and no worker has started: the round's
        end (already ended in the store, e.g. by `store_call(lambda: rnd.channel.end(...))`) to end it
        before its workers start, else None."""
        return None

    def watch(self, rnd: Round) -> RoundEnd | None:
        """One turn of the watch loop, after signals and the threads' news: the round's end (ended in
        the store) to end it, else None. Cheap: it runs on every wake-up of the loop."""
        return None

    def watch_over(self, rnd: Round) -> None:
        """The watch loop is over, whichever way: the round's end, an end before the workers started,
        or an AgentExit on its way out. The workers may still run."""

    def round_ending(self, rnd: Round) -> None:
        """The round has an end and nobody exits: its workers are stopped right after this."""

    def round_ended(self, rnd: Round, end: RoundEnd) -> None:
        """The round's workers are stopped, its end acknowledged, nothing decided yet."""

    def restarting(self, rnd: Round, end: RoundEnd) -> None:
        """Round `rnd` ended with `end` and another round follows (a restart or a re-form)."""

    def exit(self) -> str | None:
        """The agent exits (any way), its workers stopped. A line when the job, though its workers
        succeeded, must not exit 0 (the agent says it and exits 1), else None."""
        return None

    def status_fields(self) -> dict[str, object]:
        """This feature's fields of the node's status record (`rally status`, the live view, /metrics).
        Called from the round's status thread as well as the main thread."""
        return {}

    def worker_env(self) -> dict[str, str]:
        """Variables this feature adds to the environment of the round's workers (read as they start)."""
        return {}

    def workers_started(self, rnd: Round, workers: Sequence[StartedWorker]) -> None:
        """This round's workers started (their exits and output are watched already)."""

    def worker_exited(self, worker: StartedWorker) -> None:
        """A worker's pidfd turned readable: it exited (its exit code is read later)."""

    def next_due(self, now: float) -> float | None:
        """Seconds until this feature wants a turn of the watch loop (`watch`), None when it waits
        for nothing: the loop sleeps until the soonest feature's, or until something arrives."""
        return None

    def on_news(self, rnd: Round, news: News) -> None:
        """News of a kind in `wants`, posted by the round's threads for this round."""

    def on_preemption(self, rnd: Round | None, signum: int) -> RoundEnd | None:
        """A preemption signal: with a round, the round's end once this node is ready for it (the
        first feature to return one ends the round); with None, the agent exits preempted now."""
        return None

    def in_status_thread(self, rnd: Round) -> None:
        """The round's status thread published this node's record; `rnd` is on that thread's own
        connection. Runs in that thread, not the main one."""

    def round_holdings(self) -> Holdings | None:
        """What this node tells each round about its checkpoints, if this feature keeps them."""
        return None

    def helper_pids(self) -> frozenset[int]:
        """This feature's helper processes: never stopped as the job's workers, killed when the agent exits."""
        return frozenset()

    def worker_reentry(self) -> WorkerReentry | None:
        """The parking and re-entry of the workers inside `rally.job.run`, if this feature does them (the
        agent asks once, as it is built; the first feature to offer one is it)."""
        return None
