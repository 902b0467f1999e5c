"""`rally.job.run(train, *args, **kwargs)`: a training function that a failure re-enters in the
same process instead of restarting it (docs/restartable.md).

Outside rally (plain python, torchrun, or a script the agent did not start) `run` calls the
function once and returns what it returns: nothing else happens. Under rally it connects to the
agent (agent/base/reentry_wire.py) and loops:

    enter train -> it returns: tell the agent "returned" (for good: the agent ends a process
                                that lingers long after it, agent/observe/exit_watch.py), and
                                run returns its value (the process goes on to its end)
                -> it raises:   tell the agent (the root cause, unless the round already ended),
                                wait for the agent's "abort", tear torch.distributed down,
                                say "parked", wait for "enter" with the next round's environment,
                                and enter again
    "abort" while train runs: a signal to this process raises `RoundAborted` in the main thread
                at its next bytecode (a blocked gloo collective returns first, when the peer whose
                failure ended the round tears its own group down and its connections close);
                a main thread still inside after RELEASE_SECONDS (it cannot be interrupted) has
                the entry's connections shut down by the control thread, so that no peer waits
                on it: its peers leave, and the agent kills and replaces it

Who initialises torch.distributed: a script that did it before calling `run` leaves it to
rally, which initialises it again (same backend, the new round's MASTER_ADDR/PORT, RANK and
WORLD_SIZE) before each later entry; a function that calls `init_process_group` itself does so
again on each entry. Either way rally destroys every process group between two entries, so no
old group, store connection or message can reach the next round.
"""

from __future__ import annotations

import gc
import linecache
import mmap
import os
import queue
import signal
import socket
import sys
import threading
import time
import tokenize
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from rally.agent.base import kept_threads, linux
from rally.agent.base import reentry_wire as wire
from rally.agent.worker_side import group_keeper, round_env

T = TypeVar("T")

# A teardown (destroying the process groups; on NCCL aborting communicators first) that takes
# longer leaves this process's state in doubt: the agent restarts every worker process, on every node.
TEARDOWN_SECONDS = 10.0
CONNECT_SECONDS = 5.0
# A main thread still inside the function this long after the agent's abort cannot be interrupted
# (a C call that never returns to Python, the interrupt signal blocked, a collective waiting on
# such a peer): the control thread shuts the entry's connections down itself, which releases this
# rank's collectives and its peers' collectives on it. The agent kills what still does not leave.
RELEASE_SECONDS = 1.0


def open_fds() -> set[tuple[int, int]]:
    """(descriptor, inode) of every open descriptor: a number reused for a new socket (in a worker
    forked from the template, which imported this module) is a different inode."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    for name in names:
        try:
            found.add((int(name), os.stat(f"/proc/self/fd/{name}").st_ino))
        except (OSError, ValueError):
            continue  # closed meanwhile (the listing's own descriptor)
    return found


# A script imports rally.job before it makes its process group: the group's connections are
# newer than this (torch 2.13's DDP keeps a destroyed gloo group alive, connections open).
_FDS_AT_IMPORT = open_fds()


timeline: dict[str, float] = {}
"""When (time.time()) this process passed each point of its last re-entry: "abort" (the agent's
abort read), "left" (out of the function), "settled", "closed", "destroyed", "collected" (the
teardown's steps), "parked", "enter" (the agent's enter read), "initialised" (the new round's
process group made by rally). Each point is overwritten at each re-entry; read by
bench/goodput.py's phase breakdown (one dict assignment per point: nothing measurable)."""


class RoundAborted(BaseException):
    """Raised in the training function when the agent ends the round: it leaves the function the
    way an exception does (its `finally` blocks and `with` exits run). A BaseException, so a
    script's `except Exception` does not swallow it."""


