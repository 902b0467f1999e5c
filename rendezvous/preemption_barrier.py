"""The preemption barrier of one round (agent/preemption.py): node 0 asks the scheduler to requeue
the job only once every node's workers are done checkpointing, and only once per job.

Keys: `<r>/preempt_done` (a counter of nodes done; the last sets `<r>/preempt_all_done`, which
node 0 waits for) and `job/requeued` (first wins: the one node that requeues).
"""

from __future__ import annotations

from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.base.records import Assignment, NodeInfo

REQUEUED = "job/requeued"


class PreemptionBarrier:
    """Round `a.round`'s barrier after a preemption signal, as this node takes part in it."""

    def __init__(self, store: KeyValueStore, me: NodeInfo, assignment: Assignment):
        self.store = store
        self.me = me
        self.members = assignment.group_world_size
        self.done = f"{assignment.round}/preempt_done"
        self.all_done = f"{assignment.round}/preempt_all_done"

    def note_checkpointed(self) -> None:
        """This node's workers are done checkpointing after a preemption signal."""
        if self.store.add(self.done, 1) >= self.members:
            self.store.set(self.all_done, "1")

    def wait_all_checkpointed(self, timeout: float) -> bool:
        # wait: slice: the caller's timeout
        return self.store.try_wait([self.all_done], timeout)

    def claim_requeue(self) -> bool:
        """True for the one node that may ask the scheduler to requeue the job (once per job)."""
        won, _ = self.store.set_once(REQUEUED, self.me.node_id)
        return won
