"""Sharded states in the memory tier: each rank's shards as a rank-local DCP checkpoint in its node's
shared memory, with a replica in the next node's (a ring over the round's nodes), as in Gemini.

Why rank-local: torch.distributed.checkpoint can save one rank's view alone (`no_dist`: its
shards plus the replicated values, with a `.metadata` that lists only its chunks) and load it
back into the same layout without any collective. That is exactly a restarted worker's case, so
the copy in memory is DCP's own two files (`__<rank>_0.distcp` and `.metadata`, made by DCP's
planner and writer into memory) in one slot of the agent's holder (agent/checkpoint/core/client.py)::

    [ b"RALLYDCP" | metadata length u64 | world size u64 | rank u64 ][ .metadata ][ __<rank>_0.distcp ]

Keys: `dcp<rank>of<world>` for a rank's own copy, `dcpr<rank>of<world>` for the replica of
rank `rank` that the same local rank of the previous node sent over (one point-to-point
exchange per save, over the job's own process group). The same two files are then written to
disk in the background (agent/checkpoint/sharded/persist.py) and published as one DCP directory, which is what
a change of world size reshards from.

Resuming (`load`): every rank tells the others which copies its node holds (one
all_gather_object); the newest step for which every rank of an unchanged world size has a copy
on some live node, own or replica, wins over the disk if it is not older. A rank whose copy is on
another node gets it from there (send/recv). Rank 0 logs where the step came from and why.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from rally.agent.checkpoint.core import client as ckpt_client
from rally.agent.checkpoint.core.layout import Recorder
from rally.agent.checkpoint.core.torch_internals import StoragePrefix, no_record_crc
from rally.agent.checkpoint.sharded import files as dcp_files
from rally.agent.checkpoint.sharded import layout as dcp_layout
from rally.agent.checkpoint.sharded import persist as dcp_persist
from rally.agent.checkpoint.sharded.reader import MemoryReader, ViewFile

HEADER, MAGIC = dcp_files.SLOT_HEADER, dcp_files.SLOT_MAGIC
REPLICAS_ENV = "RALLY_CKPT_REPLICAS"
"""Set to 0 to keep no replica of a node's shards on its ring peer (memory and disk only)."""
_KEY_RE = dcp_files.KEY_RE
own_key, replica_key = dcp_files.own_key, dcp_files.replica_key


class _OpenBytes(io.BytesIO):
    """A BytesIO that DCP's writer may close: the bytes stay for us to take."""

    def close(self) -> None:
        pass


class _MemoryFileSystem(FileSystem):
    """DCP's file system interface over a dict of names to bytes (no directory, no fsync)."""

    def __init__(self, files: dict[str, Any] | None = None, recorder: Recorder | None = None) -> None:
        self.files: dict[str, Any] = files or {}
        self.recorder = recorder  # watches the data file's writes (agent/checkpoint/sharded/layout.py)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = Path(path).name
        if "w" in mode:
            stream = dcp_layout.RecordingBytes(self.recorder) if name.endswith(".distcp") else _OpenBytes()
            yield stream
            self.files[name] = stream
        else:
            data = self.files[name]
            yield ViewFile(data.getbuffer() if isinstance(data, io.BytesIO) else data)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.files[Path(new_path).name] = self.files.pop(Path(path).name)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return Path(path).name in self.files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.files.pop(Path(path).name, None)


class _RankLocalWriter(FileSystemWriter):
    """DCP's writer for one rank saving alone (`no_dist`), naming its file as DCP's own
    rank-local layout does (`__<rank>_0.distcp`), into memory."""

    fs: _MemoryFileSystem  # torch's writer declares a FileSystem; this one keeps the files in memory

    def __init__(self, rank: int, recorder: Recorder | None = None) -> None:
        super().__init__("/rally-memory", sync_files=False)
        self.fs = _MemoryFileSystem(recorder=recorder)
        self.own_rank = rank

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [dataclasses.replace(plan, storage_data=StoragePrefix(f"__{self.own_rank}_")) for plan in plans]


def data_name(rank: int) -> str:
    """DCP's name for a rank's data file in its rank-local layout."""
    return f"__{rank}_0.distcp"


