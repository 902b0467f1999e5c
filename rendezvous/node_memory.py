"""What the job remembers across rounds and restarts about its nodes and its timing, in the store.

Two JSON records under keys named in rendezvous/protocol.py (`LEARNED_TIMEOUTS`, `NODE_FAILURES`):
the hang timeouts learned with `--heartbeat-timeout auto` (agent/learned_timeouts.py), and the
root-cause failures per host that quarantine a node (agent/quarantine.py). Both are read-merge-
written: two nodes writing at the same instant may lose one update, which the loser repeats at
its next write (timeouts) or which costs one more failure before a quarantine; nothing depends on
them for correctness. Every value is signed like every other (rendezvous/token.py) and checked
on read; a value that is not this job's JSON reads as nothing.
"""

from __future__ import annotations

import json
from typing import Any

from rally.rendezvous.protocol import LEARNED_TIMEOUTS, NODE_FAILURES
from rally.rendezvous.store import Store, UntrustedValue


def _read(store: Store, name: str) -> dict[str, Any] | None:
    if not store.check(name):
        return None
    try:
        value = json.loads(store.get(name))
    except (ValueError, UntrustedValue):
        return None
    return value if isinstance(value, dict) else None


def load_timeouts(store: Store) -> dict[str, Any] | None:
    """The learned timeouts as stored: {"heartbeat": s | None, "sections": {name: s}}."""
    return _read(store, LEARNED_TIMEOUTS)


def save_timeouts(store: Store, values: dict[str, Any]) -> None:
    """Merge `values` into the stored timeouts, each by maximum."""
    stored = load_timeouts(store) or {}
    merged: dict[str, Any] = {"heartbeat": values.get("heartbeat"), "sections": dict(values.get("sections") or {})}
    old = stored.get("heartbeat")
    if isinstance(old, (int, float)) and (merged["heartbeat"] is None or old > merged["heartbeat"]):
        merged["heartbeat"] = old
    old_sections = stored.get("sections")
    for name, value in (old_sections.items() if isinstance(old_sections, dict) else []):
        if isinstance(value, (int, float)) and value > merged["sections"].get(name, 0):
            merged["sections"][name] = value
    store.set(LEARNED_TIMEOUTS, json.dumps(merged))


def load_node_failures(store: Store) -> dict[str, Any]:
    """{"failures": {host: [[round, unix time], ...]}, "quarantined": {host: reason}, "preflight": the
    last pre-flight verdict (agent/preflight.py) or None}; empty when none."""
    value = _read(store, NODE_FAILURES) or {}
    failures = value.get("failures") if isinstance(value.get("failures"), dict) else {}
    quarantined = value.get("quarantined") if isinstance(value.get("quarantined"), dict) else {}
    return {
        "failures": {str(h): [e for e in ts if _entry(e)] for h, ts in failures.items() if isinstance(ts, list)},
        "quarantined": {str(h): str(r) for h, r in quarantined.items()},
        "preflight": value.get("preflight") if isinstance(value.get("preflight"), dict) else None,
    }


def _entry(e: Any) -> bool:
    return isinstance(e, list) and len(e) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in e)


def save_node_failures(store: Store, value: dict[str, Any]) -> None:
    store.set(NODE_FAILURES, json.dumps(value))
