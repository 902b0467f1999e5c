"""The save fast path: when a state has the layout of the last one saved, copy only its tensors.

A training loop saves the same state again and again: the same keys, the same tensor shapes, new
values. `torch.save` would pickle the whole structure each time and write every zip header
again; the archive's bytes differ only where the tensors' data lies. So the first save of a
layout goes through `torch.save` (agent/checkpoint/core/shm.py's `write_archive`) with a
`Recorder` watching its writes: every write that is a storage's data is noted as (where in
the archive, which storage), every other write (zip headers, `data.pkl`, the central directory:
a few KB) is kept as bytes. The next save whose `signature` is equal is then a
`Layout` replayed: the kept bytes written at their offsets and each storage `copy_`-ed
straight into its place in the slot's mapping. That is the plain copy the stall is measured
against, and nothing else: no pickling, no zip writer, no allocation.

Why equal signatures give an equal archive, as `torch.load` reads it: the signature holds the
structure (container types, lengths, keys), every leaf's value, and per tensor its type, dtype,
shape, strides, offset, `requires_grad` and which storage it views (so sharing is kept), as
well as which objects are the same object (pickle's memo). Any other kind of leaf, a tensor off
the CPU, with attributes, conjugate/negative bits, quantization, nesting or an empty
storage makes the state ineligible:
it is saved by `torch.save` every time, as before. `data.pkl` may differ in memo details
(two equal strings that are one object or two); what it unpickles to does not.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rally.agent.checkpoint.core import parallel_copy, torch_internals

_LEAVES = (str, int, float, bool, type(None), bytes)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


def buffer_address(view: memoryview) -> int:
    """The address of the memory a (read-only) memoryview shows: torch hands its writer views of
    the storages themselves, so this says which storage a write is."""
    info = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(info), 0)
    try:
        return int(info.buf or 0)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(info))


def walk_structure(obj: Any, sig: list[Any], other: Callable[[Any], bool], memo: dict[int, int] | None = None) -> bool:
    """Append to `sig` the structure of `obj`: container types, lengths and keys, and every
    plain leaf's value; `other(obj)` describes anything else (False: the state is ineligible).
    With `memo`, an object met again is noted as the same one (pickle's memo). Both fast paths
    (this module's and dcp_layout's) describe their states so; they differ in their tensors."""
    kind = type(obj)
    if kind in _LEAVES:
        sig.append((kind, obj.hex() if kind is float else obj))  # -0.0 is not 0.0 to pickle
        return True
    if memo is not None:
        if id(obj) in memo:
            sig.append(("same", memo[id(obj)]))
            return True
        memo[id(obj)] = len(memo)
    if kind in (dict, OrderedDict):
        sig.append((kind, len(obj)))
        for k, v in obj.items():
            if type(k) not in _LEAVES:
                return False
            sig.append((type(k), k))
            if not walk_structure(v, sig, other, memo):
                return False
        return True
    if kind in (list, tuple):
        sig.append((kind, len(obj)))
        return all(walk_structure(v, sig, other, memo) for v in obj)
    return other(obj)


def signature(state: Any, views: list[tuple[int, Any]] | None = None) -> tuple[tuple[Any, ...], list[Any]] | None:
    """(what decides the archive's layout, the state's storages in walk order); None: ineligible, or
    a torch the replay was not checked against (agent/checkpoint/core/torch_internals.py).
    `views`, if given, receives (storage index, tensor) of every tensor met: which tensors show
    each storage (agent/checkpoint/core/overlap.py watches their in-place versions)."""
    import torch

    if not torch_internals.fast_paths():
        return None

    tensor_types = (torch.Tensor, torch.nn.Parameter)
    sig: list[Any] = []
    storages: list[Any] = []
    index: dict[int, int] = {}
    memo: dict[int, int] = {}

    def tensor(obj: Any) -> bool:
        kind = type(obj)
        if kind not in tensor_types:
            return False
        if obj.layout != torch.strided or obj.device.type != "cpu" or obj.__dict__ or obj.is_conj() or obj.is_neg():
            return False
        if obj.is_quantized or obj.is_nested:  # more than data and shape in the pickle
            return False
        storage = obj.untyped_storage()
        size, ptr = storage.nbytes(), storage.data_ptr()
        if size == 0 or ptr == 0:
            return False
        i = index.setdefault(ptr, len(storages))
        if i == len(storages):
            storages.append(storage)
        elif storages[i].nbytes() != size:
            return False
        sig.append((kind, obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset(), obj.requires_grad, i, size))
        if views is not None:
            views.append((i, obj))
        return True

    return (tuple(sig), storages) if walk_structure(state, sig, tensor, memo) else None


class Recorder:
    """Watches the writes of one `torch.save` into a slot: which are storage data, which are not.
    The data of the storages in `defer` is not to be written now (an overlapped save's copy
    thread copies it once torch.save has placed it, agent/checkpoint/core/overlap.py)."""

    def __init__(self, storages: list[Any], defer: set[int] | frozenset[int] = frozenset()) -> None:
        self.by_address = {s.data_ptr(): (i, s.nbytes()) for i, s in enumerate(storages)}
        self.data: dict[int, int] = {}  # storage index -> offset in the archive
        self.rest: list[tuple[int, bytes]] = []
        self.defer = defer
        self.deferred: list[int] = []  # the indices whose data was left out, in the order written

    def write(self, pos: int, view: memoryview) -> bool:
        """Note one write at `pos`; True: leave its bytes out (a deferred storage's data)."""
        found = self.by_address.get(buffer_address(view))
        if found is not None and found[1] == view.nbytes and found[0] not in self.data:
            self.data[found[0]] = pos
            if found[0] in self.defer:
                self.deferred.append(found[0])
                return True
        else:
            self.rest.append((pos, bytes(view)))
        return False

    def layout(self, sig: tuple[Any, ...], length: int) -> Layout | None:
        """The layout to replay, once every storage's data was seen written whole."""
        if len(self.data) != len(self.by_address):
            return None
        return Layout(sig, length, [self.data[i] for i in range(len(self.data))], self.rest)


class Layout:
    """An archive's bytes but the tensors' data, and where each storage's data goes."""

    def __init__(self, sig: tuple[Any, ...], length: int, offsets: list[int], rest: list[tuple[int, bytes]]) -> None:
        self.signature = sig
        self.length = length
        self.offsets = offsets
        self.rest = rest

    def write(self, sources: list[Any], target: Any, which: list[int] | range | None = None) -> int:
        """Write the archive of a state with this layout into `target` (a slot's mapping); its length.
        A source is a storage, or a contiguous tensor whose bytes were written as a storage of
        their own (a view DCP would clone, see agent/checkpoint/sharded/layout.py). `which`:
        only these sources' data (the rest of the archive is written all the same); the others
        are left to `copy_data` (an overlapped save's background copy)."""
        if len(target) < self.length:
            raise ValueError(f"rally: the slot of {len(target)} bytes is smaller than the archive ({self.length})")
        if len(sources) != len(self.offsets):
            raise ValueError(f"rally: {len(sources)} storages for a layout of {len(self.offsets)}")
        for pos, data in self.rest:
            target[pos : pos + len(data)] = data
        self.copy_data(sources, range(len(sources)) if which is None else which, target)
        return self.length

    def copy_data(self, sources: list[Any], which: list[int] | range, target: mmap.mmap) -> None:
        """Copy the data of `sources[i]` for each `i` in `which` into its place in `target`."""
        copy_into(target, self.length, [(sources[i], self.offsets[i]) for i in which])


def copy_into(target: mmap.mmap, length: int, placed: list[tuple[Any, int]]) -> None:
    """Copy each (source, offset) of `placed` into the first `length` bytes of `target` at its offset."""
    import torch

    whole = torch.frombuffer(target, dtype=torch.uint8, count=length)
    try:
        data = [bytes_of(source) for source, _ in placed]
        places = [whole[pos : pos + d.numel()] for (_, pos), d in zip(placed, data, strict=True)]
        if data:  # on a few threads, each part one call without the GIL (agent/checkpoint/core/parallel_copy.py)
            parallel_copy.copy(places, data)
        del places
    finally:
        del whole  # no export of the mapping outlives the save (SlotMaps may close it)


def bytes_of(source: Any) -> Any:
    """A uint8 tensor over a storage's bytes, or over a contiguous tensor's own bytes."""
    import torch

    if isinstance(source, torch.Tensor):
        return source.detach().reshape(-1).view(torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(source, 0, (source.nbytes(),), (1,))
