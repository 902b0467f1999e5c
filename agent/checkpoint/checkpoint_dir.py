"""A directory of whole-state checkpoints (`step_<N>.pt`): which steps it holds, which is the newest
intact one, and pruning to the newest few.

The worker's `rally.job.save` prunes after each write, the holder's persister after each
background write, and the agent asks for the newest intact step (its crash-loop check and the
round's resume step): one module, so the three agree on what a checkpoint file is called.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rally.agent.checkpoint.core import checkpoint_file
from rally.agent.checkpoint.sharded import files as dcp_files

CHECKPOINT_RE = re.compile(r"^step_(\d+)\.pt$")


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `directory`, oldest first. Temporary files never match."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), directory / name) for name in names if (m := CHECKPOINT_RE.match(name))]
    return sorted(found)


def prune(directory: Path, keep: int, protect: Path) -> None:
    """Keep `protect` (just written) and the `keep - 1` newest checkpoints older than it
    (agent/checkpoint/core/checkpoint_file.py's `prune_older`, as for sharded steps)."""
    own_step = int(CHECKPOINT_RE.match(protect.name).group(1))  # type: ignore[union-attr]
    checkpoint_file.prune_older(list_checkpoints(directory), keep, own_step, os.unlink)


def newest_checkpoint_step(directory: str | os.PathLike[str], above: int | None = None) -> int | None:
    """The step of the newest intact checkpoint in `directory` (None if there is none).

    The agent uses this to tell a crash loop (restarts that make no progress) from a job that
    fails now and then but keeps moving forward; sharded checkpoints (`step_*.dcp`) count alike.
    Damaged files are skipped exactly as `rally.job.load_latest` skips them, so the step counted is
    the step the workers resume from; an unreadable directory counts as no checkpoint.

    `above`: only steps newer than it count (None if none of them is intact). Checking a file
    reads all of it (a CRC over 400 MB is ~0.5 s), so a caller that holds step `above` in memory
    anyway (agent/checkpoint/holdings.py) does not read the older files on a restart's critical path.
    """
    try:
        found = list_checkpoints(Path(directory))
        sharded = dcp_files.list_steps(Path(directory))
    except OSError:
        return None
    newer = above if above is not None else -1
    whole = next((s for s, path in reversed(found) if s > newer and checkpoint_file.is_intact(path)), None)
    shard = next((s for s, path in reversed(sharded) if s > newer and dcp_files.is_intact(path)), None)
    return max((s for s in (whole, shard) if s is not None), default=None)
