"""The worker template process: preload, then fork a worker per request (see agent/template/client.py).

Runs in every worker's ancestry, so it imports only the standard library. `serve()` returns
only in a forked child, already turned into a fresh worker; bootstrap.py then runs the script.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from rally.agent.base import linux
from rally.agent.template import wire as template_wire


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


def _worker_side_modules(environ: Mapping[str, str]) -> list[str]:
    """rally's own modules that bootstrap.run imports in every worker of this environment before
    the script's first line: imported once here, they are not imported again by each forked
    worker on a restart's critical path (30-80 ms of it on a busy machine). The same modules
    end up in the worker either way; only when they are imported changes. The preemption handler
    (RALLY_PREEMPT_SIGNALS: set by default, SIGUSR1 and SIGUSR2) installs from `preemption_flag`, a
    part of `job`, which is imported whole here: a script started from the template imports torch,
    and nearly always rally.job too (22 modules, 40-60 ms per worker at a load of 8 on 2 cores).
    A plainly started worker imports only `preemption_flag` (bootstrap.install_preemption_handler)."""
    modules = []
    if environ.get("RALLY_PREEMPT_SIGNALS"):  # bootstrap.install_preemption_handler
        modules.append("rally.agent.worker_side.job")
    if environ.get("RALLY_CKPT_HOLDER"):  # bootstrap.start_resume_prefetch
        modules.append("rally.agent.checkpoint.core.resume_prefetch")
    return modules


WARM_AFTER_IDLE_SECONDS = 10.0
"""How long the template waits, once it has forked workers and nobody asks for more, before it
imports what `_warm_later` names (the first round's forks come in a burst; a restart of a job
that trains comes much later). Not sooner: the import takes about a second of a core, which the
workers' own start-up (imports, the process group, a first step) needs more."""


def _warm_later(preloaded: list[str]) -> list[str]:
    """Modules torch imports lazily at the first use of what nearly every training script uses,
    imported by the template while it idles after the first round's forks, so that a restarted
    worker does not import them on the restart's critical path: torch._dynamo, which the first
    call of a torch.optim optimizer's methods imports (`torch._disable_dynamo`): 0.7-0.9 s in
    every worker start on a 2-core machine, 0.8 s of the 1.2 s from a kill to stepping again in
    bench/goodput.py. Not preloaded before the first fork: a script without an optimizer would
    wait for it at its start. Nothing when torch was not preloaded or has no torch._dynamo."""
    if "torch" not in preloaded or "torch._dynamo" in sys.modules:
        return []
    import importlib.util

    try:
        found = importlib.util.find_spec("torch._dynamo") is not None
    except (ImportError, ValueError):
        found = False
    return ["torch._dynamo"] if found else []


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
        self.warm_later: list[str] = []  # imported once idle after the first forks (_warm_later)
        self.forked = 0

    # ------------------------------------------------------------ start-up
    def start(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(signum, signal.SIG_IGN)  # the agent decides when workers stop
        try:
            received = template_wire.recv_message(self.sock)
        except OSError:
            received = None
        if received is None:
            os._exit(0)
        init, fds = received
        for fd in fds:
            os.close(fd)
        started = time.monotonic()
        preloaded, failed = self._preload(init.get("preload", []), init.get("path0"))
        self._preload(_worker_side_modules(os.environ), None)  # a failure shows in the worker, as it would
        self.warm_later = _warm_later(preloaded)
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
                except BaseException as exc:  # reported to the agent, not fatal
                    failed[name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        finally:
            sys.path[0] = saved
        return preloaded, failed

    def _import_late(self, names: list[str]) -> None:
        """Import `names` after start-up as if preloaded: fds the imports opened stay open in the
        children, native thread pools they started are stopped before the next fork. A failure is
        ignored: a worker that needs the module imports it, and says so if it fails."""
        before = _open_fds()
        self._preload(names, None)
        self.keep_fds |= _open_fds() - before
        if _thread_count() > 1:
            self._quiesce_native_pools()

    @staticmethod
    def _quiesce_native_pools() -> None:
        """Fork once and discard the child, so pthread_atfork handlers stop native thread pools.

        OpenBLAS (loaded by numpy, which torch imports) starts its worker threads when it is
        loaded and joins them in its pre-fork handler; they are restarted on first use.
        """
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        # wait: short: a child that exits at once
        os.waitpid(pid, 0)

    # ------------------------------------------------------------ the loop
    def serve(self) -> tuple[str, str, list[str]]:
        assert self.poller is not None
        while True:
            idle_then_warm = WARM_AFTER_IDLE_SECONDS if self.warm_later and self.forked else -1
            # wait: background: the template server's loop: it waits for requests (once it forked
            # workers and has modules to warm, WARM_AFTER_IDLE_SECONDS of quiet first)
            ready = self.poller.poll(idle_then_warm)
            if not ready and self.warm_later:
                names, self.warm_later = self.warm_later, []
                self._import_late(names)  # see _warm_later
            for fd, _events in ready:
                if fd == self.wake_r:
                    self._drain_wakeups()
                    self._reap()
                elif fd == self.sock.fileno():
                    try:
                        received = template_wire.recv_message(self.sock)
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
                # wait: not_a_wait: WNOHANG
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._send({"op": "exit", "pid": pid, "status": status, "time": time.monotonic()})

    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        try:
            template_wire.send_message(self.sock, message, fds)
        except OSError:  # the agent is gone; so are we
            os._exit(0)

    def _spawn(self, request: dict[str, Any], fds: list[int]) -> tuple[str, str, list[str]] | None:
        """Fork a worker. Returns (mode, target, args) in the child; None in the template."""
        # What the bootstrap imports before the script's first line, by the worker's environment
        # (its RALLY_PREEMPT_SIGNALS and RALLY_CKPT_HOLDER are per worker, not in the template's
        # own): imported here at the first fork, so no later worker imports them (30 ms each).
        wanted = [name for name in _worker_side_modules(request.get("env", {})) if name not in sys.modules]
        if wanted:
            self._import_late(wanted)  # a failure shows in the worker, as it would
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
        self.forked += 1
        pid = os.fork()
        if pid == 0:
            try:
                self._become_worker(request, fds)
            except BaseException as exc:  # the child must never return to the loop
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
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
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
            if signum not in template_wire.PYTHON_IGNORES:
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

    def make(fd: int, name: str, write: bool, like: TextIO | None) -> io.TextIOWrapper | None:
        try:
            os.fstat(fd)
        except OSError:
            return None
        buffering = 0 if unbuffered and write else -1
        # FileIO when unbuffered, else a BufferedWriter/Reader (with .raw): open()'s overloads
        # cannot tell which from a `buffering` chosen at run time.
        buf: Any = open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)
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
        # A plain attribute at run time (create_stdio sets it so); typeshed declares it read-only.
        stream.mode = "w" if write else "r"  # type: ignore[misc]
        return stream

    # typeshed marks sys.__std*__ Final; a forked worker replaces them as a new interpreter sets them.
    old = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
    sys.stdin = sys.__stdin__ = make(0, "<stdin>", False, old[0])  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = make(1, "<stdout>", True, old[1])  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = make(2, "<stderr>", True, old[2])  # type: ignore[misc]


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
    mp_process: Any = sys.modules.get("multiprocessing.process")  # its attributes are set below
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())


def serve() -> tuple[str, str, list[str]]:
    """The template's main: preload, then fork on request. Returns only in a forked worker."""
    template = _Template()
    template.start()
    return template.serve()
