"""A cgroup of the job's own, so that what the job started can be found and killed whatever it did.

Process groups, sessions and the job token (RALLY_AGENT_TOKEN in the environment) can all be
shed: `setsid -f env -i daemon` leaves the worker's group and session and drops the token, and
once the agent is SIGKILLed nothing re-parents such a daemon to it any more. Membership of a
cgroup is inherited by every child and cannot be left without write access to the hierarchy, so
every worker (and the worker template, whose forks are workers) is put into one cgroup made for
this agent at start-up, and the orphan guard (agent/guard/orphan_guard.py) kills its members when the
agent is gone.

Which cgroup, in order of preference, where this process may create one:

* cgroup v2 (any kernel since 5.14): a child of this process's own v2 cgroup; `cgroup.kill`
  SIGKILLs every member at once, forks in flight included;
* cgroup v1 `freezer`: a child of this process's freezer cgroup; members are frozen (no fork
  can race the kill), SIGKILLed from `cgroup.procs`, then thawed so the kill takes effect;
* cgroup v1 `pids`: the same list, killed until empty (bounded).

Machines that mount v1 controllers beside an empty v2 hierarchy (as CI's do) get v2, since an
empty hierarchy has no controllers to forbid a child. None of them writable (a container
without cgroup delegation): `create` returns None and the guard falls back to the descendants it
saw. Standard library only: the guard imports this by file path.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

# How long a kill waits for the members to be gone (D-state processes may outlast it).
KILL_SECONDS = 3.0
# The kinds, in order of preference, and the v1 controllers they need.
V2, FREEZER, PIDS = "v2", "freezer", "pids"


@dataclass(frozen=True)
class JobCgroup:
    """One cgroup made for one agent's job; `kind` is V2, FREEZER or PIDS."""

    kind: str
    path: Path

    @property
    def procs_file(self) -> str:
        """Write a pid here to move that process (and its future children) in; "0": the writer."""
        return str(self.path / "cgroup.procs")

    @classmethod
    def create(cls, name: str, kinds: tuple[str, ...] = (V2, FREEZER, PIDS)) -> JobCgroup | None:
        """Make `name` under this process's own cgroup of the first of `kinds` the machine allows."""
        mine = _own_cgroups()
        for kind in kinds:
            base = _hierarchy(kind)
            if base is None or kind not in mine:
                continue
            mount, root = base
            relative = mine[kind]
            if not relative.startswith(root):
                continue
            path = Path(mount) / relative[len(root) :].lstrip("/") / name
            try:
                path.mkdir()
            except FileExistsError:
                pass
            except OSError:
                continue
            group = cls(kind, path)
            if not os.access(group.procs_file, os.W_OK) or (
                kind == V2 and not (path / "cgroup.kill").exists()
            ):  # v2: kernel < 5.14
                group.remove()
                continue
            return group
        return None

    @classmethod
    def from_line(cls, text: str) -> JobCgroup:
        kind, _, path = text.partition(" ")
        return cls(kind, Path(path))

    def to_line(self) -> str:
        return f"{self.kind} {self.path}"

    def add(self, pid: int) -> bool:
        try:
            Path(self.procs_file).write_text(str(pid))
            return True
        except OSError:
            return False

    def members(self) -> list[int]:
        try:
            return [int(line) for line in Path(self.procs_file).read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self, seconds: float = KILL_SECONDS) -> list[int]:
        """SIGKILL every member until none is left; the pids still there after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            members = [pid for pid in self.members() if pid != os.getpid()]
            if not members or time.monotonic() > deadline:
                return members
            if self.kind == V2:
                _write(self.path / "cgroup.kill", "1")
            elif self.kind == FREEZER:
                _write(self.path / "freezer.state", "FROZEN")  # no fork races the kill
                _kill(self.members())
                _write(self.path / "freezer.state", "THAWED")  # a frozen process dies once thawed
            else:
                _kill(members)
            # wait: short: 10 ms between kills of the cgroup's members, up to its deadline
            time.sleep(0.01)

    def remove(self, wait: float = 0.0) -> bool:
        """Remove the cgroup once it is empty, trying for up to `wait` seconds (killed members
        take a moment to leave it, longer on a loaded machine); False if it is still there."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
            # wait: short: 20 ms between rmdir attempts, up to its deadline
            time.sleep(0.02)


def remove_abandoned(group: JobCgroup) -> list[Path]:
    """Remove the empty cgroups beside `group` whose guard is gone (named rally-<guard pid>-...):
    a guard SIGKILLed together with its agent (a test's node crash) cannot remove its own.
    rmdir fails on a cgroup that still has members, so a live job's is never touched."""
    removed = []
    for path in group.path.parent.glob("rally-*-*"):
        guard = path.name.split("-")[1]
        if path == group.path or not guard.isdigit() or _alive(int(guard)):
            continue
        try:
            path.rmdir()
            removed.append(path)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per kind, from /proc/self/cgroup ("0::/x" is v2)."""
    found: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            found[V2] = path
        for kind in (FREEZER, PIDS):
            if kind in controllers.split(","):
                found[kind] = path
    return found


def _hierarchy(kind: str) -> tuple[str, str] | None:
    """(mount point, the hierarchy's path mounted there) of the writable mount of `kind`."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, (fstype, _source, super_options) = fields.split(), (tail.split() + ["", "", ""])[:3]
        root, mount, options = parts[3], parts[4], parts[5]
        if "rw" not in options.split(","):
            continue
        if kind == V2 and fstype == "cgroup2":
            return mount, root
        if kind != V2 and fstype == "cgroup" and kind in super_options.split(","):
            return mount, root
    return None
