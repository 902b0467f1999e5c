"""Finding a running job: the `rally status` command printed at start, and `RUN_DIR/endpoint.json`.

A newcomer who starts `rally --standalone ...` sees neither the run id (a fresh uuid) nor the
store's port (one the OS picked), and `rally status` needs both. So every agent, in every mode,
prints the exact command once its store is open, and writes the same facts into its run
directory (`<log-dir>/<run-id>_<suffix>/`, beside report.json and events.jsonl), where
`rally status RUN_DIR` reads them back: the run directory is the one name a user already has.

When the job is over (a standalone store ends with its agent), `rally status RUN_DIR` falls back
to what the agent wrote there: report.json's outcome and events.jsonl's last restart. And the
command printed at start, `rally status --rdzv-endpoint ... --rdzv-id ID`, then names the run
directory: it finds it by the run id under the default --log-dir, and in this user's index of run
directories (`$TMPDIR/rally-runs-<uid>/`, a link per run, whatever --log-dir it used).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import shlex
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rally.agent.base.untrusted_files import UntrustedFile, open_for_writing, read_capped, read_json_object
from rally.agent.display.untrusted_text import printable
from rally.rendezvous.base.path_trust import UnsafePath, open_directory
from rally.rendezvous.c10d.store import StoreEndpoint

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
# This user's index of run directories (a link each, newest kept): `$TMPDIR/rally-runs-<uid>`.
RUN_INDEX_PREFIX = "rally-runs-"
MAX_INDEXED_RUNS = 200


def status_flags(endpoint: StoreEndpoint, run_id: str) -> list[str] | None:
    """The flags `rally status` needs for this store (rendezvous.c10d.store.StoreEndpoint), or None
    for a FileStore, which only `rally status RUN_DIR` can name."""
    if endpoint.file_path:
        return None
    if endpoint.etcd:
        where = ",".join(str(m) for m in endpoint.etcd)
        return ["--rdzv-backend", "etcd", "--rdzv-endpoint", where, "--rdzv-id", run_id]
    host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
    return ["--rdzv-endpoint", f"{host}:{endpoint.port}", "--rdzv-id", run_id]


def announce(endpoint: StoreEndpoint, run_id: str, run_dir: Path) -> str:
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
    with open_for_writing(tmp) as f:  # 0600, never through a link a worker left there
        f.write((json.dumps(record, indent=1) + "\n").encode())
    os.replace(tmp, run_dir / ENDPOINT_FILE)
    index_run(run_dir)
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


def run_index(base: Path | None = None) -> Path:
    """This user's index of run directories (under `base`, the temp directory by default)."""
    return (Path(tempfile.gettempdir()) if base is None else base) / f"{RUN_INDEX_PREFIX}{os.geteuid()}"


def index_run(run_dir: Path, base: Path | None = None) -> None:
    """Link `run_dir` from this user's index (see `run_dirs_of`), keeping the newest
    MAX_INDEXED_RUNS links. The index is a directory only this user may use (mode 0700, theirs)
    in a temporary directory whose path no other user can change (rendezvous/base/path_trust.py),
    and it is written through its open descriptor: one someone else made, or one another user
    can write in, is left alone and nothing is linked. Best effort: a run is still found by its
    RUN_DIR without it."""
    real = run_dir.resolve()  # the run directory as the agent opened it (/proc/<pid>/fd/<n>)
    try:
        where = open_directory(Path(tempfile.gettempdir()) if base is None else base, "the run index")
    except (UnsafePath, OSError):
        return
    if where.fd is None:
        return
    try:
        name = run_index(base).name
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=where.fd)
        index = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=where.fd)
    except OSError:
        where.close()
        return
    try:
        found = os.fstat(index)
        if found.st_uid != os.geteuid() or found.st_mode & 0o077:
            return
        temporary = f".{real.name}.{os.getpid()}.tmp"
        os.symlink(real, temporary, dir_fd=index)
        os.replace(temporary, real.name, src_dir_fd=index, dst_dir_fd=index)
        links = sorted(os.listdir(index), key=lambda n: _mtime_in(index, n), reverse=True)
        for old in links[MAX_INDEXED_RUNS:]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old, dir_fd=index)
    except OSError:
        return
    finally:
        os.close(index)
        where.close()


