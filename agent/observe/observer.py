"""What the agent tells about a running job beyond "alive or hung": stragglers, metrics, GPU health.

The agent (agent/agent.py) owns one `Observer`, a collaborator (agent/base/collaborator.py):
its hooks run when the agent starts and exits, before it joins each round, before the workers
start, on each turn of the watch loop and before a restart; the agent also calls it when it builds
its status record, and from its keep-alive thread (`exchange`). Everything else lives in the modules this one
ties together: agent/observe/stragglers.py (step times, who is slow), agent/observe/metrics.py (/metrics for
Prometheus) and agent/observe/gpu.py (NVML).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rally.agent.base.collaborator import AgentContext, Collaborator, JobRecord, StartedWorker
from rally.agent.base.exit_codes import EXIT_BAD_INPUT, AgentExit
from rally.agent.display import console
from rally.agent.observe import gpu as gpus
from rally.agent.observe.gpu_reclaim import gpu_processes_of, wait_reclaimed
from rally.agent.observe.hang_report import StackSource
from rally.agent.observe.health import HealthMonitor, HealthSettings
from rally.agent.observe.job_view import write_job_view
from rally.agent.observe.learned_timeouts import LearnedTimeouts
from rally.agent.observe.status_record import ShownWorkers, node_status
from rally.agent.observe.stragglers import CentralValues, StragglerWatch, job_step_times
from rally.rendezvous.protocol import Assignment, Round, RoundEnd
from rally.rendezvous.status.job_notes import load_timeouts, save_timeouts


class EndedRound(Protocol):
    @property
    def end(self) -> dict | None:
        """How the round ended (its RoundEnd as a dict), None while it runs."""


class RoundsRecord(JobRecord, Protocol):
    """The agent's report.json with its rounds (agent/report.py's JobReport is one)."""

    @property
    def attempts(self) -> Sequence[EndedRound]: ...


class ObserverContext(AgentContext, Protocol):
    """What the observer needs of its agent beyond every collaborator's context."""

    @property
    def report(self) -> RoundsRecord: ...

    @property
    def group(self) -> ShownWorkers | None: ...

    @property
    def assignment(self) -> Assignment | None:
        """The round this node is in (None before the first)."""


