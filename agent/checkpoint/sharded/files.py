"""Sharded checkpoints on disk: torch.distributed.checkpoint (DCP) directories that rally publishes whole.

A sharded checkpoint is a plain DCP directory, written by torch's own planner and file format
(see `rally.agent.checkpoint.sharded.storage`), plus one file of rally's, written last:

    step_000000000120.dcp/            published: what load_latest and the crash-loop guard see
        __0_0.distcp  __1_0.distcp    one file per rank: the shards that rank held (torch.save'd)
        .metadata                     DCP's index of every tensor chunk (pickled by torch)
        rally.json                    rally's manifest: each file's size and digest, and an HMAC of
                                      it all under the job's checkpoint key
    .step_000000000120.dcp.<id>.tmp/  a save in progress, locked (flock) by its coordinator

Why a directory renamed into place: a DCP save is written by every rank at once, so there is no
single file to rename. The coordinator (global rank 0) creates the temporary directory, every
rank writes and fsyncs its file there, and only once DCP has gathered every rank's results does
the coordinator write the metadata and the manifest, fsync them, and rename the directory to its
step's name. A crash at any moment leaves the previous steps as they were and, at worst, a
temporary directory that the next save deletes once its lock is free (its coordinator died).

Why a manifest: as for single-file checkpoints (`rally.agent.checkpoint.core.checkpoint_file`), whether a
damaged shard loads depends on where the damage is; sizes and digests give every reader (each
rank, the agent) one verdict from the bytes alone. `torch.distributed.checkpoint.load` ignores
`rally.json`, so a published directory is also an ordinary DCP checkpoint.

Why an HMAC: a CRC says "whole", not "ours", and `.metadata` is a pickle. The manifest's
`mac` (agent/checkpoint/core/auth.py) covers the step and every file's digest (agent/checkpoint/core/digest.py:
SHA-256 leaves on a few threads, then a root; no CRC beside it, the MAC'd digest rejects any
damage), so a directory verifies only if the job's key signed exactly these bytes as this step.
The manifest (`rally-dcp-4`) also names the job that wrote it (its tag, auth.job_tag) inside the
signed part: in a directory other users may write, a step another of the user's jobs signed is
refused (auth.other_job); `rally-dcp-3` manifests (signed, no job) still load, with one line there.
Manifests written before (`rally-dcp-1`: CRCs only) are unauthenticated: loaded only from a directory only the job's
user can write. Nothing here follows a symlink: the step directory and its files must be what
they are (lstat), and files are opened with O_NOFOLLOW.

This module needs only the standard library: the agent's crash-loop check uses it.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import sys
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rally.agent.checkpoint.core import auth, digest, torch_internals
from rally.agent.checkpoint.core.checkpoint_file import DamagedCheckpoint, fsync_dir, lock_file, prune_older
from rally.agent.checkpoint.core.shm import own_key, replica_key  # noqa: F401 - the sharded path names its slots through these

MANIFEST = "rally.json"
MANIFEST_FORMAT = "rally-dcp-4"
OLD_FORMAT = "rally-dcp-3"
"""Signed, but bound to no job (before checkpoints were bound to their job)."""
LEGACY_FORMAT = "rally-dcp-1"
"""Manifests written before checkpoints were signed: CRCs only, no MAC."""
MAC_KIND = "dcp"
FileCheck = tuple[int, int | None, str | None]
"""A manifest's file: (size, CRC-32 of a legacy manifest or None, digest hex of a signed one or None)."""
FileSums = tuple[int, str]
"""A file's (size, digest hex: agent/checkpoint/core/digest.py), as a writer saw it."""
SUFFIX = ".dcp"
STEP_RE = re.compile(r"^step_(\d+)\.dcp$")
TEMP_RE = re.compile(r"^\.step_\d+\.dcp\..*\.tmp$")
_VERDICT_CACHE_LIMIT = 256
SLOT_HEADER = struct.Struct("<8sQQQ")
"""A sharded copy in the memory tier: magic, metadata length, world size, rank (agent/checkpoint/sharded/memory.py)."""
SLOT_MAGIC = b"RALLYDCP"
KEY_RE = re.compile(r"^dcp(r?)(\d+)of(\d+)$")
"""The holder's keys of sharded copies: `dcp<rank>of<world>` (own), `dcpr<rank>of<world>` (replica)."""


