"""Sharded checkpoints made durable in the background: each rank writes its own DCP files, rank 0
publishes the step once every rank's part is on disk. No collective, so training steps on.

Why no collective: the disk write must not stall the training step, and a thread that used the
job's process group would race the training loop's collectives (or die with
``destroy_process_group``). The rank-local copy that agent/checkpoint/dcp_memory.py already made for the
memory tier is exactly DCP's "no collectives" layout (``__<rank>_0.distcp`` and its rank's
``.metadata``), so each rank's thread only writes bytes it has::

    .step_N.dcp.<run>-<round>.tmp/       made by whichever rank comes first, locked by rank 0
        __<r>_0.distcp                   rank r's shards (DCP's file, fsynced, renamed into place)
        __<r>.metadata                   rank r's own DCP metadata
        __<r>.rally.json                 rank r's part is complete: its two files' sizes and CRC-32s

Rank 0's thread waits (bounded, PUBLISH_TIMEOUT) for every rank's marker, merges the ranks'
metadata into DCP's global ``.metadata`` (the union of their chunks: what DCP's coordinator
builds when it saves with collectives), writes rally's manifest and renames the directory to
``step_N.dcp`` (agent/checkpoint/dcp_files.py): the same published checkpoint as a synchronous save, which
any world size loads and reshards. A rank that dies before its marker leaves the step
unpublished; its memory copy and the previous durable step stay, and the temporary directory is
deleted by a later publication.

One thread per worker process, steps in order; at most ``MAX_PENDING`` steps wait for it (a
save beyond that waits for the oldest). The thread is not a daemon: a worker that returns from
its script finishes writing its last step before the process exits.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import sys
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

from rally.agent.checkpoint import dcp_files
from rally.agent.worker.checkpoint_file import _lock, fsync_dir

PUBLISH_TIMEOUT = 300.0
"""Seconds rank 0 waits for the other ranks' parts of a step before it gives that step up."""
POLL_INTERVAL = 0.02
"""How often rank 0 looks for the other ranks' markers (seconds)."""
MAX_PENDING = 2
"""Steps that may wait for the disk per worker; a save beyond that waits for the oldest."""
POLL_SLICE = 1.0
"""One slice of that wait (seconds): a written step wakes it at once, the slice only re-checks."""


def temp_name(step: int) -> str:
    """The step's temporary directory, the same name on every rank of this round."""
    tag = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}-{os.environ.get('RALLY_ROUND', '0')}"
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in tag)
    return f".{dcp_files.step_name(step)}.{safe}.tmp"


class Persister:
    """This worker's background writer of sharded steps (see the module's docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: deque[tuple[Any, ...]] = deque()
        self.thread: threading.Thread | None = None
        self.last_error: str | None = None
        self._busy = False

    def submit(self, directory: Path, step: int, keep: int, rank: int, world: int, meta: Any, data: Any) -> None:
        with self.cond:
            while len(self.pending) >= MAX_PENDING:
                self.cond.wait(POLL_SLICE)  # woken when a step is written; the slice only re-checks
            self.pending.append((directory, step, keep, rank, world, meta, data))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="rally-dcp-persist", daemon=False)
                self.thread.start()
            self.cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing waits for the disk (tests, and the end of a job); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self.pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.pending:
                    return
                job = self.pending[0]
                self._busy = True
            try:
                persist_part(*job)
            except Exception as exc:  # a failed step is not retried: the next save brings a newer one
                self.last_error = (
                    f"rally: sharded checkpoint of step {job[1]} could not be written to {job[0]}: "
                    f"{type(exc).__name__}: {exc}"
                )
                print(self.last_error, file=sys.stderr, flush=True)
            finally:
                with self.cond:
                    self.pending.popleft()
                    self._busy = False
                    self.cond.notify_all()


def persist_part(directory: Path, step: int, keep: int, rank: int, world: int, meta: Any, data: Any) -> None:
    """Write this rank's part of ``step``; on rank 0 also wait for the others and publish."""
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / temp_name(step)
    temp.mkdir(exist_ok=True)
    lock = _lock_dir(temp) if rank == 0 else None
    try:
        if rank == 0:
            _remove_dead_older(directory, step)
        files = {
            f"__{rank}_0.distcp": write_file(temp / f"__{rank}_0.distcp", data),
            f"__{rank}.metadata": write_file(temp / f"__{rank}.metadata", meta),
        }
        write_file(temp / f"__{rank}.rally.json", json.dumps(files).encode())
        if rank != 0:
            return
        parts = _wait_for_parts(temp, world)
        _publish(directory, temp, step, keep, world, parts)
    finally:
        if lock is not None:
            os.close(lock)


