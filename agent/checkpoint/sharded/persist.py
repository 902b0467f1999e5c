"""Sharded checkpoints made durable in the background: each rank writes its own DCP files, rank 0
publishes the step once every rank's part is on disk. No collective, so training steps on.

Why no collective: the disk write must not stall the training step, and a thread that used the
job's process group would race the training loop's collectives (or die with
`destroy_process_group`). The rank-local copy that agent/checkpoint/sharded/memory.py already made for the
memory tier is exactly DCP's "no collectives" layout (`__<rank>_0.distcp` and its rank's
`.metadata`), so each rank's thread only writes bytes it has:

    .step_N.dcp.<tag>.tmp/               made (0700) by whichever rank comes first, locked by rank 0
        __<r>_0.distcp                   rank r's shards (DCP's file, fsynced, renamed into place)
        __<r>.metadata                   rank r's own DCP metadata
        __<r>.rally.json                 rank r's part is complete: its two files' sizes and digests

The `<tag>` is an HMAC of the run, the round and the step under the job's checkpoint key
(agent/checkpoint/core/auth.py): every rank of the round computes the same name without talking, and
nobody without the key can predict it. A rank creates it exclusively (mode 0700) or, when
another rank was first, accepts it only as a real directory of this user's that nobody else may
write (never a link); every file in it is created 0600 under a random temporary name with
O_EXCL and O_NOFOLLOW, then renamed into place.

Rank 0's thread waits (bounded, PUBLISH_TIMEOUT) for every rank's marker, merges the ranks'
metadata into DCP's global `.metadata` (the union of their chunks: what DCP's coordinator
builds when it saves with collectives), writes rally's manifest and renames the directory to
`step_N.dcp` (agent/checkpoint/sharded/files.py): the same published checkpoint as a synchronous save, which
any world size loads and reshards. A rank that dies before its marker leaves the step
unpublished; its memory copy and the previous durable step stay, and the temporary directory is
deleted by a later publication.

One thread per worker process, steps in order. A step saved by the fast path
(agent/checkpoint/sharded/layout.py) waits in its shared-memory slot: the thread copies it into a buffer
of its own (reused) before writing, and a save that needs that slot again while the step still
waits gives the step up instead of waiting for the disk (`Persister.claim`), marking it
`__<r>.skipped` so that rank 0 publishes none of it; a step is published only once every rank
wrote its part. Other steps (DCP's own files, at the first save of a layout) hold their own bytes:
at most `MAX_PENDING` of them wait (a save beyond that waits for the oldest). The thread is
not a daemon: a worker that returns from its script finishes writing its last step before the
process exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rally.agent.checkpoint.core import auth, digest
from rally.agent.checkpoint.core.checkpoint_file import fsync_dir, lock_file, write_digested
from rally.agent.checkpoint.core.digest import BytesLike
from rally.agent.checkpoint.sharded import files as dcp_files

PUBLISH_TIMEOUT = 300.0
"""Seconds rank 0 waits for the other ranks' parts of a step before it gives that step up."""
POLL_INTERVAL = 0.02
"""How often rank 0 looks for the other ranks' markers (seconds)."""
MAX_PENDING = 2
"""Steps that may wait for the disk per worker; a save beyond that waits for the oldest."""
WRITE_CHUNK = 16 << 20
"""Bytes the writer writes (and checksums) between two looks at whether a save is copying."""
LOW_PRIORITY = 19
"""The writer thread's nice value: on busy cores the training loop's threads go first (the
holder's persister does the same); the disk write only has to keep up over several saves."""
POLL_SLICE = 1.0
"""One slice of that wait (seconds): a written step wakes it at once, the slice only re-checks."""


def temp_name(step: int) -> str:
    """The step's temporary directory: the same name on every rank of this round, unpredictable
    to anyone without the job's checkpoint key (an HMAC of the run, the round and the step)."""
    seed = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}\0{os.environ.get('RALLY_ROUND', '0')}".encode()
    return f".{dcp_files.step_name(step)}.{auth.sign('dcp-temp', step, seed)[:32]}.tmp"


def _touch_private(path: Path) -> None:
    """Create the marker `path` 0600 (never through a link); an existing one is fine."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))


def _read_private(path: Path) -> bytes:
    """A file of our temporary directory, never through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


class _Skipped(Exception):
    """A rank gave this step up (its writer fell behind and the slot holding it was written again)."""


@dataclasses.dataclass
class _FromSlot:
    """A step's data still in this rank's shared-memory slot (the save's fast path): the writer
    copies it into its own buffer before the next save may write that slot again. `data` is a
    view of the slot's mapping: while it lives the mapping cannot be closed (a slot the holder
    replaced stays readable until the step is copied out)."""

    mapping: Any
    data: memoryview


