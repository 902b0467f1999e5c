"""The sharded save's fast path: when a rank's state has the layout of its last save, copy only its shards.

A training loop saves the same sharded state again and again. DCP's rank-local save
(agent/checkpoint/sharded/memory.py) would plan it, `torch.save` every tensor into a growing
in-memory file and then copy that file into the shared-memory slot: two passes over the data
plus the planner, several times a plain copy. But for the same keys, the same DTensor layouts
and the same non-tensor values, DCP's two files differ between saves only where the tensors'
bytes lie. So the first save of a layout is DCP's own, with a `rally.agent.checkpoint.core.layout.Recorder`
watching the data file's writes (which are a storage's bytes, where; the rest, a few KB of
zip headers and pickles, kept as bytes), and the next save with an equal `signature`
writes the kept bytes and `copy_`-es each shard straight into its place in the slot: the
plain copy the stall is measured against, and nothing else.

Why equal signatures give equal files: DCP's plan for a rank depends on the flattened keys, each
tensor's dtype, shape, `requires_grad` and, for a DTensor, its mesh, placements and global
shape (which decide the chunk's offsets), and on the non-tensor values (pickled into the file);
the signature holds all of them. Eligible: every tensor on the CPU, plain or a DTensor's local
shard, contiguous, and no storage filled by two tensors. DCP hands `torch.save` a storage that
a tensor fills as it is; a tensor that does not fill its storage (FSDP2's uneven last shard is a
slice of a padded one) it copies first, into a storage nobody else knows. So the save that
teaches a layout gives DCP a compact copy of such a view, made here (`compacted`), and the
recorder sees every storage written whole exactly once (else `Recorder.layout` gives None
and every save takes DCP's way, as before); the replay copies the view's bytes. A tensor with no
bytes (an empty shard) has nothing to copy. Per-record CRC-32s are left out (`compute_crc32=False`, as
for whole states: `torch.load` does not check them); rally's manifest has the files' digests.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

from rally.agent.checkpoint.core import torch_internals
from rally.agent.checkpoint.core.digest import BytesLike
from rally.agent.checkpoint.core.layout import Layout, Recorder, bytes_of, walk_structure


def _local_kind(obj: Any) -> str | None:
    """How DCP writes a (local) tensor: `whole` (its storage itself), `view` (a clone DCP makes
    of a tensor that does not fill its storage, e.g. FSDP2's uneven last shard, a slice of its
    padded storage), `empty` (no bytes); None: not eligible for the fast path."""
    import torch

    if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.device.type != "cpu" or obj.layout != torch.strided:
        return None
    if obj.__dict__ or obj.is_conj() or obj.is_neg() or obj.is_quantized or obj.is_nested or not obj.is_contiguous():
        return None
    if obj.nbytes == 0:
        return "empty"
    return "whole" if obj.untyped_storage().nbytes() == obj.nbytes else "view"


def signature(state: Any) -> tuple[tuple[Any, ...], list[Any]] | None:
    """(what decides DCP's two files but the tensors' bytes, the sources of those bytes in walk
    order: a storage DCP writes itself, or a view whose clone it writes); None: ineligible, or a torch
    the replay was not checked against (agent/checkpoint/core/torch_internals.py)."""
    from torch.distributed.tensor import DTensor

    if not torch_internals.fast_paths():
        return None

    sig: list[Any] = []
    sources: list[Any] = []
    seen: set[int] = set()
    meshes: dict[int, tuple[Any, ...]] = {}

    def tensor(obj: Any) -> tuple[Any, ...] | None:
        kind = _local_kind(obj)
        if kind is None:
            return None
        if kind == "whole":
            storage = obj.untyped_storage()
            if storage.data_ptr() in seen:  # written twice by DCP: the recorder could not tell which is which
                return None
            seen.add(storage.data_ptr())
            sources.append(storage)
        elif kind == "view":
            sources.append(obj)
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

    return (tuple(sig), sources) if walk_structure(state, sig, leaf) else None


def compacted(state: Any, sources: list[Any]) -> tuple[Any, list[Any] | None]:
    """For the save that teaches a layout: `state` with every view among `sources` replaced
    by a compact copy made here, and the storages the recorder is to watch (that copy's in the
    view's place). DCP would copy a view itself, into a storage no recorder knows; written from
    ours, every source is seen. (`state` as it is, and None, when the walk disagrees with
    `sources`: that save teaches nothing.)"""
    import torch
    from torch.distributed.tensor import DTensor

    if not any(isinstance(s, torch.Tensor) for s in sources):
        return state, sources
    watched: list[Any] = []

    def compact(local: Any) -> Any:
        kind = _local_kind(local)
        if kind == "whole":
            watched.append(local.untyped_storage())
        elif kind == "view":
            copy = local.detach().clone(memory_format=torch.contiguous_format).requires_grad_(local.requires_grad)
            watched.append(copy.untyped_storage())
            return copy
        return local

    def rebuild(obj: Any) -> Any:
        kind = type(obj)
        if kind in (dict, OrderedDict):
            return kind((k, rebuild(v)) for k, v in obj.items())
        if kind in (list, tuple):
            return kind(rebuild(v) for v in obj)
        if kind is DTensor:
            local = obj.to_local()
            copy = compact(local)
            if copy is local:
                return obj
            return DTensor.from_local(
                copy, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        if isinstance(obj, torch.Tensor):
            return compact(obj)
        return obj

    rebuilt = rebuild(state)
    if [bytes_of(s).numel() for s in watched] != [bytes_of(s).numel() for s in sources]:
        return state, None
    return rebuilt, watched


class RecordingBytes(io.BytesIO):
    """DCP's data file in memory, with a recorder noting which write is which storage's bytes.
    DCP's writer may close it: the bytes stay for us to take."""

    def __init__(self, recorder: Recorder | None) -> None:
        super().__init__()
        self.recorder = recorder

    def write(self, data: BytesLike) -> int:
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
        """The data file of a state with this layout into `target`; its length."""
        return self.data.write(storages, target)


def learn(sig: tuple[Any, ...] | None, recorder: Recorder | None, meta: memoryview, length: int) -> FilesLayout | None:
    """The layout the first save of `sig` taught, or None when it cannot be replayed."""
    if sig is None or recorder is None:
        return None
    data = recorder.layout(sig, length)
    if data is None:
        return None  # a storage not seen whole: DCP's way every time
    return FilesLayout(sig, bytes(meta), data)
