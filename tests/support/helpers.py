"""Shared utilities for the CLI-level tests: run rally as a user would, and check what is left behind.

Everything here uses real processes: `rally` is `sys.executable -m rally ...` in its own
session (so a test can always clean it up by process group), workers are plain-Python probe
scripts written into the test's tmp directory, and "is it gone?" is answered by pid with psutil
(a zombie counts as gone: it runs no code and holds no resources but its table entry).

Import what you need: ``from support.helpers import run_rally, write_probe, procs`` (the `procs`
fixture must be imported into the test module for pytest to see it).
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# Variables a launcher sets for its workers, or that configure rally itself. A test that runs
# inside some launcher (or with PET_*/RALLY_* exported) must not leak them into the job under test.
_LAUNCH_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PYTHON_EXEC",
}  # fmt: skip
_LAUNCH_PREFIXES = ("PET_", "RALLY_", "TORCHELASTIC_", "SLURM_")


def clean_env(**extra: str | None) -> dict[str, str]:
    """This process's environment without any launcher or rally settings, plus `extra`.

    A value of None removes the variable. rally comes from its installed package (`-m rally`),
    never from the repository on PYTHONPATH, so workers see nothing of rally on sys.path.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(start_mode_env())  # hook: RALLY_TEST_START_MODE, see start_mode_env
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# ---- hook for the worker template (agent/template/client.py, tests/test_template.py) ---------------
# RALLY_TEST_START_MODE=plain     every rally these helpers start runs with --no-preload:
#                                 each worker is a fresh `python` process;
# RALLY_TEST_START_MODE=template  workers are forked from the per-node template (--preload torch);
# unset                           rally's default (the template, for Python entry points).
# Run the suite once per mode to prove both starts behave the same.
START_MODES = {"plain": {"RALLY_NO_PRELOAD": "1"}, "template": {"RALLY_PRELOAD": "torch"}}


def start_mode_env() -> dict[str, str]:
    """The rally settings for the worker start mode chosen by RALLY_TEST_START_MODE."""
    mode = os.environ.get("RALLY_TEST_START_MODE", "")
    if mode and mode not in START_MODES:
        raise ValueError(f"RALLY_TEST_START_MODE={mode!r}: use one of {', '.join(START_MODES)}")
    return dict(START_MODES.get(mode, {}))


# ---- end of the hook ---------------------------------------------------------------------------


def rally_argv(args: Sequence[str], prefix: Sequence[str] = ()) -> list[str]:
    """`python -m rally ARGS` (after `prefix`, such as `ip netns exec NS`)."""
    return [*prefix, sys.executable, "-m", "rally", *map(str, args)]


@dataclass
class Result:
    """A finished rally run as a user sees it."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.argv)}\nexit {self.returncode} after {self.elapsed:.1f} s\n"
            f"--- stdout (last 3000 chars) ---\n{self.stdout[-3000:]}\n"
            f"--- stderr (last 5000 chars) ---\n{self.stderr[-5000:]}"
        )

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


def start_rally(
    args: Sequence[str],
    *,
    cwd: Path | str,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
    stdin: Any = subprocess.DEVNULL,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    prefix: Sequence[str] = (),
    text: bool = True,
) -> subprocess.Popen:
    """Start rally (or `argv`) in a new session (so a test can always kill its process group),
    text mode unless `text=False`; stdout and stderr piped unless given (a file, a terminal, or STDOUT to merge).
    The one way the tests start rally: run_rally, LiveRally, on_terminal and agents.start_agent
    use it."""
    return subprocess.Popen(
        argv or rally_argv(args, prefix),
        cwd=str(cwd),
        env=env if env is not None else clean_env(),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=text,
        errors="replace" if text else None,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float, started: float | None = None) -> Result:
    """Collect a started run's output; on timeout kill its session and fail with what it printed."""
    started = time.monotonic() if started is None else started
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        stdout, stderr = proc.communicate()
        result = Result(list(proc.args), -9, stdout, stderr, time.monotonic() - started)
        pytest.fail(f"rally did not finish within {timeout} s\n{result.describe()}")
    return Result(list(proc.args), proc.returncode, stdout, stderr, time.monotonic() - started)