class _Link:
    """This worker's connection to its agent and the control thread that reads it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.messages: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.aborting = threading.Event()
        self.in_train = False
        self.left = threading.Event()  # the main thread is out of the function (or never in it)
        self.left.set()
        self.opened_since: set[tuple[int, int]] | None = None  # the descriptors older than this entry
        self.main_thread = threading.main_thread().ident
        self.reader = threading.Thread(target=self._read, name="rally-reentry", daemon=True)
        self.reader.start()

    @classmethod
    def from_env(cls) -> _Link | None:
        name = os.environ.get(wire.SOCKET_ENV)
        agent_pid = os.environ.get(wire.AGENT_PID_ENV)
        if not name or not agent_pid or threading.current_thread() is not threading.main_thread():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(CONNECT_SECONDS)
        try:
            sock.connect(wire.address(name))
            pid, uid, _ = socket_peer(sock)
        except OSError as exc:
            sock.close()
            print(
                f"rally: job.run: the agent's socket is unreachable ({exc}); a failure restarts the process", flush=True
            )
            return None
        if str(pid) != agent_pid or uid != os.geteuid():
            sock.close()
            print(f"rally: job.run: the socket is served by pid {pid}, not by the agent; not using it", flush=True)
            return None
        sock.settimeout(None)
        link = cls(sock)
        signal.signal(wire.INTERRUPT_SIGNAL, link._interrupt)
        return link

    # ------------------------------------------------------------ the control thread
    def _read(self) -> None:
        # One buffer for every message: recv(MAX_MESSAGE) allocated 1 MiB per message and shrank it,
        # in this thread's glibc arena, whose heap crept up by 3-6 KB an entry around the small pieces
        # left (tests/test_inprocess_restart.py's 50 re-entries). An anonymous mapping, not a bytearray
        # (which zero-fills, so all 1 MiB of it was resident): only the pages a message is written to
        # are, and the agent's messages ("abort", "enter") fit in the first one.
        buffer = memoryview(mmap.mmap(-1, wire.MAX_MESSAGE))
        while True:
            try:
                # wait: not_a_wait: the control thread's whole life; it ends with the agent's end of the socket
                data = bytes(buffer[: self.sock.recv_into(buffer)])
            except OSError:
                data = b""
            if not data:
                self.messages.put(None)  # the agent is gone: the main thread leaves
                return
            message = wire.decode(data)
            if message is None:
                continue
            if message["op"] in ("abort", "enter"):
                timeline[message["op"]] = time.time()
            if message["op"] == "abort":
                self.aborting.set()
            self.messages.put(message)  # before a wait below: a main thread out of the function goes on
            if message["op"] == "abort" and self.in_train:  # the main thread is in the function: interrupt it
                signal.pthread_kill(self.main_thread or 0, wire.INTERRUPT_SIGNAL)
                # wait: short: RELEASE_SECONDS (1); no message but the abort's can come before we park
                if not self.left.wait(RELEASE_SECONDS):
                    _close_connections(self.opened_since)  # it cannot be interrupted: release its peers

    def _interrupt(self, signum: int, frame: object) -> None:
        if self.in_train and self.aborting.is_set():
            self.in_train = False  # once: the function's own cleanup must not be interrupted again
            raise RoundAborted("rally ended this round; the function is entered again in the next one")

    # ------------------------------------------------------------ the main thread
    def send(self, op: str, **fields: object) -> None:
        try:
            self.sock.send(wire.encode(op, **fields))
        except OSError:
            pass  # the agent is gone; the wait that follows notices

    def wait_for(self, *ops: str) -> dict[str, Any]:
        """The next message that is one of `ops`; SystemExit when the agent is gone (nothing can re-enter us)."""
        while True:
            # wait: bounded, said by the agent: it sends `op`, or stops this process, or its death closes the socket
            message = self.messages.get()
            if message is None:
                raise SystemExit(1)
            if message["op"] in ops:
                return message

    def wait_for_enter(self) -> dict[str, Any]:
        """The next "enter", parked meanwhile: an "abort" (the round the agent was forming for this
        worker ended before it was re-entered in it) is answered "parked" at once, as the worker
        is, rather than left unanswered until the agent kills it for not leaving."""
        while True:
            # wait: bounded, said by agent/rounds/parking.py WorkerParking.park: the agent sends it as the round
            # ends, or stops us
            message = self.wait_for("enter", "abort")
            if message["op"] == "enter":
                return message
            self.aborting.clear()
            self.send("parked", ok=True, why="")


def socket_peer(sock: socket.socket) -> tuple[int, int, int]:
    import struct

    size = struct.calcsize("3i")
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, size))
    return pid, uid, gid


def run(train: Callable[..., T], /, *args: object, **kwargs: object) -> T:
    """Call `train(*args, **kwargs)`; under rally, call it again in this process after a failure
    anywhere in the job (an exception, a dead rank, a hang), with the next round's environment.
    Returns what the last entry returned. See the module docstring and docs/restartable.md."""
    link = _Link.from_env()
    if link is None:
        return train(*args, **kwargs)
    if os.environ.get(wire.SPARE_ENV) == "1":  # a warm spare: wait for a dead rank's place
        threading.Thread(target=_warm_up, name="rally-spare-warm-up", daemon=True).start()
        link.send("spare")
        # wait: bounded, said by agent/rounds/parking.py WorkerParking.park: the agent sends it as the round
        # ends, or stops us
        enter = link.wait_for("enter")
        _apply(enter.get("env") or {})
        os.environ.pop(wire.SPARE_ENV, None)
        if _deferred is not None:
            _deferred_init()
            timeline["initialised"] = time.time()
    backend = _rally_owned_backend()  # the script initialised torch.distributed: rally does it again
    # what a teardown may shut down: what this entry opened, and when rally makes the group, what
    # was opened since just before it made it (for the first entry, of a group the script made
    # before calling run, since `rally.job` was imported)
    opened_since = _FDS_AT_IMPORT if backend is not None else open_fds()
    # torch's init_process_group wraps sys.excepthook in a new closure on every call: restored after
    # each entry, or the chain (and the rank prefix on a crash's lines) grows by one an entry
    excepthook = sys.excepthook
    entry = 0
    while True:
        entry += 1
        if backend is None:
            opened_since = open_fds()
        link.opened_since = opened_since
        link.left.clear()
        # What is alive now (torch, the model, the data: ~170,000 objects) lives across entries: the
        # collector stops scanning it, so the teardown's collection of this entry's cycles takes
        # milliseconds instead of the 0.1-0.3 s of a full scan (the last teardown collected what
        # earlier entries left, so nothing frozen here is their garbage). What became garbage since
        # that collection goes first, or it would be frozen for good: the re-entry's own cycles (the
        # resume prefetch's torch.load makes a class per call). The young generations only, where
        # they are: 0.1-0.2 ms; a full collection rescans what the first entry left (the imports at
        # an optimizer's first use: 0.1-0.5 s at the second entry).
        if entry > 1:
            gc.collect(1)
        gc.freeze()
        # rally keeps a reference to every group made from now on (the function's own too): the
        # function dropping its last one never destroys a gloo group with the GIL held
        group_keeper.install()
        try:
            # In the try: from here on the interrupt may raise. The control thread sets `aborting`
            # before it looks at `in_train`, and this thread sets `in_train` before it looks at
            # `aborting`: an abort that came before the entry (the round ended as it began) is seen
            # by one of the two, never by neither.
            link.in_train = True
            if link.aborting.is_set():
                raise RoundAborted("rally ended this round before the function was entered")
            return _done(train(*args, **kwargs), link)
        except (SystemExit, KeyboardInterrupt):
            gc.unfreeze()
            group_keeper.release()
            raise
        except BaseException as exc:
            link.in_train = False
            timeline["left"] = time.time()
            if not link.aborting.is_set() and not isinstance(exc, RoundAborted):
                link.send("failed", **_failure(exc, entry))
            del exc  # its traceback holds the function's frames (the model's activations, the old group)
        finally:
            link.in_train = False
            link.left.set()
        # wait: bounded, said by agent/rounds/parking.py WorkerParking.park: the agent sends it as the round
        # ends, or stops us
        link.wait_for("abort")
        link.aborting.clear()  # this round's abort is taken; the next one may come as soon as "enter"
        why = teardown(opened_since)
        timeline["parked"] = time.time()
        sys.excepthook = excepthook
        link.send("parked", ok=why is None, why=why or "")
        # wait: bounded, said by agent/rounds/parking.py WorkerParking.park: the agent sends it as the round
        # ends, or stops us
        enter = link.wait_for_enter()
        _apply(enter.get("env") or {})
        if backend is not None:
            import torch.distributed as dist

            opened_since = open_fds()
            dist.init_process_group(backend=backend)  # env://: the new round's master, rank and world size
            timeline["initialised"] = time.time()


def _done(value: T, link: _Link) -> T:
    """The function is done for good: the agent is told (a process still alive long after this is
    stuck on its way out, e.g. in a process group's destructor, and the agent ends it as a
    success: agent/observe/exit_watch.py); what `run` froze goes back to the collector, so that the
    interpreter's last collection at exit finalises it as it would have (a frozen object is never
    finalised: e.g. a DDP module's gloo group made in an earlier entry would outlive Python).
    rally's references to the entry's groups go now: a group the function destroyed is joined
    here with the GIL released (agent/worker_side/group_keeper.py), not as its frame was cleared."""
    link.send("returned")
    gc.unfreeze()
    group_keeper.release()
    return value


def _failure(exc: BaseException, entry: int) -> dict[str, Any]:
    cached = set(linecache.cache)
    # The report's source lines are read one at a time, not whole files into linecache: a
    # collective's error has frames in torch's distributed_c10d.py (~6,000 lines), whose ~6,000
    # strings, even dropped at once, left Python's allocator 0.6 MB more resident for life (its
    # arenas keep their high-water mark). Swapped in for this call only; what other threads read
    # meanwhile is the same line, uncached.
    getline, linecache.getline = linecache.getline, _source_line
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        linecache.getline = getline
    for name in set(linecache.cache) - cached:  # lazy entries it made (a loader per module)
        linecache.cache.pop(name, None)
    return {
        "rank": int(os.environ.get("RANK", "0") or 0),
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0][:500] if str(exc) else "",
        "traceback": text,
        "entry": entry,
    }


def _source_line(filename: str, lineno: int, module_globals: dict[str, Any] | None = None) -> str:
    """Line `lineno` of `filename` (as linecache.getline returns it), reading up to it one line
    at a time; a source that is not a file (a zip import, `<string>`) goes through linecache."""
    try:
        with tokenize.open(filename) as source:  # the file's declared encoding, as linecache reads it
            for number, line in enumerate(source, 1):
                if number == lineno:
                    return line if line.endswith("\n") else line + "\n"
        return ""
    except (OSError, SyntaxError, UnicodeDecodeError):
        return _linecache_getline(filename, lineno, module_globals)


_linecache_getline = linecache.getline  # the real one, while _failure swaps _source_line in


def _rally_owned_backend() -> str | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return str(dist.get_backend())


def teardown(opened_since: set[tuple[int, int]] | None = None) -> str | None:
    """Destroy every process group (NCCL: abort its communicators first, keep the CUDA context,
    free the cached device memory), in a thread bounded by TEARDOWN_SECONDS. None when done,
    else why not (the process's state is in doubt: the job's processes restart). `opened_since`:
    the descriptors open when the entry began; a TCP connection opened after them and still open
    once the groups are gone (a group something still references) is shut down."""
    errors: list[str] = []

    def work() -> None:
        try:
            _settle_saves()
            timeline["settled"] = time.time()
            _close_connections(opened_since)  # first: peers blocked on us are released while we tear down
            timeline["closed"] = time.time()
            _destroy_process_groups()
            group_keeper.unpin_defaults()  # torch.distributed.nn.functional's group.WORLD defaults
            timeline["destroyed"] = time.time()
            # the last entry's objects that held a group (a DDP module's cycles) go now; rally still
            # holds each group, so none is destroyed inside the collection with the GIL held
            gc.collect()
            group_keeper.release()  # the groups destroyed now, their threads joined without the GIL
            _free_device_memory()
            _return_free_memory()
            timeline["collected"] = time.time()
        except Exception as exc:  # reported to the agent, which restarts the job's processes
            errors.append(f"{type(exc).__name__}: {exc}")

    call = _teardowns.start(work)
    call.join(TEARDOWN_SECONDS)
    if call.is_alive():
        return f"tearing torch.distributed down took more than {TEARDOWN_SECONDS:g} s"
    return errors[0] if errors else None


# Every teardown of the process runs in one kept thread, not a new thread per entry (agent/base/kept_threads.py)
_teardowns = kept_threads.Pool("rally-teardown")


def _settle_saves() -> None:
    """A save overlapped with the last step and still undecided is dropped before the groups go:
    its round is over (the holder voided it), and decided on the next entry it would reach the
    next round (agent/checkpoint/core/overlap.py `drop_at_round_end`)."""
    from rally.agent.checkpoint.core.overlap import overlap

    overlap.drop_at_round_end()


def _destroy_process_groups() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    if dist.is_nccl_available():
        import torch

        for group in list(c10d._world.pg_map):
            try:
                backend = group._get_backend(torch.device("cuda"))
            except Exception:  # a group without a CUDA backend (gloo only)
                continue
            if isinstance(backend, dist.ProcessGroupNCCL):
                backend.abort()  # releases a kernel waiting on a dead peer; the CUDA context stays
    dist.destroy_process_group()


def _close_connections(opened_since: set[tuple[int, int]] | None) -> None:
    """Shut down the TCP connections this entry opened that are still open: a destroyed process
    group that something still references (torch 2.13's DDP keeps its group) keeps its peers'
    blocked collectives waiting until its connections close. Only shut down, never closed: the
    group's own code still owns the descriptors. Listening sockets are left alone (gloo's
    listener aborts the process on an error), and so is everything older than the entry."""
    import stat

    if opened_since is None:
        return
    for fd, _ in sorted(open_fds() - opened_since):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            if tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected
        finally:
            sock.close()


def _free_device_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _return_free_memory() -> None:
    """Give the pages the entry freed back to the kernel (glibc's malloc_trim: tens of microseconds
    here). Each entry's gloo threads and activations allocate in glibc's per-thread arenas, which
    keep freed pages resident: without it the worker's RSS crept up by 13-29 KB an entry, with it
    8-10 KB, where glibc's bytes in use grew by 2 (tests/test_inprocess_restart.py's 50 re-entries;
    5-7 KB once the control thread's buffer below was made once)."""
    linux.malloc_trim()


