"""Shared plumbing for the benchmarks: starting launchers, cleaning up, polling, statistics.

Process hygiene (every benchmark goes through `Job`):
* each launcher starts in its own session (process group = its pid);
* every process started for a run carries `RALLY_BENCH_TOKEN=<uuid of this bench run>` in its
  environment (launchers pass their environment on to workers), so cleanup can find exactly
  the processes this run started, by pid, even when a worker left its parent's group;
* cleanup SIGKILLs the launcher's descendants (psutil, by pid, checked against pid reuse),
  the launcher's process group, then sweeps for leftovers carrying the token. No process
  is ever matched by name.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORKERS = BENCH_DIR / "workers"
SHIM = BENCH_DIR / "shim" / "agent_shim.py"
RESULTS = BENCH_DIR / "results"

TOKEN = uuid.uuid4().hex  # marks every process this bench run starts
TOKEN_VAR = "RALLY_BENCH_TOKEN"

LAUNCHERS = ("rally", "torchrun")


# ------------------------------------------------------------------ launchers and environment
def launcher_exe(name: str) -> str:
    """The launcher's console script in this interpreter's bin directory (not a pyenv shim,
    whose bash wrapper would add ~0.1 s to every start)."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"'{name}' is not installed (pip install -e . for rally; torch ships torchrun)")
    return found


def launcher_cmd(name: str) -> list[str]:
    return [launcher_exe(name)]


