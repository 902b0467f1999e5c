"""Worker health beyond "has it exited": hangs, silence, resources and out-of-memory kills.

A hung collective is a live process that makes no progress; torchrun waits for the backend's
timeout (30 min for gloo) and never says which rank hung. The agent checks three signals:

* heartbeats: workers that call `rally.job.heartbeat()` write a counter and a CLOCK_MONOTONIC
  time to a per-worker shared file; `--heartbeat-timeout` seconds without a new beat (counted
  from the first beat, so start-up time is never counted) means hung;
* silence: with `--silence-timeout`, a worker that printed nothing for that long is hung;
* resources: CPU, RSS and threads of each worker and the host's free memory, sampled every
  `--resource-interval` seconds, so a worker SIGKILLed while memory was short is reported as
  "likely killed by the out-of-memory killer" with the numbers. The worker's memory cgroup
  (v1 or v2) is read too: its `oom_kill` counter makes the attribution certain.

`HealthMonitor` never sleeps or polls on its own: the agent asks it when the next check is due
and folds that into its one `select` timeout.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rally.agent import heartbeat_file

MEMORY_SHORT_FRACTION = 0.10  # the host counts as short of memory below 10% available
MIB = 1024 * 1024
GPU_QUERY_TIMEOUT = 5.0


@dataclass(frozen=True)
class HealthSettings:
    heartbeat_timeout: float | None = None
    silence_timeout: float | None = None
    resource_interval: float = 5.0
    stack_dump_wait: float = 2.0


@dataclass
class ResourceSample:
    cpu_percent: float = 0.0
    rss: int = 0
    threads: int = 0
    status: str = ""
    at: float = 0.0
    gpu_memory: int | None = None  # bytes on GPUs, where nvidia-smi is present


@dataclass
class Hang:
    """A worker judged hung, and why."""

    local_rank: int
    reason: str
    silent_for: float


@dataclass
class _Watched:
    local_rank: int
    pid: int
    heartbeat_path: str | None
    started_at: float
    last_beat_count: int = 0
    last_beat_at: float | None = None  # monotonic seconds of the last new beat seen
    process: psutil.Process | None = None
    sample: ResourceSample = field(default_factory=ResourceSample)
    oom_counter: Path | None = None
    oom_kills_seen: int = 0


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def _is_exiting(pid: int) -> bool:
    """Whether `pid` has begun to exit (or is gone): its cgroup-v1 paths then read as "/"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        flags = int(stat.rpartition(")")[2].split()[6])  # field 9: the kernel's task flags
    except (OSError, ValueError, IndexError):
        return True
    return bool(flags & PF_EXITING)


