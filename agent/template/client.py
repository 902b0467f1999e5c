"""Fast restarts: workers forked from a template process that has already imported torch.

One template per node, started by the agent as `python -u <path>/agent/worker_side/bootstrap.py template`
(by file path, like every worker, so nothing named `agent` on the user's path can shadow
rally's package). It imports the modules named by `--preload` once (default: torch) and
then waits on a UNIX socket for the agent's requests. For each request it forks; the child
turns itself into exactly what `python -u bootstrap.py script train.py ARGS` would have
been, then returns to bootstrap.py's top level, which runs the script the same way for both
paths (see bootstrap.py). A worker reaches the script in milliseconds instead of seconds.

What the child resets, in this order (`_become_worker`):

* parent-death signal: SIGKILL when the template dies (the template itself gets SIGKILL when
  the agent dies), then its own session and process group (setsid);
* signal dispositions and the signal mask, back to what the template had when its
  interpreter started, which is what a fresh worker gets: Python's own SIGINT handler,
  SIGPIPE and SIGXFSZ ignored, every signal the agent ignores still ignored, all else default
  (the agent sends what it ignores and blocks at each request, in case that changed);
* stdin, stdout, stderr: the fds the agent sent (log files or pipes), new `sys.std*` objects
  built the way the interpreter builds them; the control socket and every other fd the
  template opened are closed (fds a preloaded module opened for itself are kept);
* working directory, `os.environ` replaced wholesale (C environment included), the command
  line in /proc/PID/cmdline and `sys.orig_argv` (so `ps` and psutil show the worker's argv);
* every RNG a fresh process seeds from entropy: Python's `random` (already reseeded by the
  interpreter at fork), numpy's global RandomState, torch's default CPU generator (a fresh
  `import torch` seeds it from entropy; `torch.initial_seed()` differs per process), the
  `multiprocessing` auth key, and `multiprocessing`'s notion of the start directory.

The template stays single-threaded and never touches CUDA: before each fork it checks
(threads in /proc/self/task and `threading`, `torch.cuda.is_initialized()`) and refuses if
the check fails; the agent then warns once and starts workers plainly. `import numpy` (via
torch) starts OpenBLAS's thread pool when OMP_NUM_THREADS/OPENBLAS_NUM_THREADS do not limit
it to one thread; OpenBLAS stops that pool in its own pthread_atfork handler, so the template
makes one throw-away fork after preloading and the pool is gone (children restart it on first
use, with the same size a fresh process would pick).

The template reaps its children and reports `(pid, wait status)` to the agent; the agent's
`ForkedChild` behaves like `processes.ChildProcess` (pidfd, poll, wait, returncode, times).

The code is in four modules of agent/template/: `wire` (the messages both sides exchange),
`server` (the template process; only the standard library, since it runs in every worker),
`connection` (the agent's end of the socket) and this one, the agent's side (`TemplateClient`,
`ForkedChild`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeAlias

from rally.agent.base import linux
from rally.agent.base.spec import JobSpec
from rally.agent.template import wire as template_wire
from rally.agent.template.connection import (
    Connection,
    TemplateGone,
    TemplateRefused,
    TemplateStuck,
    status_to_returncode,
)
from rally.agent.template.server import why_fork_is_unsafe  # noqa: F401 - re-exported for callers

Stdio: TypeAlias = "int | IO[Any] | None"  # a worker's stdout or stderr, as subprocess.Popen takes it

# Variables that differ from worker to worker or round to round (see workers.worker_env);
# a difference in any other variable means the template's environment is not the worker's.
PER_WORKER_VARIABLES = frozenset(
    {
        "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)  # fmt: skip
PER_WORKER_PREFIXES = ("TORCHELASTIC_", "RALLY_")

# Room in the template's environment memory for each worker's larger one (see _rewrite_proc_area).
ENV_SPACE_VARIABLE = "RALLY_TEMPLATE_SPACE"
ENV_SPACE = 16384
REPORT_TIMEOUT = 5.0  # between a worker's exit and the template's report of it


# How long the template may take to exit by itself when the agent stops it.
STOP_GRACE_SECONDS = 0.2


def bootstrap_request(argv: Sequence[str], bootstrap: str) -> tuple[str, str, list[str]] | None:
    """(mode, target, args) if `argv` is `PYTHON -u BOOTSTRAP MODE TARGET ARGS...`, else None."""
    if len(argv) >= 5 and argv[1] == "-u" and argv[2] == bootstrap and argv[3] in ("script", "module", "path"):
        return argv[3], argv[4], list(argv[5:])
    return None


def template_command(python_exec: str, bootstrap: str, worker_argv: Sequence[str]) -> list[str]:
    """The template's argv, padded to the worker's length so the worker's argv can replace it."""
    argv = [python_exec, "-u", bootstrap, "template"]
    missing = sum(len(os.fsencode(a)) + 1 for a in worker_argv) - sum(len(os.fsencode(a)) + 1 for a in argv)
    if missing >= 1:
        argv.append(" " * (missing - 1))
    return argv