def _rank_local_files(state: dict[str, Any], rank: int, recorder: Recorder | None = None) -> tuple[memoryview, ...]:
    """This rank's view of `state` as DCP's (metadata, data) files, made in memory by DCP itself
    (no per-record CRC-32 in the data file: rally's manifest has the files' own)."""
    writer = _RankLocalWriter(rank, recorder)
    with _rank_local(), no_record_crc():
        dcp.save(state, storage_writer=writer, no_dist=True)
    files = writer.fs.files
    return files[".metadata"].getbuffer(), files[data_name(rank)].getbuffer()


@contextmanager
def _rank_local() -> Iterator[None]:
    """DCP warns at every no_dist call that it "assumes the intent" is a single process: it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(state: dict[str, Any], directory: Path, step: int, keep: int) -> bool:
    """Copy this rank's shards of `step` into its node's memory and a replica into the next
    node's, then hand the same files to the background persister (agent/checkpoint/sharded/persist.py).
    False, doing nothing, when the ranks did not agree on the memory path (see `agreed`).

    A state laid out as at this rank's last save takes the fast path (`_save_fast`):
    its shards copied straight into the slot."""
    tier = ckpt_client.tier()
    if not agreed()[0] or tier is None:
        return False
    rank, world = dist.get_rank(), dist.get_world_size()
    key = own_key(rank, world)
    found = dcp_layout.signature(state)
    known = _layouts.get(key)
    if found is not None and known is not None and known.signature == found[0]:
        if _save_fast(tier, known, found[1], directory, step, keep, rank, world):
            return True
    written, watched = dcp_layout.compacted(state, found[1]) if found is not None else (state, None)
    recorder = Recorder(watched) if watched is not None else None
    meta, data = _rank_local_files(written, rank, recorder)
    learnt = dcp_layout.learn(found[0] if found is not None else None, recorder, meta, data.nbytes)
    if learnt is not None:
        _layouts[key] = learnt
    else:
        _layouts.pop(key, None)
    size = HEADER.size + meta.nbytes + data.nbytes
    target = tier.reserve(key, step, size, persist=False, keep=keep)
    if target is not None:
        dcp_persist.persister().claim(target)
        try:
            HEADER.pack_into(target, 0, MAGIC, meta.nbytes, world, rank)
            target[HEADER.size : HEADER.size + meta.nbytes] = meta
            target[HEADER.size + meta.nbytes : size] = data
        except BaseException:
            tier.abort(key, step)
            raise
        tier.commit(key, step, size)
    _replicate(tier, [HEADER.pack(MAGIC, meta.nbytes, world, rank), meta, data], step, keep, rank, world)
    dcp_persist.persister().submit(directory, step, keep, rank, world, meta, data)
    return True


_layouts: dict[str, dcp_layout.FilesLayout] = {}
"""This process's last layout of DCP's files per key (agent/checkpoint/sharded/layout.py)."""


def _save_fast(
    tier: ckpt_client.MemoryTier,
    known: dcp_layout.FilesLayout,
    storages: list[Any],
    directory: Path,
    step: int,
    keep: int,
    rank: int,
    world: int,
) -> bool:
    """The shards copied straight into the slot, beside the last save's metadata and zip headers;
    the persister copies the slot out in the background. False (nothing done): no room in memory."""
    key = own_key(rank, world)
    start = HEADER.size + len(known.meta)
    size = start + known.data.length
    target = tier.reserve(key, step, size, persist=False, keep=keep)
    if target is None:
        return False
    persister = dcp_persist.persister()
    persister.claim(target)  # no step still waiting for the disk in this slot
    try:
        with persister.saving():
            HEADER.pack_into(target, 0, MAGIC, len(known.meta), world, rank)
            target[HEADER.size : start] = known.meta
            with memoryview(target) as whole:
                known.write_data(storages, whole[start:size])
    except BaseException:
        tier.abort(key, step)
        raise
    tier.commit(key, step, size)
    with memoryview(target) as whole:
        _replicate(tier, [whole[:size]], step, keep, rank, world)
    waiting = dcp_persist._FromSlot(target, memoryview(target)[start:size])  # copied out by the writer, later
    persister.submit(directory, step, keep, rank, world, known.meta, waiting)
    return True


_agreed: tuple[bool, int, int] | None = None


def agreed() -> tuple[bool, int, int]:
    """(every rank has a memory tier, nodes in the replica ring (0: none), workers per node),
    agreed by every rank once per process: the first sharded save or load (one all-reduce).

    Every rank must take the same path, or one would wait in a send that never comes: a node
    without a tier (RALLY_MEMORY_TIER=0), replicas off anywhere, or nodes with different numbers
    of workers turn the memory path or the ring off for all. A job without a CPU process group
    (NCCL only) keeps to the disk.
    """
    global _agreed
    if _agreed is None:
        if "gloo" not in str(dist.get_backend()):
            _agreed = (False, 0, 1)
            return _agreed
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        replicas = os.environ.get(REPLICAS_ENV, "1") != "0"
        # A holder that persists nothing (no --checkpoint-dir) is no path for sharded steps: the script's
        # own directory is written by DCP as without the tier.
        has = ckpt_client.persists() and ckpt_client.tier() is not None
        flags = torch.tensor([has, replicas, local, -local], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        has_tier, replicas_everywhere, fewest, most = int(flags[0]), int(flags[1]), int(flags[2]), -int(flags[3])
        world = dist.get_world_size()
        nodes = world // local if fewest == most and world % local == 0 else 0
        _agreed = (bool(has_tier), nodes if replicas_everywhere and nodes >= 2 else 0, local)
    return _agreed


def _ring(rank: int) -> tuple[int, int] | None:
    """(the rank this rank sends its copy to, the rank it receives one from): the same local rank
    on the next and on the previous node. None with one node, or replicas turned off."""
    _, nodes, local = agreed()
    if not nodes:
        return None
    node, local_rank = divmod(rank, local)
    return ((node + 1) % nodes) * local + local_rank, ((node - 1) % nodes) * local + local_rank


def _replicate(tier: ckpt_client.MemoryTier, parts: list[Any], step: int, keep: int, rank: int, world: int) -> None:
    ring = _ring(rank)
    if ring is None:
        return
    to, source = ring
    size = sum(memoryview(p).nbytes for p in parts)
    outgoing = torch.empty(size, dtype=torch.uint8)
    view, at = outgoing.numpy().data, 0
    for part in parts:
        n = memoryview(part).nbytes
        view[at : at + n] = part
        at += n
    sizes = (torch.tensor([size], dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    _exchange(sizes[0], to, sizes[1], source)
    incoming_size = int(sizes[1].item())
    key = replica_key(source, world)
    target = tier.reserve(key, step, incoming_size, persist=False, keep=keep)
    incoming = (
        torch.frombuffer(target, dtype=torch.uint8, count=incoming_size)
        if target is not None
        else torch.empty(incoming_size, dtype=torch.uint8)  # no room here: received, not kept
    )
    try:
        _exchange(outgoing, to, incoming, source)
    except BaseException:
        if target is not None:
            tier.abort(key, step)
        raise
    if target is not None:
        tier.commit(key, step, incoming_size)


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
    """Send `send` to `to` while receiving `recv` from `source` (no deadlock in a ring)."""
    work = dist.isend(send, to)
    # wait: slice, said by the job: the ring peer's replica, inside the job: the process group's timeout, the agent's
    # hang checks
    dist.recv(recv, source)
    assert work is not None  # None only for a rank outside the group, which no rank of the job is
    # wait: slice, said by the job: the matching send, inside the job: the process group's timeout
    work.wait()


# ---------------------------------------------------------------------------------------------
# Resuming


def plan(holdings: list[dict[str, list[int]]], world: int, local: int) -> tuple[int | None, dict[int, int], str]:
    """Pick the step to resume from memory, given every rank's node's holdings (index: rank).

    Returns (step or None, for each rank the rank that provides its copy, why). A step counts
    when every rank of this world size has a copy (own or replica) on some live node.
    """
    copies: dict[int, dict[int, list[int]]] = {}  # step -> old rank -> ranks whose node holds it
    sizes: set[int] = set()
    for holder, held in enumerate(holdings):
        for key, steps in held.items():
            match = _KEY_RE.match(key)
            if not match:
                continue
            old_rank, old_world = int(match.group(2)), int(match.group(3))
            sizes.add(old_world)
            if old_world != world:
                continue
            for step in steps:
                copies.setdefault(step, {}).setdefault(old_rank, []).append(holder)
    if not copies:
        if sizes:
            return (
                None,
                {},
                f"the world size changed ({'/'.join(map(str, sorted(sizes)))} -> {world}): shards are resharded "
                "from disk",
            )
        return None, {}, "no shards of this job in any node's memory"
    why = ""
    for step in sorted(copies, reverse=True):
        missing = [r for r in range(world) if r not in copies[step]]
        if not missing:
            providers = {r: (r if r in copies[step][r] else min(copies[step][r])) for r in range(world)}
            return step, providers, why
        if not why:
            nodes = sorted({r // local for r in missing})
            why = (
                f"step {step}: the shards of rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                f"(node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))}) "
                "have no live copy in memory, neither own nor replica"
            )
    return None, {}, why


def load(state: dict[str, Any], step: int, providers: dict[int, int], prepared: memoryview | None = None) -> list[int]:
    """Load this rank's copy of `step` into `state` in place (a collective: every rank calls it,
    with the same plan); return the ranks whose copy came from another node. `prepared`: this
    rank's own copy of `step`, already mapped (agent/checkpoint/core/resume_prefetch.py)."""
    tier = ckpt_client.tier()
    assert tier is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    # Read every copy this rank needs or provides first, and vote: a missing slot on any rank
    # fails the memory path on every rank alike, before anyone waits in a send or receive.
    remote = sorted(r for r, p in providers.items() if p != r)
    blobs: dict[int, memoryview] = {}
    missing = ""
    for old_rank in [rank] * (providers.get(rank) == rank) + [r for r in remote if providers[r] == rank]:
        try:
            if old_rank == rank and prepared is not None:
                blobs[old_rank] = prepared
            else:
                blobs[old_rank] = _read_slot(tier, old_rank, world, step)
        except (RuntimeError, OSError) as exc:
            missing = str(exc)
    vote = torch.tensor([0 if missing else 1], dtype=torch.int32)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    if not vote.item():
        raise RuntimeError(missing or "rally: another rank's in-memory copy is gone")
    for needed_by in remote:  # one deterministic order on every rank
        provider = providers[needed_by]
        if rank == provider:
            blob = blobs[needed_by]
            dist.send(torch.tensor([blob.nbytes], dtype=torch.int64), needed_by)
            dist.send(torch.frombuffer(blob, dtype=torch.uint8), needed_by)
        elif rank == needed_by:
            size = torch.zeros(1, dtype=torch.int64)
            # wait: slice, said by the job: a copy served from another rank's memory at resume: the process group's
            # timeout
            dist.recv(size, provider)
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
            # wait: slice, said by the job: a copy served from another rank's memory at resume: the process group's
            # timeout
            dist.recv(buffer, provider)
            blobs[rank] = buffer.numpy().data
    mine = blobs[rank]
    magic, meta_len, old_world, old_rank = HEADER.unpack_from(mine, 0)
    if magic != MAGIC or (old_world, old_rank) != (world, rank):
        raise RuntimeError(
            f"rally: the in-memory copy of rank {rank} is not one (it says rank {old_rank} of {old_world})"
        )
    meta = mine[HEADER.size : HEADER.size + meta_len]
    data = mine[HEADER.size + meta_len :]
    files = {".metadata": meta, data_name(rank): data}
    reader = MemoryReader(files, _MemoryFileSystem(files))  # one copy per shard (agent/checkpoint/sharded/reader.py)
    with _rank_local():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return remote


def _read_slot(tier: ckpt_client.MemoryTier, old_rank: int, world: int, step: int) -> memoryview:
    for key in (own_key(old_rank, world), replica_key(old_rank, world)):
        found = tier.mapped_slot(key, step)
        if found is not None:
            return found
    raise RuntimeError(f"rally: the in-memory copy of rank {old_rank}, step {step}, is gone from this node")
