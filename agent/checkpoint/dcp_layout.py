"""The sharded save's fast path: when a rank's state has the layout of its last save, copy only its shards.

A training loop saves the same sharded state again and again. DCP's rank-local save
(agent/checkpoint/dcp_memory.py) would plan it, ``torch.save`` every tensor into a growing
in-memory file and then copy that file into the shared-memory slot: two passes over the data
plus the planner, several times a plain copy. But for the same keys, the same DTensor layouts
and the same non-tensor values, DCP's two files differ between saves only where the tensors'
bytes lie. So the first save of a layout is DCP's own, with a :class:`rally.agent.checkpoint.layout.Recorder`
watching the data file's writes (which are a storage's bytes, where; the rest, a few KB of
zip headers and pickles, kept as bytes), and the next save with an equal :func:`signature`
writes the kept bytes and ``copy_``-es each shard straight into its place in the slot: the
plain copy the stall is measured against, and nothing else.

Why equal signatures give equal files: DCP's plan for a rank depends on the flattened keys, each
tensor's dtype, shape, ``requires_grad`` and, for a DTensor, its mesh, placements and global
shape (which decide the chunk's offsets), and on the non-tensor values (pickled into the file);
the signature holds all of them. Only states DCP writes without a copy are eligible: every
tensor on the CPU, plain or a DTensor, contiguous, filling its storage from offset 0, no storage
shared between two tensors. Then DCP hands ``torch.save`` each storage itself, and the recorder
sees every storage written whole exactly once (else :meth:`Recorder.layout` gives None and every
save takes DCP's way, as before). Per-record CRC-32s are left out (``compute_crc32=False``, as
for whole states: ``torch.load`` does not check them); rally's manifest has CRC-32s of the files.
"""

from __future__ import annotations

import io
from typing import Any

from rally.agent.checkpoint.layout import Layout, Recorder, walk_structure


def signature(state: Any) -> tuple[tuple[Any, ...], list[Any]] | None:
    """(what decides DCP's two files but the tensors' bytes, the storages in walk order); None: ineligible."""
    import torch
    from torch.distributed.tensor import DTensor

    sig: list[Any] = []
    storages: list[Any] = []
    seen: set[int] = set()
    meshes: dict[int, tuple[Any, ...]] = {}

    def tensor(obj: Any) -> tuple[Any, ...] | None:
        if (
            type(obj) not in (torch.Tensor, torch.nn.Parameter)
            or obj.device.type != "cpu"
            or obj.layout != torch.strided
        ):
            return None
        if (
            obj.__dict__
            or obj.is_conj()
            or obj.is_neg()
            or obj.is_quantized
            or obj.is_nested
            or not obj.is_contiguous()
        ):
            return None
        storage = obj.untyped_storage()
        ptr = storage.data_ptr()
        if obj.storage_offset() != 0 or storage.nbytes() != obj.nbytes or obj.nbytes == 0 or ptr in seen:
            return None
        seen.add(ptr)
        storages.append(storage)
        return (type(obj), obj.dtype, tuple(obj.shape), obj.requires_grad)

    def leaf(obj: Any) -> bool:
        kind = type(obj)
        if kind is DTensor:
            local = tensor(obj.to_local())
            if local is None:
                return False
            mesh = obj.device_mesh
            if id(mesh) not in meshes:  # one mesh for most tensors: described once per save
                meshes[id(mesh)] = (
                    mesh.device_type,
                    tuple(mesh.mesh.shape),
                    tuple(mesh.mesh.flatten().tolist()),
                    mesh.mesh_dim_names,
                )
            sig.append(
                (
                    kind,
                    obj.dtype,
                    tuple(obj.shape),
                    obj.requires_grad,
                    tuple(map(repr, obj.placements)),
                    meshes[id(mesh)],
                    local,
                )
            )
            return True
        found = tensor(obj)
        if found is None:
            return False
        sig.append(found)
        return True

    return (tuple(sig), storages) if walk_structure(state, sig, leaf) else None


class RecordingBytes(io.BytesIO):
    """DCP's data file in memory, with a recorder noting which write is which storage's bytes.
    DCP's writer may close it: the bytes stay for us to take."""

    def __init__(self, recorder: Recorder | None) -> None:
        super().__init__()
        self.recorder = recorder

    def write(self, data: Any) -> int:
        if self.recorder is not None:
            with memoryview(data) as raw, raw.cast("B") as view:
                self.recorder.write(self.tell(), view)
        return super().write(data)

    def close(self) -> None:
        pass


class FilesLayout:
    """A rank's last DCP save of one signature: its metadata file's bytes and its data file's layout."""

    def __init__(self, sig: tuple[Any, ...], meta: bytes, data: Layout) -> None:
        self.signature, self.meta, self.data = sig, meta, data

    def write_data(self, storages: list[Any], target: memoryview) -> int:
        """The data file of a state with this layout into ``target``; its length."""
        return self.data.write(storages, target)


def learn(sig: tuple[Any, ...] | None, recorder: Recorder | None, meta: memoryview, length: int) -> FilesLayout | None:
    """The layout the first save of ``sig`` taught, or None when it cannot be replayed."""
    if sig is None or recorder is None:
        return None
    data = recorder.layout(sig, length)
    if data is None:
        return None  # a storage not seen whole: DCP's way every time
    return FilesLayout(sig, bytes(meta), data)
