"""Finding a running job: the `rally status` command printed at start, and `RUN_DIR/endpoint.json`.

A newcomer who starts `rally --standalone ...` sees neither the run id (a fresh uuid) nor the
store's port (one the OS picked), and `rally status` needs both. So every agent, in every mode,
prints the exact command once its store is open, and writes the same facts into its run
directory (`<log-dir>/<run-id>_<suffix>/`, beside report.json and events.jsonl), where
`rally status RUN_DIR` reads them back: the run directory is the one name a user already has.

When the job is over (a standalone store ends with its agent), `rally status RUN_DIR` falls back
to what the agent wrote there: report.json's outcome and events.jsonl's last restart.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

ENDPOINT_FILE = "endpoint.json"
REPORT_FILE = "report.json"
EVENTS_FILE = "events.jsonl"
# events.jsonl events that start a new round of the same job (agent/agent.py `_after_round`).
RESTART_EVENTS = ("restart", "membership_change")


def status_flags(endpoint: Any, run_id: str) -> list[str] | None:
    """The flags `rally status` needs for this store (rendezvous.store.StoreEndpoint), or None
    for a FileStore, which only `rally status RUN_DIR` can name."""
    if endpoint.file_path:
        return None
    if endpoint.etcd:
        where = ",".join(str(m) for m in endpoint.etcd)
        return ["--rdzv-backend", "etcd", "--rdzv-endpoint", where, "--rdzv-id", run_id]
    host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
    return ["--rdzv-endpoint", f"{host}:{endpoint.port}", "--rdzv-id", run_id]


def announce(endpoint: Any, run_id: str, run_dir: Path) -> str:
    """Write RUN_DIR/endpoint.json and return the line that tells the user how to see the job."""
    flags = status_flags(endpoint, run_id)
    record = {
        "run_id": run_id,
        "backend": "etcd" if endpoint.etcd else "c10d",
        "endpoint": None if flags is None else flags[flags.index("--rdzv-endpoint") + 1],
        "file_store": endpoint.file_path or None,
        "host": os.uname().nodename,
        "pid": os.getpid(),
    }
    tmp = run_dir / f".{ENDPOINT_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run_dir / ENDPOINT_FILE)
    by_dir = f"rally status {shlex.quote(str(run_dir.resolve()))}"
    if flags is None:
        return f"see this job with: {by_dir}"
    return f"see this job with: rally status {shlex.join(flags)}  (or: {by_dir})"


class RunDirError(ValueError):
    """RUN_DIR is not a run directory of rally (the message says what to give instead)."""


def find_run_dir(path: Path) -> Path:
    """`path` itself when it holds endpoint.json; else its one run folder (the --log-dir)."""
    if (path / ENDPOINT_FILE).is_file():
        return path
    if not path.is_dir():
        raise RunDirError(f"{path}: no such directory; give the run directory rally printed at start")
    runs = sorted(p.parent for p in path.glob(f"*/{ENDPOINT_FILE}"))
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise RunDirError(
            f"{path} is not a rally run directory (it has no {ENDPOINT_FILE}); give the one rally printed at start"
        )
    newest = max(runs, key=lambda p: (p / ENDPOINT_FILE).stat().st_mtime)
    raise RunDirError(
        f"{path} holds {len(runs)} runs; give one of them, e.g. the newest: rally status {shlex.quote(str(newest))}"
    )


def read_endpoint(run_dir: Path) -> dict:
    """What the agent wrote at start (see `announce`)."""
    try:
        record = json.loads((run_dir / ENDPOINT_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{run_dir / ENDPOINT_FILE}: cannot read it ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise RunDirError(f"{run_dir / ENDPOINT_FILE}: not written by rally (no run_id)")
    return record


def last_restart_from_events(run_dir: Path) -> dict | None:
    """The newest restart or re-formation in events.jsonl: {round, kind, detail}."""
    last = None
    try:
        lines = (run_dir / EVENTS_FILE).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(event, dict) and event.get("event") in RESTART_EVENTS:
            kind = event.get("kind") or "restart"
            last = {
                "round": event.get("round"),
                "kind": str(kind),
                "detail": str(event.get("cause") or event.get("detail") or ""),
            }
    return last


def read_report(run_dir: Path) -> dict | None:
    """report.json (written when the agent ends; None while it runs or if it died first)."""
    try:
        report = json.loads((run_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None
