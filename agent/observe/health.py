"""Worker health beyond "has it exited": hangs, silence, resources and out-of-memory kills.

A hung collective is a live process that makes no progress; torchrun waits for the backend's
timeout (30 min for gloo) and never says which rank hung. The agent checks three signals:

* heartbeats: workers that call `rally.job.heartbeat()` write a counter, a CLOCK_MONOTONIC
  time and optionally a step number to a per-worker shared file; `--heartbeat-timeout` seconds
  without a new beat (counted from the first beat) means hung, and `--startup-timeout` seconds
  from the worker's start without its first beat means hung in start-up;
* sections: inside `rally.job.section(name, timeout=T)` the worker's own deadline replaces
  the timeouts above (a long checkpoint save is not a hang; one past T is "hung in section
  'checkpoint' for 612 s"); entering or leaving a section counts as a sign of life;
* silence: with `--silence-timeout`, a worker that printed nothing for that long is hung;
* resources: CPU, RSS and threads of each worker and the host's free memory, sampled every
  `--resource-interval` seconds, so a worker SIGKILLed while memory was short is reported as
  "likely killed by the out-of-memory killer" with the numbers. The worker's memory cgroup
  (v1 or v2) is read too: its `oom_kill` counter makes the attribution certain. Where NVML
  is available (agent/observe/gpu.py), each worker's GPU memory and utilisation are sampled too.

`HealthMonitor` never sleeps or polls on its own: the agent asks it when the next check is due
and folds that into its one `select` timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import psutil

from rally.agent.base.spec import RESOURCE_INTERVAL_SECONDS, JobSpec
from rally.agent.observe.gpu import DeviceReading, worker_usage
from rally.agent.worker_side import heartbeat_file
from rally.agent.worker_side.heartbeat_file import HeartbeatRecord

MEMORY_SHORT_FRACTION = 0.10  # the host counts as short of memory below 10% available
MIB = 1024 * 1024
# Heartbeat files are read at most this often per timeout (a tenth of the shortest timeout), so
# a hang is seen within 10% of its timeout, and never more often than that however much the
# workers print.
READS_PER_TIMEOUT = 10
# And at least this often (seconds), so step times (stragglers), steps and sections stay current
# without a timeout set. Reading a 128-byte file costs microseconds.
HEARTBEAT_READ_INTERVAL = 1.0


@dataclass(frozen=True)
class HealthSettings:
    heartbeat_timeout: float | None = None
    silence_timeout: float | None = None
    resource_interval: float = RESOURCE_INTERVAL_SECONDS
    stack_dump_wait: float = 2.0
    startup_timeout: float | None = None  # --startup-timeout: first beat due within this
    learned: Any = None  # --heartbeat-timeout auto: the agent's LearnedTimeouts (agent/observe/learned_timeouts.py)

    @classmethod
    def for_job(cls, spec: JobSpec, say: Callable[[str], None], emit: Callable[..., None]) -> HealthSettings:
        """The job's timeouts (`spec`: agent.spec.JobSpec); learned ones print with `say`, record with `emit`."""
        from rally.agent.observe.learned_timeouts import LearnedTimeouts

        learned = LearnedTimeouts(spec.timeout_learning, say, emit) if spec.timeout_learning else None
        return cls(
            spec.heartbeat_timeout,
            spec.silence_timeout,
            spec.resource_interval,
            startup_timeout=spec.startup_timeout,
            learned=learned,
        )


@dataclass
class ResourceSample:
    cpu_percent: float = 0.0
    cpu_seconds: float | None = None  # user + system time of the process so far (/metrics counts it)
    rss: int = 0
    threads: int = 0
    status: str = ""
    at: float = 0.0
    gpu_memory: int | None = None  # bytes on GPUs, where NVML is available (agent/observe/gpu.py)
    gpu_utilization: int | None = None  # percent, where NVML samples it


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
    record: HeartbeatRecord = field(default_factory=HeartbeatRecord)  # the latest read of its file
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


def _memory_cgroup_counter(pid: int) -> Path | None | Literal[False]:
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


class HealthSource(Protocol):
    """Who keeps the health monitor of this round's workers (agent/observe/observer.py's Observer):
    a feature that judges the workers reads it from there, rebuilt each round."""

    @property
    def health(self) -> HealthMonitor: ...


