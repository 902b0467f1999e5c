"""The scheduler seam (launcher/schedulers/): each scheduler says what its environment gives (nodes,
node rank, endpoint, run id, requeue, what the agent needs), from fabricated environments as the
scheduler writes them; and no module outside launcher/schedulers/ reads a scheduler's variables."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rally.agent.base.spec import SchedulerView
from rally.launcher.schedulers import detect
from rally.launcher.schedulers.kubernetes import TrainingOperatorJob
from rally.launcher.schedulers.none import NoScheduler
from rally.launcher.schedulers.slurm import SlurmJob
from rally.rendezvous.backends import HostPort

REPO = Path(__file__).resolve().parents[1]
SLURM_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n1,n2",
              "SLURM_STEP_NUM_NODES": "2", "SLURMD_NODENAME": "n2"}  # fmt: skip
# A static PyTorchJob's worker pod, as the training operator writes it; and an elastic one's.
STATIC_POD = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}  # fmt: skip
ELASTIC_POD = {"PET_NNODES": "1:4", "PET_RDZV_ENDPOINT": "job-rdzv:29400", "PET_RDZV_BACKEND": "c10d",
               "PET_RDZV_ID": "job"}  # fmt: skip


@pytest.mark.timeout(10)
def test_each_environment_finds_its_scheduler_and_slurm_wins_unless_turned_off() -> None:
    assert detect({**SLURM_STEP, **STATIC_POD}).name == "slurm"
    assert detect({**SLURM_STEP, **STATIC_POD}, no_slurm=True).name == "kubernetes"
    assert detect(ELASTIC_POD).name == "kubernetes"
    assert detect({"PET_NPROC_PER_NODE": "2"}).name == "none"  # torchrun's variable alone: no operator
    assert detect({}) == NoScheduler()


@pytest.mark.timeout(10)
def test_what_each_scheduler_gives() -> None:
    slurm = SlurmJob.from_env(SLURM_STEP, expand=lambda text: text.split(","))
    assert slurm is not None
    assert (slurm.nnodes, slurm.node_rank, slurm.endpoint.host, slurm.run_id) == (2, 1, "n1", "77.0")
    assert slurm.agent_view() == SchedulerView(
        "slurm", "to keep SLURM node n2 out when the job is requeued: scontrol update JobId=77 ExcNodeList=n2", True
    )
    static = TrainingOperatorJob.from_env(STATIC_POD)
    assert static is not None
    assert (static.nnodes, static.node_rank, static.endpoint, static.run_id) == (
        2,
        1,
        HostPort("job-master-0", 23456),
        None,
    )
    elastic = TrainingOperatorJob.from_env(ELASTIC_POD)
    assert elastic is not None
    assert (elastic.nnodes, elastic.node_rank, elastic.endpoint, elastic.run_id) == (
        None,
        None,
        "job-rdzv:29400",
        "job",
    )
    assert elastic.agent_view() == SchedulerView("kubernetes")
    for nothing in (elastic, NoScheduler()):
        with pytest.raises(RuntimeError, match="--requeue"):
            nothing.requeue()


@pytest.mark.timeout(30)
def test_no_module_outside_the_schedulers_reads_a_schedulers_variables() -> None:
    """SLURM_*, SLURMD_* and the training operator's markers are read in launcher/schedulers/ only
    (the options model reads PET_<FLAG> for every flag, as torchrun does: that is no scheduler's)."""
    names = ("SLURM_", "SLURMD_", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT", "PET_NODE_RANK")
    readers = sorted(
        f"{path.relative_to(REPO)}:{node.lineno}"
        for package in ("agent", "launcher", "rendezvous")
        for path in (REPO / package).rglob("*.py")
        if "schedulers" not in path.relative_to(REPO).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(names)
    )
    assert readers == []
