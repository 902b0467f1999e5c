"""What this node tells each rendezvous round about its checkpoints, cheaply enough for a restart.

Its descriptor carries the newest step it saved (`progress`: the crash-loop guard) and its
`holdings`: the steps in its memory tier and the newest intact step on disk, from which the round
agrees on the step every member resumes from (rendezvous/base/membership.py `resume_step`). Knowing that
a file is intact means reading all of it (a CRC: ~0.5 s for a 400 MB state, once per file
version), and after a failure the newest file is always one not read yet: the holder made it
durable while the failed round ran. Read at the next rendezvous, it was most of a restart.

With one node (`--nnodes 1`), a round resumes from max(the newest step in this node's memory,
the newest intact step on disk), so a file no newer than the memory's newest cannot change
anything: only newer files are read, and the durable step is None when none of them is intact
(the round resumes from memory, as it would have; the progress is the same number). With more
nodes another member may not hold this node's memory steps and the round may resume from the
disk, so every file counts, as before.
"""

from __future__ import annotations

from typing import Protocol

from rally.agent.checkpoint.checkpoint_dir import newest_checkpoint_step


class HeldSteps(Protocol):
    """Where the steps are (agent/checkpoint/node_checkpoints.py's NodeCheckpoints is one)."""

    @property
    def checkpoint_dir(self) -> str | None: ...

    def memory_steps(self) -> list[int]: ...


class RoundHoldings:
    """`progress` and `holdings` for `Rendezvous` (rendezvous/protocol.py), read from `ckpt`: the
    checkpoint room's answer to the agent's `round_holdings` hook (agent/base/collaborator.py)."""

    def __init__(self, ckpt: HeldSteps, single_node: bool) -> None:
        self.ckpt = ckpt
        self.single_node = single_node
        self._unused: tuple[list[int], int | None] | None = None  # read by `holdings`, not yet by `progress`

    def holdings(self) -> tuple[list[int], int | None]:
        """(steps in this node's memory, the newest intact step on disk that can matter)."""
        memory = self.ckpt.memory_steps()
        directory = self.ckpt.checkpoint_dir
        if directory is None:
            self._unused = memory, None
            return self._unused
        above = max(memory) if self.single_node and memory else None
        self._unused = memory, newest_checkpoint_step(directory, above)
        return self._unused

    def progress(self) -> int | None:
        """The newest step saved, in memory or on disk: from what `holdings` just read (a descriptor
        asks for both; one round trip to the holder, not two), else read now."""
        memory, durable = self._unused if self._unused is not None else self.holdings()
        self._unused = None
        steps = [s for s in (*memory, durable) if s is not None]
        return max(steps) if steps else None
