"""The schedulers rally runs under, one module each, and the one place their variables are read.

Each says what the environment gives, as one small object (the shape of submitit's
`JobEnvironment`): how many nodes, this node's rank, where the rendezvous store is, the run id, how
to requeue the job, and what the agent needs of it (`agent_view()`, a
`rally.agent.base.spec.SchedulerView`, carried in the job's spec so that no module of the agent
reads a scheduler's variables):

* `slurm.SlurmJob`: an `srun` step or a batch shell (SLURM_*);
* `kubernetes.TrainingOperatorJob`: a pod of a PyTorchJob, from the training operator's PET_*
  variables (which the options model also reads as torchrun's environment spelling of each flag);
* `none.NoScheduler`: neither; nothing is given and `--requeue` has nobody to ask.

`detect(environ)` picks the one this process runs under. tests/test_layout.py keeps every
scheduler variable inside this package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from rally.agent.base.spec import SchedulerView
from rally.rendezvous.backends import HostPort


class Scheduler(Protocol):
    """What a scheduler's environment gives this node."""

    @property
    def name(self) -> str: ...

    @property
    def nnodes(self) -> int | None:
        """Nodes of the job (None: the scheduler does not say)."""

    @property
    def node_rank(self) -> int | None:
        """This node's rank in the job (None: the rendezvous decides)."""

    @property
    def endpoint(self) -> HostPort | str | None:
        """Where the rendezvous store is (None: the scheduler does not say)."""

    @property
    def run_id(self) -> str | None:
        """The job's run id (None: the scheduler does not say)."""

    def requeue(self) -> str:
        """Ask the scheduler to run the job again; the line to print, or RuntimeError."""

    def agent_view(self) -> SchedulerView:
        """What the agent needs of it, carried in the job's spec."""


def detect(environ: Mapping[str, str], no_slurm: bool = False) -> Scheduler:
    """The scheduler this process runs under: SLURM (unless `no_slurm`), Kubernetes' training
    operator, else none. ValueError, naming the variable, when SLURM's environment is inconsistent."""
    from rally.launcher.schedulers.kubernetes import TrainingOperatorJob
    from rally.launcher.schedulers.none import NoScheduler
    from rally.launcher.schedulers.slurm import SlurmJob

    found: Scheduler | None = None if no_slurm else SlurmJob.from_env(environ)
    return found or TrainingOperatorJob.from_env(environ) or NoScheduler()