def _lock_dir(path: Path) -> int | None:
    """Rank 0's flock on the step's temporary directory: while held, no cleaner deletes it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    if not _lock(fd, blocking=True):
        os.close(fd)
        return None
    return fd


def _remove_dead_older(directory: Path, step: int) -> None:
    """Temporary directories of older steps whose rank 0 let go (published, gave up or died)."""
    for name in os.listdir(directory):
        if not dcp_files.TEMP_RE.match(name):
            continue
        try:
            older = int(name[6:18]) < step
        except ValueError:
            continue
        if older:
            dcp_files.remove_dead_saves(directory, only=name)


def write_file(path: Path, data: Any) -> tuple[int, int]:
    """``data`` into ``path`` durably (a temporary name, fsync, rename); its (size, CRC-32)."""
    view = memoryview(data).cast("B")
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.part")  # two writers of one part never mix
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return view.nbytes, zlib.crc32(view)


def _wait_for_parts(temp: Path, world: int) -> dict[int, dict[str, list[int]]]:
    deadline = time.monotonic() + PUBLISH_TIMEOUT
    parts: dict[int, dict[str, list[int]]] = {}
    while len(parts) < world:
        for r in range(world):
            if r not in parts:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    parts[r] = json.loads((temp / f"__{r}.rally.json").read_bytes())
        if len(parts) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(parts))
                raise TimeoutError(f"ranks {missing} did not write their part within {PUBLISH_TIMEOUT:g} s")
            time.sleep(POLL_INTERVAL)
    return parts


def _publish(
    directory: Path, temp: Path, step: int, keep: int, world: int, parts: dict[int, dict[str, list[int]]]
) -> None:
    """Merge the ranks' metadata into DCP's global ``.metadata``, then publish like a synchronous save."""
    merged = merge_metadata([pickle.loads((temp / f"__{r}.metadata").read_bytes()) for r in range(world)])
    buffer = io.BytesIO()
    pickle.dump(merged, buffer)
    files = {
        name: (int(size), int(crc))
        for r in range(world)
        for name, (size, crc) in parts[r].items()
        if name.endswith(".distcp")
    }
    files[".metadata"] = write_file(temp / ".metadata", buffer.getbuffer())
    for r in range(world):  # the ranks' own metadata and markers served their purpose
        for extra in (f"__{r}.metadata", f"__{r}.rally.json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp / extra)
    fsync_dir(temp)
    dcp_files.publish_dir(directory, temp, step, files)
    dcp_files.prune(directory, keep, step)


def merge_metadata(ranks: list[Any]) -> Any:
    """DCP's global Metadata from the ranks' own (``no_dist``) ones: every fqn's chunks, each once,
    and where each chunk lives. Replicated values (saved by every rank) are taken from the lowest rank."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    for metadata in ranks:
        for fqn, item in metadata.state_dict_metadata.items():
            if fqn not in state:
                state[fqn] = (
                    item
                    if not isinstance(item, TensorStorageMetadata)
                    else TensorStorageMetadata(item.properties, item.size, [])
                )
            if isinstance(item, TensorStorageMetadata):
                known = {(tuple(c.offsets), tuple(c.sizes)) for c in state[fqn].chunks}
                state[fqn].chunks.extend(c for c in item.chunks if (tuple(c.offsets), tuple(c.sizes)) not in known)
        for index, info in (metadata.storage_data or {}).items():
            storage.setdefault(index, info)
        if isinstance(metadata.planner_data, dict):
            for key, value in metadata.planner_data.items():
                planner.setdefault(key, value)
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=ranks[0].storage_meta,
        version=ranks[0].version,
    )


_persister: Persister | None = None


def persister() -> Persister:
    """This worker process's persister, made at its first sharded save."""
    global _persister
    if _persister is None:
        _persister = Persister()
    return _persister