def _apply(env: dict[str, str]) -> None:
    """The next round's environment: RANK, WORLD_SIZE, MASTER_PORT, RALLY_ROUND and the rest as
    the agent computed them for a fresh worker; `job.context()` reads them afresh. Set through
    agent/worker_side/round_env.py: glibc's setenv would keep every round's new values for good."""
    for key, value in env.items():
        if isinstance(key, str) and isinstance(value, str):
            round_env.set_variable(key, value)
    from rally.agent.checkpoint.core import client as ckpt_client
    from rally.agent.checkpoint.core import resume_prefetch

    resume_prefetch.discard()  # prepared for an earlier round (a spare's start): this round asks afresh
    if env.get(ckpt_client.HOLDER_LOST_ENV) == "1":  # the holder died: no address, as a new worker gets
        for key in (ckpt_client.HOLDER_ENV, ckpt_client.HOLDER_PID_ENV, ckpt_client.SECRET_ENV):
            os.environ.pop(key, None)
        ckpt_client.forget_tier()
    tier = ckpt_client.tier()
    if tier is not None:  # saves and the resume are fenced by the round the holder has open
        tier.round = int(os.environ.get("RALLY_ROUND", "0") or 0)
        # the round's resume step is fixed: mapped and faulted in while the process group forms
        resume_prefetch.again()


_deferred: tuple[tuple[object, ...], dict[str, object]] | None = None


def defer_init_in_spare() -> None:
    """In a warm spare (started by the bootstrap before its script): the script's
    `init_process_group` at its top only records its arguments, since the spare has no rank yet;
    `run` makes the group with them once the spare takes a rank's place."""
    if os.environ.get(wire.SPARE_ENV) != "1":
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    real: Callable[..., None] = distributed_c10d.init_process_group

    def deferred(*args: object, **kwargs: object) -> None:
        global _deferred
        if os.environ.get(wire.SPARE_ENV) != "1":  # promoted: the real thing
            real(*args, **kwargs)
            return
        _deferred = (args, kwargs)

    deferred._rally_real = real  # type: ignore[attr-defined]  # for _deferred_init
    dist.init_process_group = deferred
    distributed_c10d.init_process_group = deferred


def _deferred_init() -> None:
    import torch.distributed as dist

    assert _deferred is not None
    args, kwargs = _deferred
    init: Callable[..., None] = dist.init_process_group
    init(*args, **kwargs)  # the spare's env var is gone: the real one runs


def _warm_up() -> None:
    """While a spare waits: import what torch imports at an optimizer's first use (torch._dynamo,
    most of a second), so the rank it becomes does not pay it at its first step."""
    if "torch" in sys.modules:
        try:
            import torch._dynamo  # noqa: F401
        except Exception:  # a torch without it: nothing to warm
            pass