def bench_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every launcher gets: the caller's, minus launcher settings that would
    change what is measured, plus the same fixed settings for both launchers."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "RALLY_", "TORCHELASTIC_", "SLURM_"))
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOGLEVEL")
    }
    env.update(
        {
            TOKEN_VAR: TOKEN,
            # Both launchers would set it for nproc > 1 anyway; fixed here so nproc 1 is alike.
            "OMP_NUM_THREADS": "1",
            # A TCPStore client reverse-resolves its peer; where the resolver drops queries a
            # connect stalls 5 s (DESIGN.md). rally sets this for itself; give both the same.
            "RES_OPTIONS": "timeout:1 attempts:1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    env.update(extra or {})
    return env


def free_port() -> int:
    """A port the OS assigns on 127.0.0.1 (bind to 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ processes
_LIVE: dict[int, Job] = {}


@dataclass
class Job:
    """One launcher process (or any process the bench starts) and everything under it."""

    name: str
    popen: subprocess.Popen
    t_start: float  # time.time() right before the process was created
    out_path: Path
    err_path: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: Path,
        log_dir: Path,
    ) -> Job:
        log_dir.mkdir(parents=True, exist_ok=True)
        out_path, err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            t_start = time.time()
            popen = subprocess.Popen(
                list(argv),
                env=env,
                cwd=str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        job = cls(name, popen, t_start, out_path, err_path)
        _LIVE[popen.pid] = job
        return job

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def process(self) -> psutil.Process | None:
        try:
            return psutil.Process(self.pid)
        except psutil.Error:
            return None

    def refresh(self) -> list[psutil.Process]:
        """Remember every current descendant (workers may leave the launcher's group)."""
        proc = self.process()
        if proc is None:
            return []
        try:
            children = proc.children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            self.seen.setdefault(child.pid, child)
        return children

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the launcher, its group and every descendant ever seen; reap the launcher."""
        self.refresh()
        for proc in list(self.seen.values()):
            try:
                proc.kill()  # psutil refuses if the pid was reused by another process
            except psutil.Error:
                pass
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.pop(self.pid, None)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the launcher (as a user's Ctrl-C would), wait `grace`, then kill everything."""
        self.refresh()
        if self.alive():
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.wait(grace)
        self.kill()
        return self.popen.returncode

    def stderr(self) -> str:
        try:
            return self.err_path.read_text(errors="replace")
        except OSError:
            return ""

    def stdout(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        text = (self.stdout() + "\n" + self.stderr()).strip().splitlines()
        return "\n".join(text[-lines:])


def short_command(cmdline: list[str]) -> str:
    """'orphan_guard.py' for `python .../orphan_guard.py`, 'bootstrap.py template' for
    `python -u .../bootstrap.py template`: enough to say what a helper process is."""
    args = [a for a in cmdline[1:] if a not in ("-u", "-B", "-E", "-s")]
    if args[:1] == ["-m"]:
        return " ".join(args[1:2])
    return " ".join([Path(args[0]).name, *args[1:2]]) if args else Path(cmdline[0]).name if cmdline else "?"


def sweep() -> list[int]:
    """Kill any process still carrying this bench run's token (by pid); return their pids."""
    me = os.getpid()
    killed = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(TOKEN_VAR) == TOKEN:
                proc.kill()
                killed.append(proc.pid)
        except psutil.Error:
            pass
    for pid in killed:
        try:
            psutil.Process(pid).wait(timeout=5)
        except psutil.Error:
            pass
    return killed


def cleanup_all() -> list[int]:
    for job in list(_LIVE.values()):
        job.kill()
    return sweep()


# ------------------------------------------------------------------ waiting and files
def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_float(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def run_dir(root: Path, *parts: str) -> Path:
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    data = sorted(values)
    if not data:
        return math.nan
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def summary(values: Iterable[float]) -> dict[str, float | int]:
    data = [v for v in values if v is not None and not math.isnan(v)]
    if not data:
        return {"n": 0}
    return {
        "n": len(data),
        "median": statistics.median(data),
        "min": min(data),
        "max": max(data),
        "p99": percentile(data, 99),
        "mean": statistics.fmean(data),
    }


@dataclass
class Figure:
    """One row of the results table: a measured quantity for both launchers.

    `samples` hold values in `unit`. `stat` says which statistic the row compares (median,
    or p99). A launcher with no samples shows its `notes` entry (e.g. "did not converge").
    `target` is the goal for rally, checked by `check` on (rally stat, torchrun stat) or
    by the benchmark itself (`met` set directly).
    """

    bench: str
    name: str
    unit: str
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in LAUNCHERS})
    stat: str = "median"
    notes: dict[str, str] = field(default_factory=dict)
    target: str = ""
    met: bool | None = None
    lower_is_better: bool = True
    comment: str = ""
    # For a launcher that never finished: the time limit, so the ratio can say "< x".
    censored_at: dict[str, float] = field(default_factory=dict)

    def value(self, launcher: str) -> float | None:
        s = summary(self.samples.get(launcher, []))
        if not s["n"]:
            return None
        return s["p99"] if self.stat == "p99" else s["median"]

    def ratio(self) -> tuple[float | None, str]:
        """rally / torchrun of the row's statistic; ('<', bound) when torchrun never finished."""
        r, t = self.value("rally"), self.value("torchrun")
        if r is not None and t is not None and t > 0:
            return r / t, ""
        if r is not None and t is None and "torchrun" in self.censored_at:
            return r / self.censored_at["torchrun"], "<"
        return None, ""

    def to_json(self) -> dict[str, Any]:
        ratio, qualifier = self.ratio()
        return {
            "bench": self.bench,
            "name": self.name,
            "unit": self.unit,
            "stat": self.stat,
            "samples": self.samples,
            "summary": {k: summary(v) for k, v in self.samples.items()},
            "notes": self.notes,
            "censored_at": self.censored_at,
            "ratio_rally_over_torchrun": ratio,
            "ratio_qualifier": qualifier,
            "target": self.target,
            "met": self.met,
            "comment": self.comment,
        }


# ------------------------------------------------------------------ one bench run's context
@dataclass
class Context:
    """What every benchmark needs: the mode's sizes, a scratch directory, a place for raw data."""

    quick: bool
    root: Path
    params: dict[str, Any]
    say: Callable[[str], None]
    raw: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    settle_limit: float = 10.0

    def record(self, bench: str, run: dict[str, Any]) -> dict[str, Any]:
        self.raw.setdefault(bench, []).append(run)
        return run

    def settle(self) -> float:
        """Wait (bounded) until the machine is not busy; return the CPU busy % last seen.

        Other processes on this 2-core machine distort every figure; each run records how
        busy the machine was just before it started.
        """
        deadline = time.monotonic() + self.settle_limit
        while True:
            busy = psutil.cpu_percent(interval=0.3)
            if busy < 40 or time.monotonic() >= deadline:
                return busy


def launcher_order(rep: int) -> tuple[str, ...]:
    """Alternate which launcher goes first (ABBA), so slow drift does not favour one."""
    return LAUNCHERS if rep % 2 == 0 else tuple(reversed(LAUNCHERS))


def error_run(run: dict[str, Any], job: Job | None, message: str) -> dict[str, Any]:
    run["ok"] = False
    run["error"] = message
    if job is not None:
        run["log_tail"] = job.tail()
    return run


# ------------------------------------------------------------------ launcher log timestamps
_RALLY_STAMP = r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) "
_GLOG_STAMP = r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ [^\n]*?"


def _nearest_day(candidate, reference: float) -> float:  # datetime
    """A wall-clock time read without (all of) its date: the day that puts it nearest `reference`."""
    import datetime as dt

    options = [candidate + dt.timedelta(days=k) for k in (-1, 0, 1)]
    return min((o.timestamp() for o in options), key=lambda t: abs(t - reference))


def rally_line_time(text: str, pattern: str, reference: float) -> float | None:
    """time.time() of rally's first `HH:MM:SS.mmm rally: <pattern>` line (rally stamps its
    lines when stderr is not a terminal); `reference` is any time.time() near it."""
    import datetime as dt
    import re

    m = re.search(_RALLY_STAMP + pattern, text, re.M)
    if not m:
        return None
    h, mi, s, ms = (int(x) for x in m.groups()[:4])
    day = dt.datetime.fromtimestamp(reference)
    return _nearest_day(day.replace(hour=h, minute=mi, second=s, microsecond=ms * 1000), reference)


def glog_line_time(text: str, pattern: str, reference: float) -> float | None:
    """time.time() of torch's first glog-style `LMMDD HH:MM:SS.uuuuuu PID file:line] <pattern>` line."""
    import datetime as dt
    import re

    m = re.search(_GLOG_STAMP + pattern, text, re.M)
    if not m:
        return None
    mo, d, h, mi, s, us = (int(x) for x in m.groups()[:6])
    day = dt.datetime.fromtimestamp(reference)
    return _nearest_day(day.replace(month=mo, day=d, hour=h, minute=mi, second=s, microsecond=us), reference)


def commit() -> str:
    """The commit of the rally tree being measured."""
    from bench.run import git

    return git("rev-parse", "HEAD").strip()


def run_header(title: str, module: str, argv: list[str], started: str, load_start: tuple[float, ...]) -> str:
    """The first line of a side-by-side bench's results file: when, where, which commit, the exact
    command, and the load average at the start and the end (this machine is often shared)."""
    load_end = os.getloadavg()
    return (
        f"{title}, {started}, {os.cpu_count()} CPUs, rally at `{commit()[:10]}`, "
        f"`python -m {module} {' '.join(argv)}`; load average at the start "
        f"{', '.join(f'{x:.1f}' for x in load_start)}, at the end {', '.join(f'{x:.1f}' for x in load_end)}"
    )
