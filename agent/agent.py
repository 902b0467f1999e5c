"""The per-node agent: rendezvous, start workers, watch them, and restart the whole job on failure.

    loop:
        assignment = rendezvous.next_round()          # who is in, my node rank, world size
        workers    = WorkerGroup.start(...)           # one process group each
        end        = watch(workers)                   # first of: a local exit, the round's end
                                                      # key in the store, a lost peer, a signal
        stop the workers (signal, one grace period, SIGKILL of every descendant)
        succeeded -> exit 0;  failed and budget left -> next round;  else report, exit non-zero

Everything the agent waits for arrives on file descriptors watched by one `selectors` loop in
the main thread: pidfds (readable the moment a worker exits), worker output pipes, the
signal wake-up fd, and a pipe that the store-watching threads write to. Nothing polls.
"""

from __future__ import annotations

import importlib
import os
import queue
import selectors
import signal
import socket
import threading
import time
from typing import Any, Callable

from rally.agent import processes
from rally.agent.events import EventLog
from rally.agent.job import newest_checkpoint_step
from rally.agent.live import LiveView
from rally.agent.observer import Observer
from rally.agent.hang_report import HangReporter
from rally.agent.health import HealthMonitor, HealthSettings
from rally.agent.orphan_guard import TOKEN_VARIABLE, GuardClient
from rally.agent.round_threads import RoundThreads, StoreProbe, StoreSilent, check_peers
from rally.agent.report import JobReport, explain, failure_end
from rally.agent.spec import JobSpec
from rally.agent.template import TemplateClient
from rally.agent.workers import LogLayout, WorkerGroup
from rally.launcher import console
from rally.rendezvous.protocol import (
    Assignment,
    NodeInfo,
    Rendezvous,
    RendezvousError,
    RoundEnd,
)
from rally.rendezvous.plan import RendezvousPlan
from rally.rendezvous.store import Store, StoreError, StoreUnavailable, UntrustedValue, host_tcp_store, open_store
from rally.rendezvous.token import Signer

EXIT_BAD_INPUT = 2
EXIT_INFRASTRUCTURE = 1
# The job was preempted (or hit its time limit) and stopped on purpose: retry later. EX_TEMPFAIL.
EXIT_PREEMPTED = 75
PENDING = object()  # a peer check has not answered yet
# How long the store's host waits for the other agents to read the final state before exiting.
EXIT_BARRIER_SECONDS = 30.0
# How long to keep reading stopped workers' pipes to their end (a grandchild may hold them open).
OUTPUT_DRAIN_SECONDS = 2.0


class AgentExit(Exception):
    """Leave the agent with this exit code (after workers are stopped)."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message)
        self.code = code


class _Inbox:
    """Events from threads, delivered to the main loop through a pipe it selects on."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def post(self, kind: str, value: Any = None) -> None:
        self.items.put((kind, value))
        try:
            os.write(self.write_fd, b"x")
        except BlockingIOError:
            pass

    def drain(self) -> list[tuple[str, Any]]:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while not self.items.empty():
            out.append(self.items.get_nowait())
        return out


