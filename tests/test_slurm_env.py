"""launcher.schedulers.slurm: host lists and SlurmJob, from fabricated SLURM environments (no cluster).

The srun, batch and salloc environments below are the ones measured on the dev
cluster (/work/shared/slurm-dev-cluster/NOTES.md and a salloc run on
slurm/devcluster.sh), trimmed of nothing that SlurmJob reads.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from rally.launcher.schedulers import slurm
from rally.launcher.schedulers.slurm import SlurmJob, expand_hostlist, first_host, hostnames

pytestmark = pytest.mark.timeout(30)

# `env | grep ^SLURM` of task 0 of `srun --nodes=2 --ntasks-per-node=1` (NOTES.md).
SRUN_TASK0 = {
    "SLURMD_NODENAME": "node1",
    "SLURM_CLUSTER_NAME": "devcluster",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SLURM_CPUS_ON_NODE": "1",
    "SLURM_GTIDS": "0",
    "SLURM_JOBID": "9",
    "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
    "SLURM_JOB_GID": "0",
    "SLURM_JOB_ID": "9",
    "SLURM_JOB_NAME": "bash",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_JOB_UID": "0",
    "SLURM_JOB_USER": "root",
    "SLURM_LABELIO": "1",
    "SLURM_LAUNCH_NODE_IPADDR": "10.250.0.1",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_PROCID": "0",
    "SLURM_SRUN_COMM_HOST": "10.250.0.1",
    "SLURM_SRUN_COMM_PORT": "37581",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_LAUNCHER_PORT": "37581",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_SUBMIT_DIR": "/tmp/sl/v",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "10033",
    "SLURM_TOPOLOGY_ADDR": "node1",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
    "SLURM_UMASK": "0022",
    "SLURM_WORKING_CLUSTER": "devcluster:10.250.0.1:6817:9728:109",
}
# Task 1 "differs only in" these (NOTES.md).
SRUN_TASK1 = SRUN_TASK0 | {
    "SLURMD_NODENAME": "node2",
    "SLURM_GTIDS": "1",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_TASK_PID": "10034",
    "SLURM_TOPOLOGY_ADDR": "node2",
}
# The batch shell of a 2-node sbatch job (NOTES.md): no step variables.
BATCH_SHELL = {
    "SLURMD_NODENAME": "node1",
    "SLURM_CLUSTER_NAME": "devcluster",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "SLURM_CPUS_ON_NODE": "1",
    "SLURM_GTIDS": "0",
    "SLURM_JOBID": "10",
    "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
    "SLURM_JOB_ID": "10",
    "SLURM_JOB_NAME": "e.sh",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_NODE_ALIASES": "(null)",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_SUBMIT_DIR": "/tmp/sl/v",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASK_PID": "10079",
    "SLURM_TOPOLOGY_ADDR": "node1",
    "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
}
# A task of `srun` inside that batch script additionally has (NOTES.md):
BATCH_STEP_TASK0 = BATCH_SHELL | {
    "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_LAUNCH_NODE_IPADDR": "10.250.0.11",
    "SLURM_SRUN_COMM_HOST": "10.250.0.11",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}
# `salloc -N2 env` on slurm/devcluster.sh: the shell runs on the login host.
SALLOC_SHELL = {
    "SLURM_CLUSTER_NAME": "rallydev",
    "SLURM_JOBID": "3",
    "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
    "SLURM_JOB_ID": "3",
    "SLURM_JOB_NAME": "interactive",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_PARTITION": "debug",
    "SLURM_NNODES": "2",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_NODE_ALIASES": "(null)",
    "SLURM_SUBMIT_DIR": "/work/main",
    "SLURM_SUBMIT_HOST": "vm",
    "SLURM_TASKS_PER_NODE": "1(x2)",
}


def job(environ: dict[str, str]) -> SlurmJob:
    """from_env with the pure parser, so no test depends on an installed scontrol."""
    found = SlurmJob.from_env(environ, expand=expand_hostlist)
    assert found is not None
    return found


# ------------------------------------------------------------------ host lists


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[1-2],gpu7,x[3-4]", ["n1", "n2", "gpu7", "x3", "x4"]),
        # several bracket groups: every combination, the leftmost slowest (as scontrol 22.05 prints)
        ("a[1-2]-b[3,5]", ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]),
        ("r[1-2]n[01-02]s", ["r1n01s", "r1n02s", "r2n01s", "r2n02s"]),
        ("[1-2]x", ["1x", "2x"]),
        ("n[3]", ["n3"]),
        ("n[1, 3]", ["n1", "n3"]),
        ("b,a,b", ["b", "a", "b"]),  # order and duplicates as written
        ("a,,b", ["a", "b"]),
        ("x y\tz", ["x", "y", "z"]),
        ("", []),
    ],
)
def test_expand_hostlist_follows_slurm_syntax(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node[1-2", r"'\[' is never closed"),
        ("node1-2]", r"'\]' without '\['"),
        ("n[[1-2]]", r"nested '\['"),
        ("node[4-2]", r"reversed range '4-2' \(4 > 2\)"),
        ("node[]", "empty brackets"),
        ("node[a-b]", r"'a-b' is not a number or a range N-M"),
        ("node[1-2-3]", "is not a number"),
        ("node[1,,2]", "is not a number"),
        ("ok[1-2],bad[3-1]", r"in 'bad\[3-1\]'"),
    ],
)
def test_expand_hostlist_rejects_malformed_lists_readably(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        expand_hostlist(text)
    assert repr(text) in str(caught.value)  # the whole list is quoted, for context


def fake_scontrol(directory: Path, body: str) -> None:
    """Put an executable `scontrol` with the given sh body in ``directory``."""
    path = directory / "scontrol"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_hostnames_prefers_scontrol_when_it_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_scontrol(tmp_path, '[ "$1 $2 $3" = "show hostnames node[1-2]" ] && echo "scontrol-says-$1-$2"; echo second')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hostnames("node[1-2]") == ["scontrol-says-show-hostnames", "second"]
    assert first_host("node[1-2]") == "scontrol-says-show-hostnames"


@pytest.mark.parametrize(
    "body",
    [
        "echo 'fatal: no config' >&2; exit 1",  # no slurm.conf (e.g. outside the cluster)
        "exit 0",  # scontrol 22.05 on a list it cannot parse: nothing, status 0
        "echo 'node]'",  # ... or fragments
    ],
)
def test_hostnames_falls_back_to_the_parser_when_scontrol_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    fake_scontrol(tmp_path, body)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hostnames("node[1-2]") == ["node1", "node2"]
    with pytest.raises(ValueError, match="never closed"):
        hostnames("node[1-2")


def test_hostnames_falls_back_when_scontrol_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_scontrol(tmp_path, "exec /bin/sleep 20")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(slurm, "SCONTROL_TIMEOUT_S", 0.3)
    assert first_host("gpu[07-08]") == "gpu07"


def test_first_host_uses_the_parser_without_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no scontrol
    assert first_host("rack[2-3]-n[5,1]") == "rack2-n5"
    with pytest.raises(ValueError, match="names no host"):
        first_host(",")


# ----------------------------------------------------------- SlurmJob detection


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"HOME": "/root", "PATH": "/usr/bin"},
        SALLOC_SHELL,  # runs on the submit host, which is not one of the job's nodes
        {"SLURM_NODEID": "0"},  # a stray variable without a job
    ],
    ids=["empty", "no-slurm", "salloc-shell", "no-job-id"],
)
def test_from_env_is_none_outside_a_slurm_node(environ: dict[str, str]) -> None:
    assert SlurmJob.from_env(environ, expand=expand_hostlist) is None


def test_srun_tasks_of_one_step_agree_on_everything_but_their_rank() -> None:
    task0, task1 = job(SRUN_TASK0), job(SRUN_TASK1)
    assert (task0.node_rank, task1.node_rank) == (0, 1)
    assert dataclasses.replace(task1, node_rank=0, node_name=task0.node_name) == task0
    assert task0.job_id == "9" and task0.step_id == 0 and task0.in_step
    assert task0.run_id == "9.0"
    assert task0.nnodes == 2
    assert task0.hosts == ("node1", "node2") and task0.nodelist == "node[1-2]"
    assert task0.store_host == "node1"
    assert task0.store_port == task1.store_port
    assert task0.restart_count == 0
    assert task0.cpus_on_node == 1 and task0.gpus_on_node is None


def test_batch_shell_is_the_job_without_a_step() -> None:
    shell = job(BATCH_SHELL)
    assert shell.step_id is None and not shell.in_step
    assert shell.run_id == "10"
    assert (shell.nnodes, shell.node_rank, shell.store_host) == (2, 0, "node1")


def test_a_step_inside_a_batch_job_gets_its_own_run_id_and_port() -> None:
    shell, step = job(BATCH_SHELL), job(BATCH_STEP_TASK0)
    assert step.run_id == "10.0" != shell.run_id
    assert step.store_port != shell.store_port


def test_two_steps_of_one_job_never_share_a_rendezvous() -> None:
    first = job(SRUN_TASK0)
    second = job(SRUN_TASK0 | {"SLURM_STEP_ID": "1", "SLURM_STEPID": "1"})
    assert (first.run_id, second.run_id) == ("9.0", "9.1")
    assert first.store_port != second.store_port


def test_old_step_variable_name_is_understood() -> None:
    environ = {k: v for k, v in SRUN_TASK0.items() if k != "SLURM_STEP_ID"}
    assert job(environ).step_id == 0


@pytest.mark.parametrize("special", ["4294967290", "4294967291", "4294967292"])
def test_slurms_special_steps_count_as_no_step(special: str) -> None:
    assert job(BATCH_SHELL | {"SLURM_STEP_ID": special}).run_id == "10"


def test_restart_count_comes_from_slurm_restart_count() -> None:
    shell = job(BATCH_SHELL | {"SLURM_RESTART_COUNT": "2"})
    assert shell.restart_count == 2
    assert shell.run_id == "10"  # a requeued job keeps its rendezvous id


def test_step_node_count_and_list_win_inside_a_step() -> None:
    # srun -N1 inside a 3-node allocation: the step has 1 node, the job 3
    environ = SRUN_TASK0 | {
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_NNODES": "3",
        "SLURM_STEP_NODELIST": "node2",
        "SLURM_STEP_NUM_NODES": "1",
    }
    step = job(environ)
    assert (step.nnodes, step.hosts, step.store_host) == (1, ("node2",), "node2")


def test_job_node_count_and_list_are_used_outside_a_step() -> None:
    environ = BATCH_SHELL | {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_NUM_NODES": "3"}
    del environ["SLURM_NNODES"]
    shell = job(environ)
    assert (shell.nnodes, shell.store_host) == (3, "gpu07")


def test_node_count_defaults_to_the_number_of_hosts() -> None:
    environ = {k: v for k, v in SRUN_TASK0.items() if "NUM_NODES" not in k and k != "SLURM_NNODES"}
    assert job(environ).nnodes == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_NODEID": "two"}, "SLURM_NODEID='two' is not an integer"),
        ({"SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is outside 0\.\.1"),
        ({"SLURM_STEP_NUM_NODES": "0"}, "node count 0 is not positive"),
        ({"SLURM_STEP_NODELIST": "node[2-1]"}, "reversed range"),
        ({"SLURM_CPUS_ON_NODE": "4x"}, "SLURM_CPUS_ON_NODE"),
    ],
)
def test_inconsistent_slurm_environment_raises_a_readable_error(change: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SlurmJob.from_env(SRUN_TASK0 | change, expand=expand_hostlist)


def test_missing_node_list_is_an_error() -> None:
    environ = {k: v for k, v in SRUN_TASK0.items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is not set"):
        SlurmJob.from_env(environ, expand=expand_hostlist)


def test_from_env_expands_with_scontrol_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_scontrol(tmp_path, "echo headnode; echo othernode")
    monkeypatch.setenv("PATH", str(tmp_path))
    found = SlurmJob.from_env(SRUN_TASK0)
    assert found is not None and found.store_host == "headnode"


def test_slurm_job_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        job(SRUN_TASK0).node_rank = 1  # type: ignore[misc]


# ---------------------------------------------------------------- store port


def test_store_port_stays_in_its_documented_range() -> None:
    low, high = slurm.STORE_PORT_BASE, slurm.STORE_PORT_BASE + slurm.STORE_PORT_SPAN
    assert (low, high) == (15000, 29000)
    for job_id in ("1", "9", "4294967295", "123456789012", "abc_12"):
        for step in (None, 0, 1, 77):
            port = dataclasses.replace(job(SRUN_TASK0), job_id=job_id, step_id=step).store_port
            assert low <= port < high
            assert not 32768 <= port <= 60999  # Linux's default ephemeral range
            assert port not in (29400, 29500)  # torch's defaults


def test_store_port_is_deterministic_and_differs_for_nearby_jobs_and_steps() -> None:
    base = job(SRUN_TASK0)
    assert base.store_port == job(dict(SRUN_TASK0)).store_port
    ports = {}
    for job_id in range(100_000, 100_500):  # jobs submitted close together may share a node
        for step in (None, 0, 1, 2, 3):
            port = dataclasses.replace(base, job_id=str(job_id), step_id=step).store_port
            assert port not in ports, f"{job_id}.{step} collides with {ports[port]}"
            ports[port] = f"{job_id}.{step}"


# ------------------------------------------------------------- GPUs and nproc


@pytest.mark.parametrize(
    ("extra", "gpus", "source"),
    [
        ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0"}, 4, "SLURM_GPUS_ON_NODE"),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2", "SLURM_STEP_GPUS": "0"}, 3, "CUDA_VISIBLE_DEVICES"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5a1b,GPU-77c2"}, 2, "CUDA_VISIBLE_DEVICES"),
        ({"SLURM_STEP_GPUS": "2,3"}, 2, "SLURM_STEP_GPUS"),
        ({"SLURM_JOB_GPUS": "0"}, 1, "SLURM_JOB_GPUS"),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0, "CUDA_VISIBLE_DEVICES"),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0, "CUDA_VISIBLE_DEVICES"),
        ({}, None, None),
    ],
)
def test_gpus_on_node(extra: dict[str, str], gpus: int | None, source: str | None) -> None:
    found = job(SRUN_TASK0 | extra)
    assert (found.gpus_on_node, found.gpus_source) == (gpus, source)


def test_nproc_auto_is_one_per_gpu_when_there_are_gpus() -> None:
    found = job(SRUN_TASK0 | {"SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "64"})
    assert found.nproc_auto() == 8
    assert found.nproc_auto_with_source() == (8, "SLURM_GPUS_ON_NODE")


def test_nproc_auto_uses_slurm_cpus_without_gpus() -> None:
    found = job(SRUN_TASK0 | {"SLURM_CPUS_ON_NODE": "6", "CUDA_VISIBLE_DEVICES": ""})
    assert found.nproc_auto_with_source() == (6, "SLURM_CPUS_ON_NODE")


def test_nproc_auto_falls_back_to_the_machines_cpus() -> None:
    environ = {k: v for k, v in SRUN_TASK0.items() if k != "SLURM_CPUS_ON_NODE"}
    assert job(environ).nproc_auto_with_source() == (os.cpu_count(), "os.cpu_count()")


# ------------------------------------------------------------------ describe


def test_describe_is_one_line_naming_what_was_taken_from_slurm() -> None:
    found = job(SRUN_TASK0 | {"SLURM_CPUS_ON_NODE": "2"})
    line = found.describe(["nnodes", "node_rank", "rdzv_id", "rdzv_endpoint", "nproc_per_node"])
    assert line == (
        f"SLURM job 9.0: 2 nodes (node[1-2]), this is node 0, store node1:{found.store_port}, "
        "nproc 2 from SLURM_CPUS_ON_NODE"
    )
    assert "\n" not in line


def test_describe_leaves_out_what_came_from_elsewhere() -> None:
    found = job(SRUN_TASK1)
    assert found.describe(["node-rank", "rdzv-endpoint"]) == (
        f"SLURM job 9.0: this is node 1, store node1:{found.store_port}"
    )
    assert found.describe([]) == "SLURM job 9.0: nothing taken from it"


def test_describe_mentions_restarts_and_warns_in_a_multi_node_batch_shell() -> None:
    line = job(BATCH_SHELL | {"SLURM_RESTART_COUNT": "1"}).describe(["nnodes"])
    assert line.startswith("SLURM job 10 (restart 1): 2 nodes (node[1-2])")
    assert "use: srun rally" in line


def test_describe_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown keys \\['nproc'\\]"):
        job(SRUN_TASK0).describe(["nproc"])
