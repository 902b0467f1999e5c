"""rally as SLURM users run it, on the real 3-node dev cluster (tests/support/slurm_cluster.py).

    a. `srun -N2 rally --nproc-per-node 2 ddp.py` without rendezvous flags: one job of 4, node-major
    b. a worker failure on node 2 restarts the workers of both nodes (--max-restarts 1)
       (one job shows both: its restart is the job of 4 of (a))
    c. --nnodes 2:3 on 3 nodes: a whole node dies (every process of its namespace, slurmd
       included) and the other two go on without it
    d. slurm/elastic-requeue.sbatch: SIGUSR1 to the batch shell -> workers checkpoint -> rally
       requeues the job -> the second run resumes and ends bit-identical to an uninterrupted run
    e. slurm/train.sbatch, the script docs/slurm.md shows, submitted as written (`sbatch
       train.sbatch`: 2 nodes x 8 GPUs, the dev cluster's GPUs are a GRES count without devices):
       16 workers, the warning, requeue, resume; the lines the page shows are lines it printed
    plus one cheap (torch-free) run of slurm/single-node.sbatch and slurm/multi-node.sbatch each.

Workers that import torch cost ~2 s of CPU each and the cluster runs 3 nodes x 4 "CPUs" on 2
real cores, so only (a, b) and (d) import torch, each with as few workers as the check needs.

Every job a test starts carries a job name unique to the test (or, for a script submitted as
written, is remembered by its id); the `jobs` fixture cancels whatever still carries it and waits
until SLURM has forgotten it, and kills the srun processes the test started, whatever the outcome.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from support.ddp_reference import params_hash
from support.helpers import start_rally, wait_for
from test_snippets import blocks_of, missing_lines

if TYPE_CHECKING:  # the fixture comes from the slurm_cluster plugin (tests/conftest.py)
    from support.slurm_cluster import SlurmCluster

pytest_plugins = ["support.slurm_cluster"]
pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "support" / "slurm_scripts"
PROBE = SCRIPTS / "probe.py"
DDP = SCRIPTS / "ddp.py"
TRAIN = REPO / "examples" / "train.py"
TEMPLATES = REPO / "slurm"
SLURM_PAGE = REPO / "docs" / "slurm.md"

# The `rally` console script of this interpreter: what `srun rally ...` runs on the nodes.
RALLY = str(Path(sys.executable).with_name("rally")) if Path(sys.executable).with_name("rally").exists() else "rally"

# Variables that configure a launcher or describe a job: never passed from this process into a
# job under test (the login wrapper sets SLURM_CONF itself).
_JOB_PREFIXES = ("RALLY_", "PET_", "TORCHELASTIC_", "SLURM_")
_JOB_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
}  # fmt: skip

# How often a test polls squeue for a job's state.
POLL_S = 0.2
CREDENTIAL_SECOND_S = 2.0  # after a requeue, before releasing the job (Jobs.release_requeued)

# srun -l puts "<task>: " before every line of the task's output.
LABEL = re.compile(r"^\s*(\d+): ", re.MULTILINE)


def job_env(cluster: SlurmCluster, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in cluster.task_env().items() if k not in _JOB_VARS and not k.startswith(_JOB_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not: this machine's pid 1 reaps lazily)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def task_lines(text: str, task: int) -> list[str]:
    """The lines srun -l labelled with ``task``, without the label."""
    prefix = re.compile(rf"^\s*{task}: ")
    return [prefix.sub("", line) for line in text.splitlines() if prefix.match(line)]


def probe_records(text: str) -> list[dict]:
    """The JSON records tests/support/slurm_scripts/probe.py printed (after any srun/rally prefixes)."""
    return [json.loads(line.split("PROBE ", 1)[1]) for line in text.splitlines() if "PROBE {" in line]


def ddp_results(text: str) -> list[dict[str, str]]:
    """The RESULT lines of tests/support/slurm_scripts/ddp.py as dicts of strings."""
    lines = [line.split("RESULT ", 1)[1] for line in text.splitlines() if "RESULT rank=" in line]
    return [dict(kv.split("=", 1) for kv in line.split()) for line in lines]


@dataclass
class Srun:
    """An srun started on the login host, its output (stdout and stderr, labelled) in a file."""

    popen: subprocess.Popen
    out: Path

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"srun still running after {timeout:g} s; output so far:\n{self.text()}") from None


@dataclass
class Jobs:
    """Starts this test's jobs under one job name and cleans all of them up afterwards."""

    cluster: SlurmCluster
    name: str
    tmp: Path
    sruns: list[Srun] = field(default_factory=list)
    jids: list[str] = field(default_factory=list)  # jobs submitted as written, under their own name

    def srun(self, args: Sequence[str], *, tag: str = "srun", env: Mapping[str, str] | None = None) -> Srun:
        out = self.tmp / f"{tag}.out"
        handle = open(out, "wb")  # owned by the child
        popen = subprocess.Popen(
            [self.cluster.login_exec, "srun", f"--job-name={self.name}", "-l", *args],
            cwd=REPO,
            env=job_env(self.cluster, env),
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        run = Srun(popen, out)
        self.sruns.append(run)
        return run

    def sbatch(
        self, template: Path, *args: str, script_args: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> str:
        """Submit ``template`` itself (not a copy) with extra sbatch ``args``; return the job id."""
        done = subprocess.run(
            [
                self.cluster.login_exec, "sbatch", "--parsable", f"--job-name={self.name}", f"--chdir={REPO}",
                f"--output={self.tmp}/job-%j.out", *args, str(template), *script_args,
            ],
            cwd=REPO, env=job_env(self.cluster, env), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, f"sbatch failed ({done.returncode}): {done.stderr}"
        return done.stdout.strip().split(";")[0]

    def sbatch_as_written(self, script: Path, submit_dir: Path, env: Mapping[str, str] | None = None) -> str:
        """`sbatch SCRIPT` run in ``submit_dir``, no option added: the script's own name, output
        file and working directory (the submit directory) hold. Return the job id."""
        done = subprocess.run(
            [self.cluster.login_exec, "sbatch", "--parsable", str(script)],
            cwd=submit_dir, env=job_env(self.cluster, env), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, f"sbatch failed ({done.returncode}): {done.stderr}"
        jid = done.stdout.strip().split(";")[0]
        self.jids.append(jid)
        return jid

    def output(self, jobid: str) -> str:
        path = self.tmp / f"job-{jobid}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def show_job(self, jobid: str) -> dict[str, str]:
        """`scontrol show job` as a dict (SLURM keeps finished jobs for MinJobAge = 300 s)."""
        done = self.cluster.run_login(["scontrol", "show", "job", "-o", jobid], timeout=10, check=True)
        return dict(word.split("=", 1) for word in done.stdout.split() if "=" in word)

    def release_requeued(self, jobid: str, started_again: Callable[[], bool], timeout: float) -> None:
        """Let the requeued ``jobid`` start again soon: SLURM gives a requeued job a begin time
        cred_expire ahead (the dev cluster's 10 s: requeued at :23, eligible at :34), a wait that
        shows nothing of rally's; ``StartTime=now`` ends it. Done once the job is PENDING (every
        process of the first run is gone) and CREDENTIAL_SECOND_S later: the nodes' slurmd revoked
        the first run's credential, and refuse a new one made within the same second of the
        revocation (credential times are whole seconds): "Killing non-startable batch JobId=1: Job
        credential revoked", the requeued job FAILED at once, in 3 of 9 runs released at PENDING.
        Nothing to do once ``started_again()``."""
        deadline = time.monotonic() + timeout
        while (state := self.cluster.job_state(jobid)) != "PENDING":
            if started_again() or not state:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} not PENDING for its requeue after {timeout}s (state: {state})")
            time.sleep(POLL_S)
        time.sleep(CREDENTIAL_SECOND_S)
        self.cluster.run_login(["scontrol", "update", f"JobId={jobid}", "StartTime=now"], timeout=10, check=True)

    def cancel(self) -> None:
        """scancel every job of this test (without waiting)."""
        self.cluster.run_login(["scancel", "-n", self.name], timeout=10)
        if self.jids:
            self.cluster.run_login(["scancel", *self.jids], timeout=10)

    def ours(self) -> list[str]:
        done = self.cluster.run_login(["squeue", "-h", "-n", self.name, "-o", "%A"], timeout=10)
        left = done.stdout.split()
        for jid in self.jids:  # one at a time: squeue fails on the whole list once SLURM forgot one
            left += [jid] if self.cluster.job_state(jid) else []
        return left

    def cleanup(self) -> None:
        left = self.ours()
        if left:
            self.cancel()
        for run in self.sruns:
            if run.popen.poll() is None:
                try:  # srun leaves after the cancel; if not, kill it (its step is cancelled already)
                    run.popen.wait(15 if left else 2)
                except subprocess.TimeoutExpired:
                    os.killpg(run.popen.pid, signal.SIGKILL)
                    run.popen.wait(10)
        wait_for(lambda: not self.ours(), 90, 0.2, f"jobs named {self.name} to be gone")


@pytest.fixture
def jobs(slurm_cluster: SlurmCluster, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Jobs]:
    tracker = Jobs(slurm_cluster, f"rt{os.getpid()}-{request.node.name[5:40]}", tmp_path)
    try:
        yield tracker
    finally:
        tracker.cleanup()


# --------------------------------------------------------------------------------- a, b: srun


# One job proves both (a) and (b), so that the torch workers start once: the first attempt fails
# on node 2 (b), and the restart is the whole job of (a), a world of 4 formed from SLURM alone.
@pytest.mark.torch
@pytest.mark.timeout(240)
def test_srun_two_nodes_without_rendezvous_flags_forms_one_job_and_a_failure_on_node2_restarts_both(
    jobs: Jobs,
) -> None:
    run = jobs.srun(
        [
            "-N2",
            "--ntasks-per-node=1",
            RALLY,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            str(DDP),
            "fail-on-node2",
        ],
        tag="ddp-restart",
    )
    code = run.wait(200)
    text = run.text()
    assert code == 0, text
    # First attempt: rank 2 (local rank 0 on node2) exited 7, and nobody reached the all_reduce.
    starts = re.findall(r"START rank=(\d) host=(node\d) restart=(\d)", text)
    assert sorted(starts) == sorted(
        [(str(r), f"node{1 + r // 2}", "0") for r in range(4)] + [(str(r), f"node{1 + r // 2}", "1") for r in range(4)]
    ), text
    # (a) The restart is one job of 4 over both nodes: one all_reduce, ranks node-major.
    results = sorted(ddp_results(text), key=lambda r: int(r["rank"]))
    assert [r["rank"] for r in results] == ["0", "1", "2", "3"], text
    assert {r["world"] for r in results} == {"4"}
    assert {r["restart"] for r in results} == {"1"} and {r["sum"] for r in results} == {"6"}  # 0+1+2+3
    assert [r["host"] for r in results] == ["node1", "node1", "node2", "node2"]  # node-major
    # Both agents took everything from SLURM: one run id <job>.0, the store on node1.
    for task in (0, 1):
        lines = "\n".join(task_lines(text, task))
        assert re.search(rf"SLURM job \d+\.0: 2 nodes \(node\[1-2\]\), this is node {task}, store node1:\d+", lines), (
            text
        )
        assert f"ranks {2 * task}-{2 * task + 1} of 4" in lines
        assert "job succeeded: 4 workers on 2 nodes" in lines
        # (b) each node's agent saw the same root cause and went round once
        assert "root cause: rank 2 (local rank 0" in lines and "on node2 failed with exit code 7" in lines, text
        assert "restarting all workers (restart 1 of 1)" in lines
        assert re.search(rf"round \d+: node {task} of 2, ranks .* restart 1/1", lines), lines
    assert "hosting the rendezvous store" in "\n".join(task_lines(text, 0))


# ------------------------------------------------------------------------------ c: a node dies


@pytest.mark.timeout(240)
def test_elastic_job_on_three_nodes_goes_on_with_two_when_a_node_dies(jobs: Jobs, slurm_cluster: SlurmCluster) -> None:
    # --no-kill: without it SLURM cancels the whole job "DUE TO NODE FAILURE" once it notices the
    # dead node (SlurmdTimeout, ~40 s here), survivors included. --kill-on-bad-exit=0: the lost
    # task's failure does not make srun kill the others. The bash wrapper reports each rally's
    # exit code (no signals are sent to this step, so the wrapper cannot be killed by one).
    rdzv_conf = "keep_alive_interval=0.2,keep_alive_timeout=2,last_call_timeout=1"
    rally = f"{RALLY} --nnodes 2:3 --nproc-per-node 1 --rdzv-conf {rdzv_conf} {PROBE} until-world 2"
    run = jobs.srun(
        ["-N3", "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0",
         "bash", "-c", f'{rally}; echo "TASK-EXIT node=$SLURMD_NODENAME rc=$?"'],
        tag="elastic",
    )  # fmt: skip
    wait_for(lambda: len(probe_records(run.text())) >= 3, 120, 0.2, "3 workers of the first round", run.text)
    first = probe_records(run.text())
    assert {r["WORLD_SIZE"] for r in first} == {"3"} and {r["host"] for r in first} == {"node1", "node2", "node3"}
    assert "hosting the rendezvous store" in "\n".join(task_lines(run.text(), 0))  # node1; node3 is not special

    victim = "node3"
    pids = slurm_cluster.node_pids(victim)
    comms = {Path(f"/proc/{p}/comm").read_text().strip() for p in pids if Path(f"/proc/{p}/comm").exists()}
    assert {"slurmd", "slurmstepd"} <= comms, comms
    try:
        for pid in pids:  # the node "crashes": slurmd, slurmstepd, rally, its workers, all at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        exits = lambda: re.findall(r"TASK-EXIT node=(node\d) rc=(\d+)", run.text())  # noqa: E731
        wait_for(lambda: len(exits()) >= 2, 90, 0.2, "the two surviving nodes to finish", run.text)
        text = run.text()
        assert sorted(exits()) == [("node1", "0"), ("node2", "0")], text
        second = [r for r in probe_records(text) if r["WORLD_SIZE"] == "2"]
        assert sorted((r["RANK"], r["host"]) for r in second) == [("0", "node1"), ("1", "node2")], text
        assert {r["TORCHELASTIC_RESTART_COUNT"] for r in second} == {"0"}  # a lost node is no restart
        assert text.count("PROBE-DONE") == 2
        for task in (0, 1):
            assert "node 2 (node3) was lost: it sent no keep-alive" in "\n".join(task_lines(text, task)), text
        assert not [pid for pid in pids if alive(pid)]
        # SLURM has not noticed yet (SlurmdTimeout): srun still waits for node3's task. Left alone
        # it would report "Node failure on node3" after ~40 s and exit 0 (--no-kill); a slurmd
        # restarted before that never reports the task, and srun would wait forever. So: cancel.
        assert run.popen.poll() is None
    finally:
        # After scancel the job stays COMPLETING until node3's slurmd answers again (or SLURM
        # marks node3 down, ~40 s); the repair restarts that slurmd, the job ends at once and
        # every node is idle again. The jobs fixture then waits for the job to be gone.
        jobs.cancel()
        slurm_cluster.repair()


# ------------------------------------------------------------------- d: preempt, requeue, resume


def checkpoint_steps(directory: Path) -> list[int]:
    return sorted(
        int(m.group(1)) for p in directory.glob("step_*.pt") if (m := re.fullmatch(r"step_(\d+)\.pt", p.name))
    )


@pytest.mark.torch
@pytest.mark.timeout(420)
def test_elastic_requeue_template_checkpoints_requeues_and_resumes_bit_identical(jobs: Jobs, tmp_path: Path) -> None:
    # Preempted after step 10 (about 2 s in), so the requeued run trains about 13 steps more.
    train_args = ["--steps", "25", "--checkpoint-every", "5", "--step-time", "0.2"]
    # The uninterrupted reference, at the same world size (2), on this host with --standalone;
    # it runs while the cluster job does (determinism does not depend on timing).
    reference = start_rally(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            str(TRAIN),
            *train_args,
            "--checkpoint-dir",
            str(tmp_path / "reference"),
        ],
        cwd=REPO,
        env=job_env(jobs.cluster),
        stderr=subprocess.STDOUT,
    )
    try:
        ckpt = tmp_path / "ckpt"
        jid = jobs.sbatch(
            TEMPLATES / "elastic-requeue.sbatch", "--nodes=2",
            script_args=[str(TRAIN), *train_args],
            env={
                "RALLY_CMD": RALLY, "RALLY_NPROC": "1", "RALLY_CHECKPOINT_DIR": str(ckpt),
                # 2:2 here: with MIN below MAX a slow second node (this machine is oversubscribed)
                # could miss the first round, and a world of 1 would train differently.
                "RALLY_MIN_NODES": "2", "RALLY_PREEMPTION_GRACE": "30",
            },
        )  # fmt: skip
        out = lambda: jobs.output(jid)  # noqa: E731
        wait_for(lambda: any(s >= 10 for s in checkpoint_steps(ckpt)), 200, 0.2, "a checkpoint at step >= 10", out)
        assert "SLURM_RESTART_COUNT=0" in out()

        # What --signal=B:USR1@90 does before the time limit: SIGUSR1 to the batch shell only.
        jobs.cluster.run_login(["scancel", "--signal=USR1", "--batch", jid], timeout=10, check=True)
        jobs.release_requeued(jid, lambda: "SLURM_RESTART_COUNT=1" in out(), 120)
        wait_for(lambda: "SLURM_RESTART_COUNT=1" in out(), 120, 0.2, "the requeued run to start", out)
        jobs.cluster.wait_job_gone(jid, timeout=240)
        text = out()

        first, second = text.split("SLURM_RESTART_COUNT=1", 1)
        assert "batch shell: got SIGUSR1" in first, text
        assert "received SIGUSR1 (preemption or time limit)" in first
        stopped = re.search(r"preempted at step (\d+): checkpoint saved, exiting", first)
        assert stopped, first
        assert f"requeued SLURM job {jid}" in first
        assert "no checkpoint, starting from scratch" in first
        resumed = re.search(r"resuming from step (\d+)", second)
        assert resumed, second
        assert int(resumed.group(1)) == int(stopped.group(1)) > 0  # the preemption checkpoint itself
        assert "step 25 loss" in second and "srun exited 0 (SLURM_RESTART_COUNT=1)" in second

        job = jobs.show_job(jid)
        assert (job["JobState"], job["Restarts"], job["ExitCode"]) == ("COMPLETED", "1", "0:0"), job

        ref_out, _ = reference.communicate(timeout=180)
        assert reference.returncode == 0, ref_out[-3000:]
        assert params_hash(second) == params_hash(ref_out)
    finally:
        if reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.communicate()


# --------------------------------------------------------------- the other templates (no torch)


@pytest.mark.timeout(180)
def test_single_node_template_takes_nproc_from_the_cpus_slurm_gave(jobs: Jobs) -> None:
    jid = jobs.sbatch(
        TEMPLATES / "single-node.sbatch", "--cpus-per-task=2", script_args=[str(PROBE), "ok"], env={"RALLY_CMD": RALLY}
    )
    jobs.cluster.wait_job_gone(jid, timeout=150)
    text = jobs.output(jid)
    records = probe_records(text)
    assert sorted(r["RANK"] for r in records) == ["0", "1"], text  # nproc auto = SLURM_CPUS_ON_NODE = 2
    assert {(r["WORLD_SIZE"], r["host"]) for r in records} == {("2", "node1")}
    taken = rf"SLURM job {jid}\.0: 1 node \(node1\), this is node 0, store node1:\d+, nproc 2 from SLURM_CPUS_ON_NODE"
    assert re.search(taken, text), text
    assert "rally exited 0" in text
    assert jobs.show_job(jid)["ExitCode"] == "0:0"


@pytest.mark.timeout(180)
def test_multi_node_template_runs_node_major_and_ends_with_the_workers_exit_code(jobs: Jobs) -> None:
    jid = jobs.sbatch(
        TEMPLATES / "multi-node.sbatch", "--nodes=2",
        env={"RALLY_CMD": RALLY, "RALLY_SCRIPT": str(PROBE), "RALLY_ARGS": "exit-rank 3 3", "RALLY_NPROC": "2"},
    )  # fmt: skip
    jobs.cluster.wait_job_gone(jid, timeout=150)
    text = jobs.output(jid)
    records = probe_records(text)
    placed = sorted((r["RANK"], r["host"]) for r in records)
    assert placed == [("0", "node1"), ("1", "node1"), ("2", "node2"), ("3", "node2")], text
    assert {r["WORLD_SIZE"] for r in records} == {"4"}
    assert text.count("root cause: rank 3") == 2  # both nodes name the same failure ...
    assert "srun exited 3" in text  # ... and end with its exit code, which becomes the job's
    assert jobs.show_job(jid)["ExitCode"] == "3:0"


# ------------------------------------------------ e: docs/slurm.md's script, submitted as written


def printed_block(page: Path) -> str:
    """The page's one `printed` block: lines of the job output of slurm/train.sbatch."""
    (block,) = [b for b in blocks_of(page) if b.kind == "printed"]
    return block.body


@pytest.mark.timeout(480)
def test_the_pages_sbatch_script_runs_as_written_is_warned_requeued_and_resumes(jobs: Jobs, tmp_path: Path) -> None:
    # What a user does: train.py next to them, `sbatch train.sbatch`, no option added. The dev
    # cluster's nodes have 32 CPUs and 8 GPUs (a GRES count: nothing to compute on), so the
    # script's --gpus-per-node=8 --cpus-per-task=32 fit and rally takes nproc 8 from SLURM. The
    # bare `rally` of the script is this interpreter's, first on PATH.
    submit = tmp_path / "submit"
    submit.mkdir()
    shutil.copy(SCRIPTS / "train.py", submit / "train.py")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    jid = jobs.sbatch_as_written(TEMPLATES / "train.sbatch", submit, env={"PATH": path})
    out_file = submit / f"train-{jid}.out"  # --output=%x-%j.out, in the submit directory
    out = lambda: out_file.read_text(errors="replace") if out_file.exists() else ""  # noqa: E731
    wait_for(lambda: out().count("TRAIN-HOLD") == 16, 240, 0.2, "16 workers holding at step 10", out)

    # What --signal=B:USR1@90 does 90 s before the time limit: SIGUSR1 to the batch shell only.
    jobs.cluster.run_login(["scancel", "--signal=USR1", "--batch", jid], timeout=10, check=True)
    jobs.release_requeued(jid, lambda: f"SLURM job {jid}.0 (restart 1)" in out(), 120)
    jobs.cluster.wait_job_gone(jid, timeout=300)
    text = out()

    first, restart, second = text.partition(f"SLURM job {jid}.0 (restart 1): ")
    assert restart, text
    for run, start in ((first, 0), (restart + second, 11)):
        for node in (0, 1):  # both rallies took everything from SLURM, nproc from the GPUs
            taken = rf"SLURM job {jid}\.0( \(restart 1\))?: 2 nodes \(node\[1-2\]\), this is node {node}, "
            assert re.search(taken + r"store node1:\d+, nproc 8 from SLURM_GPUS_ON_NODE", run), run
            assert f"round 0: node {node} of 2, ranks {8 * node}-{8 * node + 7} of 16, restart 0/3" in run
        records = re.findall(r"TRAIN rank=(\d+) world=16 host=(node\d) start=(\d+) lr=0\.1", run)
        trained = sorted((int(r), h, int(s)) for r, h, s in records)
        assert trained == [(r, f"node{1 + r // 8}", start) for r in range(16)], run  # node-major; resumed after 10
    assert first.count("received SIGUSR1 (preemption or time limit)") == 2, first  # both nodes
    assert first.count("preempted at step 10: saved, exiting") == 16
    assert f"rally: requeued SLURM job {jid}; it will resume from the latest checkpoint" in first
    assert "resuming from step 10" in second and "TRAIN-HOLD" not in second
    assert sorted(int(r) for r in re.findall(r"TRAIN-DONE rank=(\d+) step=19", second)) == list(range(16)), second
    assert second.count("job succeeded: 16 workers on 2 nodes finished") == 2
    job = jobs.show_job(jid)
    assert (job["JobState"], job["Restarts"], job["ExitCode"]) == ("COMPLETED", "1", "0:0"), job
    # RALLY_LOG_DIR: every node's run directory of both runs, where the login node sees them.
    run_dirs = sorted((submit / "rally-logs").glob(f"{jid}.0_*"))
    assert len(run_dirs) == 4 and all((d / "report.json").is_file() for d in run_dirs), run_dirs

    missing = missing_lines(printed_block(SLURM_PAGE), text)
    assert not missing, "docs/slurm.md shows lines this run did not print:\n" + "\n".join(missing) + "\n\n" + text
