"""What `rally status` and the straggler exchange read: the job's round, end and node records.

Nodes publish their records on the status board (rendezvous/status_board.py); this reader trusts none of
them (a record that is not this job's is left out), so a stranger's writes never break it.
"""

from __future__ import annotations

import json

from rally.rendezvous.kv import KeyValueStore as Store
from rally.rendezvous.kv import UntrustedValue
from rally.rendezvous.node_memory import load_node_failures
from rally.rendezvous.protocol import CURRENT_ROUND, JOB_CLOSED
from rally.rendezvous.records import RoundEnd
from rally.rendezvous.status_board import STATUS_NODES, listed_nodes, status_key


def read_job_status(store: Store) -> dict | None:
    """What `rally status` shows: the job's round, end state and every node's last record.

    Returns None when no agent of this run id has registered at this store. Records that are
    not valid JSON objects are left out (they were not written by this job's agents).
    """
    if not store.check(STATUS_NODES):
        return None
    names = [status_key(n) for n in listed_nodes(store)]  # signed lines only, bounded
    records = []
    for name in names:
        try:
            record = json.loads(store.get(name)) if store.check(name) else None
        except (UntrustedValue, ValueError):
            record = None
        if isinstance(record, dict) and isinstance(record.get("workers"), list):
            records.append(record)
    current = store.counter(CURRENT_ROUND)
    closed = RoundEnd.load(store.get(JOB_CLOSED), store.key(JOB_CLOSED)) if store.check(JOB_CLOSED) else None
    health = load_node_failures(store)  # quarantine and pre-flight (rendezvous/node_memory.py)
    return {
        "round": current,
        "closed": closed,
        "nodes": records,
        "quarantined": health["quarantined"],
        "preflight": health["preflight"],
    }
