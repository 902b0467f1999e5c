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

import glob
import itertools
import json
import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from rally.agent.base.untrusted_files import UntrustedFile, read_capped, read_json_object
from rally.agent.display.untrusted_text import printable

ENDPOINT_FILE = "endpoint.json"
REPORT_FILE = "report.json"
EVENTS_FILE = "events.jsonl"
# events.jsonl events that start a new round of the same job (agent/agent.py `_after_round`).
RESTART_EVENTS = ("restart", "membership_change")
# What `rally status RUN_DIR` reads of each file at most (each opened without following a link
# or blocking: agent/base/untrusted_files.py). The run directory may be in a shared --log-dir.
MAX_ENDPOINT_BYTES = 64 * 1024
MAX_REPORT_BYTES = 16 << 20
MAX_EVENTS_BYTES = 4 << 20  # the tail of events.jsonl: the newest restart is near its end
MAX_EVENT_LINE = 64 * 1024
MAX_TEXT = 1000  # a restart's kind and detail, as kept
MAX_RUNS_LISTED = 1000  # run folders looked at in a --log-dir


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


class Unreadable(ValueError):
    """A file of the run directory that is there but cannot be trusted (not a regular file, a
    symbolic link, too large, not this kind of JSON): the message says which and why."""


def find_run_dir(path: Path) -> Path:
    """`path` itself when it holds endpoint.json; else its one run folder (the --log-dir)."""
    if (path / ENDPOINT_FILE).is_file():
        return path
    if not path.is_dir():
        raise RunDirError(f"{printable(path)}: no such directory; give the run directory rally printed at start")
    runs = sorted(p.parent for p in itertools.islice(path.glob(f"*/{ENDPOINT_FILE}"), MAX_RUNS_LISTED))
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise RunDirError(
            f"{printable(path)} is not a rally run directory (it has no {ENDPOINT_FILE}); give the one rally "
            "printed at start"
        )
    newest = max(runs, key=lambda p: _mtime(p / ENDPOINT_FILE))
    raise RunDirError(
        f"{printable(path)} holds {len(runs)} runs; give one of them, e.g. the newest: "
        f"rally status {printable(shlex.quote(str(newest)))}"
    )


def run_dirs_of(run_id: str, base: Path | None = None) -> list[Path]:
    """This user's run directories of `run_id` under the default --log-dir (`$TMPDIR/rally_*`,
    agent/rounds/workers.py `LogLayout`), newest first: where to look once the job's store is gone.
    Only directories owned by this user count (anyone can make one under /tmp)."""
    base = Path(tempfile.gettempdir()) if base is None else base
    pattern = f"rally_*/{glob.escape(run_id.replace('/', '_'))}_*/{ENDPOINT_FILE}"
    found = []
    for path in itertools.islice(base.glob(pattern), MAX_RUNS_LISTED):
        try:
            mine = all(p.lstat().st_uid == os.geteuid() for p in (path, path.parent))
            if mine and read_endpoint(path.parent).get("run_id") == run_id:
                found.append((path.lstat().st_mtime, path.parent))
        except (OSError, RunDirError):
            continue
    return [run_dir for _, run_dir in sorted(found, reverse=True)]


def read_endpoint(run_dir: Path) -> dict:
    """What the agent wrote at start (see `announce`), each field of the type it wrote."""
    path = run_dir / ENDPOINT_FILE
    try:
        record = _json_object(path, MAX_ENDPOINT_BYTES)
    except Unreadable as exc:
        raise RunDirError(f"{exc}; give the run directory rally printed at start") from None
    if not isinstance(record.get("run_id"), str):
        raise RunDirError(f"{printable(path)}: not written by rally (no run_id)")
    for name in ("endpoint", "backend", "file_store"):
        if not isinstance(record.get(name), (str, type(None))):
            raise RunDirError(f"{printable(path)}: not written by rally ('{name}' is not text)")
    return record


def last_restart_from_events(run_dir: Path) -> dict | None:
    """The newest restart or re-formation in events.jsonl: {round, kind, detail}; None when
    there was none, or events.jsonl is missing. Only its last MAX_EVENTS_BYTES are read (the
    newest restart is near the end); Unreadable when it is not a regular file."""
    path = run_dir / EVENTS_FILE
    try:
        data = read_capped(path, MAX_EVENTS_BYTES, tail=True)
    except FileNotFoundError:
        return None
    except OSError as exc:  # UntrustedFile too: a FIFO, a link to /dev/zero
        raise Unreadable(f"{printable(path)} was not read: {_why(path, exc)}") from None
    lines = data.decode(errors="replace").splitlines()
    if len(data) == MAX_EVENTS_BYTES:
        lines = lines[1:]  # the first may be the end of a line cut by the tail
    last = None
    for line in lines:
        event = _loads(line) if len(line) <= MAX_EVENT_LINE else None
        if isinstance(event, dict) and event.get("event") in RESTART_EVENTS:
            kind, detail = event.get("kind"), event.get("cause") or event.get("detail")
            last = {
                "round": event.get("round") if type(event.get("round")) is int else None,
                "kind": kind[:MAX_TEXT] if isinstance(kind, str) and kind else "restart",
                "detail": detail[:MAX_TEXT] if isinstance(detail, str) else "",
            }
    return last


def read_report(run_dir: Path) -> dict | None:
    """report.json (written when the agent ends; None while it runs or if it died first).
    Unreadable when it is there but not a regular file, too large or not a JSON object."""
    try:
        return _json_object(run_dir / REPORT_FILE, MAX_REPORT_BYTES)
    except FileNotFoundError:
        return None


def _json_object(path: Path, limit: int) -> dict:
    """The JSON object in `path`: FileNotFoundError when it is missing, else Unreadable for
    anything but a regular file of at most `limit` bytes holding an object."""
    try:
        return read_json_object(path, limit)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable(f"{printable(path)} was not read: {_why(path, exc)}") from None


def _why(path: Path, exc: OSError) -> str:
    """What is wrong with the file: "it is a symbolic link" (UntrustedFile's message starts with its path)."""
    if isinstance(exc, UntrustedFile):
        return "it " + printable(str(exc).removeprefix(f"{path} "))
    return printable(exc.strerror or exc)


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:  # gone since it was listed
        return 0.0


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # a line cut short by a crash, or "[[[[..." 100 000 deep
        return None
