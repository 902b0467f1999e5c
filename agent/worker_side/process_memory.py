"""Checkpoints with neither rally's memory tier nor a directory (torchrun, plain python): the
newest one kept in this process's memory.

A script written for rally (`job.load_latest()` at the start, `job.save(state, step)` every few
steps) must run unchanged under `torchrun` and `python`, where no agent holds checkpoints and,
unless RALLY_CHECKPOINT_DIR is set, no directory is named. What a demanding user expects there:

* no traceback, and no file written to a place nobody chose: a default directory (the working
  directory, /tmp) would fill a disk the user did not pick, and on several nodes without a shared
  working directory rank 0 would resume from a step the other nodes cannot see, so the ranks would
  disagree on where they are (and hang in the first collective that differs);
* the same behaviour on every rank, so every rank resumes from the same step (here: from scratch
  in a new process, from the newest save in the same one);
* one line, from rank 0, saying where checkpoints went and how to keep them on disk.

So each rank keeps only its newest save, serialised with `torch.save` into bytes (a copy: the
script's tensors change in place after the save), for as long as the process lives; a later
`load_latest` in the same process (a loop that re-enters training after an error it caught) gets
it back, a new process starts from scratch. The cost is one serialised copy of the state in host
memory per rank, paid only by scripts that checkpoint without a directory.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is the worker's, imported when used
    from torch.serialization import MAP_LOCATION

LINE = (
    "checkpoints are kept in this process's memory only (the newest one) and are lost when it exits: no checkpoint "
    "directory is set and rally's memory tier is not running (torchrun, plain python); set RALLY_CHECKPOINT_DIR=DIR "
    "to keep them on disk"
)
"""Said once per process, by global rank 0, at its first save or load."""
SHARDED_LINE = (
    "no checkpoint directory: sharded (DTensor) checkpoints are not kept; set RALLY_CHECKPOINT_DIR=DIR "
    "(or run rally with --checkpoint-dir DIR) to save and load them"
)
"""Said once per process by global rank 0 when a sharded save or load has no directory."""
SOURCE = "process memory"
"""`Checkpoint.source` of a checkpoint returned from this process's memory."""

_newest: tuple[int, bytes] | None = None
_told: set[str] = set()


def tell_once(line: str, speak: bool, log: Callable[[str], None]) -> None:
    """Say `line` the first time this process needs it, if `speak` (global rank 0)."""
    if speak and line not in _told:
        log(line)
    _told.add(line)


def save(state: object, step: int) -> None:
    """Keep `state` as `step`, replacing the previous one: a copy, later changes to the tensors do not reach it."""
    global _newest
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    _newest = (step, buffer.getvalue())


def load(map_location: MAP_LOCATION, weights_only: bool) -> tuple[int, Any] | None:
    """(step, state) of the newest save of this process, or None when it saved nothing."""
    if _newest is None:
        return None
    import torch

    step, data = _newest
    return step, torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
