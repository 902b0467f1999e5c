"""Every part of torch the checkpoint code uses that torch does not promise, in one module, behind one check.

The memory tier's fast paths lean on torch's internals:

- `torch.utils.serialization.config.save.compute_crc32`, a process-wide flag: the zip records'
  own CRC-32 left out of an archive written into a slot (`no_record_crc`; rally's MAC
  protects the durable file, agent/checkpoint/core/shm.py says why);
- how `torch.save` writes: each storage's bytes in one write of a view of the storage itself,
  and the same archive for the same structure, which the save fast paths record once and replay
  (agent/checkpoint/core/layout.py, agent/checkpoint/sharded/layout.py);
- `torch._foreach_copy_`: a replayed layout's tensors copied into the slot in one call that runs
  without the GIL (`copy_tensors`); `Tensor._version`, torch's count of in-place writes,
  which tells an overlapped save whose tensors changed while they were copied
  (`in_place_version`, agent/checkpoint/core/overlap.py);
- `torch._C.PyTorchFileReader`, torch's zip reader, to find the one storage record of a DCP item
  (`storage_record_offset`) and `torch.distributed._shard._utils.narrow_tensor_by_index`, DCP's
  own narrowing of a chunk: the sharded reload's one-copy reader (agent/checkpoint/sharded/reader.py).

They were checked against the torch versions in `CHECKED` (the oldest and the newest that
`.ci/torch-matrix` runs, and CI's pinned CPU wheel; tests/test_torch_internals.py keeps the two
in step). On a torch outside `OLDEST` .. `NEWEST` (by minor release), or where one of
the internals is missing, `fast_paths` is False, says so once per process on stderr, and each
fast path takes torch's public way instead: `torch.save` at every save with the records' CRCs
computed, no overlapped copy (every save copies before it returns, as `RALLY_CKPT_OVERLAP=0`),
DCP's own reader item by item. Slower, never a crash nor a different checkpoint: the
bytes a public `torch.load` or DCP's reader reads are what they would read anyway.

The sharded path is built on DCP's `FileSystemWriter` and `FileSystemReader` and needs a few
of their private names that are no fast path and have no public stand-in: the plan types
`_StoragePrefix` and `_StorageInfo` (DCP's reader unpickles them from the metadata by name),
`_get_metadata_path`, and the private names DCP's metadata pickles (`PICKLED`). They are
reached through this module too (`StoragePrefix`, `StorageInfo`, `metadata_path`), so
that it lists every private name of torch the checkpoint code touches.

Imports no torch at module level: the holder and the agent import the checkpoint core without it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader

OLDEST = (2, 10)
"""The oldest torch minor release the fast paths were checked against (.ci/torch-matrix's OLDEST)."""
NEWEST = (2, 15)
"""The newest (.ci/torch-matrix's NEWEST): a newer torch takes the public paths until it is checked."""
CHECKED = ("2.10.0", "2.13.0", "2.15.0")
"""The releases the fast paths' tests passed on (docs/contributing.md, "Supported torch versions")."""

_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")


def torch_version() -> str:
    """The running torch's version (e.g. `2.13.0+cpu`)."""
    import torch

    return str(torch.__version__)


def _minor(version: str) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _missing() -> list[str]:
    """The internals this torch lacks, by name."""
    import torch
    import torch.utils.serialization

    missing = []
    save_config = getattr(getattr(torch.utils.serialization, "config", None), "save", None)
    if not hasattr(save_config, "compute_crc32"):
        missing.append("torch.utils.serialization.config.save.compute_crc32")
    if not hasattr(getattr(torch._C, "PyTorchFileReader", None), "get_record_offset"):
        missing.append("torch._C.PyTorchFileReader.get_record_offset")
    if not hasattr(torch, "_foreach_copy_"):
        missing.append("torch._foreach_copy_")
    if not hasattr(torch.empty(0), "_version"):
        missing.append("torch.Tensor._version")
    return missing


def _narrow() -> Any:
    try:
        from torch.distributed._shard._utils import narrow_tensor_by_index
    except ImportError:
        return None
    return narrow_tensor_by_index


@cache
def fast_paths() -> bool:
    """Whether this torch is one the fast paths were checked against and has every internal they use.
    False: one line on stderr (once per process), and every fast path takes torch's public way."""
    version = torch_version()
    minor = _minor(version)
    if minor is None or not OLDEST <= minor <= NEWEST:
        checked = f"{'.'.join(map(str, OLDEST))} to {'.'.join(map(str, NEWEST))}"
        _warn(f"torch {version} is not one rally's checkpoint fast paths were checked against ({checked})")
        return False
    missing = _missing()
    if missing:
        _warn(f"torch {version} has no {', '.join(missing)}, which rally's checkpoint fast paths use")
        return False
    return True


def _warn(why: str) -> None:
    print(
        f"rally: warning: {why}: checkpoints take torch's public, slower path (torch.save at every save, "
        "DCP's own reader); upgrade rally, or use a torch it names in agent/checkpoint/core/torch_internals.py",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def no_record_crc() -> Iterator[None]:
    """`torch.save` inside leaves the zip records' CRC-32 out (a second pass over the bytes in the
    training step's stall); computed as ever where the fast paths are off. The flag is process-wide:
    restored on the way out."""
    if not fast_paths():
        yield
        return
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


@cache
def sharded_reader() -> bool:
    """Whether the sharded reload's one-copy reader may run: `fast_paths`, and DCP's narrowing
    is there (checked apart: importing it costs ~10 ms, which a whole state's reload need not pay)."""
    if not fast_paths():
        return False
    if _narrow() is None:
        _warn(f"torch {torch_version()} has no torch.distributed._shard._utils.narrow_tensor_by_index, which "
              "rally's sharded reload uses")  # fmt: skip
        return False
    return True


def storage_record_offset(item: io.RawIOBase) -> int | None:
    """Where the one storage record of the `torch.save` archive `item` (a readable, seekable file
    over it) starts; None: another record count, an unreadable archive, or the fast paths are off."""
    if not sharded_reader():
        return None
    import torch

    try:
        archive = torch._C.PyTorchFileReader(item)  # type: ignore[call-overload]  # any readable, seekable file
        records = [name for name in archive.get_all_records() if _STORAGE_RECORD.search(name)]
        if len(records) != 1:
            return None
        return int(archive.get_record_offset(records[0]))
    except (RuntimeError, ValueError):
        return None


def copy_tensors(places: list[torch.Tensor], data: list[torch.Tensor]) -> None:
    """Copy each of `data` into its place in `places`: one `torch._foreach_copy_` (the copies run
    without the GIL, however busy the training thread keeps it), or `copy_` one by one where the
    fast paths are off."""
    import torch

    if fast_paths():
        torch._foreach_copy_(places, data)
        return
    for place, source in zip(places, data, strict=True):
        place.copy_(source)


def in_place_version(tensor: torch.Tensor) -> int:
    """torch's count of in-place writes to `tensor` (`_version`), shared by its detached views and
    bumped once an in-place op on it has run. Read only where `fast_paths` is True: elsewhere
    saves do not overlap the next step (agent/checkpoint/core/overlap.py's `enabled`)."""
    return int(tensor._version)


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """DCP's own narrowing of a chunk read for a request (its FileSystemReader's); only called
    where `sharded_reader` is True."""
    return _narrow()(tensor, offsets, sizes)


def metadata_path(reader: FileSystemReader, rank: int | None) -> os.PathLike[str]:
    """Where DCP's `FileSystemReader` `reader` finds the `.metadata` (its private `_get_metadata_path`)."""
    return reader._get_metadata_path(rank)


SHARDED_TYPES = (("torch.distributed.tensor", "DTensor"), ("torch.distributed._shard.sharded_tensor", "ShardedTensor"))
"""Where a sharded state's tensors are defined (FSDP2 and tensor parallel; FSDP1's SHARDED_STATE_DICT,
a private module): looked up among the modules already imported, a missing one is no kind."""

PICKLED = frozenset(
    {("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
)
"""Private names of torch that DCP's `.metadata` pickle refers to (a layout by its name, an item's place)."""


def __getattr__(name: str) -> Any:
    """`StoragePrefix`, `StorageInfo`: DCP's writer's private plan types, imported (with torch)
    when a module that needs them asks."""
    if name in ("StoragePrefix", "StorageInfo"):
        from torch.distributed.checkpoint import filesystem

        return getattr(filesystem, "_" + name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
