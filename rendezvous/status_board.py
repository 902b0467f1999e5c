"""The status board: what each node publishes for `rally status`, the live view's peers and a
clash line (rendezvous/status.py reads it all back, trusting none of it).

Keys, outside the rounds:

    status/nodes        every node id that ever registered, one per line (an append)
    status/node/<id>    a node's latest record (JSON; agent/observe/status_record.py builds it)
    job/started         who started the job, and when (first wins): names a run-id clash
"""

from __future__ import annotations

import json
import time
from typing import Any

from rally.rendezvous.kv import KeyValueStore, UntrustedValue
from rally.rendezvous.records import NodeInfo

STATUS_NODES = "status/nodes"
JOB_STARTED = "job/started"


def status_key(node_id: str) -> str:
    """Where a node publishes its record for `rally status` (agent/observe/status_record.py)."""
    return f"status/node/{node_id}"


class StatusBoard:
    """This node's entries on the board."""

    def __init__(self, store: KeyValueStore, me: NodeInfo):
        self.store = store
        self.me = me

    def register(self) -> None:
        """List this node under `status/nodes`; the first node signs who started the job, when."""
        self.store.append(STATUS_NODES, self.me.node_id + "\n")
        self.store.set_once(
            JOB_STARTED, json.dumps({"host": self.me.host, "node_id": self.me.node_id, "time": time.time()})
        )

    def publish(self, record: dict[str, Any]) -> None:
        self.store.set(status_key(self.me.node_id), json.dumps(record))

    def job_started(self) -> dict | None:
        """Who started the job and when (the first node's signed record), for a clash line."""
        try:
            started = json.loads(self.store.get(JOB_STARTED)) if self.store.check(JOB_STARTED) else None
        except (UntrustedValue, ValueError):
            return None
        return started if isinstance(started, dict) else None