def _memory_cgroup_counter(pid: int) -> Path | None | bool:
    """The file that counts OOM kills in the memory cgroup of `pid` (cgroup v2 or v1).

    Returns False when the answer cannot be trusted: once a process has begun to exit (the
    OOM killer's SIGKILL has landed, say), the kernel shows every cgroup-v1 path of it as "/",
    the root. A sampler that took that for a move to the root cgroup would forget the worker's
    real cgroup in the very window in which the OOM kill must be attributed, which is what
    happened on busy machines, where that window is long. cgroup-v2 paths stay valid to the end.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    found: Path | None = None
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and unified:
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            if _is_exiting(pid):  # read after the paths: an exit that began meanwhile is caught
                return False
            candidate = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        if candidate.exists():
            found = candidate
            break
    return found


def _oom_kill_count(counter: Path | None | bool) -> int:
    if not isinstance(counter, Path):
        return 0
    try:
        for line in counter.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class HealthMonitor:
    """Hang checks and resource samples for one round's workers on this node."""

    def __init__(self, settings: HealthSettings):
        self.settings = settings
        self.watched: dict[int, _Watched] = {}
        self.host_available = 0
        self.host_total = psutil.virtual_memory().total
        self.next_sample_at = 0.0

    def watch(self, local_rank: int, pid: int, heartbeat_path: str | None, started_at: float) -> None:
        self.watched[local_rank] = _Watched(local_rank, pid, heartbeat_path, started_at)

    def forget(self, local_rank: int) -> None:
        self.watched.pop(local_rank, None)

    def next_due(self, now: float) -> float | None:
        """Seconds until the next check, or None when there is nothing to check."""
        if not self.watched:
            return None
        due = [self.next_sample_at]
        if self.settings.heartbeat_timeout or self.settings.silence_timeout:
            due.append(now + min(t for t in (self.settings.heartbeat_timeout, self.settings.silence_timeout) if t) / 10)
        return max(0.0, min(due) - now)

    def check(self, last_output: dict[int, float]) -> list[Hang]:
        """Sample if due, then return the workers that are hung (heartbeat or silence)."""
        now = time.monotonic()
        if now >= self.next_sample_at:
            self.sample()
            self.next_sample_at = now + self.settings.resource_interval
        hangs = []
        for w in self.watched.values():
            hang = self._heartbeat_hang(w, now) or self._silence_hang(w, now, last_output.get(w.local_rank))
            if hang:
                hangs.append(hang)
        return hangs

    def _heartbeat_hang(self, w: _Watched, now: float) -> Hang | None:
        timeout = self.settings.heartbeat_timeout
        if not timeout or not w.heartbeat_path:
            return None
        try:
            count, _ = heartbeat_file.read(w.heartbeat_path)
        except (heartbeat_file.HeartbeatFileError, OSError):
            return None
        if count != w.last_beat_count:
            w.last_beat_count, w.last_beat_at = count, now
            return None
        if w.last_beat_at is None:  # never beat: start-up is not counted
            return None
        silent = now - w.last_beat_at
        if silent > timeout:
            return Hang(w.local_rank, f"sent no heartbeat for {silent:.1f} s (--heartbeat-timeout {timeout:g})", silent)
        return None

    def _silence_hang(self, w: _Watched, now: float, last_output_at: float | None) -> Hang | None:
        timeout = self.settings.silence_timeout
        if not timeout:
            return None
        silent = now - max(last_output_at or 0.0, w.started_at)
        if silent > timeout:
            return Hang(w.local_rank, f"printed nothing for {silent:.1f} s (--silence-timeout {timeout:g})", silent)
        return None

    def sample(self) -> None:
        """CPU, RSS, threads and status of every worker, and the host's available memory."""
        self.host_available = psutil.virtual_memory().available
        now = time.monotonic()
        gpu = gpu_memory_by_pid()
        for w in self.watched.values():
            try:
                if w.process is None:
                    w.process = psutil.Process(w.pid)
                    w.process.cpu_percent(None)  # the first call only starts the measurement
                with w.process.oneshot():
                    w.sample = ResourceSample(
                        cpu_percent=w.process.cpu_percent(None),
                        rss=w.process.memory_info().rss,
                        threads=w.process.num_threads(),
                        status=w.process.status(),
                        at=now,
                        gpu_memory=_gpu_memory_of_tree(w.process, gpu),
                    )
                counter = _memory_cgroup_counter(w.pid)
                if counter is not False and counter != w.oom_counter:
                    w.oom_counter, w.oom_kills_seen = counter, _oom_kill_count(counter)
            except psutil.Error:
                pass

    def note_exit(self, local_rank: int) -> None:
        """Called the moment a worker's pidfd turns readable, before it is reaped: its memory
        cgroup can still be read then (cgroup v2; v1 shows an exiting task's paths as "/"), even
        if it joined the cgroup after the last sample."""
        w = self.watched.get(local_rank)
        if w is not None and w.oom_counter is None:
            counter = _memory_cgroup_counter(w.pid)  # cgroup v2 only: v1 reads False by now
            if isinstance(counter, Path) and _oom_kill_count(counter) > 0:
                w.oom_counter, w.oom_kills_seen = counter, 0

    def is_stopped(self, local_rank: int) -> bool:
        w = self.watched.get(local_rank)
        try:
            return w is not None and psutil.Process(w.pid).status() == psutil.STATUS_STOPPED
        except psutil.Error:
            return False

    def explain_kill(self, local_rank: int) -> str | None:
        """Why a worker that died of SIGKILL (sent by nobody here) probably died, or None."""
        w = self.watched.get(local_rank)
        if w is None:
            return None
        kills = _oom_kill_count(w.oom_counter)
        rss = f"its last sampled RSS was {w.sample.rss / MIB:.0f} MiB"
        if kills > w.oom_kills_seen:
            return f"killed by the out-of-memory killer: its memory cgroup counted an OOM kill ({rss})"
        available = psutil.virtual_memory().available
        short = min(available, self.host_available or available) < MEMORY_SHORT_FRACTION * self.host_total
        if short:
            return (
                f"likely killed by the out-of-memory killer: the host had {min(available, self.host_available) / MIB:.0f} MiB "
                f"available of {self.host_total / MIB:.0f} MiB; {rss}"
            )
        return None

    def heartbeat_count(self, local_rank: int) -> int | None:
        """How many heartbeats the worker has sent (its progress); None without a heartbeat file."""
        w = self.watched.get(local_rank)
        if w is None or not w.heartbeat_path:
            return None
        try:
            return heartbeat_file.read(w.heartbeat_path)[0]
        except (heartbeat_file.HeartbeatFileError, OSError):
            return None

    def heartbeat_age(self, local_rank: int) -> float | None:
        """Seconds since the worker's last heartbeat (None if it never sent one)."""
        w = self.watched.get(local_rank)
        if w is None or not w.heartbeat_path:
            return None
        try:
            count, ns = heartbeat_file.read(w.heartbeat_path)
        except (heartbeat_file.HeartbeatFileError, OSError):
            return None
        return None if count == 0 else max(0.0, time.monotonic() - ns / 1e9)

    def resources(self, local_rank: int) -> ResourceSample:
        w = self.watched.get(local_rank)
        return w.sample if w else ResourceSample()


def gpu_memory_by_pid() -> dict[int, int] | None:
    """GPU memory used per process (bytes), from nvidia-smi; None where there is no NVIDIA GPU.

    nvidia-smi costs tens of milliseconds; it runs only at the resource interval and only on
    machines that have it, so CPU-only nodes pay nothing.
    """
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    usage: dict[int, int] = {}
    for line in done.stdout.splitlines():
        try:
            pid, mib = (int(part.strip()) for part in line.split(","))
        except ValueError:
            continue
        usage[pid] = usage.get(pid, 0) + mib * MIB
    return usage


def _gpu_memory_of_tree(process: psutil.Process, usage: dict[int, int] | None) -> int | None:
    """GPU memory of a worker and its children (a DataLoader worker may hold CUDA memory too)."""
    if usage is None:
        return None
    pids = {process.pid} | {child.pid for child in process.children(recursive=True)}
    return sum(usage.get(pid, 0) for pid in pids)


def heartbeat_path(rank_dir: Path) -> str:
    path = rank_dir / "heartbeat"
    heartbeat_file.create(path)
    return str(path)


