"""The job-level key names every room of the rendezvous agrees on: where a job's keys live, the
round a late joiner starts from, the job's end, and what the job notes about its nodes.

They sit below the round protocol (rendezvous/protocol.py re-exports them with the rest of its
keys) so that the readers of these keys, `rally status`'s reader and the job's notes, need not
import the protocol. The round's own keys stay with the modules that agree on them.
"""

from __future__ import annotations

RALLY_PREFIX = "rally/"  # every key rally writes; the static backend's workers write outside it


def job_prefix(run_id: str) -> str:
    """Every key of the job `run_id` lives under this prefix (the store is shared by jobs)."""
    return f"{RALLY_PREFIX}{run_id}/"


CURRENT_ROUND = "current"  # counter: the round a late joiner starts from
# Keys outside the rounds; `rally status`'s reader reads them.
JOB_CLOSED = "job/closed"  # the job's end (first wins): late joiners and spares stop
# (The status board's keys, STATUS_NODES, JOB_STARTED and status_key, are the status board's.)
# Kept for the job's whole life, read and written through the job's notes (rendezvous/status/job_notes.py):
LEARNED_TIMEOUTS = "job/timeouts"  # --heartbeat-timeout auto: JSON, merged by maximum
NODE_FAILURES = "job/node_failures"  # root-cause failures by host (JSON; every node writes the same entries)
QUARANTINED = "job/quarantined"  # host -> why (JSON; written by the quarantined node's own agent)
PREFLIGHT_VERDICT = "job/preflight"  # the last pre-flight verdict, for `rally status` (JSON; node 0)