def _mtime_in(directory: int, name: str) -> float:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False).st_mtime
    except OSError:  # gone since it was listed
        return 0.0


def _private_dir(path: Path) -> bool:
    """A directory (not a link to one) of this user's that no one else may write in or read."""
    found = path.lstat()
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid() and not found.st_mode & 0o077


def run_dirs_of(run_id: str, base: Path | None = None) -> list[Path]:
    """This user's run directories of `run_id`, newest first: where to look once the job's store
    is gone. Found under the default --log-dir (`$TMPDIR/rally_*`, agent/rounds/workers.py
    `LogLayout`) and through this user's index (`index_run`: any --log-dir). Only directories
    owned by this user count (anyone can make one under /tmp), each once."""
    found: dict[Path, float] = {}
    for run_dir, started in _own_run_dirs(base, f"{glob.escape(run_id.replace('/', '_'))}_*"):
        try:
            if read_endpoint(run_dir).get("run_id") == run_id:
                found[run_dir] = started
        except (OSError, RunDirError):
            continue
    return sorted(found, key=lambda run_dir: found[run_dir], reverse=True)


def recent_runs(base: Path | None = None, limit: int = 20) -> list[tuple[Path, dict]]:
    """This user's newest `limit` run directories, newest first, with what each agent wrote at start:
    for `rally status` with no argument. Found as `run_dirs_of` finds one run's (the default
    --log-dir and this user's index), only directories owned by this user."""
    found: dict[Path, tuple[float, dict]] = {}
    for run_dir, started in _own_run_dirs(base, "*"):
        try:
            if run_dir not in found:
                found[run_dir] = (started, read_endpoint(run_dir))
        except (OSError, RunDirError):
            continue
    newest = sorted(found, key=lambda run_dir: found[run_dir][0], reverse=True)[:limit]
    return [(run_dir, {**found[run_dir][1], "started": found[run_dir][0]}) for run_dir in newest]


def _own_run_dirs(base: Path | None, name: str) -> Iterator[tuple[Path, float]]:
    """Run directories named like `name` (a glob) under the default --log-dir (`$TMPDIR/rally_*`) and
    through this user's index, each with its endpoint file's mtime (when its agent started). Only
    directories and endpoint files owned by this user count (anyone can make one under /tmp); one
    directory may come twice (both ways), each caller keeps the one it wants."""
    base = Path(tempfile.gettempdir()) if base is None else base
    candidates = list(itertools.islice(base.glob(f"rally_*/{name}/{ENDPOINT_FILE}"), MAX_RUNS_LISTED))
    index = run_index(base)
    try:
        if _private_dir(index):  # its links are this user's own
            candidates += itertools.islice(index.glob(f"{name}/{ENDPOINT_FILE}"), MAX_RUNS_LISTED)
    except OSError:
        pass
    for path in candidates:
        try:
            run_dir = path.parent.resolve()
            if all(p.lstat().st_uid == os.geteuid() for p in (path, run_dir)):
                yield run_dir, path.lstat().st_mtime
        except OSError:
            continue


def root_cause(report: dict | None) -> str | None:
    """A failed job's root cause from its report.json (agent/report.py `JobReport.root_cause`): the last
    round end that was not a success, and the last line its worker wrote to stderr or raised."""
    attempts = (report or {}).get("attempts")
    for attempt in reversed(attempts if isinstance(attempts, list) else []):
        end = attempt.get("end") if isinstance(attempt, dict) else None
        if not isinstance(end, dict) or end.get("kind") == "succeeded" or not isinstance(end.get("detail"), str):
            continue
        info = end["info"] if isinstance(end.get("info"), dict) else {}
        traceback, tail = info.get("traceback"), info.get("stderr_tail")
        lines = traceback.splitlines() if isinstance(traceback, str) else tail if isinstance(tail, list) else []
        last = [line.strip() for line in lines if isinstance(line, str) and line.strip()]
        return printable(end["detail"][:MAX_TEXT] + (f"; {last[-1][:MAX_TEXT]}" if last else ""), limit=2 * MAX_TEXT)
    return None


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
    """The newest restart or re-formation in events.jsonl: {round, kind, detail[, recovery]}; None when
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
            if event.get("in_process") is True:  # the workers were re-entered (rally.job.run)
                last["recovery"] = "in-process"
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
