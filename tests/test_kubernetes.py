"""Specification: rally as the command of a Kubeflow PyTorchJob's pods.

The training operator runs the container's command in each pod with the job's shape in the
environment, for torchrun to read (kubeflow/training-operator, pkg/controller.v1/pytorch:
envvar.go, master.go, elastic.go). Two pods are two rally agents started here as separate
processes on loopback, each with exactly that environment and no flag: `rally probe.py`.

* The static form (a Master and a Worker replica, `nprocPerNode: "2"`): PET_NNODES=2,
  PET_NPROC_PER_NODE=2, PET_NODE_RANK, PET_MASTER_ADDR/PET_MASTER_PORT (and the same without
  PET_), plus the pod-level WORLD_SIZE (replicas x nproc) and RANK (the pod's index) that the
  operator sets for scripts run without a launcher, which the workers must not inherit. The
  master pod is given MASTER_ADDR=localhost, the worker pod the master's service name (here
  its address, 127.0.0.1). No restart budget is given, so a failed worker fails the job on
  both pods and the kubelet restarts the containers (restartPolicy: OnFailure) with the same
  environment: the job then runs again on the same port.
* The elastic form (`elasticPolicy`: minReplicas 1, maxReplicas 2, maxRestarts 3): PET_NNODES=1:2,
  PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT=<job>-worker-0:<port>, PET_MAX_RESTARTS=3,
  PET_NPROC_PER_NODE=2. A failed worker restarts the job's workers within the run.

Both forms: ranks 0-3 node-major, WORLD_SIZE 4 and LOCAL_WORLD_SIZE 2 in every worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.agents import AgentProcess, start_agent, stop_all, write_script
from support.helpers import free_port

# Each worker appends its view of the job; rank 3 fails once, in the run where no marker exists.
PROBE = """
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR", "MASTER_PORT")
record = {k: os.environ.get(k) for k in keys}
record["pod"] = os.environ["POD"]
with open(os.environ["PROBE_OUT"], "a") as f:
    f.write(json.dumps(record) + "\\n")
marker = os.environ["PROBE_OUT"] + ".failed_once"
if record["RANK"] == "3" and not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(7)
"""


def static_pods(port: int) -> dict[str, dict[str, str]]:
    """What the operator gives the Master and Worker pods of `nprocPerNode: "2"`, one replica each."""
    common = {"PYTHONUNBUFFERED": "0", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "WORLD_SIZE": "4"}
    ports = {"MASTER_PORT": str(port), "PET_MASTER_PORT": str(port)}
    return {
        "master-0": {**common, **ports, "MASTER_ADDR": "localhost", "PET_MASTER_ADDR": "localhost", "RANK": "0",
                     "PET_NODE_RANK": "0"},
        "worker-0": {**common, **ports, "MASTER_ADDR": "127.0.0.1", "PET_MASTER_ADDR": "127.0.0.1", "RANK": "1",
                     "PET_NODE_RANK": "1"},
    }  # fmt: skip


def elastic_pods(port: int) -> dict[str, dict[str, str]]:
    """What the operator gives each of two Worker pods under an elasticPolicy (1 to 2 replicas)."""
    env = {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_BACKEND": "c10d",
        "PET_NNODES": "1:2",
        "PET_MAX_RESTARTS": "3",
        "PET_NPROC_PER_NODE": "2",
    }
    return {"worker-0": dict(env), "worker-1": dict(env)}


def run_pods(tmp_path: Path, pods: dict[str, dict[str, str]], attempt: int) -> dict[str, tuple[int, AgentProcess]]:
    """Start one agent per pod (the container's command: `rally probe.py`) and wait for all."""
    probe = write_script(tmp_path, "probe.py", PROBE)
    out = str(tmp_path / "out")
    agents = [
        start_agent(f"{pod}.{attempt}", tmp_path, [str(probe)], env={**env, "POD": pod, "PROBE_OUT": out})
        for pod, env in pods.items()
    ]
    try:
        ended = {}
        for pod, agent in zip(pods, agents, strict=True):
            try:
                ended[pod] = (agent.wait(150), agent)
            except Exception:
                raise AssertionError(f"pod {pod} did not finish:\n{agent.output()}") from None
        return ended
    finally:
        stop_all(agents)


def assert_every_pod_exited(ended: dict[str, tuple[int, AgentProcess]], code: int, why: str) -> None:
    """Every pod's agent exited with `code` (`why` says what it means), its output shown if not."""
    for pod, (got, agent) in ended.items():
        assert got == code, f"pod {pod}: {why}\n{agent.output()}"


def records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out").read_text().splitlines() if line.strip()]


def assert_one_job_of_four(found: list[dict], pods: list[str]) -> None:
    """Ranks 0-3, node-major (the first pod's workers 0-1), each worker seeing the whole job."""
    assert sorted(int(r["RANK"]) for r in found) == [0, 1, 2, 3], found
    for r in found:
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) == ("4", "2"), r
        assert int(r["RANK"]) == 2 * int(r["GROUP_RANK"]) + int(r["LOCAL_RANK"]), r
    by_node = {r["GROUP_RANK"]: r["pod"] for r in found}
    assert sorted(by_node.values()) == sorted(pods) and len(by_node) == 2, found


@pytest.mark.timeout(420)
def test_static_pytorchjob_pods_form_one_job_and_run_again_after_the_kubelet_restarts_them(tmp_path: Path) -> None:
    pods = static_pods(free_port())
    assert_every_pod_exited(run_pods(tmp_path, pods, attempt=0), 7, "the failed rank's code on every pod")
    failed_run = records(tmp_path)
    assert_one_job_of_four(failed_run, list(pods))
    assert {r["pod"] for r in failed_run if r["GROUP_RANK"] == "0"} == {"master-0"}, "PET_NODE_RANK=0 is node 0"
    assert all(r["MASTER_PORT"] == pods["master-0"]["PET_MASTER_PORT"] for r in failed_run), failed_run

    # the kubelet restarts each container, same environment
    assert_every_pod_exited(run_pods(tmp_path, pods, attempt=1), 0, "after its restart")
    rerun = records(tmp_path)[len(failed_run) :]
    assert_one_job_of_four(rerun, list(pods))
    assert all(r["TORCHELASTIC_RESTART_COUNT"] == "0" for r in rerun), "a new container is a new run"


@pytest.mark.timeout(300)
def test_elastic_pytorchjob_pods_form_one_job_and_restart_it_after_a_worker_failure(tmp_path: Path) -> None:
    pods = elastic_pods(free_port())
    assert_every_pod_exited(run_pods(tmp_path, pods, attempt=0), 0, "the job restarted its workers and finished")
    found = records(tmp_path)
    by_restart = {n: [r for r in found if r["TORCHELASTIC_RESTART_COUNT"] == n] for n in ("0", "1")}
    assert len(found) == 8, found
    for attempt in by_restart.values():
        assert_one_job_of_four(attempt, list(pods))
