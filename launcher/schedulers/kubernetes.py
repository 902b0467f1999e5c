"""Kubernetes' training operator: a pod of a PyTorchJob, read from the variables the operator sets.

The operator starts one pod per node and gives each torchrun's environment spelling of the
launch: PET_NNODES (N, or MIN:MAX for an elastic job), PET_NODE_RANK and PET_MASTER_ADDR /
PET_MASTER_PORT (static: the master pod's service), or PET_RDZV_ENDPOINT, PET_RDZV_BACKEND and
PET_RDZV_ID (elastic). The options model reads every PET_<FLAG> as torchrun does (launcher/options.py),
so nothing here overrides an option; this object says what the environment gives, for the same
questions SLURM answers (launcher/schedulers/slurm.py). A pod is restarted by the operator, not
requeued: `requeue` refuses, as outside any scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rally.agent.base.spec import SchedulerView
from rally.rendezvous.backends import HostPort

# Set by the training operator on every pod of a PyTorchJob (a plain torchrun sets none of them).
OPERATOR_MARKERS = ("PET_NNODES", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")


@dataclass(frozen=True)
class TrainingOperatorJob:
    """What the training operator says about this pod's job."""

    nodes: str  # PET_NNODES as given: "2", or "1:4" for an elastic job
    node_rank: int | None  # PET_NODE_RANK (static jobs); None: the rendezvous decides
    endpoint: HostPort | str | None  # PET_RDZV_ENDPOINT, else PET_MASTER_ADDR:PET_MASTER_PORT
    run_id: str | None  # PET_RDZV_ID
    name: str = "kubernetes"

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TrainingOperatorJob | None:
        """None outside a PyTorchJob's pod (none of OPERATOR_MARKERS set). Values are kept as
        given: the options model checks them, as it checks the same variables for torchrun's sake."""
        if not any(environ.get(name, "").strip() for name in OPERATOR_MARKERS):
            return None
        rank = environ.get("PET_NODE_RANK", "").strip()
        endpoint: HostPort | str | None = environ.get("PET_RDZV_ENDPOINT", "").strip() or None
        master, port = environ.get("PET_MASTER_ADDR", "").strip(), environ.get("PET_MASTER_PORT", "").strip()
        if endpoint is None and master and port.isdigit():
            endpoint = HostPort(master, int(port))
        return cls(
            nodes=environ.get("PET_NNODES", "").strip() or "1",
            node_rank=int(rank) if rank.isdigit() else None,
            endpoint=endpoint,
            run_id=environ.get("PET_RDZV_ID", "").strip() or None,
        )

    @property
    def nnodes(self) -> int | None:
        """The job's node count; None for an elastic MIN:MAX (the rendezvous decides)."""
        return int(self.nodes) if self.nodes.isdigit() else None

    def requeue(self) -> str:
        raise RuntimeError("--requeue: a PyTorchJob's pods are restarted by the training operator, not requeued")

    def agent_view(self) -> SchedulerView:
        return SchedulerView("kubernetes")
