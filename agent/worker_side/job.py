"""Helpers for training scripts run by rally (or torchrun): job context, checkpoints, heartbeat, preemption.

Import it as `from rally import job`. Importing is cheap and never imports torch: the agent's
template process and scripts that only need `context` or `heartbeat` should not pay
two seconds for it. Torch is imported inside `save` and `load_latest`.

Environment (all optional; outside a launcher the job is rank 0 of 1):

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK, GROUP_WORLD_SIZE                   torchrun's names, set by rally and torchrun
    TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID
    RALLY_CHECKPOINT_DIR     where save/load_latest keep checkpoints (rally's --checkpoint-dir);
                             one directory that every rank sees (a shared file system on several
                             nodes). Under rally without it, checkpoints live in the memory tier only
    RALLY_CHECKPOINT_KEEP    how many checkpoints save() keeps (default 3)
    RALLY_CKPT_HOLDER, RALLY_ROUND   the agent's checkpoint holder and this worker's round: save()
                             copies into the node's memory, the holder writes the disk
    RALLY_HEARTBEAT_FILE     per-worker heartbeat file created by the agent (see heartbeat_file)
    RALLY_PREEMPT_SIGNALS    comma-separated signal names rally forwards before a kill, e.g. SIGUSR1,SIGTERM

Typical loop:

    ckpt = job.load_latest()
    start = ckpt.step if ckpt else 0
    for step in range(start + 1, steps + 1):
        with job.section("step", timeout=600):
            train_one_step(step)
        job.heartbeat(step)
        if step % 100 == 0 or job.preempted():
            job.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rally.agent.checkpoint import checkpoint_dir
from rally.agent.checkpoint.checkpoint_dir import newest_checkpoint_step  # noqa: F401 - part of this module's API
from rally.agent.checkpoint.core import auth, checkpoint_file, resume_prefetch
from rally.agent.checkpoint.core import client as ckpt_client
from rally.agent.checkpoint.core.auth import UnsafeDirectory  # noqa: F401 - part of this module's API
from rally.agent.checkpoint.core.checkpoint_file import Checkpoint  # part of this module's API (load_latest returns it)
from rally.agent.checkpoint.core.client import WHOLE_STATE_KEY, CheckpointRefused  # noqa: F401 - part of this module's API
from rally.agent.checkpoint.core.held_dir import shown
from rally.agent.checkpoint.core.overlap import overlap
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.worker_side import heartbeat_file, memory_only, process_memory
from rally.agent.worker_side.preemption_flag import (  # noqa: F401 - part of this module's API
    PREEMPT_SIGNALS_ENV,
    install_preemption_handler,
    on_preempt,
    parse_signals,
    preempted,
    to_signal,
)
from rally.agent.worker_side.restartable import RoundAborted, run  # noqa: F401 - part of this module's API

if TYPE_CHECKING:  # torch is the worker's, imported when used
    from torch.serialization import MAP_LOCATION

CHECKPOINT_DIR_ENV = "RALLY_CHECKPOINT_DIR"
CHECKPOINT_KEEP_ENV = "RALLY_CHECKPOINT_KEEP"
HEARTBEAT_FILE_ENV = "RALLY_HEARTBEAT_FILE"

DEFAULT_CHECKPOINT_KEEP = 3
"""Checkpoints kept by `save` when neither `keep` nor RALLY_CHECKPOINT_KEEP says otherwise.
More than one, so that a newest file damaged after it was written still leaves a fallback."""

# ---------------------------------------------------------------------------------------------
# Context


@dataclass(frozen=True)
class JobContext:
    """Where this worker sits in the job, as `context()` reads it from the launcher's environment.

    Attributes:
        rank: The global rank (`RANK`), 0 to `world_size - 1`.
        local_rank: The rank on this node (`LOCAL_RANK`).
        world_size: Workers in the job (`WORLD_SIZE`).
        local_world_size: Workers on this node (`LOCAL_WORLD_SIZE`).
        group_rank: This node's rank (`GROUP_RANK`).
        group_world_size: Nodes in the job (`GROUP_WORLD_SIZE`).
        restart_count: Restarts so far (`TORCHELASTIC_RESTART_COUNT`).
        max_restarts: The job-wide restart budget (`TORCHELASTIC_MAX_RESTARTS`).
        run_id: The job's run id (`TORCHELASTIC_RUN_ID`), "local" outside a launcher.
        checkpoint_dir: `RALLY_CHECKPOINT_DIR` (rally's `--checkpoint-dir`), or None.
        preempt_signals: The signals rally forwards as a preemption warning.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    restart_count: int
    max_restarts: int
    run_id: str
    checkpoint_dir: Path | None
    preempt_signals: tuple[signal.Signals, ...] = ()

    @property
    def is_rank0(self) -> bool:
        """True on the one worker (global rank 0) that writes checkpoints and prints progress."""
        return self.rank == 0


def context() -> JobContext:
    """Where this worker sits in the job: rank, world size, restart count, checkpoint directory.

    Read afresh from the environment on each call (a few microseconds), so a forked worker sees its
    own. Outside a launcher the defaults describe a single process, rank 0 of 1.

    Returns:
        The worker's `JobContext`.

    Raises:
        ValueError: A variable is malformed (e.g. `RANK=x`); the message names it.

    Examples:
        >>> from rally import job
        >>> ctx = job.context()
        >>> if ctx.rank == 0:
        ...     print(f"rank 0 of {ctx.world_size}, restart {ctx.restart_count}")
        rank 0 of 1, restart 0
    """
    ckpt_dir = os.environ.get(CHECKPOINT_DIR_ENV, "")
    return JobContext(
        rank=_env_int("RANK", 0),
        local_rank=_env_int("LOCAL_RANK", 0),
        world_size=_env_int("WORLD_SIZE", 1),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        group_rank=_env_int("GROUP_RANK", 0),
        group_world_size=_env_int("GROUP_WORLD_SIZE", 1),
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_env_int("TORCHELASTIC_MAX_RESTARTS", 0),
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", "local"),
        checkpoint_dir=Path(ckpt_dir) if ckpt_dir else None,
        preempt_signals=parse_signals(os.environ.get(PREEMPT_SIGNALS_ENV, "")),
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"rally: environment variable {name} must be an integer, got {value!r}") from None


# ---------------------------------------------------------------------------------------------
# Checkpoints


class CheckpointDirNotSet(RuntimeError):
    """`save` or `load_latest` needed a checkpoint directory and there is none.

    Whole states never need one (the node's memory under rally, the process's memory under torchrun
    or plain python); a sharded (DTensor) state under rally does, and so does a node with no room
    in memory. See [Troubleshooting](troubleshooting.md#checkpoint-dir-not-set).
    """


def save(state: Any, step: int, *, keep: int | None = None, sharded: bool | None = None) -> Path | None:
    """Checkpoint `state` as `step`, at memory speed under rally.

    Under rally the call returns once the state is copied into the node's shared memory, owned by
    the agent's holder process; a restarted worker reloads it from there in milliseconds. With
    `--checkpoint-dir` the holder also writes it to disk in the background (the newest one at a
    time, atomically, keeping the newest `keep`); `durable_steps` says which steps are on disk.
    Without one, the copy stays in memory for restarts within the job, and rank 0 says so once.
    The tensors an optimizer owns are copied while the next step computes, and each optimizer's
    `step()` waits for that copy: change saved tensors some other way only after `wait_saved`.

    Without rally's memory tier (torchrun, plain python) and with `RALLY_CHECKPOINT_DIR`, global
    rank 0 writes the file itself: `torch.save` to a temporary file with a footer (length, step, a
    MAC of every byte), fsync, rename over `step_<step>.pt`. A crash at any moment leaves the old
    set of checkpoints, or the old set plus the new complete one.

    Without the memory tier and without `RALLY_CHECKPOINT_DIR`, each rank keeps a copy of its
    newest save in its own memory for as long as the process lives, and rank 0 says so once;
    nothing is written, and a new process (torchrun's restart) starts from scratch on every rank
    alike. Not a default directory: that would write where nobody chose, and on nodes without a
    shared working directory rank 0 would resume from a step the others cannot see. A sharded
    state is not kept then (one line says so).

    Call it on every rank at the same step: the state is expected to be the same on every rank (as
    DDP keeps it), so one copy speaks for all and the script needs no rank check. A DTensor (FSDP2)
    state is saved by every rank, each its shards ([Sharded states](checkpoints.md)).

    Several savers may share a directory (a straggler of an earlier round, two jobs): each locks
    its temporary file, and a temporary file is removed only once its writer is dead. Older
    checkpoints are deleted after the new one is durable, never files newer than it.

    Args:
        state: What to save: any picklable object of tensors, numbers, strings and containers, e.g.
            `{"model": model.state_dict(), "opt": opt.state_dict()}`.
        step: The training step, an int >= 0; `load_latest` returns the newest.
        keep: How many checkpoints to keep on disk (default `RALLY_CHECKPOINT_KEEP`, else 3).
        sharded: Save per rank through torch.distributed.checkpoint; default: when `state` holds
            DTensors.

    Returns:
        On global rank 0, the path the checkpoint is (or will be) durable at; None on the other
        ranks, and without a checkpoint directory.

    Raises:
        CheckpointDirNotSet: A sharded state under rally without `--checkpoint-dir`, or no room in
            the node's memory and no directory.
        CheckpointRefused: The save came from a worker of a round that is over, or the memory tier's
            holder is not this node's.
        ValueError: `step` < 0 or `keep` < 1.

    Examples:
        >>> for step in range(start, steps):
        ...     train_one_step(step)
        ...     if step % 100 == 0 or job.preempted():
        ...         job.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
    """
    ctx = context()
    resume_prefetch.discard()  # a reload the script did not make: its mapping is let go
    overlap.settle()  # the previous save, if its copy is in flight: published before anything else is saved
    is_sharded = sharded if sharded is not None else dcp_files.holds_shards(state)
    if ctx.checkpoint_dir is None and _memory_tier(ctx) is None and not memory_only.tier_lost():
        _save_in_process(ctx, state, step, is_sharded)  # torchrun, plain python: no agent, no directory
        return None
    if is_sharded:
        from rally.agent.checkpoint.sharded import storage as dcp_storage  # imports torch.distributed.checkpoint

        return dcp_storage.save(state, _require_dir(ctx, sharded=True), step, _resolve_keep(keep))
    if step < 0:
        raise ValueError(f"rally: checkpoint step must be >= 0, got {step}")
    keep = _resolve_keep(keep)
    memory = _memory_tier(ctx)
    if memory is not None:
        overlap.install_fence()
    if ctx.checkpoint_dir is None and memory is not None:
        _save_in_memory_only(ctx, memory, state, step, keep)
        return None  # no file
    if ctx.checkpoint_dir is None and memory_only.tier_lost():
        memory_only.tell_off_once(ctx.is_rank0, _log)  # the holder died: no memory, no directory
        return None
    directory = _require_dir(ctx)
    final = directory / f"step_{step:012d}.pt"
    if memory is not None and ctx.local_rank != 0:
        return None  # local rank 0 holds this node's copy
    if memory is not None and memory.save(state, WHOLE_STATE_KEY, step, persist=ctx.is_rank0, keep=keep):
        return final if ctx.is_rank0 else None
    if not ctx.is_rank0:
        return None
    auth.make_private_dir(directory)
    checkpoint_file.remove_dead_writers_temps(directory)
    checkpoint_file.write(state, final, step)
    checkpoint_dir.prune(directory, keep, protect=final)
    return final


def load_latest(
    map_location: MAP_LOCATION = "cpu", *, weights_only: bool = True, into: dict[str, Any] | None = None
) -> Checkpoint | None:
    """The newest checkpoint every rank can load, or None when there is none.

    Call it on every rank, before the first collective. Under rally every rank resumes from the
    step the round agreed on: the newest that every node holds in memory or that is intact on disk.
    A worker restarted on a surviving node maps it from the node's memory (no copy until the script
    copies the tensors); the others read it from disk. On disk a file is intact when its footer's
    length and MAC match: a damaged newest file is skipped with a warning and the next older one is
    tried, the same on every rank. Rank 0 says in one line where it resumes from. Without the
    memory tier and without `RALLY_CHECKPOINT_DIR` (torchrun, plain python): this process's newest
    `save` (`source` "process memory"), else None.

    Args:
        map_location: Where tensors go, as for `torch.load` (default "cpu").
        weights_only: torch's safe loader (tensors, numbers, strings, containers: what state dicts
            hold); False for trusted arbitrary pickles.
        into: For sharded (FSDP2) states: the state dict to load into, in place and resharded
            (`get_state_dict(model, opt)`).

    Returns:
        A `Checkpoint` (`step`, `state`, `path`, `source`: "memory", "disk" or "process memory"), or None.

    Raises:
        CheckpointDirNotSet: `into` (a sharded state) under rally without `--checkpoint-dir`.
        CheckpointRefused: The memory tier's holder is not this node's.

    Examples:
        >>> ckpt = job.load_latest()  # None the first time
        >>> start = ckpt.step + 1 if ckpt else 0
        >>> if ckpt:
        ...     model.load_state_dict(ckpt.state["model"])
        ...     opt.load_state_dict(ckpt.state["opt"])
    """
    ctx = context()
    memory = _memory_tier(ctx)
    if ctx.checkpoint_dir is None and memory is None and not memory_only.tier_lost():
        return _load_in_process(ctx, map_location, weights_only, into)  # torchrun, plain python: no agent, no directory
    if memory is not None:
        overlap.install_fence()  # before the first step: the optimizers are known by the first save
    if ctx.checkpoint_dir is None and memory is not None and into is None:
        return _load_from_memory_only(ctx, memory, map_location, weights_only)
    if ctx.checkpoint_dir is None and into is None and memory_only.tier_lost():
        memory_only.tell_off_once(ctx.is_rank0, _log)
        return None
    directory = _require_dir(ctx, sharded=into is not None)
    if into is not None:
        from rally.agent.checkpoint.sharded import storage as dcp_storage  # imports torch.distributed.checkpoint

        return dcp_storage.load_newest(into, directory)

    import torch

    agreed = None
    prepared = resume_prefetch.take(map_location) if memory is not None else None
    if prepared is not None:  # mapped while the script started (agent/checkpoint/core/resume_prefetch.py)
        return _from_memory(ctx, directory, *prepared)
    if memory is not None:
        agreed, memfd = memory.resume(WHOLE_STATE_KEY)
        if memfd is not None and agreed is not None:
            try:
                state = torch.load(
                    f"/proc/self/fd/{memfd}", map_location=map_location, weights_only=weights_only, mmap=True
                )
            finally:
                os.close(memfd)  # the mapping keeps the copy
            return _from_memory(ctx, directory, agreed, state)

    for step, path in reversed(checkpoint_dir.list_checkpoints(directory)):
        if agreed is not None and step > agreed:
            continue  # newer than what every rank can load: not this round's step
        try:
            fd, verified = checkpoint_file.open_mapped_verified(path)
        except FileNotFoundError:
            continue  # pruned by a saver between listing and opening; an older one is still there
        except checkpoint_file.DamagedCheckpoint as damage:
            if ctx.local_rank == 0:
                _log(f"warning: checkpoint {shown(path)} is damaged ({damage}); trying an older one")
            continue
        refused = checkpoint_file.refusal(path, verified)
        if refused is not None:
            os.close(fd)
            if ctx.local_rank == 0:
                _log(f"warning: checkpoint {shown(path)} is not loaded ({refused}); trying an older one")
            continue
        if not verified.signed and ctx.is_rank0:
            _log(checkpoint_file.unauthenticated_line(path))
        elif ctx.is_rank0 and (old := checkpoint_file.old_format_line(path, verified)) is not None:
            _log(old)
        try:
            state = torch.load(f"/proc/self/fd/{fd}", map_location=map_location, weights_only=weights_only, mmap=True)
        finally:
            os.close(fd)
        if ctx.is_rank0:
            _log(f"resuming from step {step} ({shown(path)})")
        return Checkpoint(step=step, state=state, path=path)
    if ctx.is_rank0:
        _log("no checkpoint, starting from scratch")
    return None


def _from_memory(ctx: JobContext, directory: Path | None, step: int, state: object) -> Checkpoint:
    if ctx.is_rank0:
        _log(f"resuming from step {step} (from memory)")
    path = (directory or Path(memory_only.NO_DIRECTORY)) / f"step_{step:012d}.pt"
    return Checkpoint(step=step, state=state, path=path, source="memory")


def _save_in_memory_only(ctx: JobContext, memory: ckpt_client.MemoryTier, state: object, step: int, keep: int) -> None:
    memory_only.tell_once(ctx.is_rank0 and ctx.restart_count == 0, _log)
    if ctx.local_rank == 0 and not memory_only.save(memory, state, step, keep):  # local rank 0: the node's copy
        raise CheckpointDirNotSet(memory_only.NO_ROOM)


def _load_from_memory_only(
    ctx: JobContext, memory: ckpt_client.MemoryTier, map_location: MAP_LOCATION, weights_only: bool
) -> Checkpoint | None:
    memory_only.tell_once(ctx.is_rank0 and ctx.restart_count == 0, _log)
    found = resume_prefetch.take(map_location) or memory_only.load(memory, map_location, weights_only)
    if found is None:
        if ctx.is_rank0:
            _log("no checkpoint, starting from scratch")
        return None
    return _from_memory(ctx, None, *found)


def _save_in_process(ctx: JobContext, state: object, step: int, sharded: bool) -> None:
    """Neither an agent's memory tier nor a directory: the newest save stays in this process
    (agent/worker_side/process_memory.py says why this and not a default directory)."""
    if sharded:
        process_memory.tell_once(process_memory.SHARDED_LINE, ctx.is_rank0, _log)
        return
    if step < 0:
        raise ValueError(f"rally: checkpoint step must be >= 0, got {step}")
    process_memory.tell_once(process_memory.LINE, ctx.is_rank0, _log)
    process_memory.save(state, step)


def _load_in_process(
    ctx: JobContext, map_location: MAP_LOCATION, weights_only: bool, into: dict[str, Any] | None
) -> Checkpoint | None:
    if into is not None:
        process_memory.tell_once(process_memory.SHARDED_LINE, ctx.is_rank0, _log)
        return None
    process_memory.tell_once(process_memory.LINE, ctx.is_rank0, _log)
    found = process_memory.load(map_location, weights_only)
    if found is None:
        if ctx.is_rank0:
            _log("no checkpoint, starting from scratch")
        return None
    step, state = found
    if ctx.is_rank0:
        _log(f"resuming from step {step} (from this process's memory)")
    path = Path(memory_only.NO_DIRECTORY) / f"step_{step:012d}.pt"
    return Checkpoint(step=step, state=state, path=path, source=process_memory.SOURCE)


def wait_saved() -> None:
    """Wait until the last `save` is done with the state's tensors.

    Under rally's memory tier `save` returns before the tensors an optimizer owns are copied; the
    copy runs while the next step computes, and each optimizer's `step()` waits for it. A script
    that changes those tensors some other way (`p.mul_(0.5)`, `load_state_dict`) before the next
    `optimizer.step()` calls this first; otherwise that step's copy is found torn and discarded,
    with one warning line ("Overlapped saves" in [Checkpoints](checkpoints.md)). Returns at once
    when no copy is in flight, and outside rally.

    Raises:
        CheckpointRefused: The holder refused the save's commit (this worker's round is over).

    Examples:
        >>> job.save({"model": model.state_dict()}, step)
        >>> job.wait_saved()
        >>> model.load_state_dict(averaged)  # safe: the copy is done
    """
    overlap.settle()


def durable_steps(directory: str | os.PathLike[str] | None = None) -> list[int]:
    """The steps whose checkpoint files are complete on disk, oldest first.

    Under rally's memory tier `save` returns before the disk write; this says which steps a lost
    node, a lost job or a new job would find. Cheap: it checks each file's footer and length, not
    its MAC (`load_latest` does).

    Args:
        directory: The checkpoint directory; default: the job's (`RALLY_CHECKPOINT_DIR`).

    Returns:
        The steps, oldest first; empty when none is complete.

    Raises:
        CheckpointDirNotSet: No `directory` and no job checkpoint directory.

    Examples:
        >>> job.durable_steps()
        [100, 200, 300]
    """
    found = checkpoint_dir.list_checkpoints(Path(directory) if directory is not None else _require_dir(context()))
    return [step for step, path in found if checkpoint_file.is_complete(path)]


def _memory_tier(ctx: JobContext) -> ckpt_client.MemoryTier | None:
    """The node's memory tier as this script may use it. A script that names its own checkpoint
    directory (RALLY_CHECKPOINT_DIR) under an agent given no --checkpoint-dir saves to disk as
    without the tier: that agent's holder persists nothing, and the script's directory is its own."""
    memory = ckpt_client.tier()
    if memory is not None and ctx.checkpoint_dir is not None and not ckpt_client.persists():
        return None
    return memory


def _require_dir(ctx: JobContext, sharded: bool = False) -> Path:
    """The job's checkpoint directory, once it is known that no other user can plant a checkpoint
    there (or the user consented, RALLY_CHECKPOINT_DIR_SHARED=1): UnsafeDirectory otherwise."""
    if ctx.checkpoint_dir is None:
        what = "sharded checkpoints need" if sharded else "no checkpoint directory: checkpoints need"
        raise CheckpointDirNotSet(
            f"rally: {what} a directory that every rank can see: run under rally with "
            f"--checkpoint-dir DIR (under torchrun or plain python, set {CHECKPOINT_DIR_ENV}=DIR)"
        )
    auth.check_directory(ctx.checkpoint_dir)
    return ctx.checkpoint_dir


def _resolve_keep(keep: int | None) -> int:
    if keep is None:
        keep = _env_int(CHECKPOINT_KEEP_ENV, DEFAULT_CHECKPOINT_KEEP)
    if keep < 1:
        raise ValueError(f"rally: checkpoints to keep must be >= 1, got {keep} (keep= or {CHECKPOINT_KEEP_ENV})")
    return keep


# ---------------------------------------------------------------------------------------------
# Heartbeat and sections


def heartbeat(step: int | None = None) -> None:
    """Tell the agent this worker is making progress; call it once per step.

    It costs about a microsecond, never blocks and never imports torch: it writes a counter, the
    time and the step into the file rally mapped for this worker. rally turns the beats into the
    hang verdict (`--heartbeat-timeout`) and the steps into per-rank step times, which name a rank
    that stays slower than the others (a straggler). Outside rally it does nothing.

    Args:
        step: The training step just finished (an int >= 0), for step times; optional.

    Examples:
        >>> for step in range(steps):
        ...     train_one_step(step)
        ...     job.heartbeat(step)
    """
    _beat(step)
    overlap.settle_if_copied()  # an overlapped save whose copy is done: published now, not at the next step


@contextlib.contextmanager
def section(name: str, timeout: float | None = None) -> Iterator[None]:
    """Mark a named part of the work ("setup", "step", "checkpoint"), with its own timeout.

    Inside a section with a `timeout`, the agent's `--startup-timeout`, `--heartbeat-timeout` and
    `--silence-timeout` are suspended and the section's deadline holds instead: a save that takes 5
    minutes is not a hang, and one still running after `timeout` seconds is reported as "hung in
    section 'checkpoint' for 612 s" with its stacks. Without a `timeout` a section only names where
    the worker is, which a hang report then says. Sections nest (an inner one without a timeout is
    `outer/inner` and keeps the outer deadline); entering or leaving one counts as a sign of life.
    Use it from the training loop's thread. Outside rally it does nothing.

    Args:
        name: What the worker is doing, shown in hang reports and `rally status`.
        timeout: Seconds the section may take, or None for no deadline of its own.

    Raises:
        ValueError: `timeout` is not a positive number of seconds.

    Examples:
        >>> with job.section("checkpoint", timeout=600):
        ...     job.save({"model": model.state_dict()}, step)
    """
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(
            f"rally: section {name!r}: timeout must be a positive number of seconds or None, got {timeout!r}"
        )
    writer = _heartbeat_writer()
    if writer is None:
        yield
        return
    outer = _sections[-1] if _sections else None
    if timeout is None and outer is not None:
        current = (f"{outer[0]}/{name}", outer[1], outer[2])  # keeps the outer deadline
    else:
        current = (name, time.monotonic_ns(), int(timeout * 1e9) if timeout else 0)
    _sections.append(current)
    writer.set_section(*current)
    try:
        yield
    finally:
        _sections.pop()
        writer.set_section(*(outer or ("", 0, 0)))
        if outer is None and timeout is None:  # what --heartbeat-timeout auto learns a deadline from
            writer.section_done(name, current[1])


def _heartbeat_writer() -> heartbeat_file.HeartbeatWriter | None:
    """The writer for RALLY_HEARTBEAT_FILE, opened once; None when the variable is unset.

    Lazy so that a process forked from the agent's template (which imported this module before the
    worker's environment existed) reads the worker's own RALLY_HEARTBEAT_FILE.
    """
    global _writer, _writer_resolved
    if not _writer_resolved:
        path = os.environ.get(HEARTBEAT_FILE_ENV, "")
        _writer = heartbeat_file.HeartbeatWriter(path) if path else None
        _writer_resolved = True
    return _writer


def _first_beat(step: int | None = None) -> None:
    """Decide once, at the first heartbeat, whether beats go to a file or nowhere."""
    global _beat
    writer = _heartbeat_writer()
    _beat = writer.beat if writer is not None else _no_beat
    _beat(step)


def _no_beat(step: int | None = None) -> None:
    pass


_writer: heartbeat_file.HeartbeatWriter | None = None
_writer_resolved = False
_sections: list[tuple[str, int, int]] = []  # (name, entered_ns, timeout_ns), innermost last
_beat: Callable[[int | None], None] = _first_beat


def _log(message: str) -> None:
    print(f"rally: {message}", file=sys.stderr, flush=True)
