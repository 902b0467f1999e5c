"""Fast restarts: workers forked from a template process that has already imported torch.

One template per node, started by the agent as ``python -u <path>/agent/bootstrap.py template``
(by file path, like every worker, so nothing named `agent` on the user's path can shadow
rally's package). It imports the modules named by ``--preload`` once (default: torch) and
then waits on a UNIX socket for the agent's requests. For each request it forks; the child
turns itself into exactly what ``python -u bootstrap.py script train.py ARGS`` would have
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
  ``import torch`` seeds it from entropy; ``torch.initial_seed()`` differs per process), the
  `multiprocessing` auth key, and `multiprocessing`'s notion of the start directory.

The template stays single-threaded and never touches CUDA: before each fork it checks
(threads in /proc/self/task and `threading`, `torch.cuda.is_initialized()`) and refuses if
the check fails; the agent then warns once and starts workers plainly. `import numpy` (via
torch) starts OpenBLAS's thread pool when OMP_NUM_THREADS/OPENBLAS_NUM_THREADS do not limit
it to one thread; OpenBLAS stops that pool in its own pthread_atfork handler, so the template
makes one throw-away fork after preloading and the pool is gone (children restart it on first
use, with the same size a fresh process would pick).

The template reaps its children and reports ``(pid, wait status)`` to the agent; the agent's
`ForkedChild` behaves like `processes.ChildProcess` (pidfd, poll, wait, returncode, times).

Protocol, over a SOCK_STREAM socketpair (the template's stdin at start): each message is an
8-byte header (body length, fd count), a JSON body, and fds passed with SCM_RIGHTS.

    agent -> template   {"op": "init", "preload": [...], "path0": DIR}
                        {"op": "spawn", "argv", "mode", "target", "args", "env", "cwd"}
                        + fds stdin, stdout, stderr
    template -> agent   {"op": "ready", "preloaded", "failed", "threads", "seconds"}
                        {"op": "spawned", "pid"} + the child's pidfd  |  {"op": "refused", "reason"}
                        {"op": "exit", "pid", "status", "time"}

The template half of this file imports only the standard library (it runs in every worker).
"""

from __future__ import annotations

import array
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Sequence

# ================================================================ protocol (both sides)
_HEADER = struct.Struct("!II")  # body length, number of fds
_MAX_FDS = 8


def send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body), len(fds)) + body
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sent = sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One whole message and the fds that came with it (close-on-exec); None at end of file."""
    fds: list[int] = []
    header = b""
    try:
        while len(header) < _HEADER.size:
            chunk, ancdata, flags, _ = sock.recvmsg(
                _HEADER.size - len(header), socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(data[: len(data) - len(data) % received.itemsize])
                    fds.extend(received)
            if flags & socket.MSG_CTRUNC:
                raise ConnectionError("file descriptors were cut off in transit")
            if not chunk:
                if header:
                    raise ConnectionError("the connection closed in the middle of a message")
                return None
            header += chunk
        length, _count = _HEADER.unpack(header)
        body = bytearray()
        while len(body) < length:
            chunk = sock.recv(min(length - len(body), 1 << 20))
            if not chunk:
                raise ConnectionError("the connection closed in the middle of a message")
            body += chunk
        return json.loads(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# ================================================================ the template process
_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def why_fork_is_unsafe() -> str | None:
    """Why forking this process now would not give a sound child; None when it is safe."""
    tasks, python_threads = _thread_count(), threading.active_count()
    if tasks > 1 or python_threads > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        extra = f" (Python threads: {', '.join(names)})" if names else " (started by native code)"
        return f"the template has {max(tasks, python_threads)} threads{extra}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "CUDA is initialised in the template"
    return None


def _open_fds() -> set[int]:
    """This process's open fds (not counting the one used to list them)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    found = set()
    for name in names:
        try:
            os.readlink(f"/proc/self/fd/{name}")  # the listing's own fd is closed by now
        except OSError:
            continue
        found.add(int(name))
    return found


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether `fd` becomes readable within `timeout` seconds (None: wait for ever)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


