"""What the job remembers across rounds and restarts about its nodes and its timing, in the store.

JSON records under keys named in rendezvous/base/keys.py: the hang timeouts learned with
`--heartbeat-timeout auto` (`LEARNED_TIMEOUTS`, agent/observe/learned_timeouts.py), the root-cause
failures per host (`NODE_FAILURES`), the quarantined hosts (`QUARANTINED`, agent/checks/quarantine.py)
and the last pre-flight verdict (`PREFLIGHT_VERDICT`, agent/checks/preflight.py). Each is read-merge-
written, and each has writers that cannot undo each other: every node writes the same failure
entry for a round (a lost update loses nothing), only a quarantined node's own agent adds itself,
only node 0 writes a verdict; two timeouts written at the same instant may lose one, which its
node repeats at its next change. Every value is signed like every other (rendezvous/base/token.py) and checked
on read; a value that is not this job's JSON reads as nothing.
"""

from __future__ import annotations

import json
from typing import Any

from rally.rendezvous.base.keys import LEARNED_TIMEOUTS, NODE_FAILURES, PREFLIGHT_VERDICT, QUARANTINED
from rally.rendezvous.base.kv import KeyValueStore, StoreReader, UntrustedValue


def _read(store: StoreReader, name: str) -> dict[str, Any] | None:
    try:
        raw = store.get_if_present(name)
        if raw is None:
            return None
        value = json.loads(raw)
    except (ValueError, UntrustedValue, RecursionError):  # RecursionError: JSON nested 100 000 deep
        return None
    return value if isinstance(value, dict) else None


def load_timeouts(store: KeyValueStore) -> dict[str, Any] | None:
    """The learned timeouts as stored: {"heartbeat": s | None, "sections": {name: s}}."""
    return _read(store, LEARNED_TIMEOUTS)


def save_timeouts(store: KeyValueStore, values: dict[str, Any]) -> None:
    """Merge `values` into the stored timeouts, each by maximum."""
    stored = load_timeouts(store) or {}
    merged: dict[str, Any] = {"heartbeat": values.get("heartbeat"), "sections": dict(values.get("sections") or {})}
    old = stored.get("heartbeat")
    if isinstance(old, (int, float)) and (merged["heartbeat"] is None or old > merged["heartbeat"]):
        merged["heartbeat"] = old
    old_sections = stored.get("sections")
    for name, value in old_sections.items() if isinstance(old_sections, dict) else []:
        if isinstance(value, (int, float)) and value > merged["sections"].get(name, 0):
            merged["sections"][name] = value
    store.set(LEARNED_TIMEOUTS, json.dumps(merged))


def load_node_failures(store: StoreReader) -> dict[str, Any]:
    """{"failures": {host: [[round, unix time], ...]}, "quarantined": {host: reason}, "preflight": the
    last pre-flight verdict (agent/checks/preflight.py) or None}; empty when none."""
    failures = (_read(store, NODE_FAILURES) or {}).get("failures")
    quarantined = _read(store, QUARANTINED) or {}
    return {
        "failures": {str(h): [e for e in ts if _entry(e)] for h, ts in failures.items() if isinstance(ts, list)}
        if isinstance(failures, dict)
        else {},
        "quarantined": {str(h): str(r) for h, r in quarantined.items()},
        "preflight": _read(store, PREFLIGHT_VERDICT),
    }


def _entry(entry: object) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in entry)
    )


def save_failures(store: KeyValueStore, failures: dict[str, list]) -> None:
    store.set(NODE_FAILURES, json.dumps({"failures": failures}))


def load_quarantined(store: KeyValueStore) -> dict[str, str]:
    """host -> why, for every host quarantined in this job (one store read)."""
    return {str(h): str(r) for h, r in (_read(store, QUARANTINED) or {}).items()}


def add_quarantined(store: KeyValueStore, host: str, reason: str) -> None:
    quarantined = _read(store, QUARANTINED) or {}
    quarantined[host] = reason
    store.set(QUARANTINED, json.dumps(quarantined))


def save_preflight(store: KeyValueStore, verdict: dict) -> None:
    store.set(PREFLIGHT_VERDICT, json.dumps(verdict))