class Persister:
    """This worker's background writer of sharded steps (see the module's docstring)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: deque[tuple[Any, ...]] = deque()
        self.thread: threading.Thread | None = None
        self.last_error: str | None = None
        self._busy = False
        self._staging: Any = None  # the slot mapping the writer copies out of right now
        self._buffer: Any = None  # the writer's copy of a slot's data (a uint8 tensor), reused from step to step
        self._saving = 0  # saves copying into their slot right now (the writer pauses)
        self.skipped: list[int] = []  # steps given up (tests, and the log)

    def submit(self, directory: Path, step: int, keep: int, rank: int, world: int, meta: object, data: object) -> None:
        """Queue `step`'s files; `data` is bytes of its own, or a `_FromSlot`.

        Own bytes: at most MAX_PENDING steps wait (a save beyond that waits for the oldest). A
        slot: never waits here, see `claim`."""
        with self.cond:
            while not isinstance(data, _FromSlot) and len(self.pending) + self._busy >= MAX_PENDING:
                # wait: slice, said by the job: a save while MAX_PENDING (2) steps wait for this worker's own disk
                # write, in POLL_SLICE (1 s) slices
                self.cond.wait(POLL_SLICE)  # woken when a step is written; the slice only re-checks
            # the round's directory is named now: rally.job.run may enter the next round (a new
            # RALLY_ROUND) before this step is written, and its part must not join that round's
            self.pending.append((directory, step, keep, rank, world, meta, data, temp_name(step)))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="rally-dcp-persist", daemon=False)
                self.thread.start()
            self.cond.notify_all()

    def claim(self, mapping: Any) -> None:
        """Before a save writes `mapping` (a slot) again: a step still waiting in it for the disk is
        given up, and one being copied out of it is waited for (one memory copy at most).

        The step given up is marked in its temporary directory (`__<rank>.skipped`), so rank 0
        stops waiting for this rank's part and publishes none of it: a step is published only
        when every rank wrote it, and the newest step is never the one given up.
        """
        with self.cond:
            while self._staging is mapping:
                # wait: short: the writer's copy of one slot out to its buffer (one memory copy), in POLL_SLICE slices
                self.cond.wait(POLL_SLICE)
            dropped = [j for j in self.pending if isinstance(j[6], _FromSlot) and j[6].mapping is mapping]
            for job in dropped:
                self.pending.remove(job)
                self.skipped.append(job[1])
                with contextlib.suppress(BufferError):
                    job[6].data.release()
            if dropped:
                self.cond.notify_all()
        for directory, step, _, rank, _, _, _, name in dropped:
            if rank == 0 and len(self.skipped) == len(dropped):  # the first time only
                line = (f"rally: the disk is slower than the sharded saves: step {step} and later ones that find "
                        "the writer still busy are not written to it; the newest step always is")  # fmt: skip
                print(line, file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                temp = directory / name
                auth.make_private_dir(directory)
                auth.private_subdir(temp)
                _touch_private(temp / f"__{rank}.skipped")

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a save's copy into its slot: the writer pauses between chunks meanwhile, so the
        copy has the memory bandwidth to itself (the stall stays one plain copy)."""
        with self.cond:
            self._saving += 1
        try:
            yield
        finally:
            with self.cond:
                self._saving -= 1
                self.cond.notify_all()

    def _step_aside(self) -> None:
        with self.cond:
            while self._saving:
                # wait: short: the writer pauses while a save copies into its slot (one memory copy), in POLL_SLICE
                # slices
                self.cond.wait(POLL_SLICE)

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing waits for the disk (tests, and the end of a job); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self.pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                # wait: slice: the caller's timeout (tests)
                self.cond.wait(left)
        return True

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY)
        while True:
            with self.cond:
                if not self.pending:
                    return
                job = self.pending.popleft()
                self._busy = True
                source = job[6]
                if isinstance(source, _FromSlot):
                    self._staging = source.mapping
            try:
                if isinstance(source, _FromSlot):
                    job = (*job[:6], self._stage(source), *job[7:])
                directory, step, keep, rank, world, meta, data, name = job
                persist_part(directory, step, keep, rank, world, meta, data, pause=self._step_aside, temp_dir=name)
            except _Skipped as skip:  # said by rank 0 alone: the other ranks' skips say the same
                if job[3] == 0:
                    line = f"rally: sharded step {job[1]} not written to disk: {skip}; a newer step follows"
                    print(line, file=sys.stderr, flush=True)
            except Exception as exc:  # a failed step is not retried: the next save brings a newer one
                self.last_error = (
                    f"rally: sharded checkpoint of step {job[1]} could not be written to {job[0]}: "
                    f"{type(exc).__name__}: {exc}"
                )
                print(self.last_error, file=sys.stderr, flush=True)
            finally:
                with self.cond:
                    self._staging = None
                    self._busy = False
                    self.cond.notify_all()

    def _stage(self, source: _FromSlot) -> memoryview:
        """Copy a step's data out of its slot into the writer's buffer, then let the slot go.
        torch's copy, which lets go of the GIL: the training loop's thread runs on meanwhile."""
        import torch

        try:
            self._step_aside()  # not while a save of this process copies (claim waits outside it)
            n = source.data.nbytes
            if self._buffer is None or self._buffer.numel() < n:
                self._buffer = None  # the old one freed before the new one is taken
                self._buffer = torch.empty(n, dtype=torch.uint8)
            staged = self._buffer[:n]
            slot = torch.frombuffer(source.data, dtype=torch.uint8, count=n)
            staged.copy_(slot)
            del slot  # no export of the mapping outlives the copy
            with contextlib.suppress(BufferError):
                source.data.release()
            return memoryview(staged.numpy())
        finally:
            with self.cond:
                self._staging = None
                self.cond.notify_all()


