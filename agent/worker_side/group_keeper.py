"""rally's own reference to every torch.distributed process group made in a `rally.job.run`
worker, so that the last reference of a group is never dropped with the GIL held.

Why (torch 2.13, gloo): `~ProcessGroupGloo` joins the group's runLoop threads. A runLoop thread
that just finished a collective frees its work, whose thread-local state holds the Python object
autograd's backward stashes there (`_engine_run_backward`'s contextvars context): freeing it needs
the GIL. When the group's last reference goes with the GIL held (a DDP module's Reducer freed as
the function returns, after the script's `destroy_process_group`; or the teardown's `gc.collect()`
freeing it), the join waits for a thread that waits for the GIL: the process hangs for good. The
Python wrapper of a group releases the GIL when it drops the C++ group (torch's pybind holder for
process groups), so a group whose last reference is rally's Python one is joined safely.

How the groups are seen: torch registers every group it makes (`init_process_group`,
`new_group`, `split_group`, and the function's own calls alike) in `distributed_c10d._pg_map`,
a module-level dict that `destroy_process_group` only empties; rally replaces it by a dict that
also remembers each group it is given (`install`).

Also released here: groups that torch pins itself. `torch.distributed.nn.functional` (imported
by `torch._dynamo`, at an optimizer's first step) evaluates `group=group.WORLD` once, at its
import: the default group of that moment is held by those functions' defaults for the rest of
the process (the first entry's group, its threads and sockets, stayed alive in every re-entered
worker). A default that is a destroyed group is set back to None, which those functions read
as the default group of the moment (`unpin_defaults`).
"""

from __future__ import annotations

import sys
from types import FunctionType
from typing import Any

kept: list[Any] = []
"""The groups made since the last release (and those alive when `install` ran)."""


class _RecordingMap(dict[Any, Any]):  # torch's dict[ProcessGroup, tuple[str, Store]]
    """c10d's map from group to (backend, store), which also keeps each group it is given."""

    def __setitem__(self, group: Any, value: Any) -> None:
        if not any(group is old for old in kept):
            kept.append(group)
        super().__setitem__(group, value)


def install() -> bool:
    """Make c10d's group map remember every group from now on (once; True when it does). Only if
    torch.distributed is already imported: a script that never imports it is left alone."""
    c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return False
    current = getattr(c10d, "_pg_map", None)
    if isinstance(current, _RecordingMap):
        return True
    if type(current) is not dict:  # a torch whose c10d keeps its groups elsewhere: nothing to hook
        return False
    recording = _RecordingMap(current)
    for group in current:
        if not any(group is old for old in kept):
            kept.append(group)
    c10d._pg_map = recording
    return True


def release() -> None:
    """Drop rally's references. A group that c10d still holds lives on; a destroyed one whose
    last reference this was is destroyed now, its threads joined with the GIL released (by
    torch's holder), so a runLoop thread that needs the GIL gets it."""
    while kept:
        kept.pop()


def unpin_defaults() -> int:
    """Set to None every function default of torch.distributed's modules that is a group rally
    kept and c10d no longer holds (destroyed); how many were. Looks at the module-level functions
    and the methods of module-level classes of each torch.distributed module once (~10 ms for
    the ~140 modules loaded after `torch._dynamo`'s import, then nothing)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not kept:
        return 0
    live = getattr(c10d, "_pg_map", {})
    dead = [group for group in kept if group not in live]
    if not dead:
        return 0
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and module is not None and name not in _scanned:
            _scanned.add(name)  # a default is evaluated once, at the import: one look per module
            _pinning.extend(f for f in _functions(module, name) if _holds_group(f))
    return sum(_unpin(function, dead) for function in _pinning)


_scanned: set[str] = set()
_pinning: list[FunctionType] = []  # functions seen with a group rally kept among their defaults


def _functions(module: object, name: str) -> list[FunctionType]:
    found = []
    for value in list(vars(module).values()):
        # exact types only: an isinstance() on some of these objects warns (`reduce_op`)
        if type(value) is FunctionType:
            found.append(value)
        elif type(value) is type and value.__module__ == name:
            found.extend(member for member in list(vars(value).values()) if type(member) is FunctionType)
    return found


def _holds_group(function: FunctionType) -> bool:
    values = list(function.__defaults__ or ()) + list((function.__kwdefaults__ or {}).values())
    return any(value is group for value in values for group in kept)


def _unpin(function: FunctionType, dead: list[Any]) -> int:
    defaults = getattr(function, "__defaults__", None)
    unpinned = 0
    if isinstance(defaults, tuple) and any(d is g for d in defaults for g in dead):
        function.__defaults__ = tuple(None if any(d is g for g in dead) else d for d in defaults)
        unpinned += 1
    kwdefaults = getattr(function, "__kwdefaults__", None)
    if isinstance(kwdefaults, dict):
        for key, value in list(kwdefaults.items()):
            if any(value is g for g in dead):
                kwdefaults[key] = None
                unpinned += 1
    return unpinned
