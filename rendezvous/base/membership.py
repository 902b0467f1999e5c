"""Who is in a round and what each node gets: the rendezvous's arithmetic, without a store.

Everything here is a pure function of records already read and checked, so every node that
computes it gets the same answer, and the protocol (rendezvous/protocol.py, the only module that
names store keys) stays about talking to the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from rally.rendezvous.base.records import Assignment, NodeInfo, RoundEnd, RoundRecord

# Long waits are cut into slices this long so a closed job or a stop request is noticed.
WAIT_SLICE_SECONDS = 30.0


class RendezvousError(Exception):
    """The job cannot be formed; the message says why and what to do."""


class JobClosed(RendezvousError):
    """The job has already ended (succeeded or failed) when this node arrived or waited."""


@dataclass(frozen=True)
class RendezvousSettings:
    """Membership and timing of the rendezvous (torchrun's `--nnodes` and `--rdzv-conf`)."""

    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    keep_alive_interval: float = 1.0
    keep_alive_timeout: float = 5.0
    # How long the others wait for a closer before the next attempt takes over; the closer
    # waits a third of it for descriptors of nodes that counted themselves in.
    close_timeout: float = 30.0


def assign_group_ranks(nodes: list[NodeInfo]) -> list[int]:
    """Contiguous, deterministic group ranks 0..n-1 for `nodes` (in arrival order).

    A node keeps its previous rank when it is still in range and unclaimed; then a preferred
    rank (static `--node-rank`, SLURM_NODEID) is honoured; the rest fill the free ranks in
    order of (host, node id), so the same set of nodes always gets the same ranks.
    """
    n = len(nodes)
    ranks: list[int | None] = [None] * n
    free = set(range(n))
    for attribute in ("prev_rank", "preferred_rank"):
        for i, node in enumerate(nodes):
            wanted = getattr(node, attribute)
            if ranks[i] is None and wanted is not None and wanted in free:
                ranks[i] = wanted
                free.discard(wanted)
    unplaced = sorted((i for i in range(n) if ranks[i] is None), key=lambda i: (nodes[i].host, nodes[i].node_id))
    for i, rank in zip(unplaced, sorted(free), strict=True):
        ranks[i] = rank
    placed = [rank for rank in ranks if rank is not None]
    assert len(placed) == n  # every slot is filled above
    return placed


def counts_entering(
    previous: RoundRecord | None, end: RoundEnd | None, checkpoint_step: int | None
) -> tuple[int, int, int]:
    """(restart count, membership changes, stalled restarts) entering the round after `previous`.

    Derived from the previous round's record and end reason, so every node gets the same
    numbers. A failure after which no newer checkpoint appeared extends the stall; any progress
    resets it. Without checkpoints there is nothing to judge, and the stall stays 0.
    """
    if previous is None:
        return 0, 0, 0
    restarts, changes, stalled = previous.restart_count, previous.membership_changes, previous.stalled_restarts
    if end is not None:
        restarts += end.is_failure
        changes += end.is_membership_change
        if end.is_failure and checkpoint_step is not None:
            before = previous.checkpoint_step
            stalled = stalled + 1 if before is not None and checkpoint_step <= before else 0
    return restarts, changes, stalled


def newest_step(nodes: list[NodeInfo]) -> int | None:
    """The newest checkpoint step any member sees: the round resumes from it."""
    steps = [n.checkpoint_step for n in nodes if n.checkpoint_step is not None]
    return max(steps) if steps else None


def resume_step(nodes: list[NodeInfo]) -> int | None:
    """The newest step every member can load: held in every member's memory, or intact on disk.

    The disk is shared, so its newest intact step counts for all when every member sees it (the
    smallest of their views); a step in memory counts only if every member holds it. None when
    no node knows any step: the workers then read the disk as they find it.
    """
    in_all = set.intersection(*(n.held_in_memory() for n in nodes)) if nodes else set()
    durable = [n.durable_step for n in nodes]
    on_disk = min(durable) if durable and None not in durable else None  # type: ignore[type-var]
    candidates = [s for s in (max(in_all, default=None), on_disk) if s is not None]
    return max(candidates) if candidates else None


def assignments_for(round_no: int, nodes: list[NodeInfo], record: RoundRecord) -> list[Assignment]:
    """Each node's assignment for round `round_no` (in the order of `nodes`): group rank, rank offset,
    world size, the member it watches (a ring) and the host of the workers' store (rank 0)."""
    ranks = assign_group_ranks(nodes)
    by_rank = sorted(range(len(nodes)), key=lambda i: ranks[i])
    offsets, total = {}, 0
    for i in by_rank:
        offsets[i] = total
        total += nodes[i].nproc
    n = len(nodes)
    out = []
    for i in range(n):
        watch = (ranks[i] + 1) % n if n > 1 else None
        out.append(
            Assignment(
                round=round_no,
                group_rank=ranks[i],
                group_world_size=n,
                rank_offset=offsets[i],
                world_size=total,
                restart_count=record.restart_count,
                membership_changes=record.membership_changes,
                watch_rank=watch,
                watch_host=nodes[by_rank[watch]].host if watch is not None else "",
                master_host=nodes[by_rank[0]].addr,
                stalled_restarts=record.stalled_restarts,
                checkpoint_step=record.checkpoint_step,
                node_id=nodes[i].node_id,
                resume_step=record.resume_step,
            )
        )
    return out