def run_rally(
    args: Sequence[str],
    *,
    cwd: Path | str,
    env: dict[str, str] | None = None,
    timeout: float = 90,
    argv: list[str] | None = None,
    prefix: Sequence[str] = (),
) -> Result:
    """Run `rally ARGS...` (after `prefix`, such as `prlimit --as=N`; or any `argv`) to completion
    and return what it printed."""
    started = time.monotonic()
    proc = start_rally(args, cwd=cwd, env=env, argv=argv, prefix=prefix)
    try:
        return finish(proc, timeout, started)
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()


class OnTerminal:
    """rally on a pseudo-terminal (stdin, stdout and stderr), as in an interactive shell: its
    live view turns on. `read(timeout, until)` collects what it drew; `close()` kills it."""

    def __init__(self, args: Sequence[str], *, cwd: Path | str, env: dict[str, str]):
        self.controller, terminal = pty.openpty()
        try:
            self.proc = start_rally(args, cwd=cwd, env=env, stdin=terminal, stdout=terminal, stderr=terminal)
        finally:
            os.close(terminal)
        self.seen = b""

    def read(self, timeout: float, until: Callable[[bytes], object] | None = None) -> bytes:
        """Read until `until(all output so far)` holds, rally exits, or `timeout` s pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (until and until(self.seen)):
            if select.select([self.controller], [], [], 0.5)[0]:
                try:
                    chunk = os.read(self.controller, 65536)
                except OSError:  # the terminal closed: rally is gone
                    break
                if not chunk:
                    break
                self.seen += chunk
            elif self.proc.poll() is not None:
                break
        return self.seen

    def text(self) -> str:
        """What was drawn, without the terminal control codes."""
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.seen.decode(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
        self.proc.wait()
        os.close(self.controller)


def rally_status(
    args: Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> Result:
    """`rally status ARGS` as a user runs it, in a terminal 200 columns wide (so no line wraps):
    `env` is the whole environment (default: `clean_env()`), `cwd` the working directory (default: this one)."""
    return run_rally(
        ["status", *args], cwd=cwd or Path.cwd(), env={**(env or clean_env()), "COLUMNS": "200"}, timeout=timeout
    )


def run_probe(
    tmp_path: Path, args: Sequence[str], nproc: int = 1, env: dict[str, str] | None = None, timeout: float = 90
) -> Result:
    """`rally --standalone --nproc-per-node NPROC ARGS` in `tmp_path`, with PROBE_OUT=tmp_path/out
    (made here) where the probe scripts of the tests write what each worker saw."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return run_rally(
        ["--standalone", "--nproc-per-node", str(nproc), *args],
        cwd=tmp_path,
        env={**(env or clean_env()), "PROBE_OUT": str(out)},
        timeout=timeout,
    )


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def write_probe(path: Path, body: str, *, executable: bool = False) -> Path:
    """Write a small script (dedented); with `executable`, chmod +x (for --no-python)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body).lstrip("\n"))
    if executable:
        path.chmod(0o755)
    return path


def read_json_files(directory: Path, pattern: str) -> dict[str, dict]:
    """{file stem: parsed JSON} for the files matching `pattern` in `directory`."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob(pattern))}


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file, [] while it does not exist; a last line still being
    written (no closing brace yet) is left for the next read."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def read_events(log_dir: Path) -> list[dict]:
    """The tests' one events reader: every record of the agent's `<run>/events.jsonl` files under
    `log_dir` (--log-dir), oldest run first."""
    return [event for path in sorted(log_dir.glob("*/events.jsonl")) for event in read_jsonl(path)]


def free_port() -> int:
    """A port the OS says is free right now (bound to 127.0.0.1:0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(predicate: Callable[[], T], timeout: float, interval: float = 0.05) -> T:
    """The tests' one poll: `predicate`'s first truthy value within `timeout` s, else its last
    (falsy) value, for `assert eventually(...), context` or `found = eventually(...)`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
    show: Callable[[], str] | None = None,
) -> T:
    """`eventually`, failing the test (naming `what`, and what `show` returns) when `predicate` never holds."""
    value = eventually(predicate, timeout, interval)
    if not value:
        pytest.fail(f"timed out after {timeout:g} s waiting for {what}" + (f"\n{show()}" if show else ""))
    return value


