"""The preemption barrier of one round (agent/preemption.py): node 0 asks the scheduler to requeue
the job only once every node's workers are done checkpointing, and only once per job.

Keys: `<r>/preempt_done/<g>` (member g's signed record that its workers are done; node 0 waits
for every member's, each verified on read) and `job/requeued` (first wins: the one node that
requeues). A counter and a `preempt_all_done` flag once did this: anyone who reached the store,
token or not, could set the flag and make node 0 requeue while other nodes were still saving.
"""

from __future__ import annotations

from rally.rendezvous.base.kv import KeyValueStore
from rally.rendezvous.base.records import Assignment, BarrierMark, NodeInfo
from rally.rendezvous.round_channel import wait_all_marked

REQUEUED = "job/requeued"


class PreemptionBarrier:
    """Round `a.round`'s barrier after a preemption signal, as this node takes part in it."""

    def __init__(self, store: KeyValueStore, me: NodeInfo, assignment: Assignment):
        self.store = store
        self.me = me
        self.group_rank = assignment.group_rank
        self.done = [f"{assignment.round}/preempt_done/{g}" for g in range(assignment.group_world_size)]

    def note_checkpointed(self) -> None:
        """This node's workers are done checkpointing after a preemption signal: its signed record."""
        mark = BarrierMark(self.me.node_id, self.group_rank)
        self.store.set(self.done[self.group_rank], mark.to_json())

    def wait_all_checkpointed(self, timeout: float) -> bool:
        """True once every member's genuine record is there; False after `timeout`."""
        # wait: slice: the caller's timeout
        return wait_all_marked(self.store, self.done, timeout)

    def claim_requeue(self) -> bool:
        """True for the one node that may ask the scheduler to requeue the job (once per job)."""
        won, _ = self.store.set_once(REQUEUED, self.me.node_id)
        return won
