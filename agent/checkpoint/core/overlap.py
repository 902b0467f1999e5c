"""Saves that overlap the next step: `rally.job.save` returns before an optimizer's tensors are copied.

What a training step does to a saved state, in order: the forward reads the parameters (and may
change buffers in place: BatchNorm's running statistics), the backward writes gradients, and only
the optimizer's step changes the parameters and the optimizer's own state. So the tensors an
optimizer owns (the parameters in its `param_groups` and its `state`) stay as they were saved
until the next `optimizer.step()`, and their copy into the node's memory can run on a thread
while the next forward and backward compute (CheckFreq's pipelined snapshot, FAST '21). What
`save` still copies before it returns: every tensor no known optimizer owns (buffers, an EMA
copy, plain tensors), every small one (under `SMALL_BYTES`), and the archive's structure
(its plain values are part of the layout's signature, agent/checkpoint/core/layout.py, so they
are the saved step's by construction).

**The fence.** A global optimizer step pre-hook (`register_optimizer_step_pre_hook`, installed at
the first save or `load_latest`) waits for the copy before any optimizer steps, so no optimizer
changes a tensor while it is being copied. It also notes the optimizer: the tensors of the
optimizers seen stepping are the ones copied in the background. A script that changes saved
tensors in place outside an optimizer calls `rally.job.wait_saved()` first.

**A torn snapshot is never published.** Each background tensor's in-place version counter
(`in_place_version`; a state_dict's detached views share their parameter's) is read at the
save and again when the save is *settled*: any change (an in-place op outside an optimizer,
without `wait_saved()`) and that step's copy is aborted, never committed: the holder keeps the
previous checkpoint, and one warning line says what to do. The check runs on the thread that
saved, at a point between its ops, never on the copy thread: torch bumps the counter after an
in-place kernel has run, so only there is a write that began during the copy sure to be
counted. A save is settled (checked, then committed or aborted) by the next optimizer step's fence,
the next save, `wait_saved()`, a `heartbeat()` once its copy is done, or the interpreter's
exit; until then the holder does not count it, and a worker killed before that loses only that
step (the previous one resumes). Writes the counter cannot see (through `.data`, numpy, another
thread) are not detected: `wait_saved()` before them, or turn the overlap off
(`RALLY_CKPT_OVERLAP=0`: every save copies everything before it returns, as before).

**One copy in flight.** A save while the previous copy still runs waits for it first (a memory
copy's time at most), then settles it. A save is skipped (silently, counted) only when the holder
would have to write it over the newest step's slot because the other slot is being persisted: its
slot stays written until the next step's fence, and a worker killed meanwhile must still find the
newest step in memory. Not a wait (a disk write's time in the loop's stall) nor an overwrite of the
newest step (with a save every step a copy is open nearly all the time, so a failure would fall
back to the older copy being persisted): a skip costs at most a persist's time of steps
("Overlapped saves" in docs/checkpoints.md). The copy itself runs on `parallel_copy`'s threads.

Imports no torch at module level: `rally.job.heartbeat` calls `settle_if_copied`.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rally.agent.checkpoint.core import torch_internals
from rally.agent.checkpoint.core.torch_internals import in_place_version

if TYPE_CHECKING:
    import torch

OVERLAP_ENV = "RALLY_CKPT_OVERLAP"
"""`0`: saves copy everything before they return (no background copy, no fence)."""
SMALL_BYTES = 1 << 16
"""Storages smaller than this are copied before `save` returns: microseconds, and never watched."""
DISCARD_WARN_INTERVAL = 60.0
"""Seconds between two warning lines about discarded snapshots (the first is said at once)."""


def enabled() -> bool:
    """Whether saves overlap the next step (RALLY_CKPT_OVERLAP, read afresh: a forked worker's own);
    never on a torch the torn-snapshot check was not checked against (its counter is torch's
    internal, agent/checkpoint/core/torch_internals.py)."""
    return os.environ.get(OVERLAP_ENV, "1") != "0" and torch_internals.fast_paths()


class NoRoomInMemory(RuntimeError):
    """An overlapped save found no room in the node's memory: its copy thread cannot write it to
    disk instead, so that step is not kept (said in one line) and the next save reserves first."""


class SaveSkipped(RuntimeError):
    """The holder would have had to write over the newest step's slot (the other one is being
    persisted): an overlapped save, whose slot stays written for a step, is skipped instead."""


@dataclass
class PendingCopy:
    """One save whose large tensors are being copied by the copy thread; settled on the saver's thread."""

    tier: Any  # the client.MemoryTier that reserved the slot
    key: str
    step: int
    length: int
    copy: Callable[[], None]  # copies the background storages into the slot
    watched: list[tuple[Any, int]]  # (tensor, its in-place version at the save)
    state: Any  # the saved object: to name a changed tensor in the warning
    thread: int = field(default_factory=threading.get_ident)
    copied: threading.Event = field(default_factory=threading.Event)  # the copy is done (or failed)
    done: threading.Event = field(default_factory=threading.Event)  # committed or aborted
    error: BaseException | None = None

    def run(self) -> None:
        """The copy thread's first part: reserve, copy, tell the holder it is copied."""
        try:
            self.copy()
        except BaseException as exc:  # said at settle, on the saver's thread
            self.error = exc
        finally:
            self.copied.set()
        if self.error is None:
            self.tier.copied(self.key, self.step)  # the holder's persister may use the memory bandwidth again

    def finish(self, intact: bool, refused: Callable[[BaseException], None]) -> None:
        """The copy thread's second part, once the saver's thread has decided: commit or abort.
        A refusal of the commit (this worker's round is over) goes to `refused` before `done` is
        set, so that whoever waits for `done` sees it."""
        try:
            if intact:
                self.tier.commit(self.key, self.step, self.length)
            else:  # called once the copy has ended (`copied`): the slot may be written again
                self.tier.abort(self.key, self.step, ended=True)
        except Exception as error:  # CheckpointRefused: raised by the next save
            refused(error)
        finally:
            self.done.set()