def stop_every_thread(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped. The kill returns before that:
    the kernel wakes one thread to begin the stop, and on a loaded machine the others run on till
    it gets a core (one of a holder's threads answered a request sent after the kill so)."""
    os.kill(pid, signal.SIGSTOP)

    def running() -> list[str]:
        found = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                state = (task / "stat").read_text().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue  # a thread that ended meanwhile
            if state not in ("T", "t"):
                found.append(f"{task.name}: {state}")
        return found

    wait_for(
        lambda: not running(), timeout, 0.005, what=f"every thread of pid {pid} to stop", show=lambda: str(running())
    )


def is_alive(pid: int) -> bool:
    """True if `pid` is a running (non-zombie) process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(pids: Iterable[int], within: float) -> list[int]:
    """The pids still alive after waiting up to `within` seconds for all of them to go."""
    pids = list(pids)
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def describe_pids(pids: Iterable[int]) -> str:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {p.status()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            out.append(f"{pid} gone")
    return "; ".join(out)


class ProcessTracker:
    """Every process a test started or learned about; whatever is still alive at the end is SIGKILLed.

    Processes are remembered with their start time, so a recycled pid is never killed.
    """

    def __init__(self) -> None:
        self._procs: dict[int, float] = {}
        self._groups: list[int] = []

    def track(self, *pids: int) -> None:
        for pid in pids:
            try:
                self._procs[pid] = psutil.Process(pid).create_time()
            except psutil.NoSuchProcess:
                pass

    def track_group(self, pgid: int) -> None:
        """A session started by the test (rally in its own session): killed as a group at the end."""
        self._groups.append(pgid)
        self.track(pgid)

    def cleanup(self) -> None:
        for pgid in self._groups:
            try:
                if psutil.Process(pgid).create_time() == self._procs.get(pgid):
                    os.killpg(pgid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                pass
        for pid, created in self._procs.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
            except psutil.Error:
                pass


@pytest.fixture
def procs() -> Iterator[ProcessTracker]:
    tracker = ProcessTracker()
    try:
        yield tracker
    finally:
        tracker.cleanup()


def console_lines(text: str, prefix: str) -> list[str]:
    """The lines of `text` that start with `prefix`, with the prefix removed."""
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "2m") mounted at `path` for the block, unmounted after: a disk
    that fills up for real. Skips the test where this machine does not allow mounting."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def form_one_round_at_once(nodes: Sequence[Any], timeout: float) -> None:
    """Every in-process `Rendezvous` of `nodes` calls `next_round()` at the same moment, one thread
    each (how the scale tests load a store); fails the test unless each got its own group rank."""
    ranks: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Event()

    def run(node: Any) -> None:
        start.wait()
        try:
            rank = node.next_round().group_rank
            with lock:
                ranks.append(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(node,), daemon=True) for node in nodes]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join(timeout)
    assert not errors, errors[:3]
    assert sorted(ranks) == list(range(len(nodes))), "every node got its own group rank"


@contextlib.contextmanager
def over_and_over(steps: Sequence[tuple[Callable[[], None], float]]) -> Iterator[None]:
    """While the block runs, a daemon thread does each step's action then waits its pause, over and
    over (a signal every 0.5 ms; SIGSTOP, 60 ms, SIGCONT, 1 ms): a disturbance kept up for the whole
    block, stopped and joined on the way out."""
    over = threading.Event()

    def repeat() -> None:
        while not over.is_set():
            for act, pause in steps:
                act()
                # wait: short: the step's pause, ended at once when the block ends
                over.wait(pause)

    thread = threading.Thread(target=repeat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        over.set()
        # wait: short: one round of steps
        thread.join(timeout=10)


def writable_memory_cgroup_v1() -> Path | None:
    """This process's cgroup-v1 memory cgroup if the test may make groups in it (a real memory limit,
    the kernel's OOM killer), else None (cgroup v2 only, or not writable: the test skips)."""
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x)
    except (OSError, StopIteration):
        return None
    base = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
    return base if (base / "cgroup.procs").exists() and os.access(base, os.W_OK) else None