class ForeignStep(DamagedCheckpoint):
    """A genuine step another job of the user's signed, in a directory others may write: not loaded."""


def step_name(step: int) -> str:
    """The published directory's name for `step`: `step_<12 digits>.dcp`."""
    return f"step_{step:012d}{SUFFIX}"


def list_steps(directory: Path) -> list[tuple[int, Path]]:
    """Published sharded checkpoints in `directory`, oldest first; temporary ones never match."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), directory / name) for name in names if (m := STEP_RE.match(name)))


def holds_shards(state: object) -> bool:
    """Whether `state` holds a DTensor or ShardedTensor (FSDP2, tensor parallel, FSDP1's SHARDED_STATE_DICT).

    Only modules already imported are asked (no torch import here): a script that never imported
    DTensor holds none.
    """
    kinds = tuple(
        kind
        for module, name in torch_internals.SHARDED_TYPES
        if (kind := getattr(sys.modules.get(module), name, None)) is not None
    )
    if not kinds:
        return False
    pending = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, kinds):
            return True
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return False


# ---------------------------------------------------------------------------------------------
# Writing: a locked temporary directory, published by one rename


class TempDir:
    """A save's temporary directory, locked by the coordinator from creation until publication.

    The lock (an flock on the directory itself) is what tells a live save from a dead one: a
    cleaner deletes a temporary directory only when it can take that lock.
    """

    def __init__(self, directory: Path, step: int) -> None:
        self.parent = directory
        self.step = step
        while True:
            self.path = Path(tempfile.mkdtemp(prefix=f".{step_name(step)}.", suffix=".tmp", dir=directory))
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            if not lock_file(self._fd, blocking=True):
                return  # no locks on this file system: cleaners delete nothing either
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    return
            except FileNotFoundError:
                pass  # a cleaner took it between mkdtemp and our lock; make another
            os.close(self._fd)

    def publish(self, files: dict[str, FileSums]) -> Path:
        """Publish this directory as its step (see `publish_dir`); return the new path."""
        self.path = publish_dir(self.parent, self.path, self.step, files)
        return self.path

    def close(self) -> None:
        """Release the lock; an unpublished directory then counts as dead and is deleted by the next save."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        """Delete an unpublished directory (the save failed) and release the lock."""
        if TEMP_RE.match(self.path.name):
            shutil.rmtree(self.path, ignore_errors=True)
        self.close()


def _signed_part(manifest: dict[str, Any]) -> bytes:
    return json.dumps(
        {k: manifest.get(k) for k in ("format", "step", "files", "job") if k in manifest},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def publish_dir(directory: Path, temp: Path, step: int, files: dict[str, FileSums]) -> Path:
    """Write the signed manifest into `temp`, make everything durable, rename it to the step's name.

    `files` maps each file of the checkpoint (shards and `.metadata`) to (size, digest hex).
    An existing directory of the same step (a damaged one this job resumed past) is moved
    aside first and deleted after, so the name never points at a half-written directory.
    """
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "files": {n: {"size": s, "digest": d} for n, (s, d) in sorted(files.items())},
        "job": auth.job_tag().hex(),
    }
    manifest["mac"] = auth.sign(MAC_KIND, step, _signed_part(manifest))
    fd = os.open(temp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps(manifest, indent=1).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(temp)
    final = directory / step_name(step)
    try:
        os.rename(temp, final)
    except OSError:  # ENOTEMPTY / EEXIST: the step exists already
        trash = _aside(final)
        os.rename(temp, final)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_dir(directory)
    return final


def _aside(path: Path) -> Path:
    """Rename `path` to an unlocked temporary name (so it vanishes from listings at once)."""
    trash = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    os.rename(path, trash)
    return trash


def remove_dead_saves(directory: Path, only: str | None = None) -> None:
    """Delete temporary directories whose save died (nobody holds their lock); never a live save's.
    `only`: look at that one name (agent/checkpoint/sharded/persist.py picks older steps' directories)."""
    try:
        names = [only] if only is not None else os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if not TEMP_RE.match(name):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # renamed or deleted meanwhile, or not a directory of ours
        if os.fstat(fd).st_uid != os.geteuid():
            os.close(fd)
            continue  # another user's: not ours to delete
        try:
            if lock_file(fd, blocking=False) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(fd)


def prune(directory: Path, keep: int, own_step: int) -> None:
    """Keep the checkpoint of `own_step` and the `keep - 1` newest older ones; delete the rest.

    The rule is the whole-state files' (agent/checkpoint/core/checkpoint_file.py's `prune_older`). Each
    victim is first renamed to a temporary name, so a listing never shows a half-deleted step.
    """
    prune_older(list_steps(directory), keep, own_step, lambda path: shutil.rmtree(_aside(path), ignore_errors=True))


# ---------------------------------------------------------------------------------------------
# Reading: one verdict from the bytes alone


class Manifest:
    """A published step's manifest, read and judged: its files' sums, and whether the job's key signed it."""

    def __init__(self, files: dict[str, FileCheck], signed: bool) -> None:
        self.files, self.signed = files, signed


def read_manifest(path: Path) -> Manifest:
    """The manifest of the step directory `path`, its MAC checked (a legacy one only from a
    directory only this user can write), and each file there with its size. DamagedCheckpoint
    naming the first problem. Cheap: one small read and an lstat per file."""
    step_named = STEP_RE.match(path.name)
    try:
        fd = os.open(path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError
            manifest = json.loads(os.read(fd, 1 << 20))
        finally:
            os.close(fd)
        fmt = manifest.get("format")
        files: dict[str, FileCheck] = {
            str(n): (int(v["size"]), None, str(v["digest"]))
            if fmt in (MANIFEST_FORMAT, OLD_FORMAT)
            else (int(v["size"]), int(v["crc32"]), None)
            for n, v in manifest["files"].items()
        }
        if fmt not in (MANIFEST_FORMAT, OLD_FORMAT, LEGACY_FORMAT) or ".metadata" not in files:
            raise ValueError
    except FileNotFoundError:
        raise DamagedCheckpoint(f"no {MANIFEST}: not a complete rally checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise DamagedCheckpoint(f"{MANIFEST} is unreadable or malformed") from None
    signed = fmt in (MANIFEST_FORMAT, OLD_FORMAT)
    if signed:
        step = manifest.get("step")
        try:
            mac = str(manifest.get("mac"))
            genuine = isinstance(step, int) and auth.verify(MAC_KIND, step, _signed_part(manifest), mac)
        except auth.NoKey as exc:
            raise DamagedCheckpoint(str(exc)) from None
        if not genuine:
            raise DamagedCheckpoint(
                "not signed with this job's checkpoint key (written by another user, or under another job token)"
            )
        if step_named and int(step_named.group(1)) != step:
            raise DamagedCheckpoint(f"signed for step {step}, not for the step its name says (renamed)")
        if fmt == MANIFEST_FORMAT:
            try:
                job = bytes.fromhex(str(manifest.get("job")))
            except ValueError:
                raise DamagedCheckpoint(f"{MANIFEST} names no job") from None
            if (other := auth.other_job(job, path.parent)) is not None:
                raise ForeignStep(other)
    else:
        problem = auth.directory_problem(path.parent)
        if problem is not None:
            raise DamagedCheckpoint(
                f"written before checkpoints were signed, and {path.parent} {problem}: an unauthenticated "
                "checkpoint is not loaded"
            )
    for name, (size, _, _) in files.items():
        if "/" in name or name in ("", ".", ".."):
            raise DamagedCheckpoint(f"{MANIFEST} names a file outside the checkpoint: {name!r}")
        try:
            info = os.lstat(path / name)
        except OSError:
            raise DamagedCheckpoint(f"{name} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise DamagedCheckpoint(f"{name} is not a regular file")
        if info.st_size != size:
            raise DamagedCheckpoint(f"{name} has {info.st_size} bytes, the manifest says {size}")
    return Manifest(files, signed)


def manifest_files(path: Path) -> dict[str, FileCheck]:
    """The manifest's files, (size, CRC-32 of a legacy manifest, digest of a signed one), checked
    as `read_manifest` checks them."""
    return read_manifest(path).files


def check_checksums(path: Path, files: dict[str, FileCheck], names: Iterable[str]) -> None:
    """Read `names` (files of the manifest) end to end, never through a link, and compare their
    digests (signed manifests; the leaves on the digest's threads) or CRC-32s (legacy ones)."""
    for name in names:
        size, expected_crc, expected_digest = files[name]
        try:
            fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise DamagedCheckpoint(f"{name}: read error: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size < size:
                raise DamagedCheckpoint(f"{name} is shorter than the manifest says")
            if size == 0:
                actual_digest, crc = digest.of(b""), zlib.crc32(b"")
            else:
                with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data, memoryview(data) as view:
                    if expected_digest is not None:
                        actual_digest, crc = digest.of(view), 0
                    else:
                        actual_digest, crc = b"", zlib.crc32(view)
        except (OSError, ValueError) as exc:
            raise DamagedCheckpoint(f"{name}: read error: {getattr(exc, 'strerror', None) or exc}") from None
        finally:
            os.close(fd)
        if expected_digest is not None and actual_digest.hex() != expected_digest:
            raise DamagedCheckpoint(f"{name}: its digest is not the one the signed manifest lists (damaged)")
        if expected_crc is not None and crc != expected_crc:
            raise DamagedCheckpoint(f"{name}: checksum mismatch: crc32 {crc:08x}, the manifest says {expected_crc:08x}")


def verify(path: Path, share: int = 0, shares: int = 1) -> bool:
    """Check a published directory: its manifest's MAC, every file's size, and the digest (a
    legacy manifest: the CRC-32) of every `shares`-th file from `share` on (ranks split the reading, then agree; see
    dcp_storage). True: signed by the job's key; False: a legacy directory (unauthenticated, from a
    directory only this user can write). Raises DamagedCheckpoint."""
    try:
        info = os.lstat(path)
    except OSError:
        raise DamagedCheckpoint("not a directory") from None
    if not stat.S_ISDIR(info.st_mode):
        raise DamagedCheckpoint("not a directory (a link, or a file)")
    if info.st_uid != os.geteuid():
        raise DamagedCheckpoint(f"owned by uid {info.st_uid}, not by this user: not rally's")
    manifest = read_manifest(path)
    check_checksums(path, manifest.files, sorted(manifest.files)[share::shares])
    return manifest.signed


def old_format_line(path: Path) -> str | None:
    """One line when the step directory `path`, verified, is signed in the format before job
    binding and lies in a directory others may write (where the binding matters); else None."""
    if auth.directory_problem(path.parent) is None:
        return None
    try:
        fd = os.open(path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            fmt = json.loads(os.read(fd, 1 << 20)).get("format")
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        return None
    return auth.old_format_line(path) if fmt == OLD_FORMAT else None


_verdicts: dict[tuple[object, ...], bool] = {}


def is_intact(path: Path) -> bool:
    """Whether `path` passes a full `verify`, remembered per version of the directory and of
    each file in it (the agent asks every round; published files never change unless damaged)."""
    try:
        key = (
            str(path),
            *_stamp(path),
            *(item for name in sorted(os.listdir(path)) for item in (name, *_stamp(path / name))),
        )
    except OSError:
        return False
    if key not in _verdicts:
        try:
            verify(path)
            verdict = True
        except ForeignStep as refused:
            auth.note_refusal(path, str(refused))
            verdict = False
        except DamagedCheckpoint:
            verdict = False
        if len(_verdicts) >= _VERDICT_CACHE_LIMIT:
            _verdicts.clear()
        _verdicts[key] = verdict
    return _verdicts[key]


def _stamp(path: Path) -> tuple[int, int, int, int]:
    info = os.lstat(path)
    return info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns


def newest_intact_step(directory: Path) -> int | None:
    """The newest published step that verifies (the agent's crash-loop check); None if none does."""
    for step, path in reversed(list_steps(directory)):
        if is_intact(path):
            return step
    return None