class HealthMonitor:
    """Hang checks and resource samples for one round's workers on this node."""

    def __init__(self, settings: HealthSettings, gpu: Callable[[], list[DeviceReading] | None] | None = None):
        """`gpu` returns the node's GPUs as NVML reads them (agent/observe/gpu.py), or None without NVML."""
        self.settings = settings
        self.gpu = gpu
        self.watched: dict[int, _Watched] = {}
        self.host_available = 0
        self.host_total = psutil.virtual_memory().total
        self.next_sample_at = 0.0
        self.next_read_at = 0.0

    def watch(self, local_rank: int, pid: int, heartbeat_path: str | None, started_at: float) -> None:
        self.watched[local_rank] = _Watched(local_rank, pid, heartbeat_path, started_at)
        self.next_read_at = 0.0

    def forget(self, local_rank: int) -> None:
        self.watched.pop(local_rank, None)

    def next_due(self, now: float) -> float | None:
        """Seconds until the next check, or None when there is nothing to check."""
        if not self.watched:
            return None
        due = [self.next_sample_at, self.next_read_at]
        if self.settings.silence_timeout:
            due.append(now + self.settings.silence_timeout / READS_PER_TIMEOUT)
        return max(0.0, min(due) - now)

    def check(self, last_output: dict[int, float]) -> list[Hang]:
        """Sample and read heartbeat files if due, then return the workers that are hung."""
        now = time.monotonic()
        if now >= self.next_sample_at:
            self.sample()
            self.next_sample_at = now + self.settings.resource_interval
        if now >= self.next_read_at:
            self.read_heartbeats(now)
            self.next_read_at = now + self._read_interval()
        hangs = []
        for w in self.watched.values():
            hang = self._hang(w, now, last_output.get(w.local_rank))
            if hang:
                hangs.append(hang)
        return hangs

    def read_heartbeats(self, now: float) -> None:
        """Read every worker's heartbeat file once; note when each one's count last changed."""
        for w in self.watched.values():
            record = self._read(w)
            if record is None:
                continue
            if record.count != w.last_beat_count:
                w.last_beat_count, w.last_beat_at = record.count, now
            w.record = record
            if self.settings.learned is not None:
                self.settings.learned.observe(record)

    def records(self) -> dict[int, HeartbeatRecord]:
        """The latest read of each watched worker's heartbeat file, by local rank."""
        return {rank: w.record for rank, w in list(self.watched.items())}

    def _read_interval(self) -> float:
        """A tenth of the shortest timeout in force (sections included), at most HEARTBEAT_READ_INTERVAL."""
        s = self.settings
        timeouts = [t for t in (s.heartbeat_timeout, s.startup_timeout) if t]
        if s.learned is not None:
            timeouts += [t for t in (s.learned.heartbeat, *s.learned.sections.values()) if t]
        timeouts += [t for w in self.watched.values() if (t := w.record.section_timeout)]
        return min([s.resource_interval, HEARTBEAT_READ_INTERVAL, *(t / READS_PER_TIMEOUT for t in timeouts)])

    @staticmethod
    def _read(watched: _Watched) -> HeartbeatRecord | None:
        if not watched.heartbeat_path:
            return None
        try:
            return heartbeat_file.read_record(watched.heartbeat_path)
        except (heartbeat_file.HeartbeatFileError, OSError):
            return None

    def _hang(self, watched: _Watched, now: float, last_output_at: float | None) -> Hang | None:
        """The first reason this worker counts as hung, or None.

        Inside a section with a timeout of its own, only that deadline counts. Otherwise: no
        first beat within --startup-timeout, no new beat within --heartbeat-timeout, or no
        output within --silence-timeout. A section entry or exit is a sign of life too.
        """
        record, learned = watched.record, self.settings.learned
        limit, whose = record.section_timeout, "its"
        if limit is None and learned is not None and record.section:
            # --heartbeat-timeout auto: inside a section only its learned deadline counts (none
            # until it is learned), so a long checkpoint never trips the step timeout.
            limit, whose = learned.section_timeout(record.section), "its learned"
            if limit is None:
                return None
        if limit is not None:
            inside = now - record.section_entered_ns / 1e9
            if inside <= limit or not self._still_in(watched, record):
                return None
            return Hang(
                watched.local_rank,
                f"hung in section '{record.section}' for {inside:.1f} s ({whose} timeout is {limit:.3g} s)",
                inside,
            )
        where = f", in section '{record.section}'" if record.section else ""
        alive_at = max(watched.started_at, record.section_changed_ns / 1e9)
        startup = self.settings.startup_timeout
        if startup and watched.heartbeat_path and record.count == 0 and now - alive_at > startup:
            silent = now - alive_at
            since = "starting" if alive_at == watched.started_at else "its last section change"
            return Hang(
                watched.local_rank,
                f"sent no first heartbeat in {silent:.1f} s since {since} (--startup-timeout {startup:g}){where}",
                silent,
            )
        timeout, flag = (
            self.settings.heartbeat_timeout,
            f"--heartbeat-timeout {self.settings.heartbeat_timeout:g}" if self.settings.heartbeat_timeout else "",
        )
        if timeout is None and learned is not None and learned.heartbeat is not None:
            timeout, flag = learned.heartbeat, f"--heartbeat-timeout auto, learned {learned.heartbeat:.2f} s"
        if timeout and watched.last_beat_at is not None and record.count:
            silent = now - max(watched.last_beat_at, alive_at)
            if silent > timeout:
                return Hang(watched.local_rank, f"sent no heartbeat for {silent:.1f} s ({flag}){where}", silent)
        return self._silence_hang(watched, now, max(last_output_at or 0.0, alive_at), where)

    def quiet_for(self, local_rank: int, last_output_at: float | None, now: float) -> float:
        """Seconds since the worker last showed progress: a new heartbeat, a line of output, a section
        entered or left (`job.section`), or its start. 0 for a worker not watched."""
        w = self.watched.get(local_rank)
        if w is None:
            return 0.0
        signs = [w.started_at, w.last_beat_at or 0.0, w.record.section_changed_ns / 1e9, last_output_at or 0.0]
        return max(0.0, now - max(signs))

    def section(self, local_rank: int) -> str:
        """The section the worker was in at the last read of its heartbeat file ("" for none)."""
        w = self.watched.get(local_rank)
        return w.record.section if w is not None else ""

    def _still_in(self, watched: _Watched, record: HeartbeatRecord) -> bool:
        """Confirm a section hang with a second read: a read that raced a section change
        could mix two sections' fields, and nobody is killed on a torn read."""
        again = self._read(watched)
        return again is not None and (again.section, again.section_entered_ns) == (
            record.section,
            record.section_entered_ns,
        )

    def _silence_hang(
        self, watched: _Watched, now: float, last_output_at: float | None, where: str = ""
    ) -> Hang | None:
        timeout = self.settings.silence_timeout
        if not timeout:
            return None
        silent = now - max(last_output_at or 0.0, watched.started_at)
        if silent > timeout:
            return Hang(
                watched.local_rank, f"printed nothing for {silent:.1f} s (--silence-timeout {timeout:g}){where}", silent
            )
        return None

    def sample(self) -> None:
        """CPU, RSS, threads and status of every worker, and the host's available memory."""
        self.host_available = psutil.virtual_memory().available
        now = time.monotonic()
        gpus = self.gpu() if self.gpu is not None else None
        for w in self.watched.values():
            try:
                if w.process is None:
                    w.process = psutil.Process(w.pid)
                    w.process.cpu_percent(None)  # the first call only starts the measurement
                with w.process.oneshot():
                    times = w.process.cpu_times()
                    w.sample = ResourceSample(
                        cpu_percent=w.process.cpu_percent(None),
                        cpu_seconds=times.user + times.system,
                        rss=w.process.memory_info().rss,
                        threads=w.process.num_threads(),
                        status=w.process.status(),
                        at=now,
                    )
                if gpus is not None:
                    tree = {w.pid} | {child.pid for child in w.process.children(recursive=True)}
                    usage = worker_usage(gpus, tree)
                    w.sample.gpu_memory, w.sample.gpu_utilization = usage.memory, usage.utilization
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
                "likely killed by the out-of-memory killer: the host had "
                f"{min(available, self.host_available) / MIB:.0f} MiB "
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


def heartbeat_path(rank_dir: Path) -> str:
    path = rank_dir / "heartbeat"
    heartbeat_file.create(path)
    return str(path)
