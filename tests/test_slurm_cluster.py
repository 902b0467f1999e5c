"""Smoke tests of the SLURM dev cluster harness, and of launcher.schedulers.slurm on real SLURM.

These show that the cluster is a real multi-node SLURM (distinct hosts, real
job environments) before other tests build on it. Each test's timeout also
covers bringing the cluster up (about 1 s; 10-15 s when packages are installed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported by pytest as a plugin (below), so that its asserts are rewritten
    from support.slurm_cluster import SlurmCluster

pytest_plugins = ["support.slurm_cluster"]
pytestmark = pytest.mark.slurm

# Prints what every node of a step must agree on, as one JSON line per task.
PROBE = (
    "import json, os, rally.launcher.schedulers.slurm as s; j = s.SlurmJob.from_env(os.environ); "
    "print(json.dumps(None if j is None else dict(node_rank=j.node_rank, nnodes=j.nnodes, run_id=j.run_id, "
    "step_id=j.step_id, store_host=j.store_host, store_port=j.store_port, host=os.uname().nodename)))"
)


def probe_lines(text: str) -> list[dict]:
    """The JSON objects PROBE printed, in node-rank order."""
    found = [json.loads(line) for line in text.splitlines() if line.startswith(("{", "null"))]
    return sorted(found, key=lambda d: -1 if d is None else d["node_rank"])


@pytest.mark.timeout(120)
def test_srun_on_two_nodes_runs_on_two_distinct_hosts(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.run_login(["srun", "-N2", "--ntasks-per-node=1", "hostname"], timeout=30, check=True)
    hosts = done.stdout.split()
    assert len(hosts) == 2 and len(set(hosts)) == 2, done.stdout
    assert set(hosts) <= set(slurm_cluster.nodes)
    # every node's namespace holds its own slurmd: what a node-crash test would kill
    for node in slurm_cluster.nodes:
        pids = slurm_cluster.node_pids(node)
        assert any(Path(f"/proc/{p}/comm").read_text().strip() == "slurmd" for p in pids), (node, pids)


@pytest.mark.timeout(120)
def test_slurm_job_agrees_across_the_nodes_of_an_srun_step(slurm_cluster: SlurmCluster) -> None:
    done = slurm_cluster.run_login(
        ["srun", "-N2", "--ntasks-per-node=1", sys.executable, "-c", PROBE], timeout=60, check=True
    )
    tasks = probe_lines(done.stdout)
    assert [t["node_rank"] for t in tasks] == [0, 1], done.stdout
    assert [t["host"] for t in tasks] == ["node1", "node2"]
    assert {t["nnodes"] for t in tasks} == {2}
    assert len({t["run_id"] for t in tasks}) == 1 and tasks[0]["run_id"].endswith(".0")
    assert len({t["store_port"] for t in tasks}) == 1
    assert {t["store_host"] for t in tasks} == {"node1"}


@pytest.mark.timeout(120)
def test_batch_shell_and_its_step_get_different_run_ids(slurm_cluster: SlurmCluster) -> None:
    script = f"""#!/bin/bash
{sys.executable} -c '{PROBE}'
srun {sys.executable} -c '{PROBE}'
"""
    jobid = slurm_cluster.sbatch(script, "-N2", "--ntasks-per-node=1")
    slurm_cluster.wait_job_gone(jobid, timeout=60)
    output = slurm_cluster.output(jobid)
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == 3, output
    batch, step = lines[0], lines[1:]
    assert batch["step_id"] is None and batch["run_id"] == jobid and batch["host"] == "node1"
    assert sorted(t["node_rank"] for t in step) == [0, 1]
    assert {t["run_id"] for t in step} == {f"{jobid}.0"}
    assert batch["store_port"] != step[0]["store_port"]