class Overlap:
    """This process's overlapped saves: the copy thread, the one copy in flight, the fence."""

    def __init__(self) -> None:
        self.pending: PendingCopy | None = None
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.deferred: BaseException | None = None  # a refusal met at a fence: raised by the next save
        self.fence_seconds = 0.0  # time the fences and saves waited for copies (what a benchmark reports)
        self.discarded = 0
        self.skipped = 0  # saves skipped to spare the newest step (SaveSkipped)
        self.warned_at = -DISCARD_WARN_INTERVAL
        self.unwarned = 0
        self.finishing: PendingCopy | None = None  # decided, its commit or abort on the copy thread
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread_pid = 0
        self._hook: Any = None

    # ------------------------------------------------------------------ the fence
    def install_fence(self) -> None:
        """Register the optimizer step pre-hook once per process (imports torch.optim); not with
        RALLY_CKPT_OVERLAP=0."""
        if self._hook is not None or not enabled():
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        atexit.register(self.settle_at_exit)

    def _before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        self.optimizers.add(optimizer)
        if self.pending is not None:
            self.settle(raise_errors=False)

    def optimizer_storages(self) -> set[int]:
        """The addresses of the storages the known optimizers change: parameters and state."""
        import torch

        found: set[int] = set()
        for optimizer in list(self.optimizers):
            for group in optimizer.param_groups:
                found.update(p.untyped_storage().data_ptr() for p in group["params"])
            for per_param in optimizer.state.values():
                found.update(v.untyped_storage().data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        return found

    def background(self, storages: list[Any]) -> list[int]:
        """The indices of `storages` to copy in the background: large, and changed by an optimizer only."""
        if not self.optimizers or not enabled():
            return []
        owned = self.optimizer_storages()
        return [i for i, s in enumerate(storages) if s.nbytes() >= SMALL_BYTES and s.data_ptr() in owned]

    # ------------------------------------------------------------------ the copy
    def start(self, pending: PendingCopy) -> None:
        """Hand `pending` to the copy thread (started once per process, again after a fork)."""
        if self._thread_pid != os.getpid():
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._copier, args=(self._queue,), name="rally-ckpt-copy", daemon=True).start()
            self._thread_pid = os.getpid()
        self.pending = pending
        self._queue.put(pending.run)

    def _copier(self, jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            job = jobs.get()  # the next copy or commit; a daemon thread, it ends with the process
            try:
                job()
            except Exception as error:  # a bug must not end the thread the fences wait on: raised by the next save
                self.deferred = error

    # ------------------------------------------------------------------ settling
    def settle(self, *, raise_errors: bool = True) -> None:
        """Wait for the copy in flight, then decide: publish it or discard it (see the module's
        docstring); the commit or abort itself is the copy thread's round trip. On a thread other
        than the saver's only the wait: the saver's thread decides. `raise_errors` (a save,
        `wait_saved`): also wait for the decision to reach the holder, and raise a refusal or a
        copy's error here; a fence keeps them for the next save instead of failing the
        optimizer's step."""
        pending = self.pending
        if pending is not None:
            started = time.perf_counter()
            # wait: short: a memory copy under way (0.08 s for 400 MB) after the copy thread's reserve, a round trip
            # to the holder (its socket times out after client.REPLY_TIMEOUT, and the copy ends with that error)
            pending.copied.wait()
            self.fence_seconds += time.perf_counter() - started
            if threading.get_ident() == pending.thread:
                self.pending = None
                self._decide(pending)
        if raise_errors:
            finishing = self.finishing
            if finishing is not None:
                # wait: short: one round trip to the holder (a commit or an abort), usually long done; its socket
                # times out after client.REPLY_TIMEOUT
                finishing.done.wait()
                self.finishing = None
            if self.deferred is not None:
                error, self.deferred = self.deferred, None
                raise error

    def settle_if_copied(self) -> None:
        """Settle a save whose copy is done, without waiting (`heartbeat`: once a step)."""
        pending = self.pending
        if pending is not None and pending.copied.is_set() and threading.get_ident() == pending.thread:
            self.settle(raise_errors=False)

    def settle_at_exit(self) -> None:
        """At the interpreter's exit (other threads joined): the last save is published if intact."""
        pending = self.pending
        if pending is not None:
            pending.thread = threading.get_ident()
        try:
            self.settle()
        except Exception as error:  # nobody is left to raise it to
            print(f"rally: warning: the last checkpoint was not kept: {error}", file=sys.stderr, flush=True)

    def drop_at_round_end(self) -> None:
        """This process's round is over and the thread that saved has left the training function
        (`rally.job.run` between two entries, agent/worker_side/restartable.py): a save still
        undecided is dropped, and what an earlier decision of that round was refused stays with it.

        Decided later, on the next entry, such a save would reach the next round: judged torn
        by the resume's in-place load (a warning blaming the script), or committed and refused
        (its slot was voided when the agent closed the round before it aborted the function:
        agent/checkpoint/slots.py), that refusal raised by a save of the next round. Dropping it
        is what the holder has done already: the round's resume step is older, as when a worker
        is killed before its save is decided."""
        pending = self.pending
        if pending is not None:
            # wait: short: a memory copy under way after a reserve, as in settle (the teardown is bounded too)
            pending.copied.wait()
            self.pending = None
            self._queue.put(lambda: pending.finish(False, self._defer))  # the holder lets the slot go
            self.finishing = pending
        finishing = self.finishing
        if finishing is not None:
            # wait: short: one round trip to the holder (an abort or a commit); its socket times out after
            # client.REPLY_TIMEOUT
            finishing.done.wait()
            self.finishing = None
        self.deferred = None

    def _decide(self, pending: PendingCopy) -> None:
        changed = [tensor for tensor, version in pending.watched if in_place_version(tensor) != version]
        intact = pending.error is None and not changed
        if isinstance(pending.error, SaveSkipped):
            self.skipped += 1  # the newest step stays; the next save tries again
        elif isinstance(pending.error, NoRoomInMemory):
            print(pending.error, file=sys.stderr, flush=True)
        elif pending.error is not None:
            self.deferred = pending.error
        elif changed:
            self._warn_discarded(pending, changed[0])
        self._queue.put(lambda: pending.finish(intact, self._defer))
        self.finishing = pending  # after the put: an interrupt between the two leaves nothing to wait for

    def _defer(self, error: BaseException) -> None:
        self.deferred = error

    def _warn_discarded(self, pending: PendingCopy, tensor: torch.Tensor) -> None:
        self.discarded += 1
        self.unwarned += 1
        now = time.monotonic()
        if now - self.warned_at < DISCARD_WARN_INTERVAL:
            return
        more = f" ({self.unwarned - 1} more since the last warning)" if self.unwarned > 1 else ""
        print(
            f"rally: warning: checkpoint step {pending.step} was discarded{more}: {name_of(pending.state, tensor)} "
            "was changed in place while it was being copied, outside an optimizer's step; the previous "
            "checkpoint stays. Call rally.job.wait_saved() before changing saved tensors outside an optimizer",
            file=sys.stderr,
            flush=True,
        )
        self.warned_at, self.unwarned = now, 0


def name_of(state: object, tensor: torch.Tensor) -> str:
    """Where `tensor` sits in `state`, as `'model'/'w'` (or "a tensor" if it is not found)."""
    for path, value in _leaves(state, ()):
        if value is tensor:
            return "/".join(repr(part) for part in path) or "the state"
    return "a tensor"


def _leaves(obj: object, path: tuple[object, ...]) -> Iterable[tuple[tuple[object, ...], object]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


overlap = Overlap()
"""This process's overlapped saves (one copy thread, one fence)."""
