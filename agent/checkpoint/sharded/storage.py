"""Sharded `job.save` / `job.load_latest`: torch.distributed.checkpoint's own planner and format,
written through a storage writer that publishes a step only when every rank's part is durable.

Why DCP and not a format of rally's: DCP already knows how to split DTensors and FSDP2 shards
into chunks, deduplicate replicated tensors, and reshard on load when the world size changed
(elastic `--nnodes MIN:MAX`). rally adds what DCP's FileSystemWriter leaves open: it writes
into a fresh directory and tolerates a crash by leaving a half-written checkpoint under the
final name. `PublishingWriter` is that writer with the directory chosen by the
coordinator, a digest of every file computed while it is written, and publication by rename
(`rally.agent.checkpoint.sharded.files`). Loading is torch's own FileSystemReader, after every rank agreed
that the directory is intact (each checks the sizes and a share of the checksums, then one
all-reduce), so all ranks resume from the same step.

Imported only by job.save/load_latest (it imports torch).
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from rally.agent.checkpoint.core import auth, digest, resume_prefetch
from rally.agent.checkpoint.core import client as ckpt_client
from rally.agent.checkpoint.core.checkpoint_file import Checkpoint, DamagedCheckpoint
from rally.agent.checkpoint.core.digest import BytesLike
from rally.agent.checkpoint.core.held_dir import shown
from rally.agent.checkpoint.core.torch_internals import StorageInfo, StoragePrefix
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.checkpoint.sharded import memory as dcp_memory
from rally.agent.checkpoint.sharded.metadata import SafeMetadataReader


@dataclasses.dataclass
class _Part(StoragePrefix):
    """The coordinator's word to one rank: DCP's file prefix for it, and the save's temporary directory."""

    temp: str


@dataclasses.dataclass(frozen=True)
class _Checked:
    """One write result's storage info plus its whole file's size and digest, sent to the coordinator."""

    info: StorageInfo
    file_size: int
    file_digest: str


