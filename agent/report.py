"""The root-cause report: the first failure, explained once, instead of a wall of secondary errors.

When a worker fails, its agent builds a `failure_info` (node, rank, pid, exit code or signal
name, the traceback from torch's `@record` error file, else the last lines of its stderr) and
publishes it as the round's end reason. Because the first reason to reach the store wins,
every node reports the same root cause. Each agent also keeps a record of every attempt and
writes it as `report.json` in its log directory. And how the agent leaves after a failed store
call (`store_failure_exit`): the same root cause, told once, with the exit code it means.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from rally.agent.base.exit_codes import EXIT_BAD_INPUT, EXIT_INFRASTRUCTURE, AgentExit
from rally.agent.base.untrusted_files import open_for_writing, read_json_object
from rally.agent.display.worker_table import worker_table
from rally.agent.guard.processes import describe_exit, exit_status_for_shell
from rally.agent.rounds.threads import StoreSilent
from rally.agent.rounds.workers import Worker, WorkerGroup
from rally.rendezvous.backends import backend_of
from rally.rendezvous.base.kv import StoreError, StoreTampered
from rally.rendezvous.base.membership import RendezvousError
from rally.rendezvous.c10d.store import StoreEndpoint, UntrustedValue
from rally.rendezvous.protocol import Assignment, EndKind, RoundEnd

STDERR_LINES_IN_REPORT = 20
MAX_TRACEBACK_CHARS = 16_000
# torch's error file holds one traceback; a larger file is not one (a symlink to a huge file).
MAX_ERROR_FILE_BYTES = 4 * 1024 * 1024


def read_error_file(path: str) -> str | None:
    """The traceback that torch's `@record` wrote, or None when there is no usable file.

    The worker writes this file, so it is read as hostile (agent/base/untrusted_files.py): a regular
    file only, never a blocking open, at most MAX_ERROR_FILE_BYTES, and only the fields of
    torch's schema ({"message": {"message": str, "extraInfo": {"py_callstack": str}}} or
    {"message": str}) are used; anything else counts as no file."""
    try:
        data = read_json_object(path, MAX_ERROR_FILE_BYTES)
    except OSError:  # missing, a FIFO, a symlink, too large, not a JSON object
        return None
    message = data.get("message")
    text: object = message
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
        text = callstack or message.get("message")
    return text[-MAX_TRACEBACK_CHARS:] if isinstance(text, str) and text else None


def failure_info(worker: Worker, assignment: Assignment) -> dict:
    """Everything a person needs about one failed worker, small enough for the store."""
    code = worker.returncode if worker.returncode is not None else 0
    return {
        "host": socket.gethostname(),
        "group_rank": assignment.group_rank,
        "rank": worker.global_rank,
        "local_rank": worker.local_rank,
        "pid": worker.pid,
        "returncode": code,
        "exit": describe_exit(code),
        "exit_status": exit_status_for_shell(code),
        "duration": round(worker.duration(), 3),
        "traceback": read_error_file(worker.error_file),
        "stderr_tail": worker.output.last_stderr_lines(STDERR_LINES_IN_REPORT),
        "error_file": worker.error_file_shown or worker.error_file,
        "time": time.time(),
    }


def failure_end(worker: Worker, assignment: Assignment, cause: str | None = None) -> RoundEnd:
    info = failure_info(worker, assignment)
    detail = (
        f"rank {info['rank']} (local rank {info['local_rank']}, pid {info['pid']}) on {info['host']} "
        f"failed with {info['exit']} after {info['duration']:.1f} s"
    )
    if cause:
        info["cause"] = cause
        detail += f": {cause}"
    return RoundEnd(EndKind.WORKER_FAILED, detail, info["host"], info)


def explain(end: RoundEnd) -> str:
    """The root cause as a few lines of text: what failed, then its traceback or stderr tail."""
    lines = [end.detail]
    info = end.info or {}
    if info.get("stacks"):
        lines += ["its Python stacks when it was found hung:", *("  " + line for line in info["stacks"])]
    if info.get("others"):  # a hang report (agent/observe/hang_report.py): every other rank in one line
        lines += ["the other ranks:", *("  " + line for line in info["others"])]
    elif info.get("traceback"):
        source = "raised in rally.job.run's function" if info.get("soft") else "from its error file"
        lines += [f"traceback ({source}):", info["traceback"].rstrip()]
    elif info.get("stderr_tail"):
        lines += ["last lines of its stderr:", *("  " + line for line in info["stderr_tail"])]
    elif end.kind == EndKind.WORKER_FAILED and int(info.get("returncode") or 0) < 0:
        lines.append("it wrote nothing to stderr")  # killed by a signal: no handler of Python's ran, @record neither
    elif end.kind == EndKind.WORKER_FAILED:
        lines.append("it wrote nothing to stderr (no traceback: decorate main with torch's @record to get one)")
    return "\n".join(lines)


@dataclass
class AttemptRecord:
    """One round as this node saw it."""

    round: int
    restart_count: int
    group_rank: int
    group_world_size: int
    world_size: int
    started_at: float
    workers: list[dict] = field(default_factory=list)
    end: dict | None = None
    recovery: str | None = None  # "in-process": the workers were re-entered, not restarted (rally.job.run)


@dataclass
class JobReport:
    """Every attempt of this node, written to `<run log dir>/report.json` after each round."""

    run_id: str
    host: str
    path: Path
    attempts: list[AttemptRecord] = field(default_factory=list)
    outcome: str = "running"
    exit_code: int | None = None
    notes: dict[str, object] = field(default_factory=dict)  # a feature's own keys (agent/checks/quarantine.py's)
    shown: Callable[[Path], str] = str  # `path` as people see it (agent/rounds/workers.py LogLayout.shown)

    def begin(self, assignment: Assignment) -> None:
        self.attempts.append(
            AttemptRecord(
                assignment.round,
                assignment.restart_count,
                assignment.group_rank,
                assignment.group_world_size,
                assignment.world_size,
                time.time(),
            )
        )

    def finish_attempt(self, group: WorkerGroup | None, end: RoundEnd, recovery: str | None = None) -> None:
        """`recovery`: "in-process" when the workers live on into the next round (rally.job.run)."""
        if not self.attempts:
            return
        attempt = self.attempts[-1]
        attempt.recovery = recovery
        if group is not None:
            attempt.workers = [
                {
                    "host": self.host,
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state(),
                    "exit": w.describe_exit(),
                    "returncode": w.returncode,
                    "duration": round(w.duration(), 3),
                }
                for w in group.workers
            ]
        attempt.end = asdict(end)
        self.write()

    def write(self) -> None:
        data = {
            "run_id": self.run_id,
            "host": self.host,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "attempts": [asdict(a) for a in self.attempts],
            **self.notes,
        }
        tmp = self.path.with_suffix(".json.tmp")
        with open_for_writing(tmp) as f:  # the run directory is the workers' to write in too
            f.write(json.dumps(data, indent=2).encode())
        os.replace(tmp, self.path)

    def root_cause(self) -> str | None:
        """The last round's end in one line: what failed and, when the worker raised, the
        exception's last line, with where the full report is (None when no round ended)."""
        for attempt in reversed(self.attempts):
            if attempt.end:
                info = attempt.end.get("info") or {}
                last = [line.strip() for line in info.get("stderr_tail") or [] if line.strip()]
                where = f" (full report: {self.shown(self.path)})"
                return attempt.end["detail"] + (f"; {last[-1]}" if last else "") + where
        return None

    def workers_table(self) -> Table:
        """The last attempt's workers on this node, for the console (agent/display/worker_table.py)."""
        rows = self.attempts[-1].workers if self.attempts else []
        return worker_table([{"host": self.host, "workers": rows}], f"workers on {self.host}")