class Observer(Collaborator):
    """The workers' health (heartbeats, hangs, resources: the health monitor of each round),
    stragglers, /metrics and GPU health for one agent; it builds the node's status record."""

    def __init__(self, ctx: ObserverContext, settings: HealthSettings | None = None):
        """`settings`: the job's health settings (default: from its spec), with the LearnedTimeouts
        of --heartbeat-timeout auto (agent/observe/learned_timeouts.py), kept in the store. Node 0
        keeps the job's view for `rally status RUN_DIR` in the agent's run directory
        (agent/observe/job_view.py)."""
        self.ctx = ctx
        self.spec = ctx.spec
        self.run_dir: Path | None = ctx.run_dir
        self.health_settings = settings or HealthSettings.for_job(ctx.spec, console.say, ctx.events.emit)
        self.timeouts: LearnedTimeouts | None = self.health_settings.learned
        self.events = ctx.events
        self.host = ctx.host
        self.base_env = ctx.base_env
        self.stragglers = StragglerWatch(ctx.spec.straggler_factor, ctx.spec.straggler_window)
        self.metrics: Any = None
        self.gpu: gpus.NvmlMonitor | None = None
        self.gpu_devices: list[gpus.DeviceReading] | None = None
        self.gpu_xid_problems: list[str] = []  # XIDs are events: remembered once seen
        self.gpu_problems_seen: set[str] = set()  # every distinct problem so far (rally_gpu_problems_total)
        self.last_restart: dict | None = None  # why the job last went round again (`rally status`)
        self.worker_pids: set[int] = (
            set()
        )  # this round's workers and their processes seen on GPUs (agent/observe/gpu_reclaim.py)
        self.gpu_baseline: dict[int, int] = {}  # bytes in use per GPU before the round's workers started
        self.health = HealthMonitor(self.health_settings, gpu=self.read_gpus)  # rebuilt for each round's workers

    # ------------------------------------------------------------------ hooks (agent/base/collaborator.py)
    def start(self) -> None:
        """Open NVML and start /metrics; a port that cannot be bound is bad input (exit 2, one line)."""
        try:
            self._start()
        except OSError as exc:
            raise AgentExit(EXIT_BAD_INPUT, str(exc)) from None

    def workers_starting(self, rnd: Round, master: tuple[str, int]) -> RoundEnd | None:
        self.load_timeouts()
        return None

    def workers_started(self, rnd: Round, workers: Sequence[StartedWorker]) -> None:
        self.health = HealthMonitor(self.health_settings, gpu=self.read_gpus)
        for worker in workers:
            self.health.watch(worker.local_rank, worker.pid, worker.heartbeat_file, worker.started_at)

    def worker_exited(self, worker: StartedWorker) -> None:
        self.health.note_exit(worker.local_rank)  # no hang after an exit

    def next_due(self, now: float) -> float | None:
        return self.health.next_due(now)

    def watch(self, rnd: Round) -> RoundEnd | None:
        group = self.ctx.group
        assert group is not None  # the watch loop runs while the round's workers do
        self.after_check(rnd.assignment, group.workers, self.health)
        return None

    def in_status_thread(self, rnd: Round) -> None:
        self.exchange(rnd)

    def status_fields(self) -> dict[str, object]:
        """The node's status record (agent/observe/status_record.py) of the round it is in."""
        assignment, node = self.ctx.assignment, self.ctx.node
        if assignment is None:
            return {}
        return node_status(self.host, node.node_id, assignment, self.ctx.group, self.health, self)

    def backend(self) -> str:
        """The process-group backend this node's workers would use (nccl with GPUs, else gloo)."""
        return "nccl" if self.gpu is not None else "gloo"

    def restarting(self, rnd: Round, end: RoundEnd) -> None:
        self.note_restart(rnd.assignment.round, end)

    def exit(self) -> str | None:
        self.stop()
        return None

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        """Open NVML and start /metrics (OSError with one line if the port cannot be bound)."""
        self.gpu, reason = gpus.open_monitor()
        if self.gpu is None:
            self.events.emit("gpu_health_skipped", reason=reason)
            if self._gpus_expected():
                console.warn(f"GPU health checks skipped: {reason}")
        if self.spec.metrics_port is not None:
            from rally.agent.observe import metrics

            report = self.ctx.report
            ends = lambda: metrics.round_end_kinds(list(report.attempts))  # noqa: E731
            self.metrics = metrics.serve(
                self.spec.metrics_port,
                self.ctx.status_now,
                ends,
                self.spec.run_id,
                self.spec.metrics_addr,
                self.spec.rally_version,
            )
            console.say(f"Prometheus metrics at {self.metrics.url}")

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None

    def _gpus_expected(self) -> bool:
        """Say so on the console only where GPUs seem to exist; CPU-only nodes get the event only."""
        visible = self.base_env.get("CUDA_VISIBLE_DEVICES", "").strip()
        return Path("/dev/nvidiactl").exists() or visible not in ("", "-1", "NoDevFiles")

    # ------------------------------------------------------------------ GPUs
    def read_gpus(self) -> list[gpus.DeviceReading] | None:
        """The node's GPUs now (for the health monitor's samples); None without NVML."""
        if self.gpu is None:
            return None
        self.gpu_devices = self.gpu.read()
        for device in self.gpu_devices:
            problem = gpus.xid_problem(device)
            if problem and problem not in self.gpu_xid_problems:
                self.gpu_xid_problems.append(problem)
                console.warn(f"GPU problem on {self.host}: {problem}")
                self.events.emit("gpu_problem", node=self.host, problem=problem)
        return self.gpu_devices

    def gpu_problems(self) -> list[str] | None:
        """Every current GPU problem of this node (None: not checked here)."""
        if self.gpu_devices is None:
            return None
        problems = [p for d in self.gpu_devices for p in gpus.state_problems(d)] + self.gpu_xid_problems
        self.gpu_problems_seen.update(problems)
        return problems

    def before_round(self) -> None:
        """Before this node joins a round: forget the last round's ranks, wait until the last
        round's workers have left the GPUs (--gpu-reclaim-timeout), check the GPUs."""
        self.stragglers.reset()
        if self.gpu is None:
            return
        if self.worker_pids:
            # wait: bounded, said by agent/observe/gpu_reclaim.py wait_reclaimed: --gpu-reclaim-timeout (30 s), a line
            #   every few seconds; a GPU that stays occupied is named
            problems, waited = wait_reclaimed(
                lambda: self.read_gpus() or [],
                self.worker_pids,
                self.gpu_baseline,
                self.spec.gpu_reclaim_timeout,
                announce=console.say,
            )
            self.worker_pids = set()
            if problems:
                console.warn(
                    f"GPU memory not reclaimed after {waited:.1f} s (--gpu-reclaim-timeout): {'; '.join(problems)}"
                )
            self.events.emit("gpu_reclaim", node=self.host, waited=round(waited, 3), occupied=problems)
        self.gpu_baseline = {d.index: d.memory_used for d in self.read_gpus() or []}
        problems = self.gpu_problems() or []
        if problems:
            console.error(f"node {self.host} has unhealthy GPUs before joining the next round: {'; '.join(problems)}")
            self.events.emit("gpu_unhealthy", node=self.host, problems=problems)

    def load_timeouts(self) -> None:
        """Before workers start: take the timeouts this job learned before (a restart, a newcomer)."""
        store = self.ctx.store
        if self.timeouts is not None and store is not None:
            self.timeouts.merge(self.ctx.store_call(lambda: load_timeouts(store)), "the store")

    # ------------------------------------------------------------------ stragglers
    def after_check(self, assignment: Assignment, workers: Sequence[StackSource], health: HealthMonitor) -> None:
        """Feed the heartbeat files' steps to the straggler watch; name and clear stragglers."""
        if self.gpu is not None:  # whom to wait for before the next round (agent/observe/gpu_reclaim.py)
            self.worker_pids |= {w.pid for w in workers} | gpu_processes_of(
                self.gpu_devices or [], {w.pid for w in workers}
            )
        records = health.records()
        new = False
        for worker in workers:
            record = records.get(worker.local_rank)
            if record is not None:
                new |= self.stragglers.observe(worker.global_rank, record.step, record.ns)
        if not new:
            return
        named, cleared = self.stragglers.judge()
        factor = self.stragglers.factor
        for s in named:
            console.warn(
                f"straggler: rank {s.rank} on {self.host} takes {s.step_time:.3f} s per step, {s.ratio:.1f}x the "
                f"median of the {s.scope}'s other ranks ({s.median:.3f} s; --straggler-factor {factor:g})"
            )
            self.events.emit(
                "straggler",
                round=assignment.round,
                rank=s.rank,
                node=self.host,
                node_rank=assignment.group_rank,
                step_time=round(s.step_time, 6),
                median=round(s.median, 6),
                ratio=round(s.ratio, 3),
                scope=s.scope,
                factor=factor,
            )
        for rank in cleared:
            console.say(f"rank {rank} on {self.host} is no longer a straggler")
            self.events.emit("straggler_cleared", round=assignment.round, rank=rank, node=self.host)

    def worker_fields(self, worker: StackSource, health: HealthMonitor) -> dict:
        """Extra fields of one worker in the status record: step, step time, straggler, section."""
        record = health.records().get(worker.local_rank)
        straggler = self.stragglers.stragglers.get(worker.global_rank)
        return {
            "step": self.stragglers.step(worker.global_rank),
            "step_time": self.stragglers.step_times.get(worker.global_rank),
            "straggler": None
            if straggler is None
            else {"step_time": straggler.step_time, "median": straggler.median, "scope": straggler.scope},
            "section": record.section if record is not None else "",
            "gpu_utilization": health.resources(worker.local_rank).gpu_utilization,
        }

    def node_fields(self) -> dict:
        problems = self.gpu_problems()
        total = None if problems is None else len(self.gpu_problems_seen)
        return {"gpu_problems": problems, "gpu_problems_total": total, "last_restart": self.last_restart}

    def _keep_view(self, status: dict) -> None:
        assert self.run_dir is not None
        try:
            write_job_view(self.run_dir, self.spec.run_id, status)
        except OSError:
            pass  # a full disk or a removed run directory: `rally status RUN_DIR` asks the store instead

    def note_restart(self, round_: int, end: RoundEnd) -> None:
        """Round `round_` ended with `end` (a failure or a membership change) and another follows:
        kept for the status record, so `rally status` can say why the last restart happened."""
        self.last_restart = {"round": round_, "kind": str(end.kind), "detail": end.detail}

    def exchange(self, rnd: Round) -> None:
        """From the status thread, with the round (rendezvous.protocol.Round) on its connection:
        make the straggler median the job's, not only this node's, and keep the job's view.

        Node 0 reads every node's status record of this round (one multi-get), writes what it
        read into its run directory for `rally status RUN_DIR` (agent/observe/job_view.py) and
        publishes the middle of the sorted step times; every other node reads that one key.
        """
        if self.timeouts is not None and self.timeouts.changed:
            save_timeouts(rnd.store, self.timeouts.to_json())
        assignment = rnd.assignment
        if assignment.group_world_size <= 1 and self.run_dir is None:
            return
        summary: CentralValues | None
        if assignment.group_rank == 0:
            from rally.rendezvous.status.reader import read_job_status

            try:
                status = read_job_status(rnd.store)
            except (ValueError, TypeError, KeyError, AttributeError):
                return  # a record that is not JSON (store contents are not trusted): skip this time
            if status is not None and self.run_dir is not None:
                self._keep_view(status)
            if assignment.group_world_size <= 1:
                return
            times = job_step_times(status["nodes"] if status else [], assignment.round)
            summary = CentralValues.of(times)
            rnd.channel.publish_step_times(summary.to_json())
        elif (published := rnd.channel.step_times()) is not None:
            summary = CentralValues.from_json(published)
        else:
            return
        self.stragglers.job = summary if summary is not None and summary.count >= 2 else None