def persist_part(
    directory: Path,
    step: int,
    keep: int,
    rank: int,
    world: int,
    meta: Any,
    data: Any,
    pause: Callable[[], None] | None = None,
    temp_dir: str | None = None,
) -> None:
    """Write this rank's part of `step`; on rank 0 also wait for the others and publish. `temp_dir`:
    the name of the step's temporary directory in the round that saved it (default: this round's)."""
    auth.make_private_dir(directory)
    temp = directory / (temp_dir or temp_name(step))
    auth.private_subdir(temp)  # exclusively, or ours already (another rank's): never a link, never another user's
    lock = lock_dir(temp) if rank == 0 else None
    try:
        if rank == 0:
            _remove_dead_older(directory, step)
        elif (temp / "__0.skipped").exists():
            raise _Skipped("rank 0 gave it up")
        files = {f"__{rank}_0.distcp": write_file(temp / f"__{rank}_0.distcp", data, pause),
                 f"__{rank}.metadata": write_file(temp / f"__{rank}.metadata", meta)}  # fmt: skip
        write_file(temp / f"__{rank}.rally.json", json.dumps(files).encode())
        if rank != 0:
            return
        # wait: background: the worker's background writer: rank 0 waits for every rank's part, PUBLISH_TIMEOUT (300
        # s)
        parts = _wait_for_parts(temp, world)
        publish(directory, temp, step, keep, world, parts)
    finally:
        if lock is not None:
            os.close(lock)


def lock_dir(path: Path) -> int | None:
    """Rank 0's flock on the step's temporary directory: while held, no cleaner deletes it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    if not lock_file(fd, blocking=True):
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


def write_file(path: Path, data: BytesLike, pause: Callable[[], None] | None = None) -> tuple[int, str]:
    """`data` into `path` durably (a random temporary name created 0600 exclusively, never
    through a link; fsync, rename); its (size, digest hex: agent/checkpoint/core/digest.py, each leaf
    hashed on the digest's threads while the next chunk is written). `pause` is called between
    chunks (the writer steps aside while a save copies)."""
    view = memoryview(data).cast("B")
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.part")  # two writers of one part never mix
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        tree = digest.TreeDigest()
        write_digested(fd, view, tree, WRITE_CHUNK, pause)
        root = tree.root()
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return view.nbytes, root.hex()


def _wait_for_parts(temp: Path, world: int) -> dict[int, dict[str, list[Any]]]:
    deadline = time.monotonic() + PUBLISH_TIMEOUT
    parts: dict[int, dict[str, list[Any]]] = {}
    while len(parts) < world:
        gave_up = [r for r in range(world) if r not in parts and (temp / f"__{r}.skipped").exists()]
        if gave_up:
            ranks = f"rank{'s' if len(gave_up) > 1 else ''} {', '.join(map(str, gave_up))}"
            raise _Skipped(f"{ranks} gave it up (its disk writer fell behind)")
        for r in range(world):
            if r not in parts:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    parts[r] = json.loads(_read_private(temp / f"__{r}.rally.json"))
        if len(parts) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(parts))
                raise TimeoutError(f"ranks {missing} did not write their part within {PUBLISH_TIMEOUT:g} s")
            # wait: short: POLL_INTERVAL (20 ms) between looks, PUBLISH_TIMEOUT in all
            time.sleep(POLL_INTERVAL)
    return parts


def publish(
    directory: Path, temp: Path, step: int, keep: int, world: int, parts: dict[int, dict[str, list[Any]]]
) -> None:
    """Merge the ranks' metadata (read with the restricted unpickler) into DCP's global `.metadata`,
    then publish like a synchronous save: a signed manifest."""
    from rally.agent.checkpoint.sharded import metadata as dcp_metadata  # torch: only the publisher needs it

    merged = merge_metadata([dcp_metadata.loads(_read_private(temp / f"__{r}.metadata")) for r in range(world)])
    buffer = io.BytesIO()
    pickle.dump(merged, buffer)
    files = {
        name: (int(size), str(digest_hex))
        for r in range(world)
        for name, (size, digest_hex) in parts[r].items()
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
    """DCP's global Metadata from the ranks' own (`no_dist`) ones: every fqn's chunks, each once,
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