def store_lost_line(exc: BaseException, endpoint: StoreEndpoint) -> str:
    """Why this node stops when its store is lost, silent or untrusted, and what to do next time."""
    if isinstance(exc, (StoreSilent, UntrustedValue)):
        return str(exc)
    return backend_of(endpoint).lost_line(exc, endpoint)


def store_failure_exit(
    exc: StoreError | RendezvousError, reached: bool, formed: bool, endpoint: StoreEndpoint | None
) -> AgentExit:
    """How the agent leaves after a failed store call of its main thread, one mapping for all of
    them: a problem before the first round formed is bad input (exit 2); a store lost, silent or
    tampered with once the job ran is an infrastructure failure (exit 1). `reached`: the store
    answered once; `formed`: a round formed; `endpoint`: the store as bound (its lost-store line
    names it)."""
    if isinstance(exc, (RendezvousError, UntrustedValue)):
        tampered = isinstance(exc, StoreTampered)  # a record deleted: never a setup problem
        return AgentExit(EXIT_BAD_INPUT if not formed and not tampered else EXIT_INFRASTRUCTURE, str(exc))
    if not reached or endpoint is None:  # never reached: a wrong or dead endpoint is a setup problem
        return AgentExit(EXIT_BAD_INPUT, str(exc))
    return AgentExit(EXIT_INFRASTRUCTURE, store_lost_line(exc, endpoint))
