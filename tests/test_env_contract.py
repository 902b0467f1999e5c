"""Specification: rally gives each worker the environment torchrun 2.13 gives it, key for key.

A probe script writes its whole `os.environ` as JSON, one file per local rank. The same probe
runs under `torchrun --standalone` and `rally --standalone`, and the two are compared.

What is compared, and what is deliberately not:

* Keys the launcher inherited from the test's environment are compared separately: both
  launchers must pass the parent environment through unchanged.
* Of the keys torchrun adds, one is excluded as torchrun-internal:
  - TORCHELASTIC_SIGNALS_TO_HANDLE: torchrun writes `--signals-to-handle` into its *own*
    `os.environ` (`torch/distributed/launcher/api.py`) so that its agent's `PContext.start()`
    can read it back (`elastic/multiprocessing/api.py`). Workers inherit it only as a side
    effect; no worker-side torch code reads it.
* Three keys must differ between any two runs and are compared by shape: MASTER_PORT (a free
  port the OS picked: an int in 1..65535), TORCHELASTIC_RUN_ID (a fresh uuid4 under
  --standalone), TORCHELASTIC_ERROR_FILE (a fresh temp directory; the path ends in
  `<run-id>_<suffix>/attempt_0/<local_rank>/error.json` in both, as the probe resolves it: rally
  hands the path through the run directory it opened, `/proc/<agent pid>/fd/<n>/attempt_0/...`,
  so that no one who can rename entries of --log-dir can redirect the write; see
  docs/security.md).
* Keys rally adds that torchrun does not are allowed only in rally's own RALLY_ namespace.

Only the two comparison runs and one `is_torchelastic_launched()` check import torch in a
worker; everything else uses plain-Python probes.
"""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest

from support.helpers import clean_env, free_port, read_json_files, run_rally, write_probe

TORCHRUN_INTERNAL = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
DIFFERENT_EVERY_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "PROBE_ERROR_FILE_REAL"}

ENV_PROBE = """
    import json, os, sys
    out = os.path.join(sys.argv[1], "env_" + os.environ["LOCAL_RANK"] + ".json")
    real = os.path.realpath(os.environ.get("TORCHELASTIC_ERROR_FILE", ""))  # where it resolves while the job runs
    with open(out, "w") as f:
        json.dump({**os.environ, "PROBE_ERROR_FILE_REAL": real}, f)
"""


def dump_env(
    tmp_path: Path, name: str, launcher_args: list[str], *, env: dict[str, str] | None = None, torchrun: bool = False
) -> dict[int, dict[str, str]]:
    """Run the env probe under rally (or torchrun) and return {local_rank: environ}."""
    probe = write_probe(tmp_path / "env_probe.py", ENV_PROBE)
    out = tmp_path / name
    out.mkdir()
    args = [*launcher_args, str(probe), str(out)]
    argv = [sys.executable, "-m", "torch.distributed.run", *args] if torchrun else None
    result = run_rally(args, cwd=tmp_path, env=env if env is not None else clean_env(), argv=argv, timeout=90)
    assert result.returncode == 0, result.describe()
    dumps = read_json_files(out, "env_*.json")
    return {int(stem.split("_")[1]): environ for stem, environ in dumps.items()}


def assert_port(value: str) -> None:
    assert value.isdigit() and 0 < int(value) < 65536, f"not a port: {value!r}"


def assert_uuid(value: str) -> None:
    assert str(uuid.UUID(value)) == value, f"not a uuid: {value!r}"


def assert_error_file_shape(path: str, run_id: str, local_rank: int) -> None:
    """<log dir>/<run-id>_<suffix>/attempt_0/<local_rank>/error.json"""
    p = Path(path)
    assert p.is_absolute(), path
    assert (p.name, p.parent.name, p.parent.parent.name) == ("error.json", str(local_rank), "attempt_0"), path
    assert p.parents[2].name.startswith(run_id + "_"), f"run directory of {path} is not named <run-id>_*"


