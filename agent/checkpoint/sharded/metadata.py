"""DCP's `.metadata` read with a restricted unpickler: only the classes DCP's metadata holds.

torch.distributed.checkpoint stores its index of chunks as a plain pickle, and its
`FileSystemReader` reads it with `pickle.load`: whoever writes those bytes runs code in the
reader. rally reads them from a node's memory (agent/checkpoint/sharded/memory.py), from the ranks'
parts at publication (agent/checkpoint/sharded/persist.py, flush.py) and from published steps
(agent/checkpoint/sharded/storage.py). Everywhere, the bytes go through `loads`, whose
unpickler builds only DCP's metadata dataclasses, `torch.Size`, torch dtypes and layouts and a
path: anything else (`os.system`, `builtins.eval`, any other class) is refused with one line.
On disk the bytes are also authenticated first (the manifest's HMAC, agent/checkpoint/sharded/files.py):
the unpickler is the second wall, not the only one.

Imported only where torch is (it names torch's classes).
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from rally.agent.checkpoint.core import torch_internals
from rally.agent.checkpoint.core.digest import BytesLike

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = frozenset(
    {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    }
)
_OTHERS = frozenset(
    {
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        *torch_internals.PICKLED,  # a layout by its name (torch.strided), an item's place in its file
    }
)


class UnsafeMetadata(pickle.UnpicklingError):
    """The metadata names something DCP's metadata never holds; the message is one line."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name != "Size":
            found = getattr(torch, name, None)
            if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        elif (module == _METADATA_MODULE and name in _METADATA_CLASSES) or (module, name) in _OTHERS:
            return super().find_class(module, name)
        raise UnsafeMetadata(
            f"rally: DCP metadata names {module[:80]}.{name[:80]}, which DCP's metadata never holds: "
            "not loaded (written by something other than rally or torch)"
        )


def load(file: IO[bytes] | io.IOBase) -> Metadata:
    """DCP's Metadata from `file`; UnsafeMetadata for anything else."""
    try:
        found = _Restricted(file).load()
    except UnsafeMetadata:
        raise
    except Exception as exc:  # a truncated or garbled pickle: one line, as for anything refused
        raise UnsafeMetadata(f"rally: DCP metadata is unreadable ({type(exc).__name__})") from None
    if not isinstance(found, Metadata):
        raise UnsafeMetadata(f"rally: DCP metadata holds a {type(found).__name__}, not DCP's Metadata")
    return found


def loads(data: BytesLike) -> Metadata:
    return load(io.BytesIO(bytes(data)))


class SafeMetadataReader(FileSystemReader):
    """torch's FileSystemReader, but its `.metadata` is read with `load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = torch_internals.metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load(stream)
        storage_meta = metadata.storage_meta if metadata.storage_meta is not None else StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
