"""The hang-stack exchange of one round (agent/observe/hang_report.py): a node that found a hung worker
asks every node for its workers' stacks, and names the culprit from all of them.

Keys, under `<r>/`:

    dump            set once per round: a request (JSON: who asks, why), or STACKS_ROUND_OVER,
                    set by any node whose round ended, which releases the watchers
    stacks/<g>      member g's worker snapshots (JSON list)
"""

from __future__ import annotations

import json

from rally.rendezvous.base.kv import KeyValueStore, opened, opened_text
from rally.rendezvous.base.membership import WAIT_SLICE_SECONDS
from rally.rendezvous.base.records import Assignment, NodeInfo

# The value of a round's `dump` key once the round is over.
STACKS_ROUND_OVER = "over"


class StackExchange:
    """Round `a.round`'s stack requests and answers, for this node (member `a.group_rank`)."""

    def __init__(self, store: KeyValueStore, me: NodeInfo, assignment: Assignment):
        self.store = store
        self.me = me
        self.r = assignment.round
        self.group_rank = assignment.group_rank
        self.members = assignment.group_world_size
        self.dump = f"{self.r}/dump"

    def request(self, reason: str) -> bool:
        """Ask every node of the round for its workers' stacks; False when the round is over."""
        _, standing = self.store.set_once(self.dump, json.dumps({"by": self.me.host, "reason": reason}))
        return standing != STACKS_ROUND_OVER

    def end_requests(self) -> None:
        """The round is over for this node: wake its request watcher (and nobody asks any more)."""
        self.store.set_once(self.dump, STACKS_ROUND_OVER)

    def wait_request(self, slice_seconds: float = WAIT_SLICE_SECONDS) -> bool:
        """Block until the dump key is set; True if it is a request (not the round's end)."""
        # wait: background: slices
        while (found := self.store.wait_and_read([self.dump], slice_seconds)) is None:
            pass
        return opened_text(found[self.dump], self.store.key(self.dump)) != STACKS_ROUND_OVER

    def publish(self, snapshots: list[dict]) -> None:
        self.store.set(self._stacks(self.group_rank), json.dumps(snapshots))

    def gather(self, timeout: float) -> dict[int, list[dict]]:
        """Every node's published snapshots, waiting up to `timeout` for all; missing nodes left out."""
        names = [self._stacks(g) for g in range(self.members)]
        # wait: short: HANG_REPORT_WAIT_SECONDS (10 s), after the hang was named
        present = self.store.wait_and_read(names, timeout)
        if present is None:  # some never came: those that did
            present = self.store.read_present(names)
        found: dict[int, list[dict]] = {}
        for g, name in enumerate(names):
            if name in present:
                try:
                    found[g] = [s for s in json.loads(opened(present[name])) if isinstance(s, dict)]
                except (ValueError, TypeError):
                    continue
        return found

    def _stacks(self, group_rank: int) -> str:
        return f"{self.r}/stacks/{group_rank}"
