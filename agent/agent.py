"""The per-node agent: rendezvous, start workers, watch them, and restart the whole job on failure.

    loop:
        assignment = rendezvous.next_round()          # who is in, my node rank, world size
        workers    = WorkerGroup.start(...)           # one process group each
        end        = watch(workers)                   # first of: a local exit, the round's end
                                                      # key in the store, a lost peer, a signal
        stop the workers (signal, one grace period, SIGKILL of every descendant)
        succeeded -> exit 0;  failed and budget left -> next round;  else report, exit non-zero

The agent is a state machine (agent/base/states.py): its state says what a signal means, and
`_on_signals` is the only place a signal takes effect. Everything it waits for arrives on file
descriptors watched by one selector in the main thread (agent/base/event_loop.py): pidfds, worker
output pipes, the signal wake-up fd, and the inbox its store-watching threads write to. Every
store call of the main thread goes through `store_call`. What happens after a round is
decided by a pure function (agent/decide.py) and applied here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rally.agent.base.collaborator import Collaborator
from rally.agent.base.event_log import EventLog
from rally.agent.base.event_loop import EventLoop, RoundEnded, StoreLost, WorkerSaid
from rally.agent.base.exit_codes import EXIT_INFRASTRUCTURE, EXIT_PREEMPTED, AgentExit
from rally.agent.base.spec import STACK_SIGNAL, JobSpec
from rally.agent.base.states import AgentState, SignalAction, signal_action
from rally.agent.checkpoint.core.held_dir import HeldDirectory
from rally.agent.checkpoint.node_checkpoints import NodeCheckpoints
from rally.agent.checks.node_checks import NodeChecks
from rally.agent.decide import Exit, Reform, Restart, decide, exit_status
from rally.agent.display import console
from rally.agent.guard import processes
from rally.agent.guard.client import TOKEN_VARIABLE, GuardClient
from rally.agent.guard.stopping import stop_workers
from rally.agent.observe.exit_watch import ExitWatch
from rally.agent.observe.hang_report import HangReporter
from rally.agent.observe.live import LiveView
from rally.agent.observe.observer import Observer
from rally.agent.observe.run_info import announce
from rally.agent.preemption import Preemption
from rally.agent.report import JobReport, explain, store_failure_exit, store_lost_line
from rally.agent.rounds.node_waits import NodeWaits, wait_for_readers
from rally.agent.rounds.reentry import DEATH_WAIT_SECONDS, InProcessRestarts, lost_peer, soft_failure_end
from rally.agent.rounds.threads import RoundThreads, StoreProbe, left_behind_line
from rally.agent.rounds.workers import LogLayout, Worker, WorkerGroup
from rally.agent.template.client import TemplateClient
from rally.agent.worker_exits import WorkerExits
from rally.rendezvous.backends import OpenedStore
from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.c10d.store import StoreError, host_tcp_store, listen_address
from rally.rendezvous.plan import RendezvousPlan
from rally.rendezvous.protocol import Assignment, EndKind, NodeInfo, Rendezvous, RendezvousError, Round, RoundEnd
from rally.rendezvous.status.waiting import plural

if TYPE_CHECKING:  # torch is imported lazily
    from torch.distributed import TCPStore

T = TypeVar("T")

# How long the store's host waits for the other agents to read the final state before exiting.
EXIT_BARRIER_SECONDS = 30.0
# How often a node whose workers all succeeded looks at the other nodes' success records itself, in
# case the round's end never reaches its end watcher.
SUCCESS_RECHECK_SECONDS = 2.0

__all__ = ["Agent", "AgentExit", "EXIT_PREEMPTED"]


class Agent:
    """Runs this node's share of one job until it succeeds, fails for good, or is stopped.

    It is the context its collaborators are built with (agent/base/collaborator.py's AgentContext
    and the protocols of their own rooms that extend it): they read the spec, the event log, the
    store call, this round's workers and their health from it, not from parameters and callbacks."""

    def __init__(
        self, spec: JobSpec, plan: RendezvousPlan, base_env: dict[str, str], requeue: Callable[[], str] | None = None,
        checkpoint_dir: HeldDirectory | None = None,
    ):  # fmt: skip
        """`requeue`, when given, asks the scheduler to requeue this job and returns a message.
        `checkpoint_dir`: --checkpoint-dir opened by the launcher (else opened here, raising as it would)."""
        if checkpoint_dir is None and spec.checkpoint_dir and spec.checkpoint_dir_given is None:
            checkpoint_dir = HeldDirectory.open(spec.checkpoint_dir, spec.checkpoint_dir_shared)
        self.held_checkpoint_dir = checkpoint_dir  # open for the agent's lifetime (agent/checkpoint/core/held_dir.py)
        if checkpoint_dir is not None:  # every write of the job goes through the open directory
            spec = dataclasses.replace(
                spec, checkpoint_dir=checkpoint_dir.path, checkpoint_dir_given=checkpoint_dir.given
            )
        self.spec = spec
        self.plan = plan
        self.token = os.urandom(8).hex()  # marks every process of this agent's workers (orphan_guard.py)
        self.base_env = {**base_env, TOKEN_VARIABLE: self.token}
        self.host = socket.gethostname()
        self.node = NodeInfo(
            node_id=f"{self.host}:{os.getpid()}:{os.urandom(4).hex()}",
            host=self.host,
            addr=plan.local_addr,
            nproc=spec.nproc_per_node,
            preferred_rank=plan.preferred_rank,
        )
        self.state = AgentState.STARTING
        self.waits = NodeWaits(console.say)  # the line of a long wait, for the console and `rally status`
        self.loop = EventLoop(on_worker_exit=self._worker_exited, on_child_signal=self._reap_orphans)
        self.parked = False  # this node's workers wait in rally.job.run for the next round
        self.in_process_restarts = 0  # restarts this node made by re-entering its workers (`rally status`)
        self.group: WorkerGroup | None = None
        self.opened: OpenedStore | None = None  # the rendezvous store as bound (rendezvous/backends.py)
        self.store: KeyValueStore | None = None
        self.untrusted_seen: set[str] = set()  # keys already named by _untrusted_value
        self.store_server: object | None = None  # kept referenced while the store should exist
        self.worker_store: TCPStore | None = None  # this round's workers meet here (node 0, c10d)
        self.rdzv: Rendezvous | None = None
        self.guard: GuardClient | None = None
        self.template: TemplateClient | None = None  # workers are forked from it (agent/template/client.py)
        self.logs = LogLayout.create(spec.log_dir, spec.run_id)
        self.report = JobReport(spec.run_id, self.host, self.logs.run_dir / "report.json", shown=self.logs.shown)
        self.events = EventLog(self.logs.run_dir / "events.jsonl")
        self.last_failure: RoundEnd | None = None
        self.assignment: Assignment | None = None
        self.live: LiveView | None = None  # the table on a terminal (agent/observe/live.py)
        self.probe: StoreProbe | None = None  # tells a frozen store from a long wait
        # The agent's features, each built with this agent as its context (agent/base/collaborator.py),
        # and the one place a feature is named: every hook runs in the list's order (`exit` in reverse).
        observer = Observer(self)  # the workers' health, stragglers, /metrics, GPUs, the status record
        self.exits = WorkerExits(self, observer)  # also holds a soft failure in a multi-node round
        self.collaborators: list[Collaborator] = [
            NodeChecks(self, observer.backend),  # quarantine, pre-flight (agent/checks/node_checks.py)
            self.exits,  # what a worker's exit means for the round (agent/worker_exits.py)
            hangs := HangReporter(self, observer),  # who really hung, from every node (agent/observe/hang_report.py)
            ExitWatch(self, hangs),  # a worker that never ends after it is done (agent/observe/exit_watch.py)
            observer,
            NodeCheckpoints.for_agent(self),  # the memory tier's holder, the disk's steps
            Preemption(self, requeue),  # a preemption signal: checkpoint, stop, requeue (agent/preemption.py)
            InProcessRestarts(self),  # workers in rally.job.run connect to it; warm spares (agent/rounds/reentry.py)
        ]
        # a failure parks the workers inside rally.job.run and re-enters them through it (docs/restartable.md)
        self.reentry = next((r for part in self.collaborators if (r := part.worker_reentry()) is not None), None)

    # ================================================================ the context (agent/base/collaborator.py)
    @property
    def run_dir(self) -> Path:
        return self.logs.run_dir

    @property
    def hosts_store(self) -> bool:
        return self.store_server is not None

    def announce(self, line: str) -> None:
        self.waits.announce(line)

    def status_now(self) -> dict | None:
        """This node's status record in the round it is in (None before the first)."""
        return self._status_record(self.assignment) if self.assignment else None

    # ================================================================ entry point
    def run(self) -> int:
        processes.become_subreaper()
        # The signal that asks a worker for its stacks asks the agent too (`kill -SIGRTMIN+2 PID`):
        # an agent that seems stuck shows where, every thread of it, on its stderr.
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        self.loop.install_signal_handlers({*self.spec.signals_to_handle, *self.spec.preemption_signals})
        self.guard = GuardClient(self.token, v2_only=self.spec.scheduler.tracks_cgroups, warn=console.warn)
        # workers are forked from it; it preloads torch meanwhile, saying so should a fork wait for it
        self.template = TemplateClient.started_for_job(self.spec, self.base_env, console.warn, self.waits.announce)
        try:
            for part in self.collaborators:
                part.start()
            code = self._run()
        except AgentExit as exc:
            if str(exc):
                console.error(str(exc))
            code = exc.code
        finally:
            self._stop_workers(signal.SIGTERM)
            # the newest in-memory checkpoint made durable: a step lost with the holder is a line
            lost = [line for part in reversed(self.collaborators) if (line := part.exit()) is not None]
            processes.kill_descendants(self.helper_pids())  # nothing of the job outlives the agent
            for helper in (self.live, self.template, self.guard):
                if helper is not None:
                    helper.stop()
        if lost and code == 0:  # a job whose newest checkpoint died with the holder has not succeeded
            for line in lost:
                console.error(line)
            code = 1
        self.report.exit_code = code
        if self.report.outcome == "running":
            self.report.outcome = "succeeded" if code == 0 else "failed"
        self.report.write()
        self.events.emit("job_end", outcome=self.report.outcome, exit_code=code)
        self.events.close()
        return code

    def _run(self) -> int:
        """The main loop: one round after another until one of them decides the exit code."""
        rdzv, watcher, keeper = self._join_job()
        while True:
            self.state = AgentState.RENDEZVOUS
            for part in self.collaborators:
                part.before_round()  # the last round's workers have left the GPUs
            rnd: Round = self.store_call(rdzv.join_round, waiting=True)  # a signal pending since the last round ends it
            for store in (rnd.store, watcher, keeper):  # the job runs: a stranger's garbage ends nothing
                if store.replaces_untrusted:
                    store.on_untrusted = self._untrusted_value
            if self.spec.crash_loop_limit and rnd.assignment.stalled_restarts >= self.spec.crash_loop_limit:
                return self._stop_crash_loop(rnd)
            end = self._run_round(rnd, rnd.on(watcher), rnd.on(keeper))
            code = self._after_round(rnd, end)
            if code is not None:
                return code

    def _untrusted_value(self, line: str) -> None:
        """A value this job did not write was replaced or ignored (rendezvous/base/kv.py): one line per key."""
        key = line.split("'")[1] if line.count("'") >= 2 else line
        if key not in self.untrusted_seen:
            self.untrusted_seen.add(key)
            console.warn(line)

    def _join_job(self) -> tuple[Rendezvous, KeyValueStore, KeyValueStore]:
        """Open (or host) the store and make this node known; one connection per watching thread."""
        self.opened = self.store_call(lambda: self.plan.open_store(self.spec.run_id, console.say), waiting=True)
        self.store, self.store_server = self.opened.store, self.opened.server
        if self.store_server is not None:
            console.say(f"hosting the rendezvous store on port {self.opened.port}")
        console.say(announce(self.opened.endpoint, self.spec.run_id, self.logs.run_dir))  # the `rally status` command
        # what this node tells each round about its checkpoints (agent/checkpoint/holdings.py)
        held = next((h for part in self.collaborators if (h := part.round_holdings()) is not None), None)
        told = (held.progress, held.holdings) if held is not None else ()
        self.rdzv = rdzv = Rendezvous(self.store, self.plan.settings, self.node, console.say, *told)
        # The probe first: a store that freezes from here on is noticed within read_timeout.
        prober, watcher, keeper = (self.store_call(self.store.connect_again, waiting=True) for _ in range(3))
        for part in self.collaborators:
            part.joined(self.store)  # a node quarantined earlier in this job leaves (agent/checks/quarantine.py)
        self.probe = StoreProbe(Rendezvous(prober, self.plan.settings, self.node), self.plan.read_timeout)
        self.store_call(rdzv.status.register, waiting=True)
        return rdzv, watcher, keeper  # the round threads' connections

    def _stop_crash_loop(self, rnd: Round) -> int:
        """K failures in a row without a newer checkpoint: stop instead of burning the budget."""
        a, rdzv = rnd.assignment, rnd.rendezvous
        detail = (
            f"crash loop: {a.stalled_restarts} restarts in a row made no progress (the newest "
            f"checkpoint is still step {a.checkpoint_step}); fix the cause, or raise --crash-loop-limit"
        )
        last = self.last_failure
        info = dict(last.info) if last else {}
        ours = RoundEnd(EndKind.ABORTED, detail, self.host, info)
        end = self.store_call(lambda: rnd.channel.end(ours))
        self.store_call(lambda: rdzv.close_job(end))
        self.store_call(rnd.channel.acknowledge_end)  # no barrier wait
        self.report.outcome = "crash loop"
        console.error(end.detail)
        if last is not None:
            console.error("the last failure: " + explain(last))
        self._exit_barrier(rnd)
        return exit_status(ours)

    # ================================================================ one round
    def _run_round(self, rnd: Round, watcher: Round, keeper: Round) -> RoundEnd:
        """`watcher` and `keeper`: the same round on the round threads' connections."""
        a = rnd.assignment
        self.state, self.assignment = AgentState.ROUND_SETUP, a
        if self.live is None and LiveView.wanted(console.console()) and not self.spec.quiet:
            self.live = LiveView(console.console(), self.status_now)
            self.live.start()
        self.report.begin(a)
        self.events.emit(
            "round_formed",
            round=a.round,
            group_rank=a.group_rank,
            group_world_size=a.group_world_size,
            world_size=a.world_size,
            restart_count=a.restart_count,
        )
        console.say(
            f"round {a.round}: node {a.group_rank} of {a.group_world_size}, ranks "
            f"{a.rank_offset}-{a.rank_offset + self.spec.nproc_per_node - 1} of {a.world_size}, "
            f"restart {a.restart_count}/{self.spec.max_restarts}"
        )
        post, read_timeout = self.loop.inbox.post, self.plan.read_timeout
        threads = RoundThreads(post, watcher, keeper, read_timeout, self._status_record, self._in_status_thread)
        threads.start()  # keep-alives from the start: a spare judges a round dead by their absence
        for part in self.collaborators:
            part.round_formed(rnd)
        try:
            master = self._workers_store(rnd)
            if isinstance(master, RoundEnd):
                return master
            for part in self.collaborators:  # e.g. the pre-flight may leave a node out (agent/checks/preflight.py)
                if (end := part.workers_starting(rnd, master)) is not None:
                    return end
            self._start_workers(rnd, master)
            self.state = AgentState.RUNNING
            return self._watch_workers(rnd)
        finally:
            threads.stop()
            for part in self.collaborators:
                part.watch_over(rnd)

    def _workers_store(self, rnd: Round) -> tuple[str, int] | RoundEnd:
        """Where this round's workers meet (MASTER_ADDR/PORT): node 0 provides it, the others wait."""
        a = rnd.assignment
        if a.group_rank == 0 and self.plan.workers_use_rendezvous_store:
            # Every node stopped its old workers before it joined this round, so no worker of
            # an earlier attempt can write here any more: its keys go, rally's own stay.
            self.store_call(rnd.rendezvous.clear_worker_keys)
            assert self.opened is not None  # the store is open before any round
            where = self.opened.endpoint  # as bound
            self.store_call(lambda: rnd.channel.publish_master(where.host, where.port))
            return (where.host, where.port)
        if a.group_rank == 0:
            self.worker_store = None  # the previous round's store closes here
            # listening where MASTER_ADDR says
            self.worker_store = workers = host_tcp_store(0, self.plan.read_timeout, listen_address(a.master_host))
            self.store_call(lambda: rnd.channel.publish_master(a.master_host, workers.port))
            return (a.master_host, workers.port)
        timeout = self.plan.settings.keep_alive_timeout * 4 + 30
        # wait: slice, said by rendezvous/round_channel.py RoundChannel.wait_master: 1 s slices up to
        # keep_alive_timeout*4+30
        return self.store_call(lambda: rnd.wait_master(timeout), waiting=True)

    def _start_workers(self, rnd: Round, master: tuple[str, int]) -> None:
        """A new process for each local rank, or the workers parked at the last round's end entering
        their training function again (agent/rounds/parking.py)."""
        assignment = rnd.assignment
        if self.parked and self.reentry is not None:
            self.reentry.reenter(rnd, master)  # a dead rank's place taken by a warm spare or a new process
        else:
            self.events.emit("workers_starting", round=assignment.round)  # the restart's breakdown (bench/goodput.py)
            self.group = self.launch(assignment, master)
            self.watch_started(assignment, self.group)
        assert self.group is not None
        for part in self.collaborators:
            part.workers_started(rnd, self.group.workers)  # e.g. the health monitor watches them (again)
        self.parked = False

    def workers_env(self) -> dict[str, str]:
        """What the features add to the workers' environment (the holder's address, none once it died)."""
        return {**self.base_env, **{k: v for part in self.collaborators for k, v in part.worker_env().items()}}

    def launch(
        self, assignment: Assignment, master: tuple[str, int], local_ranks: set[int] | None = None, **extra: str
    ) -> WorkerGroup:
        """Start workers (`local_ranks`: only these) from the template, output to the live view. Public:
        the in-process restart starts a dead rank's replacement and the warm spares through it
        (agent/rounds/parking.py's ParkingContext)."""
        multi_node = assignment.group_world_size > 1 or self.plan.settings.max_nodes > 1
        launch = self.template.spawn if self.template is not None else processes.spawn
        sink = self.live.sink if self.live is not None else None
        env, logs, spec = {**self.workers_env(), **extra}, self.logs, self.spec
        return WorkerGroup.start(spec, env, assignment, master, logs, multi_node, sink, sink, launch, local_ranks)

    def watch_started(self, assignment: Assignment, group: WorkerGroup) -> None:
        """Watch new workers' output and exits; the orphan guard learns their process groups."""
        for stream in group.streams:
            self.loop.watch_stream(stream)
        for worker in group.workers:
            self.loop.watch_exit(worker)
            if self.guard is not None:
                self.guard.guard_group(worker.pid)
            rank, local_rank = worker.global_rank, worker.local_rank
            self.events.emit("worker_started", round=assignment.round, rank=rank, local_rank=local_rank, pid=worker.pid)

    def _watch_workers(self, rnd: Round) -> RoundEnd:
        """Until the round ends: signals, the threads' news, the collaborators' watch (exits, hangs,
        stragglers, the checkpoint lease, in the order registered), success, in that order."""
        a, group = rnd.assignment, self.group
        assert group is not None
        reported_at: float | None = None  # when this node's success was recorded
        while True:
            now = time.monotonic()
            due = [d for part in self.collaborators if (d := part.next_due(now)) is not None]
            if reported_at is not None:  # the others' records are looked at again, however the end watcher fares
                due.append(SUCCESS_RECHECK_SECONDS)
            self.loop.pump(min(due) if due else None)
            end = self._on_signals(rnd) or self._on_events(rnd)
            for part in self.collaborators if end is None else ():
                if (end := part.watch(rnd)) is not None:
                    break
            if end is not None:
                return end
            if reported_at is None and group.all_succeeded():
                reported_at = time.monotonic()
                if a.group_world_size > 1:
                    console.say(f"{_every(len(group.workers))} on this node finished; waiting for the other nodes")
                # bounded like every store call after the workers' exit: a silent store is one line, exit 1
                if (end := self.store_call(rnd.channel.report_success, waiting=True)) is not None:
                    return end  # the last node's record ended the round: no need to hear it from the end watcher
            elif reported_at is not None and time.monotonic() - reported_at >= SUCCESS_RECHECK_SECONDS:
                reported_at = time.monotonic()
                if (end := self.store_call(rnd.channel.all_succeeded, waiting=True)) is not None:
                    return end

    def _on_events(self, rnd: Round) -> RoundEnd | None:
        """What the round's threads posted (agent/rounds/threads.py, agent/observe/hang_report.py):
        the round's end and a lost store here, the rest of this round's to the features that want it."""
        a = rnd.assignment
        for news in self.loop.take_events():
            match news:
                case RoundEnded(round=a.round, end=end):
                    return end
                case StoreLost(error=error) if self.opened is not None:
                    raise AgentExit(EXIT_INFRASTRUCTURE, store_lost_line(error, self.opened.endpoint))
                case WorkerSaid(pid=pid, message={"op": "failed"} as message):
                    if (raised := self._soft_failure(rnd, pid, message)) is not None:
                        return raised
                case _ if getattr(news, "round", a.round) == a.round:
                    for part in self.collaborators:
                        if isinstance(news, part.wants):
                            part.on_news(rnd, news)
        return None

    def _soft_failure(self, rnd: Round, pid: int, message: dict) -> RoundEnd | None:
        """An exception escaped a worker's training function (rally.job.run): the root cause,
        unless the round already ended (then it is a consequence of the abort)."""
        group = self.group
        worker = next((w for w in group.workers if w.pid == pid), None) if group else None
        if group is None or worker is None or worker.returncode is not None:
            return None
        # A rank that died first caused it (its peers' collectives fail with "connection reset"): the
        # dead rank's exit is the root cause, judged by the exits feature in this same turn of the watch.
        # Its sockets close before it is a zombie, so a lost connection waits a moment for that exit.
        others = [w for w in group.workers if w is not worker]
        deadline = time.monotonic() + (DEATH_WAIT_SECONDS if lost_peer(message) else 0.0)
        for other in others:
            left = max(0.0, deadline - time.monotonic())
            # wait: short: DEATH_WAIT_SECONDS (1) in all, a dying rank's exit after its sockets closed
            if other.returncode is None and other.process.wait(timeout=left) is not None:
                return None
        # wait: not_a_wait: WNOHANG
        if any(w.process.poll() is not None for w in others):
            return None
        end = soft_failure_end(self.host, worker.global_rank, worker.local_rank, pid, message)
        rank = worker.global_rank
        self.events.emit("worker_raised", round=rnd.assignment.round, rank=rank, pid=pid, cause=end.detail)
        if lost_peer(message) and rnd.assignment.group_world_size > 1:
            self.exits.hold(rnd, end)  # a node lost is the cause if one went silent (as for a worker's exit)
            return None
        return self.store_call(lambda: rnd.channel.end(end))

    def _after_round(self, rnd: Round, end: RoundEnd) -> int | None:
        """Stop this round's workers, then apply `decide` (agent/decide.py): an exit code, or
        None to go round again."""
        a, group = rnd.assignment, self.group
        for part in self.collaborators:
            part.round_ending(rnd)  # e.g. from now on a save of this round's workers is refused
        decision = decide(end, a, self.spec.max_restarts)
        stopping = time.monotonic()
        reentry = self.reentry if isinstance(decision, Restart | Reform) else None
        self.parked = reentry is not None and reentry.park(rnd, end.info.get("rank"))
        if not self.parked:
            self._stop_workers(signal.SIGTERM)
        stop_seconds = round(time.monotonic() - stopping, 6)
        self.report.finish_attempt(group, end, "in-process" if self.parked else None)
        self.events.emit("round_ended", round=a.round, kind=end.kind, detail=end.detail, stop_seconds=stop_seconds)
        self.store_call(rnd.channel.acknowledge_end, waiting=True)  # bounded: a silent store is one line
        for part in self.collaborators:
            part.round_ended(rnd, end)  # e.g. quarantined, or left out by the pre-flight: AgentExit
        if end.is_failure:
            self.last_failure = end
            console.error("root cause: " + explain(end))
        if isinstance(decision, Restart):
            how = "re-entering the training function in every worker" if self.parked else "restarting all workers"
            if self.parked:
                self.in_process_restarts += 1
            console.say(f"{how} (restart {decision.restart_count} of {self.spec.max_restarts})")
            self.events.emit(
                "restart",
                round=a.round,
                restart_count=decision.restart_count,
                kind=end.kind,
                cause=end.detail,
                in_process=self.parked,
            )
            for part in self.collaborators:
                part.restarting(rnd, end)
            return None
        if isinstance(decision, Reform):
            lost_me = (
                end.kind is EndKind.NODE_LOST and end.info.get("group_rank") == a.group_rank and a.group_world_size > 1
            )
            if lost_me and not rnd.store.leased_liveness:  # c10d fences a node the others lost (etcd re-forms it)
                raise AgentExit(EXIT_INFRASTRUCTURE, left_behind_line(a, end))
            if end.kind is EndKind.NODE_LOST:
                console.error("root cause: " + end.detail)
            console.say(f"re-forming the job: {end.detail} (does not count as a restart)")
            self.events.emit(
                "membership_change", round=a.round, kind=end.kind, detail=end.detail, in_process=self.parked
            )
            for part in self.collaborators:
                part.restarting(rnd, end)
            return None
        return self._exit(rnd, end, decision)

    def _exit(self, rnd: Round, end: RoundEnd, decision: Exit) -> int:
        """The job is over: close it for every node (unless it was closed already), say why."""
        a = rnd.assignment
        if end.kind is EndKind.ABORTED:
            console.error(f"job ended: {end.detail}")
            return decision.code
        if decision.gave_up:  # a failure with no restarts left ends the job for every node
            self.report.outcome = "failed"
            end = RoundEnd(EndKind.ABORTED, f"restarts exhausted; {end.detail}", end.node, end.info)
        elif end.kind is EndKind.PREEMPTED:
            self.report.outcome = "preempted"
        self.store_call(lambda: rnd.rendezvous.close_job(end), waiting=True)  # bounded: a silent store is one line
        if decision.gave_up:
            console.console().print(self.report.workers_table())
            console.error(
                f"job failed: no restarts left (--max-restarts {self.spec.max_restarts}); "
                f"report: {self.logs.shown(self.report.path)}"
            )
        elif decision.code == EXIT_PREEMPTED:
            console.say(f"stopping: the job was preempted ({end.detail}); exit code {EXIT_PREEMPTED}")
        else:
            console.say(
                f"job succeeded: {plural(a.world_size, 'worker')} on {plural(a.group_world_size, 'node')} finished"
            )
        self._exit_barrier(rnd)
        return decision.code

    def _exit_barrier(self, rnd: Round) -> None:
        if self.store_server is not None:  # a signal ends the wait at once
            self.state = AgentState.EXIT_BARRIER
            # wait: bounded, said by agent/rounds/node_waits.py wait_for_readers: EXIT_BARRIER_SECONDS (30), a signal
            # ends it
            self.store_call(lambda: wait_for_readers(rnd, EXIT_BARRIER_SECONDS), waiting=True)

    def _status_record(self, assignment: Assignment) -> dict:
        """The node's status record: the features' fields (the observer's record of the node and its
        workers among them) and a long wait under way (agent/rounds/node_waits.py)."""
        features = {key: value for part in self.collaborators for key, value in part.status_fields().items()}
        waiting = self.waits.fields(assignment.round, self.rdzv.waiting if self.rdzv else None)
        return {**features, **waiting}

    def _in_status_thread(self, rnd: Round) -> None:
        """After each status record the round's status thread publishes (agent/rounds/threads.py)."""
        for part in self.collaborators:
            part.in_status_thread(rnd)

    # ================================================================ signals
    def _on_signals(self, rnd: Round | None = None) -> RoundEnd | None:
        """The one place a signal takes effect, as the agent's state says (agent/base/states.py).
        Exits raise AgentExit; a preemption returns the round's end; the rest stay pending."""
        signals = self.loop.take_signals()
        later: list[int] = []
        for i, signum in enumerate(signals):
            action = signal_action(self.state, signum, self.spec.preemption_signals)
            name = processes.signal_name(signum)
            if action is SignalAction.EXIT_PREEMPTED:
                for part in self.collaborators:
                    part.on_preemption(None, signum)  # e.g. node 0 asks the scheduler to requeue
                raise AgentExit(EXIT_PREEMPTED, f"preempted ({name}) while waiting for {self.state.waiting_for}")
            if action is SignalAction.EXIT:
                raise AgentExit(128 + signum, f"stopped by {name} while waiting for {self.state.waiting_for}")
            if action is SignalAction.LEAVE and rnd is not None:
                self._leave(rnd, signum)
            if action is SignalAction.PREEMPT and rnd is not None:
                self.loop.keep_signals(later + signals[i + 1 :])
                self.state = AgentState.PREEMPTING
                ends = (part.on_preemption(rnd, signum) for part in self.collaborators)
                return next((end for end in ends if end is not None), None)
            if action is not SignalAction.IGNORE:
                later.append(signum)  # for the main loop (in a blocking call) or the next state
        self.loop.keep_signals(later)
        return None

    def _leave(self, rnd: Round, signum: int) -> None:
        """Stopped by a signal while running: the workers get it, the others re-form without us."""
        name = processes.signal_name(signum)
        again = "Ctrl-C again" if signum == signal.SIGINT else f"{name} again"
        console.say(
            f"received {name}: forwarding it to the workers and stopping; they get up to "
            f"{self.spec.shutdown_timeout:g} s to exit (--shutdown-timeout), then SIGKILL; {again} kills them now"
        )
        group = self.group
        self._stop_workers(signum)
        end = RoundEnd(EndKind.NODE_LEFT, f"{self.host} stopped by {name}", self.host)
        # report.json lists the workers as they were stopped, as after any other round's end
        self.report.outcome = f"stopped by {name}"
        self.report.finish_attempt(group, end)
        with contextlib.suppress(AgentExit):  # best effort: the others find this node gone anyway
            self.store_call(lambda: rnd.channel.leave(end))
        stopped = len(group.workers) if group is not None else 0
        console.say(  # the closing line: the user's own Ctrl-C is no error, but they should know how it ended
            f"stopped by {name}: {_every(stopped)} on this node stopped; exit code {128 + signum}; "
            f"report: {self.logs.shown(self.report.path)}"
        )
        raise AgentExit(128 + signum)

    # ================================================================ the store
    def store_call(self, fn: Callable[[], T], waiting: bool = False) -> T:
        """Every store call of the main thread: a lost, silent or untrusted store ends the agent
        with one line. `waiting` runs the call in a thread while the main loop handles signals and
        the probe watches for a frozen store."""
        try:
            if not waiting:
                return fn()
            self.loop.pump(0)
            self._on_signals()  # also those that arrived before: never lost between rounds
            # wait: slice, said by the job: the call runs in a thread; the main loop keeps handling signals and the
            # store probe
            return self.loop.run_blocking(fn, self._while_waiting, self.probe.interval if self.probe else None)
        except (RendezvousError, StoreError) as exc:
            formed = self.rdzv is not None and self.rdzv.last_round is not None
            endpoint = self.opened.endpoint if self.opened else None
            raise store_failure_exit(exc, self.rdzv is not None, formed, endpoint) from None

    def _while_waiting(self) -> None:
        if self.probe and (stalled := self.probe.stalled()):  # a frozen store never answers the call
            raise AgentExit(EXIT_INFRASTRUCTURE, stalled)
        self._on_signals()

    # ================================================================ processes
    def _stop_workers(self, signum: int) -> None:
        if self.group is not None:
            self.state = AgentState.STOPPING  # a signal now cuts the grace short and waits its turn
            spec, helpers = self.spec, self.helper_pids()
            stop_workers(
                self.group, signum, spec.shutdown_timeout, self.loop, self.guard, helpers, spec.preemption_signals
            )
            self.group = None

    def _worker_exited(self, worker: Worker) -> None:
        """Its pidfd turned readable: e.g. the health monitor stops judging it (no hang after an exit)."""
        for part in self.collaborators:
            part.worker_exited(worker)

    def _reap_orphans(self) -> None:
        """SIGCHLD: an orphan re-parented to us (a subreaper) may have exited; reap it now."""
        processes.reap_zombies(self.helper_pids() | {w.pid for w in (self.group.workers if self.group else [])})

    def helper_pids(self) -> frozenset[int]:
        """The agent's own processes and its features': never stopped as the job's workers."""
        template = self.template.helper_pids() if self.template is not None else set()
        features = {pid for part in self.collaborators for pid in part.helper_pids()}
        return frozenset(({self.guard.pid} if self.guard is not None else set()) | template | features)


def _every(workers: int) -> str:
    """ "all 4 workers", "the 1 worker": never "all 1 workers"."""
    return "the 1 worker" if workers == 1 else f"all {workers} workers"
