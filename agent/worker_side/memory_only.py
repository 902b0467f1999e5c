"""Checkpoints under rally without a checkpoint directory: in the memory tier only.

A script written for rally (`job.load_latest()` / `job.save(state, step)`) must just work
under `rally` with no extra flag. Without `--checkpoint-dir` the agent still runs its holder
(agent/checkpoint/node_checkpoints.py), and `rally.job` keeps each save there without ever writing it
(`persist=False`): restarts within the job resume from memory, nothing survives the job's end,
and rank 0 says so once, with the flag that makes checkpoints durable. Should the holder die,
the agent turns the tier off for the later rounds (RALLY_CKPT_HOLDER_LOST): their saves and loads
then do nothing, and rank 0 says once that checkpoints are off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rally.agent.checkpoint.core.client import HOLDER_LOST_ENV, WHOLE_STATE_KEY, MemoryTier

if TYPE_CHECKING:  # torch is the worker's, imported when used
    from torch.serialization import MAP_LOCATION

LINE = (
    "checkpoints are kept in this node's memory only, for restarts within this job; "
    "to keep them on disk as well, run rally with --checkpoint-dir DIR"
)
"""Said once per worker process, on rank 0 of the job's first round, at the first save or load."""
NO_ROOM = (
    "rally: this node has too little memory to keep checkpoints in memory and no checkpoint "
    "directory to write them to; run rally with --checkpoint-dir DIR"
)
OFF_LINE = (
    "checkpoints are off: this node's checkpoint holder died in an earlier round and there is no "
    "checkpoint directory; saves do nothing from now on (run rally with --checkpoint-dir DIR to keep them)"
)
"""Said once per worker process on rank 0 when the tier is off and there is no directory."""
NO_DIRECTORY = "<memory>"
"""The directory part of a memory-only checkpoint's `Checkpoint.path`: it has no file."""

_told = False
_told_off = False


def tier_lost() -> bool:
    """Whether the agent turned the memory tier off because its holder died (read afresh: forked workers)."""
    return os.environ.get(HOLDER_LOST_ENV, "") == "1"


def tell_off_once(speak: bool, log: Callable[[str], None]) -> None:
    """Say `OFF_LINE` the first time, if `speak`."""
    global _told_off
    if speak and not _told_off:
        log(OFF_LINE)
    _told_off = True


def tell_once(speak: bool, log: Callable[[str], None]) -> None:
    """Say `LINE` the first time this process checkpoints, if `speak`."""
    global _told
    if speak and not _told:
        log(LINE)
    _told = True


def save(memory: MemoryTier, state: object, step: int, keep: int) -> bool:
    """Copy `state` into the node's memory as `step`, never to disk; False if there is no room."""
    return memory.save(state, WHOLE_STATE_KEY, step, persist=False, keep=keep)


def load(memory: MemoryTier, map_location: MAP_LOCATION, weights_only: bool) -> tuple[int, Any] | None:
    """(step, state) of the step the round agreed on, mapped from the node's memory; None if none."""
    agreed, memfd = memory.resume(WHOLE_STATE_KEY)
    if memfd is None or agreed is None:
        return None
    import torch

    try:
        state = torch.load(f"/proc/self/fd/{memfd}", map_location=map_location, weights_only=weights_only, mmap=True)
    finally:
        os.close(memfd)  # the mapping keeps the copy
    return agreed, state