@pytest.mark.torch
@pytest.mark.timeout(180)
def test_rally_workers_get_every_variable_torchrun_workers_get(tmp_path: Path) -> None:
    parent = clean_env(OMP_NUM_THREADS=None)
    torchrun = dump_env(tmp_path, "torchrun", ["--standalone", "--nproc-per-node", "2"], env=parent, torchrun=True)
    rally = dump_env(tmp_path, "rally", ["--standalone", "--nproc-per-node", "2"], env=parent)
    assert sorted(torchrun) == sorted(rally) == [0, 1]

    for local_rank in (0, 1):
        t_env, r_env = torchrun[local_rank], rally[local_rank]
        # Both pass the launcher's own environment through unchanged.
        for key, value in parent.items():
            assert t_env.get(key) == value, f"torchrun changed inherited {key}"
            assert r_env.get(key) == value, f"rally changed or dropped inherited {key}: {r_env.get(key)!r} != {value!r}"

        added_by_torchrun = {k for k in t_env if k not in parent} - TORCHRUN_INTERNAL
        assert (
            "RANK" in added_by_torchrun and "TORCHELASTIC_ERROR_FILE" in added_by_torchrun
        )  # the probe saw a real torchrun
        missing = sorted(added_by_torchrun - set(r_env))
        assert not missing, f"local rank {local_rank}: rally does not set {missing}"

        for key in sorted(added_by_torchrun - DIFFERENT_EVERY_RUN):
            assert r_env[key] == t_env[key], (
                f"local rank {local_rank}: {key} is {r_env[key]!r} under rally, {t_env[key]!r} under torchrun"
            )

        for env in (t_env, r_env):
            assert_port(env["MASTER_PORT"])
            assert_uuid(env["TORCHELASTIC_RUN_ID"])
            assert_error_file_shape(env["PROBE_ERROR_FILE_REAL"], env["TORCHELASTIC_RUN_ID"], local_rank)
        assert Path(r_env["TORCHELASTIC_ERROR_FILE"]).parts[-3:] == ("attempt_0", str(local_rank), "error.json")

        extra = sorted(k for k in set(r_env) - set(t_env) - set(parent) if not k.startswith("RALLY_"))
        assert not extra, f"rally adds variables outside its RALLY_ namespace: {extra}"

    # One run, one run id and one master for all its workers.
    assert rally[0]["TORCHELASTIC_RUN_ID"] == rally[1]["TORCHELASTIC_RUN_ID"]
    assert rally[0]["MASTER_PORT"] == rally[1]["MASTER_PORT"]


