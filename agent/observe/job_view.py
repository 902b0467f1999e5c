"""The job as `rally status` shows it, kept in node 0's run directory: `RUN_DIR/status.json`.

Node 0 of each round already reads every node's status record from the store every
STATUS_INTERVAL_SECONDS (agent/observe/observer.py: the straggler exchange); it writes what it
read there too, so `rally status RUN_DIR` on its machine answers from one file, without a store
connection. What it writes was read through the agent's own store connection, so every record
in it was verified with the job's token (a standalone job's random one included, which `rally
status --rdzv-endpoint` never has): a record the job's key does not verify is not in the file.

The file is the user's own: written atomically (a new file, then a rename) with mode 0600, and
read only when it is a regular file this user owns that no one else may read or write
(`read_job_view`), at most MAX_VIEW_BYTES, each node record checked against its writer's types
(rendezvous/status/schema.py) as a record from the store is, and only while it is fresh (at most
MAX_VIEW_AGE_SECONDS old: node 0 has moved, or the job is between rounds, once it is older; then
`rally status` asks the store, as before).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

from rally.agent.base.untrusted_files import open_regular
from rally.rendezvous.status.schema import MAX_ITEMS, Number, Text, Whole, checked, checked_node

VIEW_FILE = "status.json"
VIEW_VERSION = 1
# The status thread writes every 2 s (agent/rounds/threads.py STATUS_INTERVAL_SECONDS); a view
# older than this is not the job's current one (node 0 moved, the job re-forms, the agent hangs).
MAX_VIEW_AGE_SECONDS = 10.0
MAX_VIEW_BYTES = 16 << 20
END: dict[str, Any] = {"kind": Text, "detail": Text}
HEAD: dict[str, Any] = {"version": Whole, "written": Number, "run_id": Text, "round": Whole, "host": Text, "pid": Whole}


def write_job_view(run_dir: Path, run_id: str, status: dict) -> None:
    """Replace RUN_DIR/status.json with `status` (rendezvous/status/reader.py's `read_job_status`)."""
    closed = status.get("closed")
    view = {
        "version": VIEW_VERSION,
        "written": time.time(),
        "run_id": run_id,
        "host": os.uname().nodename,  # the agent that writes it: a view whose writer is gone is not read
        "pid": os.getpid(),
        "round": status.get("round"),
        "closed": None if closed is None else {"kind": str(closed.kind), "detail": closed.detail},
        "nodes": status.get("nodes", []),
        "quarantined": status.get("quarantined") or {},
        "preflight": status.get("preflight"),
    }
    temporary = run_dir / f".{VIEW_FILE}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as out:
        json.dump(view, out, default=str)
    os.replace(temporary, run_dir / VIEW_FILE)


def read_job_view(run_dir: Path, run_id: str, now: float | None = None) -> tuple[dict, float] | None:
    """The job's status as node 0 last wrote it, and its age in seconds; None when there is no
    such file, or it cannot be trusted (not this user's own, readable or writable by others, a
    link, too large, not the view of `run_id`), or it is older than MAX_VIEW_AGE_SECONDS, or the
    agent that wrote it is gone (killed: no report.json, and a view seconds old of a job that is
    over) or not on this machine (a run directory on a shared file system: asked of the store)."""
    view = _own_json(run_dir / VIEW_FILE)
    head = checked(view, HEAD)
    if not head or head.get("version") != VIEW_VERSION or head.get("run_id") != run_id or "written" not in head:
        return None
    if head.get("host") != os.uname().nodename or not _alive(head.get("pid")):
        return None
    age = (time.time() if now is None else now) - head["written"]
    if not -1.0 <= age <= MAX_VIEW_AGE_SECONDS:  # a second of clock step is fine
        return None
    assert view is not None
    nodes = view["nodes"] if isinstance(view.get("nodes"), list) else []
    quarantined = view["quarantined"] if isinstance(view.get("quarantined"), dict) else {}
    status = {
        "round": head.get("round"),
        "closed": checked(view.get("closed"), END),
        "nodes": [n for n in (checked_node(n) for n in nodes[:MAX_ITEMS]) if n is not None],
        "quarantined": {str(h)[:1000]: str(r)[:1000] for h, r in list(quarantined.items())[:MAX_ITEMS]},
        "preflight": view.get("preflight"),  # checked where it is shown (status_command.preflight_lines)
    }
    return status, max(age, 0.0)


def _alive(pid: object) -> bool:
    """Whether process `pid` of this machine exists (of any user: psutil counts EPERM as one)."""
    return isinstance(pid, int) and pid > 0 and psutil.pid_exists(pid)


def _own_json(path: Path) -> dict | None:
    """The JSON object in `path` when it is a regular file of this user's that only they may read
    and write, of at most MAX_VIEW_BYTES; None otherwise."""
    try:
        fd = open_regular(path)
    except OSError:  # missing, or UntrustedFile: a link, a FIFO, a directory
        return None
    try:
        found = os.fstat(fd)
        if found.st_uid != os.geteuid() or found.st_mode & 0o077 or found.st_size > MAX_VIEW_BYTES:
            return None
        data = os.read(fd, MAX_VIEW_BYTES + 1)  # a regular file: all of it, up to the cap
    finally:
        os.close(fd)
    try:
        value = json.loads(data) if len(data) <= MAX_VIEW_BYTES else None
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." 100 000 deep
        return None
    return value if isinstance(value, dict) else None