class _Template:
    """The template's state; `serve()` is its main loop."""

    def __init__(self) -> None:
        # What a fresh worker starts with, recorded before this process changes anything:
        # the interpreter's start-up dispositions (SIG_IGN inherited from the agent, Python's
        # SIGINT handler, SIGPIPE/SIGXFSZ ignored) and the inherited signal mask.
        self.initial_handlers: dict[int, Any] = {}
        for signum in signal.valid_signals():
            if signum in (signal.SIGKILL, signal.SIGSTOP):
                continue
            handler = signal.getsignal(signum)
            if handler is not None:
                self.initial_handlers[signum] = handler
        self.initial_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.pid = os.getpid()
        # The control socket arrives as stdin; stdin itself becomes /dev/null.
        self.sock = socket.socket(fileno=os.dup(0))
        self.sock.set_inheritable(False)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        self.unbuffered = bool(getattr(sys.stdout, "write_through", True))
        self.wake_r = self.wake_w = -1
        self.keep_fds: set[int] = set()
        self.poller: select.epoll | None = None

    # ------------------------------------------------------------ start-up
    def start(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, signal.SIG_IGN)  # the agent decides when workers stop
        try:
            received = recv_message(self.sock)
        except OSError:
            received = None
        if received is None:
            os._exit(0)
        init, fds = received
        for fd in fds:
            os.close(fd)
        started = time.monotonic()
        preloaded, failed = self._preload(init.get("preload", []), init.get("path0"))
        if _thread_count() > 1:
            self._quiesce_native_pools()
        # fds opened by preloaded modules belong to them (kept in the children); the ones
        # opened from here on belong to the template (closed in the children).
        self.keep_fds = _open_fds() - {0, 1, 2, self.sock.fileno()}
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd carries it
        self.poller = select.epoll()
        self.poller.register(self.sock.fileno(), select.EPOLLIN)
        self.poller.register(self.wake_r, select.EPOLLIN)
        self._send(
            {
                "op": "ready",
                "preloaded": preloaded,
                "failed": failed,
                "threads": _thread_count(),
                "unsafe": why_fork_is_unsafe(),
                "seconds": round(time.monotonic() - started, 3),
            },
        )

    @staticmethod
    def _preload(names: list[str], path0: str | None) -> tuple[list[str], dict[str, str]]:
        """Import the named modules, with sys.path[0] where the worker will have it."""
        import importlib
        import traceback

        saved = sys.path[0]
        if path0:
            sys.path[0] = path0
        preloaded, failed = [], {}
        try:
            for name in names:
                try:
                    importlib.import_module(name)
                    preloaded.append(name)
                except BaseException as exc:  # noqa: BLE001 - reported to the agent, not fatal
                    failed[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        finally:
            sys.path[0] = saved
        return preloaded, failed

    @staticmethod
    def _quiesce_native_pools() -> None:
        """Fork once and discard the child, so pthread_atfork handlers stop native thread pools.

        OpenBLAS (loaded by numpy, which torch imports) starts its worker threads when it is
        loaded and joins them in its pre-fork handler; they are restarted on first use.
        """
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    # ------------------------------------------------------------ the loop
    def serve(self) -> tuple[str, str, list[str]]:
        assert self.poller is not None
        while True:
            for fd, _events in self.poller.poll():
                if fd == self.wake_r:
                    self._drain_wakeups()
                    self._reap()
                elif fd == self.sock.fileno():
                    try:
                        received = recv_message(self.sock)
                    except OSError:
                        received = None
                    if received is None:  # the agent closed the connection or died
                        os._exit(0)
                    message, fds = received
                    if message.get("op") == "spawn":
                        child = self._spawn(message, fds)
                        if child is not None:
                            return child
                    else:
                        for fd_ in fds:
                            os.close(fd_)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._send({"op": "exit", "pid": pid, "status": status, "time": time.monotonic()})

    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        try:
            send_message(self.sock, message, fds)
        except OSError:  # the agent is gone; so are we
            os._exit(0)

    def _spawn(self, request: dict[str, Any], fds: list[int]) -> tuple[str, str, list[str]] | None:
        """Fork a worker. Returns (mode, target, args) in the child; None in the template."""
        reason = why_fork_is_unsafe()
        if reason is not None:
            for fd in fds:
                os.close(fd)
            self._send({"op": "refused", "reason": reason})
            return None
        # Move everything the preload created into the GC's permanent generation: the child's
        # collections (and the one at its exit) then skip torch's heap instead of touching every
        # object, which would copy each page and, at exit, take seconds on a loaded machine.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            try:
                self._become_worker(request, fds)
            except BaseException as exc:  # noqa: BLE001 - the child must never return to the loop
                try:
                    os.write(2, f"rally: the worker template could not start this worker: {exc!r}\n".encode())
                finally:
                    os._exit(1)
            return request["mode"], request["target"], list(request["args"])
        try:
            pidfd = os.pidfd_open(pid)  # opened before the child can be reaped: no pid reuse race
            try:
                self._send({"op": "spawned", "pid": pid}, [pidfd])
            finally:
                os.close(pidfd)
        finally:
            for fd in fds:
                os.close(fd)
        return None

    # ------------------------------------------------------------ in the child
    def _become_worker(self, request: dict[str, Any], fds: list[int]) -> None:
        # Die with the template (which dies with the agent), as a plain worker dies with the agent.
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self.pid:
            os._exit(1)
        os.setsid()
        self._restore_signals(set(request.get("ignored", ())), request.get("sigmask"))
        self._install_stdio(request, fds)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _rewrite_proc_area("cmdline", request["argv"])
        _rewrite_proc_area("environ", [f"{k}={v}" for k, v in request["env"].items()])
        sys.orig_argv = list(request["argv"])
        _fresh_process_state()

    def _restore_signals(self, ignored: set[int], sigmask: list[int] | None) -> None:
        """Dispositions and mask as a fresh worker started by the agent right now would have them.

        That is the template's own start-up state (same interpreter, same start path), adjusted
        for what the agent ignores or blocks now if that changed since: an ignored signal stays
        ignored across exec, SIGPIPE/SIGXFSZ are ignored by every Python, SIGINT gets Python's
        handler unless ignored, and the mask is inherited as it is.
        """
        signal.set_wakeup_fd(-1)
        for signum, handler in self.initial_handlers.items():
            if signum not in _PYTHON_IGNORES:
                if signum in ignored:
                    handler = signal.SIG_IGN
                elif handler is signal.SIG_IGN:
                    handler = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            if signal.getsignal(signum) is not handler:
                try:
                    signal.signal(signum, handler)
                except (OSError, ValueError):
                    pass
        signal.pthread_sigmask(signal.SIG_SETMASK, self.initial_mask if sigmask is None else sigmask)

    def _install_stdio(self, request: dict[str, Any], fds: list[int]) -> None:
        """fds 0-2 from the request, everything the template opened closed, new sys.std* objects."""
        present = request.get("stdio", [True, True, True])
        received = iter(fds)
        for target, there in enumerate(present):
            if there:
                fd = next(received)
                os.dup2(fd, target)  # inheritable, as after exec
            else:
                try:
                    os.close(target)
                except OSError:
                    pass
        for fd in fds:
            if fd > 2:
                os.close(fd)
        assert self.poller is not None
        self.poller.close()
        self.sock.close()
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        for fd in _open_fds() - self.keep_fds - {0, 1, 2}:
            try:
                os.close(fd)  # nothing should be left; an fd nobody owns must not leak
            except OSError:
                pass
        _reopen_stdio(self.unbuffered)


# Python ignores these at start-up whatever it inherited (subprocess resets them before exec).
_PYTHON_IGNORES = frozenset({signal.SIGPIPE, signal.SIGXFSZ})


def ignored_signals() -> set[int]:
    """Signals this process ignores that a child would inherit ignored (agent side)."""
    out = set()
    for signum in signal.valid_signals():
        if signum not in (signal.SIGKILL, signal.SIGSTOP) and signum not in _PYTHON_IGNORES:
            if signal.getsignal(signum) is signal.SIG_IGN:
                out.add(int(signum))
    return out


def _rewrite_proc_area(which: str, strings: list[str]) -> bool:
    """Write `strings` over this process's original argv or environment memory.

    /proc/PID/cmdline and /proc/PID/environ (read by ps, psutil, pgrep and by the monitoring
    tools that find a job's processes by their environment) show that memory, not sys.argv
    or os.environ. The agent pads the template's command line to the worker's exact length
    and its environment with RALLY_TEMPLATE_SPACE (see `TemplateClient`), so the worker's fit;
    the rest is zeros, which readers take as the end. Skipped (False) when they do not fit or
    the memory does not hold what the kernel says it holds.
    """
    import ctypes

    first = {"cmdline": 45, "environ": 47}[which]  # arg_start/arg_end, env_start/env_end (fields 48-51)
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[first]), int(fields[first + 1])
        with open(f"/proc/self/{which}", "rb") as f:
            current = f.read()
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    new = b"".join(os.fsencode(item) + b"\0" for item in strings)
    if size <= 0 or len(current) != size or len(new) > size or ctypes.string_at(start, size) != current:
        return False
    ctypes.memmove(start, new + b"\0" * (size - len(new)), size)
    return True


