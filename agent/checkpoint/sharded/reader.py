"""Reading a rank's DCP files out of memory with one copy per shard: the sharded reload's fast path.

DCP's `FileSystemReader` reads each tensor item by handing `torch.load` a view of the data
file: `torch.load` parses the item's zip archive, unpickles it with the safe loader, and reads
the tensor's bytes into a new storage; then DCP copies that into the target. For a 400 MB rank
with 100 tensors that is two copies and a hundred unpicklings: slower, from memory, than the
same load from the page cache should be.

An item DCP wrote is a `torch.save` archive of one compact tensor (DCP copies a tensor that
does not fill its storage before writing it, see agent/checkpoint/sharded/layout.py), whose one
storage record holds exactly the chunk's bytes; the chunk's dtype and sizes are in DCP's
metadata. So for each tensor item this reader finds that record in the archive's zip directory
(torch's own zip reader over a view of the item, agent/checkpoint/core/torch_internals.py: it
reads the directory, not the data), views its bytes in the mapped slot as the chunk
(`torch.frombuffer`: no copy) and lets DCP's planner copy it into the target: one copy.
Whatever does not look exactly so (another record count or size, a transform, a byte order
other than the machine's, a dtype torch cannot view, a torch the reader was not checked
against) goes through DCP's own way, item by item. DCP's planner, metadata and file format are DCP's:
this only reads faster what it wrote.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from rally.agent.checkpoint.core import torch_internals
from rally.agent.checkpoint.core.digest import BytesLike
from rally.agent.checkpoint.sharded.metadata import SafeMetadataReader


class MemoryReader(SafeMetadataReader):
    """DCP's reader over a rank's files held in memory (`files`: name -> buffer), fast for tensors;
    its `.metadata` read with the restricted unpickler (agent/checkpoint/sharded/metadata.py)."""

    def __init__(self, files: dict[str, Any], fs: Any) -> None:
        super().__init__("/rally-memory")
        self.fs = fs
        self.buffers = files
        self.viewed = 0  # tensor items read straight out of the buffers (the others went DCP's way)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        slow = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            view = self._tensor_view(req, info)
            if view is None:
                slow.append(req)
                continue
            view = torch_internals.narrow_tensor_by_index(
                view, req.storage_offsets, req.lengths
            )  # as DCP's reader does
            target = planner.resolve_tensor(req).detach()
            if target.size() != view.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {view.size()}")
            target.copy_(view)
            planner.commit_tensor(req, target)
            self.viewed += 1
        if slow:  # DCP's own way for the rest (bytes items, and anything unexpected)
            return super().read_data(LoadPlan(slow, plan.storage_data, plan.planner_data), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _tensor_view(self, req: Any, info: Any) -> torch.Tensor | None:
        """The item's chunk as a tensor over the slot's bytes, or None: read it DCP's way."""
        if req.type != LoadItemType.TENSOR or info.transform_descriptors or sys.byteorder != "little":
            return None
        chunk = self._chunk(req)
        if chunk is None:
            return None
        dtype, sizes = chunk
        buffer = self.buffers.get(info.relative_path)
        if buffer is None:
            return None
        item = memoryview(buffer)[info.offset : info.offset + info.length]
        start = torch_internals.storage_record_offset(ViewFile(item))  # None where the fast paths are off
        if start is None:
            return None
        count = 1
        for size in sizes:
            count *= size
        if start + count * dtype.itemsize > info.length or count == 0:
            return None
        try:
            flat = torch.frombuffer(item, dtype=dtype, count=count, offset=start)
        except (TypeError, ValueError, RuntimeError):
            return None
        return flat.view(sizes)

    def _chunk(self, req: Any) -> tuple[torch.dtype, list[int]] | None:
        """(dtype, sizes) of the chunk the item holds, from DCP's metadata (its index a hint, its
        offsets the key, as DCP looks chunks up)."""
        meta = getattr(self, "_metadata", None)
        entry = meta.state_dict_metadata.get(req.storage_index.fqn) if meta is not None else None
        chunks = list(getattr(entry, "chunks", None) or [])
        if entry is None or not chunks:
            return None
        wanted = list(req.storage_index.offset or [])
        hint = req.storage_index.index
        ordered = ([chunks[hint]] if hint is not None and 0 <= hint < len(chunks) else []) + chunks
        for chunk in ordered:
            if list(chunk.offsets) == wanted:
                return entry.properties.dtype, list(chunk.sizes)
        return None

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata


class ViewFile(io.RawIOBase):
    """A seekable read-only file over a memoryview (a mapped slot): no copy of the whole file.
    torch's zip reader reads only an item's directory through it."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = memoryview(view).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: BytesLike) -> int:
        target = memoryview(buffer).cast("B")
        n = max(0, min(target.nbytes, self.view.nbytes - self.pos))
        target[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.view.nbytes}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos
