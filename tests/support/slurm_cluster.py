"""pytest plugin: a real 3-node SLURM cluster on this machine, for ``@pytest.mark.slurm`` tests.

The cluster is ``slurm/devcluster.sh`` (network namespaces, real slurmctld and
slurmd). The session fixture :func:`slurm_cluster` brings it up once, hands the
tests a :class:`SlurmCluster` with helpers, and takes it down at the end of the
session. It skips, with the reason, where the cluster cannot run: not root,
no ``ip``, no network namespaces, packages not installable.

Load it as a plugin, so that every test module shares the one session fixture::

    pytest_plugins = ["support.slurm_cluster"]    # in tests/conftest.py (or a test module)

The session holds a lease on the cluster (``devcluster.sh up --for-pid``) and
returns it at the end (``devcluster.sh release``), which takes the cluster down
only if no other live session holds one, so sessions of several engineers, or
pytest-xdist workers, can share it. A cluster brought up by hand
(``slurm/devcluster.sh up``) stays up until ``slurm/devcluster.sh down``. Set
``RALLY_DEVCLUSTER_KEEP=1`` to leave it up after the session (the next session
then finds it up at once).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "slurm" / "devcluster.sh"
ENV_FILE = Path("/run/rally-devcluster/cluster.env")

#: ``devcluster.sh up`` may install packages (measured 10-15 s; apt-get update adds more).
UP_TIMEOUT_S = 300.0
#: ``devcluster.sh down`` cancels jobs and stops daemons, each with a bounded grace.
DOWN_TIMEOUT_S = 120.0
#: How often the job helpers poll ``squeue``: SLURM has no cheap way to wait for a job.
POLL_INTERVAL_S = 0.2
CONTROLLER_BUSY_S = 60.0  # how long squeue may fail before the controller counts as down
#: squeue's states of a job that is over (JOB STATE CODES in squeue(1)); REQUEUED is not one.
FINAL_JOB_STATES = frozenset(
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED REVOKED TIMEOUT".split()
)
#: devcluster.sh's exit status for "this machine cannot run the cluster".
EX_UNSUITABLE = 3
#: Environment variable that keeps the cluster up after the session.
KEEP_ENV = "RALLY_DEVCLUSTER_KEEP"


@dataclass(frozen=True)
class SlurmCluster:
    """A running dev cluster and the ways a test talks to it.

    Every SLURM command runs on the login host through ``login_exec`` (the
    cluster's addresses and slurm.conf exist only inside its namespaces). By
    default commands run in the repository (rally is installed); srun passes
    environment and working directory on to the tasks, and all nodes share this
    machine's file system, so tasks can run this checkout with ``sys.executable``.
    """

    nodes: tuple[str, ...]
    addrs: Mapping[str, str]
    netns: Mapping[str, str]
    login_exec: str
    slurm_conf: str
    logs: Path
    workdir: Path

    @classmethod
    def from_env_file(cls, path: Path, workdir: Path) -> SlurmCluster:
        """Read the ``cluster.env`` that ``devcluster.sh up`` writes."""
        values: dict[str, str] = {}
        for line in path.read_text().splitlines():
            for word in shlex.split(line, comments=True):
                key, _, value = word.partition("=")
                values[key] = value
        nodes = tuple(values["RALLY_DEVCLUSTER_NODE_NAMES"].split())
        return cls(
            nodes=nodes,
            addrs=dict(zip(nodes, values["RALLY_DEVCLUSTER_NODE_ADDRS"].split(), strict=True)),
            netns=dict(zip(nodes, values["RALLY_DEVCLUSTER_NODE_NETNS"].split(), strict=True)),
            login_exec=values["RALLY_DEVCLUSTER_EXEC"],
            slurm_conf=values["RALLY_DEVCLUSTER_SLURM_CONF"],
            logs=Path(values["RALLY_DEVCLUSTER_LOGS"]),
            workdir=workdir,
        )

    def task_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment commands (and through srun, tasks) get: ours (rally is installed, not on PYTHONPATH)."""
        env = dict(os.environ)
        env.update(extra or {})
        return env

    def run_login(
        self,
        cmd: Sequence[str] | str,
        timeout: float,
        *,
        check: bool = False,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on the login host and capture its output; a string goes to ``bash -c``.

        ``env`` adds to :meth:`task_env`. On ``timeout`` the command is killed
        (subprocess.TimeoutExpired); with ``check`` a non-zero exit raises and
        the error shows the output.
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        done = subprocess.run(
            [self.login_exec, *argv],
            cwd=cwd or REPO,
            env=self.task_env(env),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{argv} exited {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
            )
        return done

    def sbatch(self, script_text: str, *args: str, timeout: float = 30.0) -> str:
        """Submit ``script_text`` as a batch job and return its job id.

        The script and its output (``slurm-<jobid>.out``, read it with
        :meth:`output`) live in this session's work directory; ``args`` are
        extra sbatch options, e.g. ``"-N2"``.
        """
        fd, name = tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.workdir)
        os.close(fd)
        script = Path(name)
        script.write_text(script_text if script_text.startswith("#!") else "#!/bin/bash\n" + script_text)
        done = self.run_login(
            ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={self.workdir}/slurm-%j.out", *args, str(script)],
            timeout,
            check=True,
        )
        return done.stdout.strip().split(";")[0]

    def output(self, jobid: str) -> str:
        """The batch output of ``jobid`` (empty if there is none yet)."""
        path = self.workdir / f"slurm-{jobid}.out"
        return path.read_text() if path.exists() else ""

    def job_state(self, jobid: str) -> str:
        """The job's squeue state (PENDING, RUNNING, COMPLETING, REQUEUED, ...), or "" once it is
        over (a final state such as COMPLETED, or forgotten by the controller)."""
        # `-t all`: by default squeue lists only pending, running and completing jobs, so a job
        # between its requeue and PENDING (REQUEUED) looked gone for a poll or two. squeue fails
        # with "Invalid job id" once the controller forgot the job: gone too. Any other failure is
        # the controller too busy to answer (16 workers stopping on two cores), not the job's end.
        deadline = time.monotonic() + CONTROLLER_BUSY_S
        while True:
            done = self.run_login(["squeue", "-h", "-t", "all", "-j", jobid, "-o", "%T"], 10.0)
            if done.returncode == 0:
                state = done.stdout.strip()
                return "" if state in FINAL_JOB_STATES else state
            if "Invalid job id" in done.stderr:
                return ""
            if time.monotonic() > deadline:
                raise RuntimeError(f"squeue -j {jobid} kept failing for {CONTROLLER_BUSY_S}s: {done.stderr.strip()}")
            time.sleep(POLL_INTERVAL_S)

    def wait_job_state(self, jobid: str, state: str, timeout: float) -> None:
        """Wait until the job is in ``state``; TimeoutError says where it is instead."""
        deadline = time.monotonic() + timeout
        while (current := self.job_state(jobid)) != state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} not {state} after {timeout}s (state: {current or 'gone'})")
            time.sleep(POLL_INTERVAL_S)

    def wait_job_gone(self, jobid: str, timeout: float) -> None:
        """Wait until squeue no longer lists the job (finished, failed or cancelled)."""
        deadline = time.monotonic() + timeout
        while current := self.job_state(jobid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {jobid} still {current} after {timeout}s")
            time.sleep(POLL_INTERVAL_S)

    def node_pids(self, node: str) -> list[int]:
        """Every pid living in ``node``'s namespace (slurmd, slurmstepd, tasks).

        For node-crash tests: SIGKILL them all. SLURM marks the node ``down*``
        after SlurmdTimeout (30 s; 43 s measured here) and then cancels the
        steps that ran on it "due to node failure". :meth:`repair` brings it back.
        """
        done = subprocess.run(
            ["ip", "netns", "pids", self.netns[node]], capture_output=True, text=True, timeout=10, check=True
        )
        return [int(p) for p in done.stdout.split()]

    def repair(self) -> None:
        """Restart crashed slurmd's, reconnect cut links and resume DOWN nodes (``devcluster.sh up``)."""
        done = _devcluster("up", "--for-pid", str(os.getpid()), timeout=UP_TIMEOUT_S)
        if done.returncode != 0:
            raise AssertionError(f"devcluster.sh up failed ({done.returncode}):\n{done.stdout}")


def _devcluster(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``devcluster.sh <args>``; its stdout and stderr together are the result's stdout.

    The script is never killed half-way: it runs in its own session and writes
    to a file, not a pipe, so if this process is interrupted (Ctrl-C, a
    pytest-timeout firing during session teardown) or gives up waiting, the
    script still finishes and the cluster is not left half up or half down.
    Every step inside the script is bounded by its own timeouts.
    """
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"devcluster.sh {' '.join(args)} still running after {timeout}s") from None
        out.seek(0)
        return subprocess.CompletedProcess(proc.args, returncode, out.read(), "")


def unsuitable_reason() -> str | None:
    """Why this machine cannot run the dev cluster, checked without touching anything; None if it may."""
    if sys.platform != "linux":
        return "the SLURM dev cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the SLURM dev cluster needs root (network namespaces, slurmd)"
    if shutil.which("ip") is None:
        return "the SLURM dev cluster needs the `ip` command (iproute2)"
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The dev cluster, up for the whole session (see the module docstring)."""
    reason = unsuitable_reason()
    if reason:
        pytest.skip(reason)
    done = _devcluster("up", "--for-pid", str(os.getpid()), timeout=UP_TIMEOUT_S)
    if done.returncode == EX_UNSUITABLE:
        pytest.skip(f"SLURM dev cluster unavailable: {done.stdout.strip().splitlines()[-1]}")
    if done.returncode != 0:
        pytest.fail(f"slurm/devcluster.sh up failed ({done.returncode}):\n{done.stdout}")
    try:
        yield SlurmCluster.from_env_file(ENV_FILE, tmp_path_factory.mktemp("slurm"))
    finally:
        if not os.environ.get(KEEP_ENV):
            # goes down unless another session (or a manual `up`) still holds a lease
            down = _devcluster("release", str(os.getpid()), timeout=DOWN_TIMEOUT_S)
            if down.returncode != 0:
                pytest.fail(f"slurm/devcluster.sh release failed ({down.returncode}):\n{down.stdout}")