def _reopen_stdio(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, built as the interpreter's create_stdio builds them."""
    import io

    def make(fd: int, name: str, write: bool, like: Any) -> Any:
        try:
            os.fstat(fd)
        except OSError:
            return None
        buffering = 0 if unbuffered and write else -1
        buf = io.open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)
        raw = buf if buffering == 0 else buf.raw
        raw.name = name
        stream = io.TextIOWrapper(
            buf,
            encoding=getattr(like, "encoding", None),
            errors=getattr(like, "errors", None),
            newline="\n",
            line_buffering=not unbuffered and (raw.isatty() or fd == 2),
            write_through=unbuffered,
        )
        stream.mode = "w" if write else "r"
        return stream

    old = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
    sys.stdin = sys.__stdin__ = make(0, "<stdin>", False, old[0])
    sys.stdout = sys.__stdout__ = make(1, "<stdout>", True, old[1])
    sys.stderr = sys.__stderr__ = make(2, "<stderr>", True, old[2])


def _fresh_process_state() -> None:
    """Reseed what a fresh process seeds from entropy; reset caches that describe the template."""
    import importlib
    import linecache

    importlib.invalidate_caches()
    linecache.clearcache()
    # Python's `random` is reseeded by the interpreter at fork (random.py registers it).
    np_random = sys.modules.get("numpy.random")
    if np_random is not None and hasattr(np_random, "seed"):
        np_random.seed()  # numpy seeds its global RandomState from entropy on import
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()  # a fresh `import torch` seeds the CPU generator from entropy
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())


