"""The hang-stack exchange of one round (agent/observe/hang_report.py): a node that found a hung worker
asks every node for its workers' stacks, and names the culprit from all of them.

A round can see several requests: a hang that ends the round (a hang timeout) asks once, and the
default hang watch (agent/observe/hang_watch.py) may ask again whenever a rank looks stuck. Keys,
under `<r>/`:

    dumps           a counter: the next request's number n
    dump/<n>        request n (JSON: who asks, why), or STACKS_ROUND_OVER, set by any node whose
                    round ended, which releases the watchers (they answer in order, so every
                    request before it is answered first)
    dumps_over      set with that STACKS_ROUND_OVER, so nobody asks any more
    stacks/<n>/<g>  member g's worker snapshots for request n (JSON list)
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
        self.counter = f"{self.r}/dumps"
        self.over = f"{self.r}/dumps_over"

    def _dump(self, n: int) -> str:
        return f"{self.r}/dump/{n}"

    def request(self, reason: str) -> int | None:
        """Ask every node of the round for its workers' stacks: the request's number, or None when
        the round is over."""
        if self.store.check(self.over):
            return None
        n = self.store.add(self.counter, 1) - 1
        _, standing = self.store.set_once(self._dump(n), json.dumps({"by": self.me.host, "reason": reason}))
        return None if standing == STACKS_ROUND_OVER else n

    def end_requests(self) -> None:
        """The round is over for this node: wake the request watchers (and nobody asks any more)."""
        self.store.set(self.over, "1")
        n = self.store.add(self.counter, 1) - 1
        self.store.set_once(self._dump(n), STACKS_ROUND_OVER)

    def wait_request(self, n: int, slice_seconds: float = WAIT_SLICE_SECONDS) -> bool:
        """Block until request `n` is made; True if it is a request (not the round's end)."""
        key = self._dump(n)
        # wait: background: slices
        while (found := self.store.wait_and_read([key], slice_seconds)) is None:
            pass
        return opened_text(found[key], self.store.key(key)) != STACKS_ROUND_OVER

    def publish(self, n: int, snapshots: list[dict]) -> None:
        self.store.set(self._stacks(n, self.group_rank), json.dumps(snapshots))

    def gather(self, n: int, timeout: float) -> dict[int, list[dict]]:
        """Every node's snapshots for request `n`, waiting up to `timeout` for all; missing nodes left out."""
        names = [self._stacks(n, g) for g in range(self.members)]
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

    def _stacks(self, n: int, group_rank: int) -> str:
        return f"{self.r}/stacks/{n}/{group_rank}"