class _DigestStream(io.RawIOBase):
    """A write-only file that counts the bytes written and their digest (agent/checkpoint/core/digest.py:
    whole leaves of a large write hashed on its threads; one pass, no re-read)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.tree = raw, digest.TreeDigest()

    def writable(self) -> bool:
        return True

    def write(self, data: BytesLike) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)  # buffered: writes all of it or raises
        self.tree.update(view)
        return view.nbytes

    def tell(self) -> int:
        return self.tree.length

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, remembering (size, digest hex) of every file it writes, by
    name; files are created 0600 and never through a link (in the save's 0700 temporary directory)."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, mode) as raw, _DigestStream(raw) as stream:
            yield stream
        self.sums[Path(path).name] = (stream.tree.length, stream.tree.root().hex())


class PublishingWriter(FileSystemWriter):
    """torch's FileSystemWriter (one `__<rank>_0.distcp` per rank, fsynced), into a temporary
    directory made and locked by the coordinator, published by rename in `finish`.

    DCP calls `finish` on the coordinator only after gathering every rank's write results, and
    not at all when any rank failed, so a published directory always holds every rank's part.
    """

    fs: _ChecksummingFileSystem  # torch's writer declares a FileSystem; this one also sums what it writes

    def __init__(self, directory: Path, step: int, keep: int) -> None:
        super().__init__(directory, single_file_per_rank=True, sync_files=True, overwrite=True)
        self.fs = _ChecksummingFileSystem()
        self.directory, self.step, self.keep = directory, step, keep
        self.temp: dcp_files.TempDir | None = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan  # the directory is the coordinator's choice, made in prepare_global_plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        auth.make_private_dir(self.directory)
        dcp_files.remove_dead_saves(self.directory)
        self.temp = dcp_files.TempDir(self.directory, self.step)
        name = self.temp.path.name
        return [
            dataclasses.replace(plan, storage_data=_Part(prefix=f"__{i}_", temp=name)) for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.path = self.directory / plan.storage_data.temp
        # wait: not_a_wait: torch's FileSystemWriter writes before it returns: the future is already done
        results = super().write_data(plan, planner).wait()
        checked = [
            dataclasses.replace(r, storage_data=_Checked(r.storage_data, *self.fs.sums[r.storage_data.relative_path]))
            for r in results
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(checked)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.temp is not None, "finish before prepare_global_plan"
        files: dict[str, tuple[int, str]] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank_results])
            for r in rank_results:
                files[r.storage_data.info.relative_path] = (r.storage_data.file_size, r.storage_data.file_digest)
        super().finish(metadata, plain)  # .metadata.tmp, fsync, rename to .metadata
        files[".metadata"] = self.fs.sums[".metadata.tmp"]
        self.temp.publish(files)
        self.temp.close()
        dcp_files.prune(self.directory, self.keep, self.step)


class ShardedSaveFailed(RuntimeError):
    """A sharded save failed on some rank; the message names the step, the directory, the rank and
    its error in one line (DCP's own CheckpointException, chained, is a BaseException with every
    rank's traceback). The previous checkpoints are untouched."""


def save(state: dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Save `state` as step `step` on every rank (a collective when torch.distributed is up).

    torch.distributed.checkpoint's own planner and file format, one `__<rank>_0.distcp` file per
    rank in a temporary directory that global rank 0 renames to `step_<step:012d>.dcp` only once
    every rank's file, DCP's `.metadata` and rally's manifest (sizes, digests) are durable. Keeps
    the newest `keep` sharded checkpoints, as job.save keeps whole-state files.
    """
    if step < 0:
        raise ValueError(f"rally: checkpoint step must be >= 0, got {step}")
    if not isinstance(state, dict):
        raise TypeError(
            "rally: a sharded checkpoint's state must be a dict (torch.distributed.checkpoint's rule), got "
            f"{type(state).__name__}"
        )
    if dist.is_available() and dist.is_initialized() and dcp_memory.save(state, directory, step, keep):
        return directory / dcp_files.step_name(step)  # in memory now, on disk in the background
    writer = PublishingWriter(directory, step, keep)
    try:
        dcp.save(state, storage_writer=writer)
    except CheckpointException as failure:
        if writer.temp is not None:
            writer.temp.discard()
        rank, (error, _) = min(failure.failures.items())
        error = _os_error_within(error)
        others = f" (and on {len(failure.failures) - 1} more ranks)" if len(failure.failures) > 1 else ""
        raise ShardedSaveFailed(
            f"rally: sharded checkpoint of step {step} in {shown(directory)} failed on rank {rank}{others}: "
            f"{type(error).__name__}: {error}"
        ) from failure
    except BaseException:
        if writer.temp is not None:
            writer.temp.discard()
        raise
    finally:
        if writer.temp is not None:
            writer.temp.close()
    return directory / dcp_files.step_name(step)


def _os_error_within(error: BaseException) -> BaseException:
    """The OSError behind `error`, if any: torch.save turns a failed write (ENOSPC) into
    "unexpected pos 704 vs 598", with the OSError only in its context."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return error


def load_newest(state: dict[str, Any], directory: Path) -> Checkpoint | None:
    """Load the newest intact sharded checkpoint into `state` in place (job.load_latest(into=state)).

    Every rank walks the same list (rank 0's) and skips the same damaged directories: each rank
    checks every file's size and the digest of its share of the files, and a directory is used
    only when every rank found its share intact. Rank 0 says which directory was skipped and why,
    and where it resumes from.
    """
    rank, world = _rank_and_world()
    steps = _same_on_every_rank([step for step, _ in dcp_files.list_steps(directory)], world)
    from_memory, why = _load_from_memory(state, max(steps, default=None), directory)
    if from_memory is not None:
        return from_memory
    for step in reversed(steps):
        path = directory / dcp_files.step_name(step)
        reason, signed = "", True
        try:
            signed = dcp_files.verify(path, share=rank, shares=world)
        except DamagedCheckpoint as damage:
            reason = str(damage)
        reasons = _reasons_of_every_rank(reason, world)
        if any(reasons):
            if rank == 0:
                broken = next(r for r in reasons if r)
                _log(f"warning: checkpoint {shown(path)} is damaged ({broken}); trying an older one")
            continue
        if not signed and rank == 0:
            _log(
                f"checkpoint {shown(path)} was written before rally signed checkpoints: it is unauthenticated, loaded "
                "because only you can write its directory"
            )
        if signed and rank == 0 and (old := dcp_files.old_format_line(path)) is not None:
            _log(old)
        dcp.load(state, storage_reader=SafeMetadataReader(path))  # authenticated above; restricted unpickler
        if rank == 0:
            _log(
                f"resuming from step {step} ({shown(path)}, sharded, world size "
                f"{world}){f'; not from memory: {why}' if why else ''}"
            )
        return Checkpoint(step=step, state=state, path=path)
    if rank == 0:
        _log("no sharded checkpoint, starting from scratch")
    return None


def _load_from_memory(
    state: dict[str, Any], newest_on_disk: int | None, directory: Path
) -> tuple[Checkpoint | None, str]:
    """Resume from the nodes' memory when every rank's shards of a step not older than the disk's
    newest are held by a live node (own copy or ring replica); else (None, why not)."""
    if not (dist.is_available() and dist.is_initialized()) or not dcp_memory.agreed()[0]:
        return None, ""  # without a process group there is no memory path (and no tier asked)
    tier = ckpt_client.tier()
    if tier is None:
        return None, ""
    rank, world = dist.get_rank(), dist.get_world_size()
    holdings: list[Any] = [None] * world
    dist.all_gather_object(holdings, tier.held("dcp"))
    local = dcp_memory.agreed()[2]
    step, providers, why = dcp_memory.plan(holdings, world, local)
    if step is None:
        return None, why
    if newest_on_disk is not None and newest_on_disk > step:
        return None, f"the disk holds a newer step ({newest_on_disk}) than memory ({step})"
    failure = ""
    try:
        prepared = resume_prefetch.take_slot(dcp_memory.own_key(rank, world), step)  # mapped as the script started
        remote = dcp_memory.load(state, step, providers, prepared)
    except Exception as exc:  # the same on every rank after the vote below: all take the disk
        failure, remote = f"{type(exc).__name__}: {exc}", []
    reasons = _reasons_of_every_rank(failure, world)
    if any(reasons):
        return None, f"loading step {step} from memory failed ({next(r for r in reasons if r)})"
    if rank == 0:
        origin = (
            "every rank's shards from its own node"
            if not remote
            else (
                f"rank{'s' if len(remote) > 1 else ''} {', '.join(map(str, remote))} from the ring replica on "
                f"node{'s' if len({providers[r] // local for r in remote}) > 1 else ''} "
                f"{', '.join(str(n) for n in sorted({providers[r] // local for r in remote}))}: "
                f"{'its own node' if len(remote) == 1 else 'their own nodes'} lost "
                f"{'its' if len(remote) == 1 else 'their'} copy"
            )
        )
        _log(f"resuming from step {step} from memory (sharded, world size {world}; {origin})")
    return Checkpoint(step=step, state=state, path=directory / dcp_files.step_name(step), source="memory"), ""


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device() -> torch.device:
    """Where this job's default process group takes tensors (NCCL: the current GPU; else the CPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _same_on_every_rank(steps: list[int], world: int) -> list[int]:
    if world == 1:
        return steps
    box: list[Any] = [steps]
    dist.broadcast_object_list(box, src=0, device=_device())
    return box[0]


def _reasons_of_every_rank(reason: str, world: int) -> list[str]:
    """Every rank's verdict ("" = intact): one all-reduce, and a gather of the reasons only on damage."""
    if world == 1:
        return [reason]
    flag = torch.tensor([0 if reason else 1], dtype=torch.int32, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 1:
        return [""] * world
    reasons: list[Any] = [None] * world
    dist.all_gather_object(reasons, reason)
    return [str(r) for r in reasons]


def _log(message: str) -> None:
    print(f"rally: {message}", file=sys.stderr, flush=True)
