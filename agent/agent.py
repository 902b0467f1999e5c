"""The per-node agent: rendezvous, start workers, watch them, and restart the whole job on failure.

    loop:
        assignment = rendezvous.next_round()          # who is in, my node rank, world size
        workers    = WorkerGroup.start(...)           # one process group each
        end        = watch(workers)                   # first of: a local exit, the round's end
                                                      # key in the store, a lost peer, a signal
        stop the workers (signal, one grace period, SIGKILL of every descendant)
        succeeded -> exit 0;  failed and budget left -> next round;  else report, exit non-zero

The agent is a state machine (agent/states.py): its state says what a signal means, and
`_on_signals` is the only place a signal takes effect. Everything it waits for arrives on file
descriptors watched by one selector in the main thread (agent/event_loop.py): pidfds, worker
output pipes, the signal wake-up fd, and the inbox its store-watching threads write to. Every
store call of the main thread goes through `store_call`. What happens after a round is
decided by a pure function (agent/decide.py) and applied here.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any, Callable

from rally.agent import processes
from rally.agent.checkpoint.agent_side import NodeCheckpoints
from rally.agent.event_loop import Event, EventLoop
from rally.agent.observe.event_log import EventLog
from rally.agent.agent_exit import AgentExit, store_failure_exit
from rally.agent.decide import Exit, Reform, Restart, decide
from rally.agent.exit_codes import EXIT_BAD_INPUT, EXIT_INFRASTRUCTURE, EXIT_PREEMPTED
from rally.agent.guard.client import TOKEN_VARIABLE, GuardClient
from rally.agent.hang_report import HangReporter
from rally.agent.node_waits import NodeWaits, wait_for_readers
from rally.agent.observe.health import HealthMonitor, HealthSettings
from rally.agent.observe.live import LiveView
from rally.agent.checks.node_checks import EXIT_QUARANTINED, NodeChecks
from rally.agent.observe.observer import Observer
from rally.agent.preemption import Preemption
from rally.agent.report import JobReport, explain, failure_end, store_lost_line
from rally.agent.round_threads import HeldFailure, RoundThreads, StoreProbe, check_peers, left_behind_line
from rally.agent.observe.run_info import announce
from rally.agent.spec import JobSpec
from rally.agent.states import AgentState, SignalAction, signal_action
from rally.agent.observe.status_record import node_status
from rally.agent.stopping import read_what_is_left, stop_workers
from rally.agent.template import TemplateClient
from rally.agent.workers import LogLayout, WorkerGroup
from rally.agent.display import console
from rally.rendezvous.backends import OpenedStore
from rally.rendezvous.kv import KeyValueStore
from rally.rendezvous.plan import RendezvousPlan
from rally.rendezvous.protocol import Assignment, EndKind, NodeInfo, Rendezvous, RendezvousError, RoundEnd
from rally.rendezvous.store import StoreError, host_tcp_store, listen_address

# How long the store's host waits for the other agents to read the final state before exiting.
EXIT_BARRIER_SECONDS = 30.0

__all__ = ["Agent", "AgentExit", "EXIT_PREEMPTED"]


class Agent:
    """Runs this node's share of one job until it succeeds, fails for good, or is stopped."""

    def __init__(self, spec: JobSpec, plan: RendezvousPlan, base_env: dict[str, str], requeue: Callable[[], str] | None = None):
        """`requeue`, when given, asks the scheduler to requeue this job and returns a message."""
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
        self.loop = EventLoop(on_worker_exit=lambda w: self.health.note_exit(w.local_rank), on_child_signal=self._reap_orphans)
        self.preemption = Preemption(spec, self.host, plan.preferred_rank, self.loop, self.store_call, requeue)
        self.group: WorkerGroup | None = None
        self.opened: OpenedStore | None = None  # the rendezvous store as bound (rendezvous/backends.py)
        self.store: KeyValueStore | None = None
        self.store_server: Any = None
        self.worker_store: Any = None
        self.rdzv: Rendezvous | None = None
        self.guard: GuardClient | None = None
        self.template: TemplateClient | None = None  # workers are forked from it (agent/template.py)
        self.logs = LogLayout.create(spec.log_dir, spec.run_id)
        self.report = JobReport(spec.run_id, self.host, self.logs.run_dir / "report.json")
        self.events = EventLog(self.logs.run_dir / "events.jsonl")
        self.health_settings = HealthSettings.for_job(spec, console.say, self.events.emit)
        self.observer = Observer(spec, self.events, self.host, base_env, self.health_settings.learned)  # stragglers, /metrics, GPUs
        self.health = HealthMonitor(self.health_settings, gpu=self.observer.read_gpus)
        self.kill_causes: dict[int, str] = {}
        self.last_failure: RoundEnd | None = None
        self.assignment: Assignment | None = None
        self.live: LiveView | None = None  # the table on a terminal (agent/observe/live.py)
        self.hangs = HangReporter(  # who really hung, from every node (agent/hang_report.py)
            self.host, spec.is_python, self.health_settings.stack_dump_wait, self.loop, self.store_call,
            connect=lambda: Rendezvous(self.store.connect_again(), plan.settings, self.node),
            group=lambda: self.group, heartbeat_count=lambda r: self.health.heartbeat_count(r), emit=self.events.emit,
        )  # fmt: skip
        self.probe: StoreProbe | None = None  # tells a frozen store from a long wait
        self.held: HeldFailure | None = None  # this round's local failure, until the peer check answers
        self.observer.node_checks = self.checks = NodeChecks(self)  # quarantine, pre-flight (agent/checks/node_checks.py)
        self.ckpt = NodeCheckpoints(spec.checkpoint_dir, self.events, console.warn, spec.run_id, console.say)  # the memory tier (agent/checkpoint/agent_side.py)
        self.base_env.update(self.ckpt.env())

    # ================================================================ entry point
    def run(self) -> int:
        processes.become_subreaper()
        self.loop.install_signal_handlers({*self.spec.signals_to_handle, *self.spec.preemption_signals})
        self.guard = GuardClient(self.token)
        self.template = TemplateClient.started_for_job(self.spec, self.base_env, console.warn, self.waits.announce)  # preloads torch meanwhile
        try:
            self._start_observer()
            code = self._run()
        except AgentExit as exc:
            if str(exc):
                console.error(str(exc))
            code = exc.code
        finally:
            self._stop_workers(signal.SIGTERM)
            self.ckpt.finish(self.spec.shutdown_timeout)  # the newest in-memory step made durable
            processes.kill_descendants(self._helper_pids())  # nothing of the job outlives the agent
            for part in (self.live, self.template, self.guard, self.observer):
                if part is not None:
                    part.stop()
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
            self.observer.before_round()
            a = self.store_call(rdzv.next_round, waiting=True)  # a signal pending since the last round ends it
            if self.spec.crash_loop_limit and a.stalled_restarts >= self.spec.crash_loop_limit:
                return self._stop_crash_loop(rdzv, a)
            end = self._run_round(rdzv, watcher, keeper, a)
            code = self._after_round(rdzv, a, end)
            if code is not None:
                return code

    def _join_job(self) -> tuple[Rendezvous, Rendezvous, Rendezvous]:
        """Open (or host) the store and make this node known; one connection per watching thread."""
        self.opened = self.store_call(lambda: self.plan.open_store(self.spec.run_id, console.say), waiting=True)
        self.store, self.store_server = self.opened.store, self.opened.server
        if self.store_server is not None:
            console.say(f"hosting the rendezvous store on port {self.opened.port}")
        console.say(announce(self.opened.endpoint, self.spec.run_id, self.logs.run_dir))  # the `rally status` command
        self.rdzv = rdzv = Rendezvous(
            self.store, self.plan.settings, self.node, on_status=console.say, progress=self.ckpt.progress, holdings=self.ckpt.holdings
        )
        # The probe first: a store that freezes from here on is noticed within read_timeout.
        prober, watcher, keeper = (Rendezvous(self.store_call(self.store.connect_again, waiting=True), self.plan.settings, self.node) for _ in range(3))
        if line := self.checks.at_join(self.store):  # quarantined earlier in this job (agent/checks/quarantine.py)
            raise AgentExit(EXIT_QUARANTINED, line)
        self.probe = StoreProbe(prober, self.plan.read_timeout)
        self.store_call(rdzv.register_status, waiting=True)
        return rdzv, watcher, keeper

    def _start_observer(self) -> None:
        """Stragglers, GPU health and /metrics (agent/observe/observer.py); a port in use is bad input."""
        try:
            self.observer.start(lambda: self._status_record(self.assignment) if self.assignment else None, self.report)
        except OSError as exc:
            raise AgentExit(EXIT_BAD_INPUT, str(exc)) from None

    def _stop_crash_loop(self, rdzv: Rendezvous, a: Assignment) -> int:
        """K failures in a row without a newer checkpoint: stop instead of burning the budget."""
        detail = (
            f"crash loop: {a.stalled_restarts} restarts in a row made no progress (the newest "
            f"checkpoint is still step {a.checkpoint_step}); fix the cause, or raise --crash-loop-limit"
        )
        last = self.last_failure
        info = dict(last.info) if last else {}
        end = self.store_call(lambda: rdzv.end_round(a.round, RoundEnd(EndKind.ABORTED, detail, self.host, info)))
        self.store_call(lambda: rdzv.close_job(end))
        self.store_call(lambda: rdzv.acknowledge_end(a.round, a.group_world_size))  # no barrier wait
        self.report.outcome = "crash loop"
        console.error(end.detail)
        if last is not None:
            console.error("the last failure: " + explain(last))
        self._exit_barrier(rdzv, a)
        return int(info.get("exit_status", 1)) or 1

    # ================================================================ one round
    def _run_round(self, rdzv: Rendezvous, watcher: Rendezvous, keeper: Rendezvous, a: Assignment) -> RoundEnd:
        self.state, self.assignment = AgentState.ROUND_SETUP, a
        if self.live is None and LiveView.wanted(console.console()) and not self.spec.quiet:
            self.live = LiveView(console.console(), lambda: self._status_record(self.assignment))
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
        threads = RoundThreads(self.loop.inbox.post, watcher, keeper, a, self.plan.read_timeout, self._status_record, self.observer.exchange)
        threads.start()  # keep-alives from the start: a spare judges a round dead by their absence
        self.hangs.start_watching(a)
        try:
            master = self._workers_store(rdzv, a)
            if isinstance(master, RoundEnd):
                return master
            if (left_out := self.checks.round_formed(rdzv, a, master)) is not None:  # pre-flight (agent/checks/preflight.py)
                return left_out
            self.ckpt.open_round(a, self.plan.settings.keep_alive_timeout)
            self._start_workers(a, master)
            self.state = AgentState.RUNNING
            return self._watch_workers(rdzv, a)
        finally:
            threads.stop()
            self.hangs.round_over(rdzv, a)

    def _workers_store(self, rdzv: Rendezvous, a: Assignment) -> tuple[str, int] | RoundEnd:
        """Where this round's workers meet (MASTER_ADDR/PORT): node 0 provides it, the others wait."""
        if a.group_rank == 0 and self.plan.workers_use_rendezvous_store:
            # Every node stopped its old workers before it joined this round, so no worker of
            # an earlier attempt can write here any more: its keys go, rally's own stay.
            self.store_call(rdzv.clear_worker_keys)
            where = self.opened.endpoint  # as bound
            self.store_call(lambda: rdzv.publish_master(a.round, where.host, where.port))
            return (where.host, where.port)
        if a.group_rank == 0:
            self.worker_store = None  # the previous round's store closes here
            self.worker_store = host_tcp_store(0, self.plan.read_timeout, listen_address(a.master_host))  # where MASTER_ADDR says
            self.store_call(lambda: rdzv.publish_master(a.round, a.master_host, self.worker_store.port))
            return (a.master_host, self.worker_store.port)
        timeout = self.plan.settings.keep_alive_timeout * 4 + 30
        return self.store_call(lambda: rdzv.wait_master(a.round, timeout, a.master_host), waiting=True)

    def _start_workers(self, a: Assignment, master: tuple[str, int]) -> None:
        multi_node = a.group_world_size > 1 or self.plan.settings.max_nodes > 1
        launch = self.template.spawn if self.template is not None else processes.spawn
        self.observer.load_timeouts(self.store_call, self.store)  # --heartbeat-timeout auto: learned before, by any node
        sink = self.live.sink if self.live is not None else None
        self.group = WorkerGroup.start(
            self.spec, self.base_env, a, master, self.logs, multi_node, console_out=sink, console_err=sink, launch=launch
        )
        self.health = HealthMonitor(self.health_settings, gpu=self.observer.read_gpus)
        for stream in self.group.streams:
            self.loop.watch_stream(stream)
        for worker in self.group.workers:
            self.loop.watch_exit(worker)
            if self.guard is not None:
                self.guard.guard_group(worker.pid)
            self.health.watch(worker.local_rank, worker.pid, worker.heartbeat_file, worker.process.started_at)
            self.events.emit("worker_started", round=a.round, rank=worker.global_rank, local_rank=worker.local_rank, pid=worker.pid)

    def _watch_workers(self, rdzv: Rendezvous, a: Assignment) -> RoundEnd:
        """Until the round ends: signals, the threads' news, exits, hangs, success, in that order."""
        group = self.group
        assert group is not None
        self.held = None  # a local failure waiting for the peer check (see _check_exits)
        reported_success = False
        while True:
            self.loop.pump(self.health.next_due(time.monotonic()))
            end = self._on_signals(rdzv, a) or self._on_events(rdzv, a) or self._check_exits(rdzv, a)
            hangs = end is None and self.health.check({w.local_rank: w.output.last_output_at() for w in group.running()})
            if hangs:
                end = self._end_round(rdzv, a.round, self.hangs.report(rdzv, a, hangs[0]))
            if end is not None:
                return end
            self.observer.after_check(a, group.workers, self.health)
            self.ckpt.renew()  # the fence's lease: a frozen agent's workers cannot checkpoint
            if not reported_success and group.all_succeeded():
                reported_success = True
                if a.group_world_size > 1:
                    console.say(f"all {len(group.workers)} workers on this node finished; waiting for the other nodes")
                self.store_call(lambda: rdzv.report_success(a.round, a.group_world_size, a.group_rank))

    def _on_events(self, rdzv: Rendezvous, a: Assignment) -> RoundEnd | None:
        """What the round's threads posted (agent/round_threads.py, agent/hang_report.py)."""
        for kind, value in self.loop.take_events():
            if kind is Event.ROUND_END and value[0] == a.round:
                return value[1]
            if kind is Event.PEER_VERDICT and value[0] == a.round and self.held is not None:
                self.held.answer(value[1])
            if kind is Event.STORE_LOST:
                raise AgentExit(EXIT_INFRASTRUCTURE, store_lost_line(value, self.opened.endpoint))
            if kind is Event.DUMP_STACKS and value == a.round:
                self.hangs.answer(rdzv, a)
        return None

    def _check_exits(self, rdzv: Rendezvous, a: Assignment) -> RoundEnd | None:
        """Note exits; a local failure ends the round at once on one node, or once the peer
        check says whether a node was lost (then that is the cause, and this a consequence)."""
        assert self.group is not None
        for worker in self.group.workers:
            if worker.returncode is not None and worker.local_rank in self.health.watched:
                self._note_exit(a, worker)
        failed = [w for w in self.group.workers if w.returncode not in (None, 0)]
        if not failed:
            return None
        first = min(failed, key=lambda w: w.process.ended_at or 0)
        read_what_is_left(first.output.streams, self.loop)  # its last words, without waiting
        end = failure_end(first, a, self.kill_causes.get(first.local_rank))
        if a.group_world_size == 1:
            return self._end_round(rdzv, a.round, end)
        if self.held is None:
            self.held = HeldFailure(self.store_call(lambda: rdzv.first_failure(a.round, end)))
            check_peers(self.loop.inbox.post, lambda: Rendezvous(self.store.connect_again(), rdzv.settings, self.node), a)
            return None
        if not self.held.answered:
            return None
        return self._end_failure(rdzv, a, self.held.first, self.held.silent, end)

    def _note_exit(self, a: Assignment, worker) -> None:  # noqa: ANN001 - agent.workers.Worker
        """Record a worker's exit once; explain a SIGKILL that nobody here sent."""
        if worker.returncode == -signal.SIGKILL and not worker.stopped:
            cause = self.health.explain_kill(worker.local_rank)
            if cause:
                self.kill_causes[worker.local_rank] = cause
        self.health.forget(worker.local_rank)
        self.events.emit(
            "worker_exited",
            round=a.round,
            rank=worker.global_rank,
            pid=worker.pid,
            exit=worker.describe_exit(),
            returncode=worker.returncode,
            duration=round(worker.duration(), 3),
            cause=self.kill_causes.get(worker.local_rank),
        )

    def _end_round(self, rdzv: Rendezvous, r: int, end: RoundEnd) -> RoundEnd:
        return self.store_call(lambda: rdzv.end_round(r, end))

    def _end_failure(self, rdzv: Rendezvous, a: Assignment, first: RoundEnd, silent: tuple[int, float] | None, local: RoundEnd) -> RoundEnd:
        """The job-wide first failure ends the round, unless a peer went silent: then that node's loss is the cause."""
        if silent is None:
            return self._end_round(rdzv, a.round, first)
        group_rank, silent_for = silent
        host = a.watch_host if group_rank == a.watch_rank else ""
        note = f"; {local.detail} after it (a consequence)"
        return self.store_call(lambda: rdzv.declare_lost(a.round, group_rank, host, silent_for, note))

    def _after_round(self, rdzv: Rendezvous, a: Assignment, end: RoundEnd) -> int | None:
        """Stop this round's workers, then apply `decide` (agent/decide.py): an exit code, or
        None to go round again."""
        group = self.group
        self.ckpt.close_round(a)  # from now on a save of this round's workers is refused
        self._stop_workers(signal.SIGTERM)
        self.report.finish_attempt(group, end)
        self.events.emit("round_ended", round=a.round, kind=end.kind, detail=end.detail)
        self.store_call(lambda: rdzv.acknowledge_end(a.round, a.group_world_size))
        if line := self.checks.after_round(rdzv, a, end, self.store_server is not None):  # quarantined, or left out
            raise AgentExit(EXIT_QUARANTINED, line)
        decision = decide(end, a, self.spec.max_restarts)
        if end.is_failure:
            self.last_failure = end
            console.error("root cause: " + explain(end))
        if isinstance(decision, Restart):
            console.say(f"restarting all workers (restart {decision.restart_count} of {self.spec.max_restarts})")
            self.events.emit("restart", round=a.round, restart_count=decision.restart_count, kind=end.kind, cause=end.detail)
            self.observer.note_restart(a.round, end)
            return None
        if isinstance(decision, Reform):
            lost_me = end.kind is EndKind.NODE_LOST and end.info.get("group_rank") == a.group_rank and a.group_world_size > 1
            if lost_me and not rdzv.store.leased_liveness:  # c10d fences a node the others lost (etcd re-forms it)
                raise AgentExit(EXIT_INFRASTRUCTURE, left_behind_line(a, end))
            if end.kind is EndKind.NODE_LOST:
                console.error("root cause: " + end.detail)
            console.say(f"re-forming the job: {end.detail} (does not count as a restart)")
            self.events.emit("membership_change", round=a.round, kind=end.kind, detail=end.detail)
            self.observer.note_restart(a.round, end)
            return None
        return self._exit(rdzv, a, end, decision)

    def _exit(self, rdzv: Rendezvous, a: Assignment, end: RoundEnd, decision: Exit) -> int:
        """The job is over: close it for every node (unless it was closed already), say why."""
        if end.kind is EndKind.ABORTED:
            console.error(f"job ended: {end.detail}")
            return decision.code
        if decision.gave_up:  # a failure with no restarts left ends the job for every node
            self.report.outcome = "failed"
            end = RoundEnd(EndKind.ABORTED, f"restarts exhausted; {end.detail}", end.node, end.info)
        elif end.kind is EndKind.PREEMPTED:
            self.report.outcome = "preempted"
        self.store_call(lambda: rdzv.close_job(end))
        if decision.gave_up:
            console.console().print(self.report.workers_table())
            console.error(f"job failed: no restarts left (--max-restarts {self.spec.max_restarts}); report: {self.report.path}")
        elif decision.code == EXIT_PREEMPTED:
            console.say(f"stopping: the job was preempted ({end.detail}); exit code {EXIT_PREEMPTED}")
        else:
            console.say(f"job succeeded: {a.world_size} workers on {a.group_world_size} node{'s' if a.group_world_size != 1 else ''} finished")
        self._exit_barrier(rdzv, a)
        return decision.code

    def _exit_barrier(self, rdzv: Rendezvous, a: Assignment) -> None:
        if self.store_server is not None:  # a signal ends the wait at once
            self.state = AgentState.EXIT_BARRIER
            self.store_call(lambda: wait_for_readers(rdzv, a.round, EXIT_BARRIER_SECONDS), waiting=True)

    def _status_record(self, a: Assignment) -> dict:
        waiting = self.waits.fields(a.round, self.rdzv.waiting if self.rdzv else None)  # a long wait under way (agent/node_waits.py)
        return {**node_status(self.host, self.node.node_id, a, self.group, self.health, self.observer), **self.ckpt.status_fields(), **waiting}

    # ================================================================ signals
    def _on_signals(self, rdzv: Rendezvous | None = None, a: Assignment | None = None) -> RoundEnd | None:
        """The one place a signal takes effect, as the agent's state says (agent/states.py).
        Exits raise AgentExit; a preemption returns the round's end; the rest stay pending."""
        signals, later = self.loop.take_signals(), []
        for i, signum in enumerate(signals):
            action = signal_action(self.state, signum, self.spec.preemption_signals)
            name = processes.signal_name(signum)
            if action is SignalAction.EXIT_PREEMPTED:
                self.preemption.requeue_once(None, None)
                raise AgentExit(EXIT_PREEMPTED, f"preempted ({name}) while waiting for {self.state.waiting_for}")
            if action is SignalAction.EXIT:
                raise AgentExit(128 + signum, f"stopped by {name} while waiting for {self.state.waiting_for}")
            if action is SignalAction.LEAVE and rdzv is not None and a is not None:
                self._leave(rdzv, a, signum)
            if action is SignalAction.PREEMPT and rdzv is not None and a is not None:
                self.loop.keep_signals(later + signals[i + 1 :])
                self.state = AgentState.PREEMPTING
                return self.preemption.run(rdzv, a, self.group, signum)
            if action is not SignalAction.IGNORE:
                later.append(signum)  # for the main loop (in a blocking call) or the next state
        self.loop.keep_signals(later)
        return None

    def _leave(self, rdzv: Rendezvous, a: Assignment, signum: int) -> None:
        """Stopped by a signal while running: the workers get it, the others re-form without us."""
        name = processes.signal_name(signum)
        console.say(f"received {name}: forwarding it to the workers, then stopping")
        self._stop_workers(signum)
        self.store_call(lambda: rdzv.leave(a.round, RoundEnd(EndKind.NODE_LEFT, f"{self.host} stopped by {name}", self.host)), best_effort=True)
        raise AgentExit(128 + signum)

    # ================================================================ the store
    def store_call(self, fn: Callable[[], Any], waiting: bool = False, best_effort: bool = False) -> Any:
        """Every store call of the main thread: a lost, silent or untrusted store ends the agent
        with one line (or, `best_effort`, gives None). `waiting` runs the call in a thread while
        the main loop handles signals and the probe watches for a frozen store."""
        try:
            if not waiting:
                return fn()
            self.loop.pump(0)
            self._on_signals()  # also those that arrived before: never lost between rounds
            return self.loop.run_blocking(fn, self._while_waiting, self.probe.interval if self.probe else None)
        except (RendezvousError, StoreError) as exc:
            if best_effort:
                return None
            formed = self.rdzv is not None and self.rdzv.last_round is not None
            raise store_failure_exit(exc, self.rdzv is not None, formed, self.opened and self.opened.endpoint) from None

    def _while_waiting(self) -> None:
        if self.probe and (stalled := self.probe.stalled()):  # a frozen store never answers the call
            raise AgentExit(EXIT_INFRASTRUCTURE, stalled)
        self._on_signals()

    # ================================================================ processes
    def _stop_workers(self, signum: int) -> None:
        if self.group is not None:
            self.state = AgentState.STOPPING  # a signal now cuts the grace short and waits its turn
            stop_workers(
                self.group, signum, self.spec.shutdown_timeout, self.loop, self.guard, self._helper_pids(), self.spec.preemption_signals
            )
            self.group = None

    def _reap_orphans(self) -> None:
        """SIGCHLD: an orphan re-parented to us (a subreaper) may have exited; reap it now."""
        processes.reap_zombies(self._helper_pids() | {w.pid for w in (self.group.workers if self.group else [])})

    def _helper_pids(self) -> frozenset[int]:
        template = self.template.helper_pids() if self.template is not None else set()
        holder = {self.ckpt.pid} if self.ckpt.pid is not None else set()
        return frozenset(({self.guard.pid} if self.guard is not None else set()) | template | holder)
