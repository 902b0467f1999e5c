"""What `rally status` and the straggler exchange read: the job's round, end and node records.

Nodes publish their records on the status board (rendezvous/status/board.py); this reader trusts none of
them: a record that is not this job's JSON object (not signed for its key, larger than
MAX_RECORD_BYTES, nested past the parser's depth) is left out, and every field of the others is
checked against its writer's types (rendezvous/status/schema.py), so a stranger's writes never break it.
"""

from __future__ import annotations

import json
from typing import Any

from rally.rendezvous.base.keys import CURRENT_ROUND, JOB_CLOSED
from rally.rendezvous.base.kv import StoreReader as Store
from rally.rendezvous.base.kv import UntrustedValue
from rally.rendezvous.base.records import MAX_COUNT, RoundEnd
from rally.rendezvous.status.board import listed_nodes, status_key
from rally.rendezvous.status.job_notes import load_node_failures
from rally.rendezvous.status.schema import MAX_RECORD_BYTES, checked_node


def read_job_status(store: Store) -> dict | None:
    """What `rally status` shows: the job's round, end state and every node's last record.

    Returns None when no agent of this run id has registered at this store. Records that are
    not valid JSON objects are left out (they were not written by this job's agents). `round` is
    the newest round a node's record reports (the store's round counter runs one ahead once a
    round has ended), the counter only while no node has published a record.
    """
    # signed lines only, each once, at most board.MAX_LISTED_NODES: a stranger's appends
    # drive no store call per line
    listed = listed_nodes(store)
    if listed is None:
        return None
    names = [status_key(n) for n in listed]
    records = []
    for name in names:
        record = checked_node(_json(store, name))
        if record is not None:
            records.append(record)
    rounds = [r["round"] for r in records if r.get("round") is not None]
    health = load_node_failures(store)  # quarantine and pre-flight (rendezvous/status/job_notes.py)
    return {
        "round": max(rounds) if rounds else _counter(store),
        "closed": _job_end(store),
        "nodes": records,
        "quarantined": health["quarantined"],
        "preflight": health["preflight"],
    }


def _counter(store: Store) -> int | None:
    try:
        return store.counter(CURRENT_ROUND, MAX_COUNT)
    except UntrustedValue:  # a stranger's text or negative number where the counter goes
        return None


def _json(store: Store, name: str) -> Any:
    """The JSON value at `name`, or None for anything else (absent, unsigned, too large, too deep)."""
    try:
        raw = store.get_if_present(name)
        return json.loads(raw) if raw is not None and len(raw) <= MAX_RECORD_BYTES else None
    except (UntrustedValue, ValueError, RecursionError):  # RecursionError: "[[[[..." 100 000 deep
        return None


def _job_end(store: Store) -> RoundEnd | None:
    """The job's end, when one was recorded that this job could have written."""
    try:
        raw = store.get_if_present(JOB_CLOSED)
        if raw is None:
            return None
        return RoundEnd.load(raw, store.key(JOB_CLOSED)) if len(raw) <= MAX_RECORD_BYTES else None
    except (UntrustedValue, ValueError, RecursionError):
        return None