def serve() -> tuple[str, str, list[str]]:
    """The template's main: preload, then fork on request. Returns only in a forked worker."""
    template = _Template()
    template.start()
    return template.serve()


# ================================================================ the agent's side
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
READY_TIMEOUT = 300.0  # importing torch on a loaded node
REPLY_TIMEOUT = 30.0
REPORT_TIMEOUT = 5.0  # between a worker's exit and the template's report of it


# How long the template may take to exit by itself when the agent stops it.
STOP_GRACE_SECONDS = 0.2


class TemplateGone(Exception):
    """The template process died or stopped answering."""


class TemplateStuck(TemplateGone):
    """The template is alive but did not answer in time (a preload that hangs, say)."""


class TemplateRefused(Exception):
    """The template is not safe to fork from (threads, CUDA)."""


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


def _status_to_returncode(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


class _Connection:
    """One template process and the agent's end of its socket."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, init: dict[str, Any]) -> None:
        import subprocess

        from rally.agent import processes

        parent = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.popen = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                close_fds=True,
                preexec_fn=lambda: processes._die_with_parent(parent),
            )
        finally:
            theirs.close()
        self.sock = ours
        self.exits: dict[int, tuple[int, float]] = {}
        self.ready: dict[str, Any] | None = None
        self.closed = False
        self.lock = threading.RLock()
        self.started_at = time.monotonic()
        try:
            send_message(self.sock, init)
        except OSError:
            self.closed = True

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return not self.closed and self.popen.poll() is None

    # ------------------------------------------------------------ reading
    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """Read one message within `timeout`; exit reports are filed, others returned."""
        if self.closed:
            raise TemplateGone(self.describe_death())
        if not _readable(self.sock.fileno(), timeout):
            return None
        try:
            received = recv_message(self.sock)
        except (OSError, ValueError) as exc:
            self.closed = True
            raise TemplateGone(f"the connection to the template broke: {exc}") from exc
        if received is None:
            self.closed = True
            raise TemplateGone(self.describe_death())
        message, fds = received
        if message.get("op") == "exit":
            self.exits[int(message["pid"])] = (int(message["status"]), float(message["time"]))
            return {"op": "filed"}
        message["fds"] = fds
        return message

    def _await(self, ops: tuple[str, ...], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemplateStuck(f"the worker template did not answer within {timeout:g} s")
            message = self._read(left)
            if message is None or message["op"] == "filed":
                continue
            if message["op"] == "ready":
                self.ready = message
            if message["op"] in ops:
                return message
            for fd in message.get("fds", []):
                os.close(fd)

    def drain(self) -> None:
        """File every exit report already waiting (never blocks)."""
        with self.lock:
            while not self.closed:
                try:
                    if self._read(0) is None:
                        return
                except TemplateGone:
                    return

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        with self.lock:
            if self.ready is None:
                self._await(("ready",), READY_TIMEOUT if timeout is None else timeout)
            assert self.ready is not None
            return self.ready

    def fork(self, request: dict[str, Any], fds: list[int]) -> tuple[int, int]:
        """Ask for a worker; returns (pid, pidfd)."""
        with self.lock:
            try:
                send_message(self.sock, request, fds)
            except OSError as exc:
                self.closed = True
                raise TemplateGone(self.describe_death()) from exc
            reply = self._await(("spawned", "refused"), REPLY_TIMEOUT)
            if reply["op"] == "refused":
                raise TemplateRefused(reply["reason"])
            pidfds = reply["fds"]
            for extra in pidfds[1:]:
                os.close(extra)
            if not pidfds:
                raise TemplateGone("the template sent no pidfd for its worker")
            return int(reply["pid"]), pidfds[0]

    def exit_status(self, pid: int, timeout: float) -> tuple[int, float] | None:
        """The (wait status, time) the template reported for `pid`, waiting up to `timeout`."""
        with self.lock:
            deadline = time.monotonic() + timeout
            while pid not in self.exits:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    break
                try:
                    self._read(left)
                except TemplateGone:
                    break
            return self.exits.pop(pid, None)

    def describe_death(self) -> str:
        try:
            code = self.popen.wait(timeout=1.0)
        except Exception:  # noqa: BLE001 - still running, or not ours to wait for
            return "the template stopped answering"
        from rally.agent.processes import describe_exit

        return f"the template process exited ({describe_exit(code)})"

    # ------------------------------------------------------------ stopping
    def close(self, timeout: float = 5.0) -> None:
        """Close the socket (the template exits at end of file), then make sure it is gone."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.popen.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            self.popen.kill()
            self.popen.wait()


class ForkedChild:
    """A worker forked by the template, with `processes.ChildProcess`'s interface.

    The exit status comes from the template, which reaps its children. If the template
    died first, the worker (killed by its parent-death signal) was re-parented to the agent,
    a child subreaper, and is reaped through its pidfd instead.
    """

    def __init__(self, connection: _Connection, pid: int, pidfd: int, started_at: float) -> None:
        self.connection = connection
        self.pid = pid
        self.pidfd = pidfd
        self.started_at = started_at
        self.ended_at: float | None = None
        self.returncode: int | None = None
        self._watch = os.dup(pidfd)  # still usable after close(), for a late wait()

    def _has_exited(self, timeout: float | None = 0) -> bool:
        return self._watch < 0 or _readable(self._watch, timeout)

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
            self._finish(_status_to_returncode(status), ended)
            return self.returncode
        if self.connection.alive():  # exited, but the template does not say so: it is broken
            self.connection.popen.kill()
            self.connection.popen.wait()
        self._reap_after_template_death()
        return self.returncode

    def _reap_after_template_death(self) -> None:
        deadline = time.monotonic() + 2.0
        while True:
            try:
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
            time.sleep(0.01)

    def _finish(self, returncode: int, ended_at: float) -> None:
        self.returncode = returncode
        self.ended_at = ended_at
        if self._watch >= 0:
            os.close(self._watch)
            self._watch = -1

    def wait(self) -> int:
        while self.returncode is None:
            self._has_exited(None)
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
    ) -> None:
        self.bootstrap = bootstrap
        self.argv = template_command(python_exec, bootstrap, worker_argv)
        self.python_exec = python_exec
        self.preload = list(preload)
        self.env = dict(env)
        self.cwd = cwd
        self.warn = warn
        request = bootstrap_request(worker_argv, bootstrap)
        self.path0 = preload_path0(request[0], request[1], cwd) if request else cwd
        self.connection: _Connection | None = None
        self.disabled: str | None = None  # why workers start plainly from now on
        self._warned: set[str] = set()
        self.forks = 0
        self.plain_starts = 0

    @classmethod
    def for_job(cls, spec: Any, base_env: dict[str, str], warn: Callable[[str], None] | None = None) -> "TemplateClient | None":
        """The template for this job, or None when workers start plainly (--no-preload, --no-python)."""
        preload = getattr(spec, "preload", None)
        if preload is None or not spec.is_python:
            return None
        from rally.agent.spec import BOOTSTRAP
        from rally.agent.workers import shared_worker_env

        if warn is None:
            from rally.launcher import console

            warn = console.warn
        cwd = os.path.abspath(spec.cwd or os.getcwd())
        return cls(spec.python_exec, BOOTSTRAP, spec.command(), preload, shared_worker_env(spec, base_env), cwd, warn)

    # ------------------------------------------------------------ lifetime
    def start(self) -> None:
        """Start the template; it preloads while the agent goes on (the first spawn waits)."""
        env = {**self.env, ENV_SPACE_VARIABLE: " " * ENV_SPACE}
        self.connection = _Connection(self.argv, env, self.cwd, {"op": "init", "preload": self.preload, "path0": self.path0})

    @property
    def pid(self) -> int | None:
        return self.connection.pid if self.connection is not None else None

    def helper_pids(self) -> set[int]:
        return {self.connection.pid} if self.connection is not None else set()

    def stop(self) -> None:
        """Stop the template at the agent's exit. Its workers are already stopped by then, so it
        gets only a moment to leave by itself: one still importing torch cannot notice the
        closed socket, and under SLURM's KillWait every second of exit counts."""
        if self.connection is not None:
            self.connection.close(timeout=STOP_GRACE_SECONDS)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warn(message)

    def _live_connection(self) -> _Connection:
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
    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str | None, stdout: Any, stderr: Any) -> Any:
        from rally.agent import processes

        request = bootstrap_request(argv, self.bootstrap)
        if request is None or self.disabled or argv[0] != self.python_exec:
            self.plain_starts += 1
            return processes.spawn(argv, env, cwd, stdout, stderr)
        different = sorted(
            k
            for k in set(env) | set(self.env)
            if env.get(k) != self.env.get(k) and k not in PER_WORKER_VARIABLES and not k.startswith(PER_WORKER_PREFIXES)
        )
        if different:
            self._warn_once(
                "env", f"starting workers plainly: their environment differs from the worker template's in {', '.join(different)}"
            )
            self.plain_starts += 1
            return processes.spawn(argv, env, cwd, stdout, stderr)
        for attempt in (1, 2):
            connection = self._live_connection()
            try:
                child = self._fork(connection, argv, request, env, cwd, stdout, stderr)
                self.forks += 1
                return child
            except TemplateRefused as exc:
                self.disabled = str(exc)
                self._warn_once("refused", f"starting workers plainly from now on: {exc} (forking it would not be safe)")
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
        self.plain_starts += 1
        return processes.spawn(argv, env, cwd, stdout, stderr)

    def _fork(
        self,
        connection: _Connection,
        argv: Sequence[str],
        request: tuple[str, str, list[str]],
        env: dict[str, str],
        cwd: str | None,
        stdout: Any,
        stderr: Any,
    ) -> ForkedChild:
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
            "ignored": sorted(ignored_signals()),
            "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        }
        started = time.monotonic()
        pid, pidfd = connection.fork(message, [fd for fd in stdio if fd is not None])
        return ForkedChild(connection, pid, pidfd, started)


def _fileno(value: Any, default: int | None = None) -> int | None:
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
