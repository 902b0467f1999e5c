"""Checkpoints under rally without a checkpoint directory: in the memory tier only.

A script written for rally (``job.load_latest()`` / ``job.save(state, step)``) must just work
under ``rally`` with no extra flag. Without ``--checkpoint-dir`` the agent still runs its holder
(agent/checkpoint/tier.py), and ``rally.job`` keeps each save there without ever writing it
(``persist=False``): restarts within the job resume from memory, nothing survives the job's end,
and rank 0 says so once, with the flag that makes checkpoints durable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rally.agent.checkpoint.client import WHOLE_STATE_KEY, MemoryTier

LINE = (
    "checkpoints are kept in this node's memory only, for restarts within this job; "
    "to keep them on disk as well, run rally with --checkpoint-dir DIR"
)
"""Said once per worker process, on rank 0 of the job's first round, at the first save or load."""
NO_ROOM = (
    "rally: this node has too little memory to keep checkpoints in memory and no checkpoint "
    "directory to write them to; run rally with --checkpoint-dir DIR"
)
NO_DIRECTORY = "<memory>"
"""The directory part of a memory-only checkpoint's ``Checkpoint.path``: it has no file."""

_told = False


def tell_once(speak: bool, log: Callable[[str], None]) -> None:
    """Say :data:`LINE` the first time this process checkpoints, if ``speak``."""
    global _told
    if speak and not _told:
        log(LINE)
    _told = True


def save(memory: MemoryTier, state: Any, step: int, keep: int) -> bool:
    """Copy ``state`` into the node's memory as ``step``, never to disk; False if there is no room."""
    return memory.save(state, WHOLE_STATE_KEY, step, persist=False, keep=keep)


def load(memory: MemoryTier, map_location: Any, weights_only: bool) -> tuple[int, Any] | None:
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
