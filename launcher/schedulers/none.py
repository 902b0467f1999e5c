"""No scheduler: rally started by hand, by a script or a container runtime that says nothing.

Nothing is given: the options (and their defaults) decide the nodes, the rank, the store and the
run id, and `--requeue` has nobody to ask (one line on the console when a preemption signal
comes; the job still stops with EXIT_PREEMPTED)."""

from __future__ import annotations

from dataclasses import dataclass

from rally.agent.base.spec import SchedulerView


@dataclass(frozen=True)
class NoScheduler:
    name: str = "none"
    nnodes: None = None
    node_rank: None = None
    endpoint: None = None
    run_id: None = None

    def requeue(self) -> str:
        raise RuntimeError("--requeue: not inside a SLURM job (SLURM_JOB_ID is unset)")

    def agent_view(self) -> SchedulerView:
        return SchedulerView()