# The parity pass (.ci/run) runs only (4, "trainer"): the two start their workers alike and differ
# only in the values the agent puts in their environment, which a forked worker takes whole.
# (2, None) was a third case: what it showed beyond these two, OMP_NUM_THREADS=1 for more than one
# worker of the default role, is shown by test_rally_workers_get_every_variable_torchrun_workers_get
# (two workers, no role, every variable torchrun sets compared with torchrun's, that one included).
SIBLING = pytest.mark.same_start_as_a_sibling


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("nproc", "role"), [pytest.param(1, None, marks=SIBLING), (4, "trainer")])
def test_rank_variables_describe_each_worker_of_a_single_node_job(tmp_path: Path, nproc: int, role: str | None) -> None:
    role_args = ["--role", role, "--max-restarts", "3"] if role else []
    envs = dump_env(tmp_path, "out", ["--standalone", "--nproc-per-node", str(nproc), *role_args])
    assert sorted(envs) == list(range(nproc))
    for local_rank, env in envs.items():
        assert env["LOCAL_RANK"] == str(local_rank)
        assert env["RANK"] == str(local_rank)  # one node: global rank == local rank
        assert env["ROLE_RANK"] == str(local_rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == str(nproc)
        assert env["GROUP_RANK"] == "0"
        assert env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == (role or "default")
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == ("3" if role else "0")
    if nproc == 1:
        assert "OMP_NUM_THREADS" not in envs[0], "a single worker keeps the default thread count"
    else:
        assert all(env["OMP_NUM_THREADS"] == "1" for env in envs.values()), "OMP_NUM_THREADS=1 when unset and nproc > 1"


# Same start either way: the script imports torch, so rally's default is the template already.
@pytest.mark.same_start_either_way
@pytest.mark.torch
@pytest.mark.timeout(120)
def test_torch_sees_itself_launched_by_torchelastic(tmp_path: Path) -> None:
    probe = write_probe(
        tmp_path / "launched.py",
        """
        import torch.distributed as dist
        print("is_torchelastic_launched", dist.is_torchelastic_launched())
        """,
    )
    result = run_rally(["--standalone", "--nproc-per-node", "1", probe], cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    assert re.search(r"^\[0\] is_torchelastic_launched True$", result.stdout, re.MULTILINE), result.describe()


# Not in the parity pass (.ci/run): its workers start as test_rank_variables_...[4-trainer]'s (the
# environment probe); how many the agent starts, and its refusal of `gpu` (no worker starts), are
# the agent's, whichever way a worker starts.
@pytest.mark.same_start_as_a_sibling
@pytest.mark.timeout(120)
def test_nproc_auto_and_gpu_count_only_devices_that_exist_whatever_cuda_visible_devices_lists(tmp_path: Path) -> None:
    """As torchrun's determine_local_world_size: on a node without GPUs, `auto` starts one worker
    per CPU torch counts (torch._utils.cpu_count), and `gpu` is an error ("Cuda is not
    available"), even when CUDA_VISIBLE_DEVICES names more devices than that."""
    import torch
    from torch._utils import cpu_count

    if torch.cuda.is_available():
        pytest.skip("the case is a node without GPUs")
    cpus = cpu_count()
    assert cpus
    env = clean_env(CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(cpus + 1)))
    envs = dump_env(tmp_path, "out", ["--standalone", "--nproc-per-node", "auto"], env=env)
    assert sorted(envs) == list(range(cpus)) and envs[0]["WORLD_SIZE"] == str(cpus)
    result = run_rally(["--standalone", "--nproc-per-node", "gpu", "--no-python", "true"], cwd=tmp_path, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.describe()
    errors = [line for line in result.stderr_lines if "rally: error:" in line]
    assert len(errors) == 1 and "gpu: Cuda is not available" in errors[0], result.describe()


# torchrun's single-node launch forms: the default (static) backend named by a run id only, the
# caffe2-era master address/port/node rank, an elastic c10d job of one node out of 1:2 (the
# quoted --rdzv-conf PyTorch's own launcher test passes), and no --nproc-per-node (1 worker).
LAUNCH_FORMS = {
    "rdzv-id-only": lambda port: (["--nnodes=1", "--nproc-per-node=4", "--rdzv-id=job42"], 4),
    "master-port": lambda port: (
        ["--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost", f"--master-port={port}", "--node-rank=0"],
        4,
    ),
    "elastic-one-of-two": lambda port: (
        ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
         "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", "--rdzv-id=job42"],
        4,
    ),
    "default-nproc": lambda port: (["--nnodes=1", "--rdzv-id=job42"], 1),
}  # fmt: skip


# The parity pass (.ci/run) runs only "master-port", the form whose workers' environment differs
# most (MASTER_ADDR and MASTER_PORT as given, run id "none"): the forms differ in how the agent
# forms the job, not in how its workers start.
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "form", [form if form == "master-port" else pytest.param(form, marks=SIBLING) for form in LAUNCH_FORMS]
)
def test_each_single_node_launch_form_runs_every_rank_with_the_parent_environment(tmp_path: Path, form: str) -> None:
    """Each form torchrun accepts starts every rank once, passes the parent's environment through
    and names the run as given; the master-port form serves the job's store on that port. An
    OMP_NUM_THREADS the user set is left alone (rally sets 1 only when it is unset and there is
    more than one worker: four here, but in "default-nproc"); that was a job of its own."""
    port = free_port()
    args, nproc = LAUNCH_FORMS[form](port)
    envs = dump_env(tmp_path, "out", args, env=clean_env(TEST_SENTINEL_PARENT="FOOBAR", OMP_NUM_THREADS="3"))
    assert sorted(envs) == list(range(nproc)), envs.keys()
    for local_rank, env in envs.items():
        assert (env["RANK"], env["WORLD_SIZE"], env["TEST_SENTINEL_PARENT"]) == (str(local_rank), str(nproc), "FOOBAR")
        assert env["OMP_NUM_THREADS"] == "3", env  # the user's, not rally's 1
        assert env["TORCHELASTIC_RUN_ID"] == ("none" if form == "master-port" else "job42")
        if form == "master-port":
            assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("localhost", str(port)), env
