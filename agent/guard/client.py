"""The agent's side of the orphan guard (agent/guard/orphan_guard.py): start it, give it the job's
cgroup (agent/guard/job_cgroup.py), tell it about each worker group, stop it at exit. The guard itself
runs by file path, so it imports none of this."""

from __future__ import annotations

import os
from collections.abc import Callable

from rally.agent.base.helper_process import HelperProcess
from rally.agent.guard import orphan_guard, processes
from rally.agent.guard.job_cgroup import FREEZER, PIDS, V2, JobCgroup, remove_abandoned
from rally.agent.guard.orphan_guard import SWEEP_SECONDS, TOKEN_VARIABLE

__all__ = ["GuardClient", "TOKEN_VARIABLE"]

# RALLY_JOB_CGROUP: "auto" (the default: the first of v2, freezer, pids this machine allows),
# one of them, or "off" (where something else manages cgroups; the guard then kills what it saw).
CGROUP_VARIABLE = "RALLY_JOB_CGROUP"
CGROUP_CHOICES = {"auto": (V2, FREEZER, PIDS), V2: (V2,), FREEZER: (FREEZER,), PIDS: (PIDS,), "off": ()}


def job_cgroup(guard_pid: int = 0, v2_only: bool = False) -> JobCgroup | None:
    """The job's own cgroup, of the kind RALLY_JOB_CGROUP asks for (an unknown value: auto).

    With `v2_only` (the scheduler tracks a step by its own cgroups: SLURM, SchedulerView.tracks_cgroups),
    auto means v2 only: SLURM's v1 plugins track a step by the members of its own freezer/cpuset
    cgroups, and a v1 child would take the workers out of that list; a v2 child stays inside the
    step's cgroup, whose kill is recursive."""
    choice = os.environ.get(CGROUP_VARIABLE, "auto").strip().lower()
    kinds = CGROUP_CHOICES.get(choice, CGROUP_CHOICES["auto"])
    if choice not in (FREEZER, PIDS) and v2_only:
        kinds = tuple(k for k in kinds if k == V2)
    # A name, not a secret: every user reads it in /proc/PID/cgroup, so it carries no part of the token.
    group = JobCgroup.create(f"rally-{guard_pid}-{os.urandom(6).hex()}", kinds) if kinds else None
    if group is not None:
        remove_abandoned(group)
    return group


class GuardClient:
    """The agent's side: start the guard, tell it about worker groups, stop it at exit."""

    def __init__(self, token: str, v2_only: bool = False, warn: Callable[[str], None] | None = None):
        """`v2_only`: the job's cgroup must be v2 (the scheduler tracks steps by cgroups: `job_cgroup`);
        `warn` hears the one line of a guard that stopped reading or had to be killed at the end."""
        self.token = token
        # by file path, in a session of its own
        self.helper = HelperProcess(orphan_guard.__file__, name="the orphan guard", warn=warn)
        self.process = self.helper.process
        self._tell(f"token {token}\n")
        # Every process the agent starts from now on (workers, the template) joins the cgroup
        # between fork and exec; everything they start inherits it.
        self.cgroup = job_cgroup(self.process.pid, v2_only)
        if self.cgroup is not None:
            self._tell(f"cgroup {self.cgroup.to_line()}\n")
        processes.set_job_cgroup(self.cgroup.procs_file if self.cgroup is not None else None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def guard_group(self, pgid: int) -> None:
        """A worker started (it leads session and group `pgid`): called before the agent reaps
        it, so its start time is read while the id is still its own."""
        self._tell(f"{pgid} {orphan_guard.start_time(pgid) or ''}\n".replace(" \n", "\n"))

    def unguard_group(self, pgid: int) -> None:
        self._tell(f"-{pgid}\n")

    def clean_up_at_exit(self, path: str) -> None:
        """Have the guard remove `path` (a file or directory, such as shared memory the job
        keeps) once the job's processes are dead, however the agent ends."""
        self._tell(f"cleanup {path}\n")

    def forget_cleanup(self, path: str) -> None:
        self._tell(f"-cleanup {path}\n")

    def _tell(self, line: str) -> None:
        self.helper.send(line)

    def stop(self, timeout: float = SWEEP_SECONDS + 3.0) -> None:
        """Close the pipe (the guard sweeps what is left, normally nothing) and wait, bounded."""
        self.helper.stop(timeout)
        processes.set_job_cgroup(None)
        if self.cgroup is not None:
            self.cgroup.remove()  # normally gone already: the guard removes it