class Agent:
    """Runs this node's share of one job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        spec: JobSpec,
        plan: RendezvousPlan,
        base_env: dict[str, str],
        requeue: Callable[[], str] | None = None,
    ):
        """`requeue`, when given, asks the scheduler to requeue this job and returns a message."""
        self.spec = spec
        self.requeue = requeue
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
        self.selector = selectors.DefaultSelector()
        self.inbox = _Inbox()
        self.selector.register(self.inbox.read_fd, selectors.EVENT_READ, ("inbox", None))
        self.signal_r, self.signal_w = os.pipe()
        os.set_blocking(self.signal_r, False)
        os.set_blocking(self.signal_w, False)
        self.selector.register(self.signal_r, selectors.EVENT_READ, ("signal", None))
        self.pending_signals: list[int] = []
        self.pending_events: list[tuple[str, Any]] = []
        self.group: WorkerGroup | None = None
        self.store: Store | None = None
        self.store_server: Any = None
        self.worker_store: Any = None
        self.guard: GuardClient | None = None
        self.template: TemplateClient | None = None  # workers are forked from it (agent/template.py)
        self.logs = LogLayout.create(spec.log_dir, spec.run_id)
        self.report = JobReport(spec.run_id, self.host, self.logs.run_dir / "report.json")
        self.events = EventLog(self.logs.run_dir / "events.jsonl")
        self.health_settings = HealthSettings(
            heartbeat_timeout=spec.heartbeat_timeout,
            silence_timeout=spec.silence_timeout,
            resource_interval=spec.resource_interval,
            startup_timeout=spec.startup_timeout,
        )
        self.observer = Observer(spec, self.events, self.host, base_env)  # stragglers, /metrics, GPUs
        self.health = HealthMonitor(self.health_settings, gpu=self.observer.read_gpus)
        self.kill_causes: dict[int, str] = {}
        self.last_failure: RoundEnd | None = None
        self.assignment: Assignment | None = None
        self.live: LiveView | None = None  # the table on a terminal (agent/live.py)
        self.hangs = HangReporter(self)  # who really hung, from every node (agent/hang_report.py)
        self.probe: StoreProbe | None = None  # tells a frozen store from a long wait

    # ================================================================ entry point
    def run(self) -> int:
        processes.become_subreaper()
        self._install_signal_handlers()
        self.guard = GuardClient(self.token)
        self._start_template()
        try:
            self._start_observer()
            code = self._run()
        except AgentExit as exc:
            if str(exc):
                console.error(str(exc))
            code = exc.code
        finally:
            self._stop_workers(signal.SIGTERM)
            processes.kill_descendants(self._helper_pids())  # nothing of the job outlives the agent
            if self.live is not None:
                self.live.stop()
            self._stop_template()
            if self.guard is not None:
                self.guard.stop()
            self.observer.stop()
        self.report.exit_code = code
        if self.report.outcome == "running":
            self.report.outcome = "succeeded" if code == 0 else "failed"
        self.report.write()
        self.events.emit("job_end", outcome=self.report.outcome, exit_code=code)
        self.events.close()
        return code

    def _run(self) -> int:
        self.store, self.store_server = self._blocking(self._open_store)
        if self.store_server is not None:
            console.say(f"hosting the rendezvous store on port {self.plan.endpoint.port}")
        rdzv = Rendezvous(self.store, self.plan.settings, self.node, on_status=console.say, progress=self._checkpoint_step)
        self._store_call(rdzv.register_status)
        watcher = Rendezvous(self._blocking(self.store.connect_again), self.plan.settings, self.node)
        keeper, prober = (Rendezvous(self._blocking(self.store.connect_again), self.plan.settings, self.node) for _ in range(2))
        self.probe = StoreProbe(prober, self.plan.read_timeout)
        while True:
            self.observer.before_round()
            try:
                assignment = self._blocking(rdzv.next_round)  # a signal pending since the last round ends it
            except (RendezvousError, UntrustedValue) as exc:
                raise AgentExit(EXIT_BAD_INPUT if assignment_never_formed(rdzv) else EXIT_INFRASTRUCTURE, str(exc))
            except StoreError as exc:
                raise AgentExit(EXIT_INFRASTRUCTURE, self._store_lost_message(exc)) from None
            limit = self.spec.crash_loop_limit
            if limit and assignment.stalled_restarts >= limit:
                return self._stop_crash_loop(rdzv, assignment)
            end = self._run_round(rdzv, watcher, keeper, assignment)
            code = self._after_round(rdzv, assignment, end)
            if code is not None:
                return code

    def _start_observer(self) -> None:
        """Stragglers, GPU health and /metrics (agent/observer.py); a port in use is bad input."""
        try:
            self.observer.start(lambda: self._status_record(self.assignment) if self.assignment else None, self.report)
        except OSError as exc:
            raise AgentExit(EXIT_BAD_INPUT, str(exc)) from None

    def _checkpoint_step(self) -> int | None:
        return newest_checkpoint_step(self.spec.checkpoint_dir) if self.spec.checkpoint_dir else None

    def _stop_crash_loop(self, rdzv: Rendezvous, a: Assignment) -> int:
        """K failures in a row without a newer checkpoint: stop instead of burning the budget."""
        detail = (
            f"crash loop: {a.stalled_restarts} restarts in a row made no progress (the newest "
            f"checkpoint is still step {a.checkpoint_step}); fix the cause, or raise --crash-loop-limit"
        )
        last = self.last_failure
        info = dict(last.info) if last else {}
        end = self._store_call(lambda: rdzv.end_round(a.round, RoundEnd("aborted", detail, self.host, info)))
        self._store_call(lambda: rdzv.close_job(end))
        self._store_call(lambda: rdzv.acknowledge_end(a.round, a.group_world_size))  # no barrier wait
        self.report.outcome = "crash loop"
        console.error(end.detail)
        if last is not None:
            console.error("the last failure: " + explain(last))
        self._exit_barrier(rdzv, a)
        return int(info.get("exit_status", 1)) or 1

    def _open_store(self) -> tuple[Store, Any]:
        try:
            opened = open_store(
                self.plan.endpoint,
                f"rally/{self.spec.run_id}/",
                self.plan.connect_timeout,
                self.plan.read_timeout,
                Signer(self.plan.token),
            )
        except StoreUnavailable as exc:
            raise AgentExit(EXIT_BAD_INPUT, str(exc)) from exc
        if self.plan.endpoint.etcd:
            # Reaching etcd needs no torch, but any node may host the workers' TCPStore in a
            # later round: import it now, beside the rendezvous, not in the middle of a re-form.
            threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()
        return opened

    # ================================================================ one round
    def _run_round(self, rdzv: Rendezvous, watcher: Rendezvous, keeper: Rendezvous, a: Assignment) -> RoundEnd:
        r = a.round
        self.assignment = a
        if self.live is None and LiveView.wanted(console.console()) and not self.spec.quiet:
            self.live = LiveView(console.console(), lambda: self._status_record(self.assignment))
            self.live.start()
        self.report.begin(a)
        self.events.emit(
            "round_formed",
            round=r,
            group_rank=a.group_rank,
            group_world_size=a.group_world_size,
            world_size=a.world_size,
            restart_count=a.restart_count,
        )
        console.say(
            f"round {r}: node {a.group_rank} of {a.group_world_size}, ranks "
            f"{a.rank_offset}-{a.rank_offset + self.spec.nproc_per_node - 1} of {a.world_size}, "
            f"restart {a.restart_count}/{self.spec.max_restarts}"
        )
        threads = RoundThreads(self.inbox.post, watcher, keeper, a, self.plan.read_timeout, self._status_record, self.observer.exchange)
        threads.start()  # keep-alives from the start: a spare judges a round dead by their absence
        self.hangs.start_watching(a)
        try:
            if a.group_rank == 0 and self.plan.workers_use_rendezvous_store:
                # Every node stopped its old workers before it joined this round, so no worker of
                # an earlier attempt can write here any more: its keys go, rally's own stay.
                self._store_call(lambda: self.store.delete_keys_outside("rally/"))
                master: tuple[str, int] | RoundEnd = (self.plan.endpoint.host, self.plan.endpoint.port)
                self._store_call(lambda: rdzv.publish_master(r, *master))
            elif a.group_rank == 0:
                self.worker_store = None  # the previous round's store closes here
                self.worker_store = host_tcp_store(0, self.plan.read_timeout)
                self._store_call(lambda: rdzv.publish_master(r, a.master_host, self.worker_store.port))
                master = (a.master_host, self.worker_store.port)
            else:
                master = self._blocking(lambda: self._store_call(lambda: rdzv.wait_master(r, self.plan.settings.keep_alive_timeout * 4 + 30, a.master_host)))
            if isinstance(master, RoundEnd):
                return master
            return self._watch_workers(rdzv, a, master)
        finally:
            threads.stop()
            self.hangs.round_over(rdzv, a)

    def _watch_workers(self, rdzv: Rendezvous, a: Assignment, master: tuple[str, int]) -> RoundEnd:
        multi_node = a.group_world_size > 1 or self.plan.settings.max_nodes > 1
        launch = self.template.spawn if self.template is not None else processes.spawn
        sink = self.live.sink if self.live is not None else None
        self.group = WorkerGroup.start(
            self.spec, self.base_env, a, master, self.logs, multi_node, console_out=sink, console_err=sink, launch=launch
        )
        self.health = HealthMonitor(self.health_settings, gpu=self.observer.read_gpus)
        for stream in self.group.streams:
            self.selector.register(stream.fd, selectors.EVENT_READ, ("stream", stream))
        for worker in self.group.workers:
            self.selector.register(worker.process.pidfd, selectors.EVENT_READ, ("exit", worker))
            if self.guard is not None:
                self.guard.guard_group(worker.pid)
            self.health.watch(worker.local_rank, worker.pid, worker.heartbeat_file, worker.process.started_at)
            self.events.emit("worker_started", round=a.round, rank=worker.global_rank, local_rank=worker.local_rank, pid=worker.pid)
        # held: (the job's first failure, the peer verdict or PENDING) - see _end_failure
        reported_success, held = False, None
        while True:
            self._pump(self.health.next_due(time.monotonic()))
            for signum in self._take_signals():
                if signum in self.spec.preemption_signals:
                    return self._preempt(rdzv, a, signum)
                self._leave_on_signal(rdzv, a, signum)
            for kind, value in self._take_events():
                if kind == "round_end" and value[0] == a.round:
                    return value[1]
                if kind == "peer_verdict" and value[0] == a.round and held is not None:
                    held = (held[0], value[1])
                if kind == "store_lost":
                    raise AgentExit(EXIT_INFRASTRUCTURE, self._store_lost_message(value))
                if kind == "dump_stacks" and value == a.round:
                    self.hangs.answer(rdzv, a)
            for worker in self.group.workers:
                if worker.returncode is not None and worker.local_rank in self.health.watched:
                    self._note_exit(a, worker)
            failed = [w for w in self.group.workers if w.returncode not in (None, 0)]
            if failed:
                first = min(failed, key=lambda w: w.process.ended_at or 0)
                self._read_what_is_left(first.output.streams)  # its last words, without waiting
                end = failure_end(first, a, self.kill_causes.get(first.local_rank))
                if a.group_world_size == 1:
                    return self._end_round(rdzv, a.round, end)
                if held is None:
                    held = (self._store_call(lambda: rdzv.first_failure(a.round, end)), PENDING)
                    check_peers(self.inbox.post, lambda: Rendezvous(self.store.connect_again(), rdzv.settings, self.node), a)
                elif held[1] is not PENDING:
                    return self._end_failure(rdzv, a, held[0], held[1], end)
            hangs = self.health.check({w.local_rank: w.output.last_output_at() for w in self.group.running()})
            if hangs:
                return self._end_round(rdzv, a.round, self.hangs.report(rdzv, a, hangs[0]))
            self.observer.after_check(a, self.group.workers, self.health)
            if not reported_success and self.group.all_succeeded():
                reported_success = True
                if a.group_world_size > 1:
                    console.say(f"all {len(self.group.workers)} workers on this node finished; waiting for the other nodes")
                self._store_call(lambda: rdzv.report_success(a.round, a.group_world_size))

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
        return self._store_call(lambda: rdzv.end_round(r, end))

    def _end_failure(self, rdzv: Rendezvous, a: Assignment, first: RoundEnd, silent: tuple[int, float] | None, local: RoundEnd) -> RoundEnd:
        """The job-wide first failure ends the round, unless a peer went silent: then that node's loss is the cause."""
        if silent is None:
            return self._end_round(rdzv, a.round, first)
        group_rank, silent_for = silent
        host = a.watch_host if group_rank == a.watch_rank else ""
        note = f"; {local.detail} after it (a consequence)"
        return self._store_call(lambda: rdzv.declare_lost(a.round, group_rank, host, silent_for, note))

    def _after_round(self, rdzv: Rendezvous, a: Assignment, end: RoundEnd) -> int | None:
        """Stop this round's workers and decide: exit with a code, or None to go round again."""
        group = self.group
        self._stop_workers(signal.SIGTERM)
        self.report.finish_attempt(group, end)
        self.events.emit("round_ended", round=a.round, kind=end.kind, detail=end.detail)
        self._store_call(lambda: rdzv.acknowledge_end(a.round, a.group_world_size))
        if end.kind == "succeeded":
            self._store_call(lambda: rdzv.close_job(end))
            console.say(f"job succeeded: {a.world_size} workers on {a.group_world_size} nodes finished")
            self._exit_barrier(rdzv, a)
            return 0
        if end.is_failure:
            self.last_failure = end
            console.error("root cause: " + explain(end))
            if a.restart_count + 1 > self.spec.max_restarts:
                self.report.outcome = "failed"
                self._store_call(lambda: rdzv.close_job(RoundEnd("aborted", f"restarts exhausted; {end.detail}", end.node, end.info)))
                console.console().print(self.report.workers_table())
                console.error(
                    f"job failed: no restarts left (--max-restarts {self.spec.max_restarts}); "
                    f"report: {self.report.path}"
                )
                self._exit_barrier(rdzv, a)
                return int(end.info.get("exit_status", 1)) or 1
            console.say(f"restarting all workers (restart {a.restart_count + 1} of {self.spec.max_restarts})")
            self.events.emit("restart", round=a.round, restart_count=a.restart_count + 1, cause=end.detail)
            return None
        if end.kind == "preempted":
            self.report.outcome = "preempted"
            self._store_call(lambda: rdzv.close_job(end))
            console.say(f"stopping: the job was preempted ({end.detail}); exit code {EXIT_PREEMPTED}")
            self._exit_barrier(rdzv, a)
            return EXIT_PREEMPTED
        if end.kind == "aborted":
            console.error(f"job ended: {end.detail}")
            return int(end.info.get("exit_status", 1)) or 1
        if end.kind == "node_lost":
            console.error("root cause: " + end.detail)
        console.say(f"re-forming the job: {end.detail} (does not count as a restart)")
        self.events.emit("membership_change", round=a.round, kind=end.kind, detail=end.detail)
        return None

    def _exit_barrier(self, rdzv: Rendezvous, a: Assignment) -> None:
        if self.store_server is not None:  # a signal ends the wait at once
            self._blocking(lambda: self._store_call(lambda: rdzv.wait_all_acknowledged(a.round, EXIT_BARRIER_SECONDS)), "the exit barrier")

    # ================================================================ status
    def _status_record(self, a: Assignment) -> dict:
        """This node as `rally status` shows it (built from a snapshot; races are harmless)."""
        workers = []
        group = self.group
        for w in list(group.workers) if group else []:
            sample = self.health.resources(w.local_rank)
            workers.append(
                {
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state(),
                    "cpu": sample.cpu_percent,
                    "rss": sample.rss,
                    "gpu_memory": sample.gpu_memory,
                    "heartbeat_age": self.health.heartbeat_age(w.local_rank),
                    **self.observer.worker_fields(w, self.health),
                }
            )
        return {
            "host": self.host,
            "node_id": self.node.node_id,
            "group_rank": a.group_rank,
            "round": a.round,
            "restart_count": a.restart_count,
            "world_size": a.world_size,
            "group_world_size": a.group_world_size,
            "updated": time.time(),
            "workers": workers,
            **self.observer.node_fields(),
        }

    def _blocking(self, fn: Callable[[], Any], waiting_for: str = "the rendezvous") -> Any:
        """Run a blocking store call in a thread while the main loop keeps handling signals
        (also those that arrived before: a signal is never lost between rounds)."""
        self._pump(0)
        self._exit_if_signalled(waiting_for)
        box: dict[str, Any] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                box["error"] = exc
            done.set()
            self.inbox.post("wake")

        threading.Thread(target=call, daemon=True).start()
        while not done.is_set():
            self._pump(self.probe.interval if self.probe else None)
            if self.probe and self.probe.stalled():  # a frozen store never answers the call
                raise AgentExit(EXIT_INFRASTRUCTURE, self.probe.stalled() or "")
            self._exit_if_signalled(waiting_for)
            events = [e for e in self._take_events() if e[0] != "wake"]
            self.pending_events.extend(events)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _exit_if_signalled(self, waiting_for: str) -> None:
        for signum in self._take_signals():
            name = processes.signal_name(signum)
            if signum in self.spec.preemption_signals and waiting_for == "the exit barrier":
                continue  # the job has ended: nothing left to preempt or requeue
            if signum in self.spec.preemption_signals:
                self._requeue_once(None, None)
                raise AgentExit(EXIT_PREEMPTED, f"preempted ({name}) while waiting for {waiting_for}")
            raise AgentExit(128 + signum, f"stopped by {name} while waiting for {waiting_for}")

    def _store_call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (StoreUnavailable, UntrustedValue) as exc:
            raise AgentExit(EXIT_INFRASTRUCTURE, self._store_lost_message(exc)) from exc

    def _store_lost_message(self, exc: BaseException) -> str:
        if isinstance(exc, (StoreSilent, UntrustedValue)):
            return str(exc)
        where = self.plan.endpoint
        if where.etcd:
            return f"{exc}; the job cannot go on without its rendezvous, so this node stops. Check the cluster: etcdctl --endpoints {','.join(map(str, where.etcd))} endpoint health"
        return (
            f"{exc}; the rendezvous store at {where} is gone, so this node stops. Its host "
            "was probably lost. To survive the loss of any compute node next time, run "
            "`rally store --port PORT` on a machine that does not train and point "
            "--rdzv-endpoint at it"
        )

    # ================================================================ event plumbing
    def _pump(self, timeout: float | None) -> None:
        """Wait for and handle I/O: worker exits, worker output, signals, thread events."""
        for key, _ in self.selector.select(timeout):
            kind, obj = key.data
            if kind == "stream":
                if not obj.on_readable():
                    self.selector.unregister(key.fd)
            elif kind == "exit":
                self.health.note_exit(obj.local_rank)
                obj.process.poll()
                self.selector.unregister(key.fd)
            elif kind == "signal":
                try:
                    data = os.read(self.signal_r, 64)
                except BlockingIOError:
                    data = b""
                if signal.SIGCHLD in data:  # an orphan re-parented to us may have exited: reap it now
                    processes.reap_zombies(self._helper_pids() | {w.pid for w in (self.group.workers if self.group else [])})
                self.pending_signals.extend(s for s in data if s != signal.SIGCHLD)
            elif kind == "inbox":
                self.pending_events.extend(self.inbox.drain())

    def _take_signals(self) -> list[int]:
        out, self.pending_signals = self.pending_signals, []
        return out

    def _take_events(self) -> list[tuple[str, Any]]:
        out, self.pending_events = self.pending_events, []
        return out

    def _install_signal_handlers(self) -> None:
        signal.set_wakeup_fd(self.signal_w, warn_on_full_buffer=False)
        handled = {*self.spec.signals_to_handle, *self.spec.preemption_signals}
        for signum in (*handled, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the number
        signal.siginterrupt(signal.SIGCHLD, False)  # threads' blocking calls restart, not fail
        # The launcher blocks the preemption signals until now (see launcher.cli.main); a signal
        # that arrived meanwhile is delivered here, to the handler just installed.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled | {signal.SIGUSR1, signal.SIGUSR2})

    def _preempt(self, rdzv: Rendezvous, a: Assignment, signum: int) -> RoundEnd:
        """The scheduler warned that the job will be killed: let workers checkpoint, then stop.

        The signal is forwarded to every worker (rally's bootstrap turns it into
        `rally.job.preempted()` instead of a kill), the workers get up to
        `--preemption-grace` seconds to save and exit, node 0 requeues the job when asked to,
        and the round ends as "preempted" so every node stops with EXIT_PREEMPTED.
        """
        name = processes.signal_name(signum)
        group = self.group
        grace = self.spec.preemption_grace
        console.say(f"received {name} (preemption or time limit): forwarding it to the workers; up to {grace:g} s to checkpoint")
        for worker in group.running() if group else []:
            processes.send_to_group(worker.pid, signum)
        deadline = time.monotonic() + grace
        while group and group.running() and time.monotonic() < deadline:
            self._pump(max(0.0, deadline - time.monotonic()))
            if any(s not in self.spec.preemption_signals for s in self._take_signals()):
                break
        self._wait_for_all_nodes_to_checkpoint(rdzv, a, deadline)
        self._requeue_once(rdzv, a)
        end = RoundEnd("preempted", f"{self.host} received {name}", self.host, {"exit_status": EXIT_PREEMPTED})
        return self._store_call(lambda: rdzv.end_round(a.round, end))

    def _wait_for_all_nodes_to_checkpoint(self, rdzv: Rendezvous, a: Assignment, deadline: float) -> None:
        """Node 0 requeues only when every node's workers are done (or the grace is over):
        the requeue makes SLURM kill every task, and a shard still being saved would be lost."""
        r = a.round
        if self._store_call(lambda: rdzv.store.add(f"{r}/preempt_done", 1)) >= a.group_world_size:
            self._store_call(lambda: rdzv.store.set(f"{r}/preempt_all_done", "1"))
        if a.group_rank == 0 and self.spec.requeue:
            remaining = max(0.01, deadline - time.monotonic())
            if not self._store_call(lambda: rdzv.store.try_wait([f"{r}/preempt_all_done"], remaining)):
                console.warn("not every node finished checkpointing within --preemption-grace; requeueing anyway")

    def _requeue_once(self, rdzv: Rendezvous | None, a: Assignment | None) -> None:
        """Node 0 asks the scheduler to requeue the job, once per job, when --requeue is on."""
        if not self.spec.requeue or self.requeue is None:
            return
        if a is not None and a.group_rank != 0:
            return
        if a is None and self.plan.preferred_rank not in (0, None):
            return
        if rdzv is not None and a is not None:
            won, _ = self._store_call(lambda: rdzv.store.set_once("job/requeued", self.node.node_id))
            if not won:
                return
        try:
            console.say(self.requeue())
        except Exception as exc:  # noqa: BLE001 - a failed requeue is reported, not fatal
            console.error(f"could not requeue the job: {exc}")

    def _leave_on_signal(self, rdzv: Rendezvous, a: Assignment, signum: int) -> None:
        name = processes.signal_name(signum)
        console.say(f"received {name}: forwarding it to the workers, then stopping")
        self._stop_workers(signum)
        try:
            rdzv.leave(a.round, RoundEnd("node_left", f"{self.host} stopped by {name}", self.host))
        except StoreError:
            pass
        raise AgentExit(128 + signum)

    # ================================================================ stopping
    def _stop_workers(self, signum: int) -> None:
        """Signal every worker's group, keep draining output for one grace period, then SIGKILL."""
        group = self.group
        if group is None:
            return
        running = group.running()
        tree = processes.snapshot_descendants([w.process for w in running])
        for worker in running:
            worker.stopped = True
            processes.stop_group(worker.pid, signum)  # with SIGCONT: a stopped worker must not sit out the grace
        deadline = time.monotonic() + self.spec.shutdown_timeout
        pending = len(self.pending_signals)
        while group.running() and time.monotonic() < deadline:
            self._pump(max(0.0, deadline - time.monotonic()))
            if len(self.pending_signals) > pending:  # a signal: no more grace (it stays pending, handled next)
                break
        stuck = processes.kill_all([w.process for w in group.workers], tree, self._helper_pids())  # the whole tree
        if stuck:
            console.warn(f"processes {stuck} did not die within {processes.KILL_WAIT_SECONDS:g} s of SIGKILL (stuck in the kernel?)")
        self._drain_output(group)
        for worker in group.workers:
            if self.guard is not None:
                self.guard.unguard_group(worker.pid)
        group.close()
        self.group = None

    def _read_what_is_left(self, streams: list) -> None:
        """Read whatever a dead worker left in its pipes, without waiting for end-of-file (a
        child of the worker may hold the pipe open for a long time)."""
        for stream in streams:
            while stream.open:
                before = stream.last_read_at
                if not stream.on_readable():
                    self._unregister(stream.fd)
                    break
                if stream.last_read_at == before:  # nothing more available right now
                    break

    def _unregister(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def _drain_streams(self, streams: list, seconds: float) -> None:
        """Keep reading until these pipes reach end-of-file (bounded: a grandchild may hold them)."""
        deadline = time.monotonic() + seconds
        while any(s.open for s in streams) and time.monotonic() < deadline:
            self._pump(0.05)

    def _drain_output(self, group: WorkerGroup) -> None:
        self._drain_streams(group.streams, OUTPUT_DRAIN_SECONDS)
        for key in list(self.selector.get_map().values()):
            if key.data[0] in ("stream", "exit"):
                self.selector.unregister(key.fd)

    # ================================================================ helpers
    def _helper_pids(self) -> frozenset[int]:
        template = self.template.helper_pids() if self.template is not None else set()
        return frozenset(({self.guard.pid} if self.guard is not None else set()) | template)

    # ================================================================ worker template
    def _start_template(self) -> None:
        """Start the worker template now, so it preloads torch while the rendezvous runs."""
        self.template = TemplateClient.for_job(self.spec, self.base_env)
        if self.template is None:
            return
        try:
            self.template.start()
        except OSError as exc:
            console.warn(f"could not start the worker template ({exc}); starting workers plainly")
            self.template = None

    def _stop_template(self) -> None:
        if self.template is not None:
            self.template.stop()
            self.template = None


def assignment_never_formed(rdzv: Rendezvous) -> bool:
    """A rendezvous error before the first round formed is a setup problem (exit 2)."""
    return rdzv.last_round is None
