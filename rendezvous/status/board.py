"""The status board: what each node publishes for `rally status`, the live view's peers and a
clash line (rendezvous/status/reader.py reads it all back, trusting none of it).

Keys, outside the rounds:

    status/nodes        every node id that ever registered, one signed line each (an append:
                        anyone can add to it, so each line carries the job's HMAC and readers
                        act only on lines that verify, at most MAX_LISTED_NODES of them)
    status/node/<id>    a node's latest record (JSON; agent/observe/status_record.py builds it)
    job/started         who started the job, and when (first wins): names a run-id clash
"""

from __future__ import annotations

import json
import time
from typing import Any

from rally.rendezvous.base.kv import KeyValueStore, StoreReader, UntrustedValue
from rally.rendezvous.base.records import NodeInfo
from rally.rendezvous.base.token import BadRecord

STATUS_NODES = "status/nodes"
JOB_STARTED = "job/started"
# At most this many node ids are taken from `status/nodes` (nodes that ever registered, restarts
# included); a line longer than MAX_LINE_BYTES is nobody's (a node id is a host name and a pid).
MAX_LISTED_NODES = 4096
MAX_LINE_BYTES = 1024


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
        self.store.append(STATUS_NODES, signed_line(self.store, STATUS_NODES, self.me.node_id))
        self.store.set_once(
            JOB_STARTED, json.dumps({"host": self.me.host, "node_id": self.me.node_id, "time": time.time()})
        )

    def publish(self, record: dict[str, Any]) -> None:
        self.store.set(status_key(self.me.node_id), json.dumps(record))

    def job_started(self) -> dict | None:
        """Who started the job and when (the first node's signed record), for a clash line."""
        try:
            value = self.store.get_if_present(JOB_STARTED)
            started = None if value is None else json.loads(value)
        except (UntrustedValue, ValueError):
            return None
        return started if isinstance(started, dict) else None


def signed_line(store: KeyValueStore, name: str, text: str) -> str:
    """One line of an append-list: `text` in the store's signed envelope (rendezvous/base/token.py,
    bound to the list's key), hex-encoded so it holds no newline."""
    return store.signer.seal(store.key(name), text).hex() + "\n"


def listed_nodes(store: StoreReader) -> list[str] | None:
    """The node ids on `status/nodes` whose line verifies, each once, in order, at most
    MAX_LISTED_NODES (None: no node ever registered): a stranger's appends (garbage, or 1.5 MB of
    lines) cost one read of the list and an HMAC each, never a store call per line."""
    listed = store.get_unsigned(STATUS_NODES)
    if listed is None:
        return None
    key, found = store.key(STATUS_NODES), dict[str, None]()
    for line in listed.split(b"\n"):
        if not line or len(line) > MAX_LINE_BYTES:
            continue
        try:
            node_id = store.signer.open(key, bytes.fromhex(line.decode("ascii"))).decode()
        except (BadRecord, ValueError):  # not hex, not text, not signed with this job's token
            continue
        found[node_id] = None
        if len(found) >= MAX_LISTED_NODES:
            break
    return list(found)