def preload_path0(mode: str, target: str, cwd: str) -> str:
    """sys.path[0] as the worker will have it (see bootstrap.run)."""
    if mode == "module":
        return cwd
    return os.path.dirname(os.path.abspath(os.path.join(cwd, target)))


class ForkedChild:
    """A worker forked by the template, with `processes.ChildProcess`'s interface.

    The exit status comes from the template, which reaps its children. If the template
    died first, the worker (killed by its parent-death signal) was re-parented to the agent,
    a child subreaper, and is reaped through its pidfd instead.
    """

    def __init__(self, connection: Connection, pid: int, pidfd: int, started_at: float) -> None:
        self.connection = connection
        self.pid = pid
        self.pidfd = pidfd
        self.started_at = started_at
        self.ended_at: float | None = None
        self.returncode: int | None = None
        self._watch = os.dup(pidfd)  # still usable after close(), for a late wait()

    def _has_exited(self, timeout: float | None = 0) -> bool:
        return self._watch < 0 or linux.readable(self._watch, timeout)

    def poll(self) -> int | None:
        """The returncode once the worker has exited (call when the pidfd is readable)."""
        if self.returncode is not None:
            return self.returncode
        self.connection.drain()
        if not self._has_exited():
            return None
        found = self.connection.exit_status(self.pid, REPORT_TIMEOUT)
        if found is not None:
            status, ended = found
            self._finish(status_to_returncode(status), ended)
            return self.returncode
        if self.connection.alive():  # exited, but the template does not say so: it is broken
            self.connection.popen.kill()
            # wait: after_kill: after popen.kill()
            self.connection.popen.wait()
        self._reap_after_template_death()
        return self.returncode

    def _reap_after_template_death(self) -> None:
        deadline = time.monotonic() + 2.0
        while True:
            try:
                # wait: not_a_wait: WNOHANG
                result = os.waitid(os.P_PIDFD, self._watch, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                result = None  # not (yet) re-parented to us
            if result is not None:
                if result.si_code == os.CLD_EXITED:
                    code = result.si_status
                else:
                    code = -result.si_status
                self._finish(code, time.monotonic())
                return
            if time.monotonic() > deadline:
                # Someone else reaped it; the template's death is the cause (SIGKILL).
                self._finish(-signal.SIGKILL, time.monotonic())
                return
            # wait: short: 10 ms, 2 s deadline
            time.sleep(0.01)

    def _finish(self, returncode: int, ended_at: float) -> None:
        self.returncode = returncode
        self.ended_at = ended_at
        if self._watch >= 0:
            os.close(self._watch)
            self._watch = -1

    def wait(self, timeout: float | None = None) -> int | None:
        """The returncode once the worker has exited; None if it is still there after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and (deadline is None or time.monotonic() < deadline):
            if self._has_exited(None if deadline is None else max(0.0, deadline - time.monotonic())):
                # wait: not_a_wait: ForkedChild.poll
                self.poll()
        return self.returncode

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def __del__(self) -> None:
        if getattr(self, "_watch", -1) >= 0:
            try:
                os.close(self._watch)
            except OSError:
                pass


class TemplateClient:
    """The agent's handle on its node's template: start it, fork workers from it, replace it if it dies.

    `spawn` has `processes.spawn`'s signature and falls back to it (a plain start) for
    commands the template cannot run (not rally's bootstrap), when the template refuses
    (threads, CUDA), or when the worker's environment differs from the template's in a
    variable that is not per-worker.
    """

    def __init__(
        self,
        python_exec: str,
        bootstrap: str,
        worker_argv: Sequence[str],
        preload: Sequence[str],
        env: dict[str, str],
        cwd: str,
        warn: Callable[[str], None],
        announce: Callable[[str], None] | None = None,
    ) -> None:
        """`warn` hears what went wrong; `announce` what a long wait for the template waits for
        (agent/rounds/node_waits.py; default: the console)."""
        if announce is None:
            from rally.agent.display import console

            announce = console.say
        self.bootstrap = bootstrap
        self.argv = template_command(python_exec, bootstrap, worker_argv)
        self.python_exec = python_exec
        self.preload = list(preload)
        self.env = dict(env)
        self.cwd = cwd
        self.warn = warn
        self.announce = announce
        request = bootstrap_request(worker_argv, bootstrap)
        self.path0 = preload_path0(request[0], request[1], cwd) if request else cwd
        self.connection: Connection | None = None
        self.disabled: str | None = None  # why workers start plainly from now on
        self._warned: set[str] = set()
        self.forks = 0

    @classmethod
    def for_job(
        cls,
        spec: JobSpec,
        base_env: dict[str, str],
        warn: Callable[[str], None] | None = None,
        announce: Callable[[str], None] | None = None,
    ) -> TemplateClient | None:
        """The template for this job, or None when workers start plainly (--no-preload, --no-python)."""
        preload = getattr(spec, "preload", None)
        if preload is None or not spec.is_python:
            return None
        from rally.agent.base.spec import BOOTSTRAP, shared_worker_env

        if warn is None:
            from rally.agent.display import console

            warn = console.warn
        cwd = os.path.abspath(spec.cwd or os.getcwd())
        return cls(
            spec.python_exec, BOOTSTRAP, spec.command(), preload, shared_worker_env(spec, base_env), cwd, warn, announce
        )

    @classmethod
    def started_for_job(
        cls,
        spec: JobSpec,
        base_env: dict[str, str],
        warn: Callable[[str], None],
        announce: Callable[[str], None] | None = None,
    ) -> TemplateClient | None:
        """`for_job`, started at once so it preloads torch while the rendezvous runs; None (workers
        start plainly) when the job has none, or when it cannot start (said once, with `warn`)."""
        template = cls.for_job(spec, base_env, warn, announce)
        if template is None:
            return None
        try:
            template.start()
        except OSError as exc:
            warn(f"could not start the worker template ({exc}); starting workers plainly")
            return None
        return template

    # ------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Start the template; it preloads while the agent goes on (the first spawn waits)."""
        env = {**self.env, ENV_SPACE_VARIABLE: " " * ENV_SPACE}
        init = {"op": "init", "preload": self.preload, "path0": self.path0}
        self.connection = Connection(self.argv, env, self.cwd, init, self.announce)

    @property
    def pid(self) -> int | None:
        return self.connection.pid if self.connection is not None else None

    def helper_pids(self) -> set[int]:
        return {self.connection.pid} if self.connection is not None else set()

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """Stop the template at the agent's exit. Its workers are already stopped by then, so it
        gets only a moment (`grace`) to leave by itself: one still importing torch cannot notice the
        closed socket, and under SLURM's KillWait every second of exit counts."""
        if self.connection is not None:
            self.connection.close(timeout=grace)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warn(message)

    def _live_connection(self) -> Connection:
        connection = self.connection
        if connection is None:
            self.start()
        elif not connection.alive():
            self.warn(f"the worker template died ({connection.describe_death()}); starting a new one")
            connection.close(timeout=1.0)
            self.start()
        assert self.connection is not None
        return self.connection

    # ------------------------------------------------------------ spawning
    def spawn(
        self, argv: Sequence[str], env: dict[str, str], cwd: str | None, stdout: Stdio, stderr: Stdio
    ) -> Any:  # a ChildProcess, or a ForkedChild with its interface
        from rally.agent.guard import processes

        request = bootstrap_request(argv, self.bootstrap)
        if request is None or self.disabled or argv[0] != self.python_exec:
            return processes.spawn(argv, env, cwd, stdout, stderr)
        different = sorted(
            k
            for k in set(env) | set(self.env)
            if env.get(k) != self.env.get(k) and k not in PER_WORKER_VARIABLES and not k.startswith(PER_WORKER_PREFIXES)
        )
        if different:
            self._warn_once(
                "env",
                "starting workers plainly: their environment differs from the worker template's in "
                f"{', '.join(different)}",
            )
            return processes.spawn(argv, env, cwd, stdout, stderr)
        for attempt in (1, 2):
            connection = self._live_connection()
            try:
                child = self._fork(connection, argv, request, env, cwd, stdout, stderr)
                self.forks += 1
                return child
            except TemplateRefused as exc:
                self.disabled = str(exc)
                self._warn_once(
                    "refused", f"starting workers plainly from now on: {exc} (forking it would not be safe)"
                )
                break  # left running until stop(): workers it already forked die with it
            except TemplateGone as exc:
                connection.close(timeout=1.0)  # kills it if it is stuck: workers it forked die with it
                if attempt == 2 or isinstance(exc, TemplateStuck):
                    self.disabled = str(exc)
                    self._warn_once("gone", f"starting workers plainly from now on: {exc}")
                    break
                else:
                    self.warn(f"the worker template failed ({exc}); starting a new one")
                    self.start()
        return processes.spawn(argv, env, cwd, stdout, stderr)

    def _fork(
        self,
        connection: Connection,
        argv: Sequence[str],
        request: tuple[str, str, list[str]],
        env: dict[str, str],
        cwd: str | None,
        stdout: Stdio,
        stderr: Stdio,
    ) -> ForkedChild:
        # wait: bounded, said by agent/template/connection.py Connection._await: READY_TIMEOUT (300 s: importing
        # torch on a loaded node)
        ready = connection.wait_ready()
        if ready.get("failed"):
            for name, error in ready["failed"].items():
                self._warn_once(f"preload:{name}", f"the worker template could not preload {name}: {error}")
        if ready.get("unsafe"):
            raise TemplateRefused(ready["unsafe"])
        stdio = [_fileno(0), _fileno(stdout, 1), _fileno(stderr, 2)]
        mode, target, args = request
        message = {
            "op": "spawn",
            "argv": list(argv),
            "mode": mode,
            "target": target,
            "args": args,
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "stdio": [fd is not None for fd in stdio],
            # What a plainly started worker would inherit from this thread right now.
            "ignored": sorted(template_wire.ignored_signals()),
            "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        }
        started = time.monotonic()
        pid, pidfd = connection.fork(message, [fd for fd in stdio if fd is not None])
        return ForkedChild(connection, pid, pidfd, started)


def _fileno(value: Stdio, default: int | None = None) -> int | None:
    """The fd a Popen-style stdio argument stands for (None: inherit ours; closed: None)."""
    if value is None:
        value = default
    if value is None:
        return None
    fd = value if isinstance(value, int) else value.fileno()
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd
